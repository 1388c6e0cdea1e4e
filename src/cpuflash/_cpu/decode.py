"""Decoding: few queries against a long K/V, read in place. prange over (batch*kv-head, split).

With ``Nq`` small the forward pass is bound by reading K and V, and packing them (as the
tiled kernel does) would read them twice. Here every task takes one split of the key axis for
one kv head and all the query rows of its GQA group (``group * Nq`` rows), so each K/V byte is
read once per call, straight from the caller's array (rows must be unit-stride):

    for each chunk of 16 keys in the split:
        s[r, :] = q_r . k_j                  # one vector dot product per (row, key)
        online softmax over the chunk        # as the tiled kernel, base 2
        acc[r] = alpha * acc[r] + sum_j p[r, j] * v_j

Each split leaves ``m``, ``l`` and an unnormalized ``acc``; ``combine`` merges the splits in
split order (``out = sum_s acc_s 2^(m_s - M) / sum_s l_s 2^(m_s - M)``). The number of splits
is a function of the shapes only, so the result is the same for any thread count.
"""
import math

import numpy as np
from numba import prange

from . import simd
from ._jit import helper, kernel
from .tasks import unravel
from .dropout import dropout_row
from .masking import apply_user_mask, row_band
from .scores import modify_row
from .tiles import MR, online_softmax, rescale_add, tile_product

LN2 = math.log(2.0)
LOG2_E = 1.0 / LN2
CHUNK = 16           # keys per online-softmax step (whole vectors for every lane count)
KEYS_PER_SPLIT = 1024  # a split's keys: enough work per task, splits enough for the threads
MAX_NQ = 16          # attention() takes this path for Nq up to this


@helper
def dot_rows(q_s, q_off, kf, k_off, d, d_vec):
    """``q_s[q_off:q_off+d] . kf[k_off:k_off+d]``: vectors up to ``d_vec``, then scalars."""
    acc = simd.vsplat(q_s, 0.0)
    for dd in range(0, d_vec, simd.lanes_of(q_s)):
        acc = simd.vfma(simd.vload(q_s, q_off + dd), simd.vload(kf, k_off + dd), acc)
    total = simd.vhsum(acc)
    for dd in range(d_vec, d):
        total += q_s[q_off + dd] * kf[k_off + dd]
    return total


@helper
def axpy_row(acc, acc_off, p, vf, v_off, dv, dv_vec):
    """``acc[acc_off:acc_off+dv] += p * vf[v_off:v_off+dv]``."""
    p_v = simd.vsplat(acc, p)
    for c in range(0, dv_vec, simd.lanes_of(acc)):
        simd.vstore(acc, acc_off + c, simd.vfma(p_v, simd.vload(vf, v_off + c),
                                                 simd.vload(acc, acc_off + c)))
    for c in range(dv_vec, dv):
        acc[acc_off + c] += p * vf[v_off + c]


