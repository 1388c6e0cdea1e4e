"""Forward pass: prange over (batch*head, q-block); K/V streamed in packed tiles.

For one block of ``block_q`` query rows, with ``Q`` pre-multiplied by ``scale * log2(e)`` so
scores are in base-2 units:

    m = -inf, l = 0, acc = 0                        # per row: running max, sum, output
    for each key tile the block can see:
        S   = Q @ K_tile^T                          # (block_q, block_k), in L1/L2
        S   = -inf where masked                     # only on tiles that cross a mask edge
        m'  = max(m, rowmax(S))
        P   = 2^(S - m');  alpha = 2^(m - m')
        l   = alpha * l + rowsum(P)
        acc = alpha * acc + P @ V_tile
    out = acc / l;  lse = ln(2) * (m + log2(l))

Never built in full: the (Nq, Nk) score matrix. Scratch per task is O(block_q * (D + block_k +
Dv)). Every task writes only its own rows of ``out``/``lse``, so the result is bitwise the same
for any thread count.

Masks: ``tile_key_range`` gives the key tiles a query block can see at all (tiles outside are
skipped, never computed); ``tile_needs_mask`` tells whether a visible tile crosses a mask edge,
and only then ``mask_tile`` sets scores to ``-inf`` element by element. Later masks (window,
kv_lens, bool/float masks, ALiBi, softcap, dropout) slot into these three functions.
"""
import math

import numba
import numpy as np
from numba import prange

from .. import config
from . import simd
from ._jit import helper, kernel, portable_twin
from .tasks import run_dynamic, unravel
from .decode import run_decode
from .pack import empty, packed_kv
from .masking import (HIDDEN, MIXED, apply_user_mask, mask_tile, tile_key_range,
                      tile_needs_mask)
from .dropout import dropout_row
from .scores import modify_row
from .tiles import divide_row, online_softmax, row_max, tile_product_max, tile_product_rescale

LN2 = math.log(2.0)
LOG2_E = 1.0 / LN2
PORTABLE = False  # True in ``forward_portable``: a compile-time constant (_jit.portable_twin)


@helper
def balanced_order(j, n):
    """The j-th of n query blocks in the order 0, n-1, 1, n-2, ...: under causal masking a
    block's cost grows with its index; where Numba hands each thread a contiguous range of
    tasks, pairing cheap with dear blocks gives every thread the same work (measured at H=1,
    N=8192, causal: 147 -> 218 GFLOP/s). The kernel now runs with tasks handed out one at a
    time (``tasks.run_dynamic``), which balances by itself; the order keeps the dear blocks
    from all coming last."""
    return j // 2 if j % 2 == 0 else n - 1 - j // 2


@kernel(strided=("q", "mask_bools", "mask_adds", "tile_state"),
        read_only=("kv_lens", "slopes2"))
