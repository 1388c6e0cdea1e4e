"""Forward pass: tasks over (batch*head, q-block); K/V streamed in packed tiles.

For one block of ``block_q`` query rows, with ``Q`` pre-multiplied by ``scale``:

    m = -inf, l = 0, acc = 0                        # per row: running max, sum, output
    for each key tile the block can see:
        S   = Q @ K_tile^T                          # (block_q, block_k), in L1/L2
        S   = -inf where masked                     # only on tiles that cross a mask edge
        m'  = max(m, rowmax(S))
        P   = e^(S - m');  alpha = e^(m - m')
        l   = alpha * l + rowsum(P)
        acc = alpha * acc + P @ V_tile
    out = acc / l;  lse = m + ln(l)

The scores stay in natural units, as torch's: a row's largest score is a float of the dtype,
and a one-hot row's lse is exactly it, so the backward pass's ``P = exp(S - lse)`` is exactly 1
there. (Until stop 30 Q carried ``scale * log2(e)``: scores 1.44 times larger, rounded up to
twice as coarsely, and the lse, stored in natural units, no longer equal to any score: the
backward's dV on sharp rows had twice torch's error.) The difference ``S - m'`` comes first:
exact near the maximum, and exactly 0 at it (``tiles.exp_shifted_sum``), and e^x from it with
``x log2(e)`` rounded once (``simd.vexp_once``, since stop 43: two operations fewer a vector;
the error it adds is largest for small probabilities, at most 4.4e-8 of the largest), and in
float32 2^f by a polynomial of degree 5 (since stop 64: one operation fewer, 1.6e-7 relative).

Never built in full: the (Nq, Nk) score matrix. Scratch per worker (one a thread, reset for
each of its tasks) is O(block_q * (D + block_k + Dv)). Every task writes only its own rows of
``out``/``lse``, so the result is bitwise the same for any thread count.

Masks: ``tile_key_range`` gives the key tiles a query block can see at all (tiles outside are
skipped, never computed); ``tile_needs_mask`` tells whether a visible tile crosses a mask edge,
and only then ``mask_tile`` sets scores to ``-inf`` element by element. Later masks (window,
kv_lens, bool/float masks, ALiBi, softcap, dropout) slot into these three functions.
"""
import functools
from typing import NamedTuple

import numpy as np
from numba import prange

from .. import config
from . import sequences, simd
from ._jit import helper, inlined_helper, kernel, portable_twin
from .sequences import (BLOCK_Q, N_Q, N_QB, Q_BATCH, Q_ROW0, TASK0, TILE0, TILES,
                        computed_rows, find_task)
from .tasks import new_claims, next_task, num_threads, run_shared
from .decode import NO_SINKS, arrays_of_blocks, run_decode, sink_of, takes_decode
from ..masks import UserMask
from .pack import (empty, key_tile, keys_transposed_task, output, packed_kv, packed_varlen,
                   scratch, values_task)
from .masking import (HIDDEN, MIXED, apply_user_mask, band_runs, mask_tile,
                      tile_key_range, tile_needs_mask)
from .dropout import dropout_row
from .scores import modifies, modify_row
from .tiles import (divide_row, online_softmax, row_max, scale_row, tile_product_max,
                    tile_product_rescale)

# The seeds of a call without dropout: never read (``drop_below = 0``), one for every batch
# row made anew was a microsecond of a small call.
NO_SEEDS = np.zeros(1, dtype=np.int64)
PORTABLE = False  # True in ``forward_portable``: a compile-time constant (_jit.portable_twin)


@helper
def balanced_order(j, n):
    """The j-th of n query blocks in the order 0, n-1, 1, n-2, ...: under causal masking a
    block's cost grows with its index; where Numba hands each thread a contiguous range of
    tasks, pairing cheap with dear blocks gives every thread the same work (measured at H=1,
    N=8192, causal: 147 -> 218 GFLOP/s). Each thread's share of the tasks is still such a
    contiguous range (``tasks.next_task``): its first and last tasks, the ones a faster thread
    takes over, are then of every cost."""
    return j // 2 if j % 2 == 0 else n - 1 - j // 2