@kernel
def decode(q, kf, k_strides, vf, v_strides, n_hkv, n_k, d, dv, n_splits, scale2, left, right,
           kv_lens, softcap2, slopes2, mask, mask_given, mask_is_bool, drop_below, seed,
           m_part, l_part, acc_part):
    """q: (B, Hq, Nq, D) any strides. kf, vf: 1-D views from the first element of K and V;
    element (b, h, j, c) is at ``b*s0 + h*s1 + j*s2 + c`` with ``k_strides = (s0, s1, s2)``.
    left, right, kv_lens: the band of keys each row sees (masking.py); the splits divide the
    array's ``n_k`` keys, and keys outside a row's band are never read.
    Writes per split: m_part, l_part (n_splits, B, Hq, Nq) and acc_part (..., Dv)."""
    n_b, n_hq, n_q, _ = q.shape
    group = n_hq // n_hkv
    rows = group * n_q
    lanes = simd.lanes_of(kf)
    d_vec = d // lanes * lanes
    dv_vec = dv // lanes * lanes
    # P @ V by the micro-kernel, V rows read in place, when they are whole vectors (a padded
    # read past the last row would leave the array); else one row update per key.
    tiled = dv == dv_vec
    rows_pad = (rows + MR - 1) // MR * MR
    ld = dv  # acc row stride
    split_len = (n_k + n_splits - 1) // n_splits
    modify = softcap2 != 0.0 or np.any(slopes2 != 0.0)
    inv_keep = 2.0**32 / (2.0**32 - drop_below)  # 1 / (1 - p)
    no_t = np.empty(0, dtype=acc_part.dtype)
    for task in prange(n_b * n_hkv * n_splits):
        b, hk, split = unravel(task, n_hkv, n_splits)
        q_s = np.empty(rows * d, dtype=acc_part.dtype)  # rows (h, i) of the group, scaled
        for g in range(group):
            for i in range(n_q):
                for dd in range(d):
                    q_s[(g * n_q + i) * d + dd] = q[b, hk * group + g, i, dd] * scale2
        s = np.zeros(rows_pad * CHUNK, dtype=acc_part.dtype)  # padding rows stay P = 0
        m_i = np.full(rows, -np.inf, dtype=acc_part.dtype)
        l_i = np.zeros(rows, dtype=acc_part.dtype)
        l_tile = np.empty(rows, dtype=acc_part.dtype)
        alpha_i = np.empty(rows, dtype=acc_part.dtype)
        acc = np.zeros(rows_pad * ld, dtype=acc_part.dtype)
        pv = np.empty(rows_pad * ld, dtype=acc_part.dtype)
        kv_len = kv_lens[b]
        # The keys of this split that some row of the group sees.
        j_start = max(split * split_len, row_band(0, n_q, kv_len, left, right)[0])
        j_stop = min(split * split_len + split_len,
                     row_band(n_q - 1, n_q, kv_len, left, right)[1] + 1)
        k_head = b * k_strides[0] + hk * k_strides[1]
        v_head = b * v_strides[0] + hk * v_strides[1]
        for c0 in range(j_start, j_stop, CHUNK):
            n_c = min(CHUNK, j_stop - c0)
            for r in range(rows):
                i = r % n_q
                first, last = row_band(i, n_q, kv_len, left, right)
                for jj in range(CHUNK):
                    j = c0 + jj
                    s[r * CHUNK + jj] = 0.0
                    if jj < n_c and first <= j <= last:
                        s[r * CHUNK + jj] = dot_rows(q_s, r * d, kf, k_head + j * k_strides[2],
                                                     d, d_vec)
                h = hk * group + r // n_q
                if modify:
                    modify_row(s, r * CHUNK, CHUNK, i + kv_len - n_q, c0, softcap2,
                               slopes2[b, h], no_t, False)
                if mask_given:
                    apply_user_mask(s, r * CHUNK, CHUNK, 1, mask, mask_is_bool, b, h, i, c0,
                                    n_c, LOG2_E)
                for jj in range(CHUNK):  # masked after the modifiers, as the tiled kernel
                    if not (jj < n_c and first <= c0 + jj <= last):
                        s[r * CHUNK + jj] = -np.inf
            online_softmax(s, CHUNK, CHUNK, rows, m_i, l_tile, alpha_i, False)
            for r in range(rows):
                l_i[r] = alpha_i[r] * l_i[r] + l_tile[r]
                if drop_below > 0:
                    dropout_row(s, r * CHUNK, CHUNK, seed,
                                (b * n_hq + hk * group + r // n_q) * n_q + r % n_q, c0,
                                drop_below, inv_keep)
            if tiled:
                tile_product(pv, 0, ld, s, 0, CHUNK, 1, vf, v_head + c0 * v_strides[2],
                             v_strides[2], 1, rows_pad, dv, n_c, False, False)
                rescale_add(acc, pv, ld, rows, alpha_i, False)
            else:
                for r in range(rows):
                    for c in range(dv):
                        acc[r * ld + c] *= alpha_i[r]
                    for jj in range(n_c):
                        axpy_row(acc, r * ld, s[r * CHUNK + jj], vf,
                                 v_head + (c0 + jj) * v_strides[2], dv, dv_vec)
        for g in range(group):
            for i in range(n_q):
                r = g * n_q + i
                h = hk * group + g
                m_part[split, b, h, i] = m_i[r]
                l_part[split, b, h, i] = l_i[r]
                for c in range(dv):
                    acc_part[split, b, h, i, c] = acc[r * ld + c]


@kernel
def combine(m_part, l_part, acc_part, out, lse):
    """Merge the splits in split order: out = sum_s acc_s 2^(m_s - M) / sum_s l_s 2^(m_s - M)."""
    n_s, n_b, n_h, n_q = m_part.shape
    dv = out.shape[3]
    for task in prange(n_b * n_h * n_q):
        b, h, i = unravel(task, n_h, n_q)
        m = -np.inf
        for sp in range(n_s):
            m = max(m, m_part[sp, b, h, i])
        if m == -np.inf:  # the row sees no key
            for c in range(dv):
                out[b, h, i, c] = 0.0
            lse[b, h, i] = -np.inf
            continue
        total = 0.0
        for c in range(dv):
            out[b, h, i, c] = 0.0
        for sp in range(n_s):
            w = np.exp2(m_part[sp, b, h, i] - m)
            total += w * l_part[sp, b, h, i]
            for c in range(dv):
                out[b, h, i, c] += w * acc_part[sp, b, h, i, c]
        for c in range(dv):
            out[b, h, i, c] /= total
        lse[b, h, i] = (m + np.log2(total)) * LN2


def _flat_view(x):
    """A 1-D view from ``x``'s first element over all of it, and its strides in elements; None
    unless rows are unit-stride and the other strides are non-negative whole elements."""
    item = x.itemsize
    if x.strides[3] != item and x.shape[3] > 1:
        return None
    if any(st < 0 or st % item for st in x.strides[:3]):
        return None
    steps = tuple(st // item for st in x.strides[:3])
    span = 1 + sum((n - 1) * st for n, st in zip(x.shape[:3], steps)) + (x.shape[3] - 1)
    flat = np.lib.stride_tricks.as_strided(x, shape=(span,), strides=(item,), writeable=False)
    return flat, steps


def run_decode(q, k, v, scale, band, mods, user_mask, drop, out=None):
    """The decode path for 4-D arrays of one compute dtype, or None where it does not apply
    (K or V rows not unit-stride): the caller then takes the tiled path. ``band``: the
    ``(left, right, kv_lens)`` of masking.py."""
    left, right, kv_lens = band
    softcap2, slopes2 = mods[0] * LOG2_E, mods[1] * LOG2_E
    n_b, n_hq, n_q, d = q.shape
    n_hkv, n_k, dv = v.shape[1], v.shape[2], v.shape[3]
    if n_q > MAX_NQ or n_k == 0 or q.size == 0 or v.size == 0:
        return None
    k_view, v_view = _flat_view(k), _flat_view(v)
    if k_view is None or v_view is None:
        return None
    n_splits = max(1, min(64, -(-n_k // KEYS_PER_SPLIT)))
    dtype = q.dtype
    m_part = np.empty((n_splits, n_b, n_hq, n_q), dtype=dtype)
    l_part = np.empty((n_splits, n_b, n_hq, n_q), dtype=dtype)
    acc_part = np.empty((n_splits, n_b, n_hq, n_q, dv), dtype=dtype)
    decode(q, k_view[0], k_view[1], v_view[0], v_view[1], n_hkv, n_k, d, dv, n_splits,
           scale * LOG2_E, left, right, kv_lens, softcap2, slopes2, user_mask.view,
           user_mask.given, user_mask.is_bool, drop[0], drop[1], m_part, l_part, acc_part)
    if out is None:
        out = np.empty((n_b, n_hq, n_q, dv), dtype=dtype)
    lse = np.empty((n_b, n_hq, n_q), dtype=dtype)
    combine(m_part, l_part, acc_part, out, lse)
    return out, lse