def forward(q, kt, vt, block_q, scale2, left, right, kv_lens, softcap2, slopes2, mask_bools,
            mask_adds, mask_is_bool, tile_state, drop_below, seed, out, lse):
    """Attention forward on packed K/V.

    q: (B, Hq, Nq, D) any strides, float32/float64. kt, vt: from ``pack.packed_kv``.
    block_q: a multiple of the micro-tile rows. scale2: ``scale * log2(e)``.
    left, right, kv_lens: the band of keys each row sees (masking.py); kv_lens: (B,) int64.
    softcap2, slopes2 (B, Hq): the score modifiers in base-2 units, 0 for off (scores.py).
    mask_bools, mask_adds, mask_is_bool, tile_state: the caller's mask and its tile table
    (masks.UserMask).
    drop_below, seed: dropout (dropout.py); ``drop_below = 0`` for none.
    out: (B, Hq, Nq, Dv) contiguous. lse: (B, Hq, Nq), natural log.
    """
    n_b, n_hq, n_q, d = q.shape
    dv = out.shape[3]
    n_hkv = kt.shape[0] // n_b
    group = n_hq // n_hkv
    block_k = kt.shape[2] // d
    dv_pad = vt.shape[2] // block_k
    n_qb = (n_q + block_q - 1) // block_q
    kt_flat = kt.reshape(-1)
    vt_flat = vt.reshape(-1)
    out_flat = out.reshape(-1)  # C-contiguous
    tile_k = d * block_k
    tile_v = block_k * dv_pad
    # Score rows one vector longer than the tile: rows a power of two apart (1 KiB at 256 keys)
    # alias in L1 and in the store-to-load forwarding of the tile products.
    ld_s = block_k + simd.lanes_of(out)
    modify = softcap2 != 0.0 or np.any(slopes2 != 0.0)
    no_t = np.empty(0, dtype=out.dtype)
    n_k_all = mask_bools.shape[3]
    inv_keep = 2.0**32 / (2.0**32 - drop_below)  # 1 / (1 - p)
    for task in prange(n_b * n_hq * n_qb):
        b, h, qb = unravel(task, n_hq, n_qb)
        qb = balanced_order(qb, n_qb)
        bh_kv = b * n_hkv + h // group
        n_k = kv_lens[b]
        q0 = qb * block_q
        rows = min(block_q, n_q - q0)
        q_s = np.zeros(block_q * d, dtype=out.dtype)   # Q block, scaled to base-2 units
        s = np.empty(block_q * ld_s, dtype=out.dtype)  # scores, then probabilities
        acc = np.zeros(block_q * dv_pad, dtype=out.dtype)
        m_i = np.full(block_q, -np.inf, dtype=out.dtype)
        l_i = np.zeros(block_q, dtype=out.dtype)
        l_tile_sums = np.empty(block_q, dtype=out.dtype)
        alpha_i = np.empty(block_q, dtype=out.dtype)
        tile_max = np.empty(block_q, dtype=out.dtype)  # row maxima of a score tile
        pv = np.empty(block_q * dv_pad if PORTABLE else 0, dtype=out.dtype)  # P @ V (portable)
        row_vmax = np.empty(block_q * simd.lanes_of(out), dtype=out.dtype)
        for r in range(rows):
            for dd in range(d):
                q_s[r * d + dd] = q[b, h, q0 + r, dd] * scale2  # as backward.row_terms
        kb_lo, kb_hi = tile_key_range(q0, q0 + rows, n_q, n_k, block_k, left, right)
        for kb in range(kb_lo, kb_hi):
            state = tile_state[b, h, qb, kb]
            if state == HIDDEN:
                continue  # the caller's mask hides the whole tile
            k0 = kb * block_k
            k_off = (bh_kv * kt.shape[1] + kb) * tile_k
            v_off = (bh_kv * vt.shape[1] + kb) * tile_v
            tile_product_max(s, 0, ld_s, q_s, 0, d, 1, kt_flat, k_off, d, block_q, block_k, d,
                             row_vmax, tile_max, PORTABLE)
            # The row maxima came with the product (a pass over S saved); the modifiers and
            # masks below say whether they still hold.
            max_given = not modify
            if modify:
                for r in range(rows):
                    modify_row(s, r * ld_s, block_k, q0 + r + n_k - n_q, k0, softcap2,
                               slopes2[b, h], no_t, PORTABLE)
            if state == MIXED:
                n_cols = min(block_k, n_k_all - k0)
                apply_user_mask(s, 0, ld_s, rows, mask_bools, mask_adds, mask_is_bool, b, h,
                                q0, k0, n_cols, LOG2_E, tile_max)
                max_given = n_cols == block_k
                if max_given:  # padding rows: their scores are 0 (Q zero-padded), or NaN
                    for r in range(rows, block_q):
                        tile_max[r] = row_max(s, r * ld_s, block_k, PORTABLE)
            if tile_needs_mask(q0, q0 + rows, k0, block_k, n_q, n_k, left, right):
                mask_tile(s, ld_s, rows, q0, k0, block_k, n_q, n_k, left, right, -np.inf)
                max_given = False
            online_softmax(s, 0, ld_s, block_k, block_q, m_i, l_tile_sums, alpha_i, tile_max,
                           max_given, PORTABLE)
            for r in range(block_q):
                l_i[r] = alpha_i[r] * l_i[r] + l_tile_sums[r]
            if drop_below > 0:  # after the sums: l normalizes the probabilities before dropout
                for r in range(rows):
                    dropout_row(s, r * ld_s, block_k, seed, (b * n_hq + h) * n_q + q0 + r,
                                k0, drop_below, inv_keep)
            # This tile's P @ V on its own, then acc = alpha * acc + it: each tile's sum is short,
            # which keeps float32 rounding lower than one long running sum over all keys.
            n_valid = min(block_k, n_k - k0)  # keys past kv_len have P = 0: V rows never read
            tile_product_rescale(acc, 0, dv_pad, s, 0, ld_s, 1, vt_flat, v_off, 0, block_k,
                                 block_q, dv_pad, n_valid, alpha_i, 0, alpha_i, 0, pv, PORTABLE)
        for r in range(rows):
            if l_i[r] == 0.0:  # the row sees no key: output 0, lse -inf
                for c in range(dv):
                    out_flat[((b * n_hq + h) * n_q + q0 + r) * dv + c] = 0.0
                lse[b, h, q0 + r] = -np.inf
            else:  # a true division: one rounding, not two
                divide_row(out_flat, ((b * n_hq + h) * n_q + q0 + r) * dv, acc, r * dv_pad, dv,
                           l_i[r], PORTABLE)
                lse[b, h, q0 + r] = (m_i[r] + np.log2(l_i[r])) * LN2