@inlined_helper
def band_scores(s, ld_s, q_s, d, kt_flat, k_off, runs, n_runs, row_vmax, tile_max, portable):
    """``tile_product_max`` over a key tile, once per run of row blocks (``runs``: the
    ``(r0, r1, need)`` of ``masking.band_runs`` in steps of a vector of keys, as P V takes
    them; on a tile that crosses no mask edge, one run of every row and key), each over only
    the vectors of keys up to the last key one of its rows sees: on a causal diagonal tile of
    128 rows and 128 keys (AVX-512), 72 keys a row on average in place of 128 (96 in steps of a
    panel, as until stop 61), on a 64-token prompt's one tile 40 in place of 64. The scores
    left out are all outside their rows' bands, and ``mask_tile`` sets every such score to
    ``-inf`` next, so the masked tile is the same, bit for bit; its row maxima are then read
    again from it (``max_given`` false), not taken from here. Padding rows past ``rows``, which
    the mask leaves alone, get every panel (their scores 0, as Q is zero there). One call of
    the product for every run: each call inlines its micro-kernels, and with a second call in
    the kernel the float32 forward's cold compile took 2.7-4.8 s longer than without
    ``band_scores`` (22.8 s against 18.0-20.1), with this one call 0.7-2.3 s longer (stop 51,
    alternating processes, each with an empty cache). Runs that end inside a panel take a
    product of their own in ``tile_product_max`` (reading 1-3 vectors of a panel), so whole
    tiles run stop 60's code: against stop 60's package, one process, calls in alternating
    order, medians of the ratios, a GPT-2-small layer's 64-token prompt (H=12, causal) took
    0.957x and 0.956x the time; N=2048 0.997x and 0.999x, causal 1.000x and 0.999x, N=512
    1.000x (stop 61; the float32 forward's cold compile 12.1 s)."""
    for i in range(n_runs):
        r0, r1, need = runs[i, 0], runs[i, 1], runs[i, 2]
        if need > 0:
            tile_product_max(s, r0 * ld_s, ld_s, q_s, r0 * d, d, 1, kt_flat, k_off, d, r1 - r0,
                             need, d, row_vmax, tile_max, r0, portable)


@helper
def finish_row(m, l, sink):
    """A row's ``lse`` and the sum its accumulator is divided by, from its running max ``m``
    and sum ``l > 0`` and its sink's logit (-inf: none), in float64: the sink adds
    ``e^(sink - m)`` to the sum, ``out = acc / (l + e^(sink - m))`` and ``lse = m + log(l +
    e^(sink - m))``, one exponential a row. Where that overflows (the sink over 709 above every
    score), the output is 0 to well within the compute dtype's precision, as it should be, and
    ``lse = sink + log(1 + l e^(m - sink))``. Without a sink: ``m + log(l)`` (exactly ``m``
    where ``l = 1``, a one-hot row) and ``l``."""
    m64 = np.float64(m)
    if sink == -np.inf:
        return m64 + np.log(l), l
    total = l + np.exp(sink - m64)
    if total < np.inf:
        return m64 + np.log(total), total
    return sink + np.log1p(l * np.exp(m64 - sink)), total


@kernel(strided=("q", "mask_bools", "mask_adds", "tile_state", "sinks"),
        read_only=("k_own", "v_own", "seqs", "kv_lens", "slopes", "seeds"))
def forward(q, kt, vt, k_own, v_own, n_hkv, block_q, scale, left, right, seqs, kv_lens, softcap,
            slopes, mask_bools, mask_adds, mask_is_bool, tile_state, drop_below, inv_keep, seeds,
            sinks, out_flat, out_layout, lse, n_threads):
    """Attention forward on packed K/V, for the sequences of the table ``seqs``
    (sequences.py): one task per (sequence, head, query block), shared out by ``n_threads``
    workers (``tasks.next_task``).

    q: (Bq, Hq, rows, D) any strides, float32/float64. kt, vt: (tiles, D * block_k) and
    (tiles, block_k * Dv_pad), laid out as ``pack.packed_kv`` makes them; n_hkv: key heads.
    k_own, v_own: empty, or K and V themselves, C-contiguous (B, Hkv, Nk, D/Dv), for a dense
    call whose tasks read one key tile each (``packs_own_tiles``): each task then packs its
    head's tile into its worker's scratch, with the helpers ``pack_tiles`` calls (the same
    bytes), and ``kt``, ``vt`` are empty, their widths alone given.
    block_q: the largest query block in ``seqs``. scale: the scores' scale.
    left, right, kv_lens: the band of keys each row sees (masking.py); kv_lens: (S,) int64.
    softcap, slopes (S, Hq): the score modifiers, 0 for off (scores.py).
    mask_bools, mask_adds, mask_is_bool, tile_state: the caller's mask and its tile table
    (masks.UserMask), by sequence.
    drop_below, inv_keep, seeds (S,): dropout (dropout.py, ``masks.dropout``); ``drop_below =
    0`` for none.
    sinks: float64 (S or 1, Hq), attention sinks' logits (``cpuflash/sinks.py``), or empty
    (``decode.NO_SINKS``): one more term of each row's sum, added at its end (``finish_row``).
    out_flat, out_layout: the output's buffer and ``(batch stride, head stride, row stride,
    Dv)``: element ``(b, h, row, c)`` of the output, ``c < Dv``, is ``out_flat[b * stride_b +
    h * stride_h + row * stride_row + c]``.
    lse: (Bq, Hq, rows), natural log.
    """
    n_hq, d = q.shape[1], q.shape[3]
    group = n_hq // n_hkv
    block_k = kt.shape[1] // d
    dv_pad = vt.shape[1] // block_k
    dv = out_layout[3]
    kt_flat = kt.reshape(-1)
    vt_flat = vt.reshape(-1)
    tile_k = d * block_k
    tile_v = block_k * dv_pad
    # Score rows one vector longer than the tile: rows a power of two apart (1 KiB at 256 keys)
    # alias in L1 and in the store-to-load forwarding of the tile products.
    lanes = simd.lanes_of(out_flat)
    ld_s = block_k + lanes
    modify = modifies(softcap, slopes)
    no_t = np.empty(0, dtype=out_flat.dtype)
    n_k_all = mask_bools.shape[3]
    n_tasks = seqs[-1, TASK0] + n_hq * seqs[-1, N_QB] if seqs.shape[0] else 0
    n_workers = min(n_threads, n_tasks)
    claims = new_claims(n_workers)
    own_tiles = k_own.size > 0
    panel = config.MICRO_VECS * lanes
    k_own_flat, v_own_flat = k_own.reshape(-1), v_own.reshape(-1)  # once, not a view a task
    for worker in prange(n_workers):  # one a thread: they share the tasks out (tasks.py)
        # A worker's scratch, for each of its tasks in turn
        k_tiles = scratch(tile_k, out_flat) if own_tiles else kt_flat  # its task's K tile
        v_tiles = scratch(tile_v, out_flat) if own_tiles else vt_flat
        q_s = scratch(block_q * d, out_flat)   # Q block, scaled
        s = scratch(block_q * ld_s, out_flat)  # scores, then probabilities
        acc = scratch(block_q * dv_pad, out_flat)
        m_i = np.empty(block_q, dtype=out_flat.dtype)
        l_i = np.empty(block_q, dtype=np.float64)  # see the sum over tiles below
        l_tile_sums = np.empty(block_q, dtype=out_flat.dtype)
        alpha_i = np.empty(block_q, dtype=out_flat.dtype)
        tile_max = np.empty(block_q, dtype=out_flat.dtype)  # row maxima of a score tile
        pv = np.empty(block_q * dv_pad if PORTABLE else 0, dtype=out_flat.dtype)  # portable
        row_vmax = scratch(block_q * simd.lanes_of(out_flat), out_flat)
        runs = np.empty((block_q // config.MICRO_ROWS + 1, 3), dtype=np.int64)  # band_runs
        # The K/V head whose tile the worker's scratch holds (own tiles; -1: none yet). Every
        # task of a call packs as many keys, so after the first the zeros past them are there.
        own_head = -1
        for _ in range(n_tasks):
            task = next_task(claims, worker, n_workers, n_tasks)
            if task < 0:
                break
            b, h, qb = find_task(seqs, n_hq, task)
            n_q, bq, n_qb = seqs[b, N_Q], seqs[b, BLOCK_Q], seqs[b, N_QB]
            qb = balanced_order(qb, n_qb)
            q_b, row0 = seqs[b, Q_BATCH], seqs[b, Q_ROW0]
            tile0 = seqs[b, TILE0] + (h // group) * seqs[b, TILES]
            if own_tiles:  # the head's one key tile, packed as pack_tiles packs tile 0
                tile0 = 0
                kv_head = q_b * n_hkv + h // group
                if kv_head != own_head:  # (a GQA group's next head here reads it as it is)
                    n_own, padded = k_own.shape[2], own_head >= 0
                    k_src, n_packed = key_tile(kv_head, 1, block_k, n_own, d)
                    keys_transposed_task(k_own_flat, k_src, d, n_packed, d, block_k, panel,
                                         k_tiles, 0, padded)
                    v_src, _ = key_tile(kv_head, 1, block_k, n_own, dv)
                    values_task(v_own_flat, v_src, dv, n_packed, dv, dv_pad, block_k, panel,
                                False, v_tiles, 0, padded)
                    own_head = kv_head
            n_k = kv_lens[b]
            q0 = qb * bq
            rows = min(bq, n_q - q0)
            rows_up = computed_rows(rows, bq)  # its padding past them: never computed or read
            out_row0 = q_b * out_layout[0] + h * out_layout[1] + (row0 + q0) * out_layout[2]
            q_s[rows * d:rows_up * d] = 0.0  # padding rows; scale_row writes the others
            acc[:rows_up * dv_pad] = 0.0
            m_i[:] = -np.inf
            l_i[:] = 0.0
            for r in range(rows):  # in float64, rounded once, as backward.row_terms
                scale_row(q_s, r * d, q[q_b, h, row0 + q0 + r], d, scale, PORTABLE)
            kb_lo, kb_hi = tile_key_range(q0, q0 + rows, n_q, n_k, block_k, left, right)
            for kb in range(kb_lo, kb_hi):
                state = tile_state[b, h, qb, kb]
                if state == HIDDEN:
                    continue  # the caller's mask hides the whole tile
                k0 = kb * block_k
                k_off = (tile0 + kb) * tile_k
                v_off = (tile0 + kb) * tile_v
                masked = tile_needs_mask(q0, q0 + rows, k0, block_k, n_q, n_k, left, right)
                # S = Q K^T with its row maxima; on a masked tile only the vectors of keys each
                # run of row blocks may see (band_scores; the same runs for P V below)
                n_runs = band_runs(runs, rows_up, masked, rows, q0, k0, n_q, n_k, left, right,
                                   block_k, lanes)
                band_scores(s, ld_s, q_s, d, k_tiles, k_off, runs, n_runs, row_vmax, tile_max,
                            PORTABLE)
                # The row maxima came with the product (a pass over S saved); the modifiers and
                # masks below say whether they still hold.
                max_given = not modify
                if modify:
                    for r in range(rows):
                        modify_row(s, r * ld_s, block_k, q0 + r + n_k - n_q, k0, softcap,
                                   slopes[b, h], no_t, PORTABLE)
                if state == MIXED:
                    n_cols = min(block_k, n_k_all - k0)
                    apply_user_mask(s, 0, ld_s, rows, mask_bools, mask_adds, mask_is_bool, b, h,
                                    q0, k0, n_cols, 1.0, tile_max)
                    max_given = n_cols == block_k
                    if max_given:  # padding rows: their scores are 0 (Q zero-padded), or NaN
                        for r in range(rows, rows_up):
                            tile_max[r] = row_max(s, r * ld_s, block_k, PORTABLE)
                if masked:
                    mask_tile(s, ld_s, rows, q0, k0, block_k, n_q, n_k, left, right, -np.inf,
                              PORTABLE)
                    max_given = False
                # The exponentials stop at the vector that holds the last key (N=65: 80 of the
                # tile's 128 columns). Past it every score is -inf and its e^x = +0, whose
                # sum (one vector accumulator, in order) would change no bit; P V reads no
                # column past the last key.
                n_exp = min(block_k, -(-(n_k - k0) // lanes) * lanes)
                online_softmax(s, 0, ld_s, n_exp, rows_up, bq, m_i, l_tile_sums, alpha_i,
                               tile_max, max_given, True, PORTABLE)
                for r in range(rows_up):
                    # In float64: in a sharp row, the largest probability is 1 and each later
                    # tile adds less than half an ulp of 1; float32 lost every such tile's sum
                    # (peaked q = k = v, N=2048: up to 2.7 ulp of error in the output, where
                    # torch's 4 tiles of 512 keys lost less).
                    l_i[r] = alpha_i[r] * l_i[r] + l_tile_sums[r]
                if drop_below > 0:  # after the sums: l normalizes the probabilities before dropout
                    for r in range(rows):
                        dropout_row(s, r * ld_s, block_k, seeds[b],
                                    (q_b * n_hq + h) * n_q + q0 + r, k0, drop_below, inv_keep)
                # This tile's P @ V on its own, then acc = alpha * acc + it: each tile's sum is
                # short, which keeps float32 rounding lower than one long running sum over all
                # keys.
                # Keys past kv_len have P = 0: their V rows are never read. On a masked tile
                # neither are those past the last vector of keys a run of row blocks sees (P =
                # 0 there too; band_runs in steps of one vector of keys, not of a panel: on a
                # causal diagonal tile of 128 keys, 72 keys a row on average, not 96, in 8
                # calls). A sum of P V starts at +0 and never turns -0, so the terms left out,
                # each 0 * V = +-0, change no bit: only an Inf or NaN in a skipped value no
                # longer reaches rows that do not see it (masking.py). Each run's acc is
                # rescaled by alpha, if it adds nothing.
                n_valid = min(block_k, n_k - k0)
                for i in range(n_runs):
                    r0, r1, need = runs[i, 0], runs[i, 1], runs[i, 2]
                    tile_product_rescale(acc, r0 * dv_pad, dv_pad, s, r0 * ld_s, ld_s, 1, v_tiles,
                                         v_off, 0, block_k, r1 - r0, dv_pad, min(n_valid, need),
                                         alpha_i, r0, alpha_i, 0, pv, PORTABLE)
            sink = sink_of(sinks, b, h)  # the head's sink logit; -inf: none
            for r in range(rows):
                at = out_row0 + r * out_layout[2]
                if l_i[r] == 0.0:  # the row sees no key: output 0; lse the sink's (or -inf)
                    for c in range(dv):
                        out_flat[at + c] = 0.0
                    lse[q_b, h, row0 + q0 + r] = sink
                else:
                    lse[q_b, h, row0 + q0 + r], l_tile_sums[r] = finish_row(m_i[r], l_i[r],
                                                                            sink)
                    # a true division: one rounding, not two
                    divide_row(out_flat, at, acc, r * dv_pad, dv, l_tile_sums[r], PORTABLE)


forward_portable = portable_twin(forward)


class Tiling(NamedTuple):
    """What a dense forward call of one geometry runs on besides its arrays (``tiling``)."""
    block_k: int
    block_q: int
    own_shapes: bool  # each task one query block on one key tile (``packs_own_tiles``)
    no_kt: np.ndarray  # the kernel's ``kt``, ``vt`` where the tasks pack their own tiles
    no_vt: np.ndarray
    seqs_own: np.ndarray  # the sequence table then (one tile a K/V head),
    seqs_packed: np.ndarray  # and where K/V are packed beforehand
    out_layout: tuple


@functools.lru_cache(maxsize=64)
def tiling(n_b, n_hq, n_hkv, n_q, n_k, d, dv, dtype, threads):
    """The tile sizes, the stand-ins and the sequence tables of a dense forward call, kept per
    geometry: made anew, they were about 3 us of Python a call (a 16-token prompt's call
    36-40 us), what every layer of a small model pays on each short sequence."""
    block_k = config.block_k(d, n_k)
    block_q = config.block_q(n_q, d, n_b * n_hq, threads)
    lanes = config.lanes(dtype)
    dv_pad = -(-dv // lanes) * lanes
    n_blocks = -(-n_k // block_k)
    own_shapes = n_k <= block_k and n_q <= block_q
    no_kt = np.empty((0, d * block_k), dtype)  # never written: only their widths are read
    no_vt = np.empty((0, block_k * dv_pad), dtype)
    seqs_own, _ = sequences.dense(n_b, n_hq, n_q, block_q, n_hkv, 1)
    seqs_packed, _ = sequences.dense(n_b, n_hq, n_q, block_q, n_hkv, n_blocks)
    return Tiling(block_k, block_q, own_shapes, no_kt, no_vt, seqs_own, seqs_packed,
                  (n_hq * n_q * dv, n_q * dv, dv, dv))


@functools.lru_cache(maxsize=4)
def no_own_kv(dtype):
    """An empty (0, 0, 0, 0) array of ``dtype``: the kernel's ``k_own`` and ``v_own`` where
    the tiles are packed beforehand. Made once, never written."""
    return np.empty((0, 0, 0, 0), dtype)


def packs_own_tiles(plan, k, v):
    """Whether the forward kernel's tasks pack their own K/V tiles (``forward``'s ``k_own``),
    for a call of ``plan`` (``tiling``): where each task is one query block on one key tile
    (``plan.own_shapes``). That saves the packing's own parallel region and kernel call, about
    6 us, which a short prompt's call paid on top of its 30-40 us. K and V C-contiguous (the
    tasks read their rows by offsets, as ``pack_tiles`` does); V's rows padded to whole
    vectors as ``packed_kv`` pads them.

    A GQA group's query heads share their K/V head's tile: a worker packs it for the first of
    them it runs and the next ones read it (``forward``'s ``own_head``). Until stop 66 each
    head packed it anew, and groups that would repack more than 12 tiles a call packed in one
    region instead (Hq=32 Hkv=8 at N=16 took 1.09x the time on own tiles). With the shared
    tile, own tiles against one region (B=1, D=64, causal, 2 threads, four blocks of 300 calls
    alternating in one process, order reversed every other block): Hq=32 Hkv=8 at N=16 and 64
    0.78-0.80 and 0.92; Hq=32 Hkv=4 N=16 and 128 0.83-0.84 and 0.96-0.97; Hq=16 Hkv=2 N=16
    and 64 0.81-0.82 and 0.89-0.90; Hq=64 Hkv=8 N=32 0.91-0.92."""
    return plan.own_shapes and k.flags.c_contiguous and v.flags.c_contiguous


def run_forward(q, k, v, scale, band, mods, user_mask, drop, portable, out=None,
                kv_scales=None, kv_blocks=None, sinks=None):
    """Pack K/V and run the kernel on 4-D arrays of one compute dtype (float32 or float64).

    ``k``, ``v`` may also be a K/V cache in a storage type (float16, or int8 with
    ``kv_scales = (k_scale, v_scale)``, (B, Hkv, Nk) each): the decode path reads it in place;
    the tiled path converts it to the compute dtype first. ``kv_blocks``: a layer of KVCache's
    ``decode.Blocks``, ``k`` and ``v`` then only their shapes and dtypes: the decode path
    reads the blocks in place, the tiled path gets K and V from them as arrays.

    Returns ``out`` (B, Hq, Nq, Dv), contiguous, and ``lse`` (B, Hq, Nq), both in that dtype.
    ``out``, if given, must be such an array; it is written in place. ``band``: the
    ``(left, right, kv_lens)`` of masking.py; ``mods``: ``(softcap, alibi_slopes (B, Hq))``
    in natural units (scores.py); ``user_mask``: a ``masks.UserMask``; ``drop``:
    ``(drop_below, seed, inv_keep)`` (``masks.dropout``). ``sinks``: attention sinks' logits,
    float64 (B or 1, Hq) (``cpuflash/sinks.py``), or None: each kernel adds them to its rows'
    sums (``decode.combine_row``, ``finish_row``).
    """
    n_b, n_hq, n_q, d = q.shape
    n_k, dv = v.shape[2], v.shape[3]
    if out is None:
        out = output((n_b, n_hq, n_q, dv), q.dtype)  # very large: plain pages (pack.empty)
    lse = np.empty((n_b, n_hq, n_q), dtype=q.dtype)
    if out.size == 0:
        return out, lse
    if n_k == 0:  # no key at all: every row sees nothing, its lse the sink's (or -inf)
        out[...] = 0.0
        lse[...] = -np.inf if sinks is None else sinks[:, :, None]
        return out, lse
    if not portable and takes_decode(n_q, n_k, n_hq // v.shape[1],
                                     kv_blocks is not None or k.dtype != q.dtype):
        decoded = run_decode(q, k, v, scale, band, mods, user_mask, drop, out, kv_scales, lse,
                             kv_blocks, sinks)
        if decoded is not None:
            return decoded
    if kv_blocks is not None:
        k, v = arrays_of_blocks(kv_blocks, n_k)
    left, right, kv_lens = band
    if kv_scales is not None:  # int8 times its per-token scale, in the compute dtype
        k, v = (x * x_scale[..., None].astype(q.dtype) for x, x_scale in zip((k, v), kv_scales))
    if k.dtype != q.dtype:
        k = k.astype(q.dtype)
    if v.dtype != q.dtype:
        v = v.astype(q.dtype)
    plan = tiling(n_b, n_hq, k.shape[1], n_q, n_k, d, dv, q.dtype, num_threads())
    block_k, block_q = plan.block_k, plan.block_q
    if packs_own_tiles(plan, k, v):
        kt, vt, seqs = plan.no_kt, plan.no_vt, plan.seqs_own
        k_own, v_own = k, v
    else:
        kt, vt = packed_kv(k, v, block_k, config.lanes(q.dtype), config.panel_width(q.dtype))
        kt, vt = kt.reshape(-1, kt.shape[2]), vt.reshape(-1, vt.shape[2])
        seqs = plan.seqs_packed
        k_own = v_own = no_own_kv(q.dtype)
    run_shared(forward_portable if portable else forward, q, kt, vt, k_own, v_own, k.shape[1],
               block_q, scale, left, right, seqs, kv_lens, mods[0], mods[1],
               *user_mask.kernel_args(), user_mask.tile_states(block_q, block_k), drop[0],
               drop[2], np.full(n_b, drop[1]) if drop[0] else NO_SEEDS,
               NO_SINKS if sinks is None else sinks, out.reshape(-1), plan.out_layout, lse)
    return out, lse


def run_varlen(q, k, v, cu_q, cu_k, scale, band, mods, drop, portable, sinks=None):
    """The forward pass over packed sequences in one kernel call (``cpuflash.varlen``).

    ``q``: (total_q, Hq, D), ``k``/``v``: (total_k, Hkv, D/Dv), any strides, of one compute
    dtype; ``cu_q``/``cu_k``: int64 offsets of the S sequences (S + 1 each). ``band``: ``(left,
    right)``; ``mods``: ``(softcap, slopes (S, Hq))``; ``drop``: ``(drop_below, seeds (S,),
    inv_keep)``; ``sinks``: float64 (S or 1, Hq) sink logits, or None.
    Returns ``out`` (total_q, Hq, Dv) and ``lse`` (Hq, total_q).
    """
    total_q, n_hq, d = q.shape
    n_hkv, dv = v.shape[1], v.shape[2]
    q_lens, k_lens = np.diff(cu_q), np.diff(cu_k)
    out = empty((total_q, n_hq, dv), q.dtype)
    lse = np.empty((1, n_hq, total_q), dtype=q.dtype)
    n_seq = len(q_lens)
    if out.size == 0 or n_seq == 0:
        return out, lse.reshape(n_hq, total_q)
    longest_q, longest_k = int(q_lens.max()), int(k_lens.max())
    block_k = config.block_k(d, longest_k)
    block_q = config.block_q(longest_q, d, n_seq * n_hq, num_threads())
    seqs, _, n_tiles = sequences.varlen(cu_q[:-1], q_lens, k_lens, n_hq, n_hkv, block_q,
                                        block_k, config.MICRO_ROWS)
    kt, vt = packed_varlen(k, v, cu_k, seqs, block_k, config.lanes(q.dtype),
                           config.panel_width(q.dtype), n_tiles)
    no_mask = UserMask(None, n_seq, n_hq, block_q * int(seqs[:, N_QB].max()),
                       block_k * max(1, int(seqs[:, TILES].max())), q.dtype)
    no_own = no_own_kv(q.dtype)
    run_shared(forward_portable if portable else forward, q.transpose(1, 0, 2)[None], kt, vt,
                no_own, no_own, n_hkv, block_q, scale, band[0], band[1], seqs,
                k_lens.astype(np.int64),
                mods[0], mods[1], *no_mask.kernel_args(),
                no_mask.tile_states(block_q, block_k), drop[0], drop[2], drop[1],
                NO_SINKS if sinks is None else sinks, out.reshape(-1), (0, dv, n_hq * dv, dv), lse)
    return out, lse.reshape(n_hq, total_q)