forward_portable = portable_twin(forward)


def run_forward(q, k, v, scale, band, mods, user_mask, drop, portable, out=None,
                kv_scales=None):
    """Pack K/V and run the kernel on 4-D arrays of one compute dtype (float32 or float64).

    ``k``, ``v`` may also be a K/V cache in a storage type (float16, or int8 with
    ``kv_scales = (k_scale, v_scale)``, (B, Hkv, Nk) each): the decode path reads it in place;
    the tiled path converts it to the compute dtype first.

    Returns ``out`` (B, Hq, Nq, Dv), contiguous, and ``lse`` (B, Hq, Nq), both in that dtype.
    ``out``, if given, must be such an array; it is written in place. ``band``: the
    ``(left, right, kv_lens)`` of masking.py; ``mods``: ``(softcap, alibi_slopes (B, Hq))``
    in natural units (scores.py); ``user_mask``: a ``masks.UserMask``; ``drop``:
    ``(drop_below, seed)`` (dropout.py).
    """
    n_b, n_hq, n_q, d = q.shape
    n_k, dv = v.shape[2], v.shape[3]
    if out is None:
        out = empty((n_b, n_hq, n_q, dv), q.dtype)  # very large: plain pages (pack.empty)
    lse = np.empty((n_b, n_hq, n_q), dtype=q.dtype)
    if out.size == 0:
        return out, lse
    if n_k == 0:  # no key at all: every row sees nothing
        out[...] = 0.0
        lse[...] = -np.inf
        return out, lse
    decoded = (run_decode(q, k, v, scale, band, mods, user_mask, drop, out, kv_scales, lse)
               if not portable else None)
    if decoded is not None:
        return decoded
    left, right, kv_lens = band
    softcap2, slopes2 = mods[0] * LOG2_E, mods[1] * LOG2_E
    if kv_scales is not None:  # int8 times its per-token scale, in the compute dtype
        k, v = (x * x_scale[..., None].astype(q.dtype) for x, x_scale in zip((k, v), kv_scales))
    k, v = (x if x.dtype == q.dtype else x.astype(q.dtype) for x in (k, v))
    block_k = config.block_k(d, n_k)
    kt, vt = packed_kv(k, v, block_k, config.lanes(q.dtype), config.panel_width(q.dtype))
    block_q = config.block_q(n_q, d, n_b * n_hq, numba.get_num_threads())
    run_dynamic(forward_portable if portable else forward, q, kt, vt, block_q, scale * LOG2_E,
                left, right, kv_lens, softcap2, slopes2, *user_mask.kernel_args(),
                user_mask.tile_states(block_q, block_k), drop[0], drop[1], out, lse)
    return out, lse
