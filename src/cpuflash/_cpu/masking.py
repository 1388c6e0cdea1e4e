"""Which keys a query row sees: the band of causal, window and kv_lens, tile by tile.

Row ``i`` of batch ``b`` sees the keys ``first <= j <= last`` with, for ``off = kv_len - Nq``
(bottom-right alignment to the keys that exist, as FlashAttention's kv-cache call):

    first = max(0, i + off - left)          last = min(kv_len - 1, i + off + right)

``left``/``right`` come from ``window`` (``UNBOUNDED`` for a side without a limit), and
``causal`` is ``right = min(right, 0)``. The kernels ask three questions per tile, so that
tiles outside the band are never computed and only tiles that cross its edge pay for
element-wise masking:

* ``tile_key_range``: the key tiles a block of rows sees at all;
* ``tile_needs_mask``: whether a visible tile crosses an edge of the band;
* ``mask_tile``: set the scores outside the band to ``-inf``;
* ``band_columns``, ``band_runs``: on such a tile, the keys each block of rows
  needs computed at all (the score products, forward and backward, skip the rest, which
  ``mask_tile`` then overwrites; the forward's P V and the backward's dP, dQ, dK and dV skip
  them too).

A caller's bool/float mask comes with a small table of tile states (``masks.tile_states``):
``HIDDEN`` tiles are skipped like tiles outside the band, ``CLEAR`` tiles (all True, or all 0.0)
cost nothing, and only ``MIXED`` tiles are masked element by element (``apply_user_mask``).
"""
import numpy as np
from numba import prange

from .. import config
from . import simd
from ._jit import helper, kernel
from .tasks import unravel

UNBOUNDED = 1 << 40  # a window side with no limit (any sequence is shorter)
HIDDEN, MIXED, CLEAR = 0, 1, 2  # tile states of a caller's mask


@helper
def row_band(i, n_q, kv_len, left, right):
    """Keys ``[first, last]`` that row ``i`` sees; ``first > last`` when it sees none."""
    off = kv_len - n_q
    return max(0, i + off - left), min(kv_len - 1, i + off + right)


@helper
def tile_key_range(q0, q1, n_q, kv_len, block_k, left, right):
    """Key tiles ``[kb_lo, kb_hi)`` that rows ``[q0, q1)`` may see; empty if none."""
    first = row_band(q0, n_q, kv_len, left, right)[0]
    last = row_band(q1 - 1, n_q, kv_len, left, right)[1]
    if last < first or last < 0:
        return 0, 0
    return first // block_k, last // block_k + 1


@helper
def tile_needs_mask(q0, q1, k0, block_k, n_q, kv_len, left, right):
    """Whether some row of ``[q0, q1)`` must not see some key of ``[k0, k0 + block_k)``."""
    first_hi = row_band(q1 - 1, n_q, kv_len, left, right)[0]  # the largest first key
    last_lo = row_band(q0, n_q, kv_len, left, right)[1]       # the smallest last key
    return k0 < first_hi or k0 + block_k - 1 > last_lo


@helper
def band_columns(r0, mr, rows, q0, k0, n_q, kv_len, left, right, block_k, width):
    """The columns of the key tile from key ``k0`` that the ``mr`` tile rows from ``r0`` (query
    rows ``q0 + r0 ..``) need computed: whole panels of ``width`` keys up to the last key one
    of them sees (a row's last key grows with the row), 0 if they see none of the tile's; all
    ``block_k`` for a block that holds padding rows (past ``rows``), which no mask covers."""
    if r0 + mr > rows:
        return block_k
    last = row_band(q0 + r0 + mr - 1, n_q, kv_len, left, right)[1] - k0  # a tile column
    return min(block_k, max(0, (last + width) // width * width))


@helper
def band_runs(runs, bq, banded, rows, q0, k0, n_q, kv_len, left, right, block_k, width):
    """The runs of whole ``MICRO_ROWS`` row blocks of a tile's first ``bq`` rows (the rows its
    query block computes, ``sequences.computed_rows``) that need the same
    columns of the key tile from ``k0`` computed (``band_columns``: the first ``need``, 0 for
    none), in order, as many blocks a run as do, into ``runs`` (an int64 array of at least
    ``ceil(bq / MICRO_ROWS)`` rows of three): ``(r0, r1, need)`` each; returns how many. On a
    tile that crosses no mask edge (not ``banded``), one run of every row and all ``block_k``
    keys. The products over a tile run once per run, each from one call site (each call of a
    product inlines its micro-kernels, and compile time grows with them)."""
    if not banded:
        runs[0, 0], runs[0, 1], runs[0, 2] = 0, bq, block_k
        return 1
    mr = config.MICRO_ROWS
    n = 0
    r0 = 0
    while r0 < bq:
        need = band_columns(r0, mr, rows, q0, k0, n_q, kv_len, left, right, block_k, width)
        r1 = min(r0 + mr, bq)  # (query blocks are whole micro-tiles: the min only guards)
        while r1 < bq and band_columns(r1, mr, rows, q0, k0, n_q, kv_len, left, right,
                                       block_k, width) == need:
            r1 = min(r1 + mr, bq)
        runs[n, 0], runs[n, 1], runs[n, 2] = r0, r1, need
        n += 1
        r0 = r1
    return n


@helper
def fill(s, start, stop, value, portable):
    """``s[start:stop] = value``: whole vectors from ``start`` (unaligned stores), then the rest
    one by one; all one by one if ``portable``."""
    j = start
    if not portable:
        lanes = simd.lanes_of(s)
        value_v = simd.vsplat(s, value)
        while j + lanes <= stop:
            simd.vstore(s, j, value_v)
            j += lanes
    while j < stop:
        s[j] = value
        j += 1


@helper
def mask_tile(s, ld, rows, q0, k0, block_k, n_q, kv_len, left, right, masked, portable):
    """Set the scores of rows ``q0 + r`` (``r < rows``) for keys outside their band to
    ``masked`` (``-inf``), each row's two runs by ``fill`` (one by one, a causal 64-token
    prompt's diagonal tiles took 9 % of its forward pass)."""
    for r in range(rows):
        first, last = row_band(q0 + r, n_q, kv_len, left, right)
        lo = min(block_k, max(0, first - k0))      # tile columns before the band
        hi = max(lo, min(block_k, last - k0 + 1))  # tile columns in the band end here
        fill(s, r * ld, r * ld + lo, masked, portable)
        fill(s, r * ld + hi, r * ld + block_k, masked, portable)


@helper
def apply_user_mask(s, off, ld, rows, bools, adds, is_bool, b, h, q0, k0, n_cols, unit,
                    row_max):
    """The caller's mask (``masks.UserMask.kernel_args``: ``bools`` if ``is_bool``, else
    ``adds``) on rows ``q0 + r`` (``r < rows``, scores at ``s[off + r*ld + j]``), key columns
    ``k0 .. k0 + n_cols``, and the rows' maxima (``mask_rows``)."""
    if is_bool:
        mask_rows(s, off, ld, rows, bools, True, b, h, q0, k0, n_cols, unit, row_max)
    else:
        mask_rows(s, off, ld, rows, adds, False, b, h, q0, k0, n_cols, unit, row_max)


@helper
def mask_rows(s, off, ld, rows, mask, is_bool, b, h, q0, k0, n_cols, unit, row_max):
    """The caller's mask on rows ``q0 + r`` (``r < rows``, scores at ``s[off + r*ld + j]``), key
    columns ``k0 .. k0 + n_cols``:
    bool (its bytes, 0/1): 0 sets ``-inf``; float: adds ``mask * unit`` (1 where the scores are
    in natural units, ``log2(e)`` where they are in base 2).
    ``mask`` is a (B, Hq, Nq, Nk) view, broadcast by stride 0, never a dense copy. A row of
    contiguous mask entries goes by whole vectors, the rest one entry at a time (measured, one
    thread, H=8, N=2048, a 2-D float mask with causal: time over plain causal 1.95x -> 1.25x
    with random values in the lower triangle).

    ``row_max[r]`` gets the maximum of the row's ``n_cols`` masked scores (``-inf`` if all are
    ``-inf``; NaN passed over, as ``tiles.row_max``): the online softmax can take it instead
    of reading the tile once more for its row maxima."""
    lanes = simd.lanes_of(s)
    neg_inf = simd.vsplat(s, -np.inf)
    scale = simd.vsplat(s, unit)
    for r in range(rows):
        mask_row = mask[b, h, q0 + r, k0:k0 + n_cols]  # a view: strided or broadcast
        row = off + r * ld
        n_vec = n_cols // lanes * lanes if mask_row.strides[0] == mask_row.itemsize else 0
        best_v = neg_inf
        for j in range(0, n_vec, lanes):
            m = simd.vload_as(s, mask_row, j)
            x = simd.vload(s, row + j)
            if is_bool:
                x = simd.vselect_nonzero(m, x, neg_inf)
            else:
                x = simd.vfma(m, scale, x)
            simd.vstore(s, row + j, x)
            best_v = simd.vmax(best_v, x)
        best = simd.vhmax(best_v)
        for j in range(n_vec, n_cols):
            if is_bool:
                x = s[row + j] if mask_row[j] else -np.inf
            else:
                x = s[row + j] + mask_row[j] * unit
            s[row + j] = x
            if x > best:
                best = x
        row_max[r] = best


@helper
def row_not_clear_not_hidden(row, is_bool, like, lowest):
    """``(not_clear, not_hidden)`` counts of a mask row: entries that change a score, and
    entries that do not hide it. bool (its bytes): clear = 1, hidden = 0. float: clear = +-0.0
    (adding it leaves every score as it is), hidden = -inf; NaN is neither, so it reaches the
    scores. A contiguous row goes by whole vectors of ``like``'s type (the mask's own float
    type, or float32 for bool), compared lane by lane into two counters; ``lowest`` is the
    most negative finite value of that type (``x < lowest`` only for -inf, never for NaN)."""
    n = row.shape[0]
    lanes = simd.lanes_of(like)
    n_vec = n // lanes * lanes if row.strides[0] == row.itemsize else 0
    zero = simd.vsplat(like, 0.0)
    one = simd.vsplat(like, 1.0)
    half = simd.vsplat(like, 0.5)
    lowest_v = simd.vsplat(like, lowest)
    not_clear_v = zero
    not_hidden_v = zero
    for j in range(0, n_vec, lanes):
        x = simd.vload_as(like, row, j)
        if is_bool:
            not_clear_v = simd.vadd(not_clear_v, simd.vwhere_lt(x, half, one, zero))
            not_hidden_v = simd.vadd(not_hidden_v, simd.vselect_nonzero(x, one, zero))
        else:
            not_clear_v = simd.vadd(not_clear_v, simd.vselect_nonzero(x, one, zero))
            not_hidden_v = simd.vadd(not_hidden_v, simd.vwhere_lt(x, lowest_v, zero, one))
    not_clear = simd.vhsum(not_clear_v)
    not_hidden = simd.vhsum(not_hidden_v)
    for j in range(n_vec, n):
        x = row[j]
        if is_bool:
            not_clear += x == 0
            not_hidden += x != 0
        else:
            not_clear += x != 0.0  # NaN too
            not_hidden += not (x == -np.inf)
    return not_clear, not_hidden


@kernel(strided=("mask",))
def tile_state_table(mask, is_bool, like, lowest, block_q, block_k, n_kb, states):
    """``states[b, h, qb, kb]`` of the caller's mask in one parallel pass over it: CLEAR if every
    entry of the tile is the "attend, add nothing" value, HIDDEN if every entry is the "never
    attend" value, else MIXED (``row_not_clear_not_hidden``). ``mask`` is (B', H', Nq' in
    {1, Nq}, Nk' in {1, Nk}), bool masks as uint8; ``states`` is (B', H', n_qb', n_kb)."""
    n_b, n_h, n_q, n_k = mask.shape
    n_qb = states.shape[2]
    for task in prange(n_b * n_h * n_qb):
        b, h, qb = unravel(task, n_h, n_qb)
        q0 = qb * block_q
        q1 = min(n_q, q0 + block_q)
        for kb in range(n_kb):
            k0 = 0 if n_k == 1 else kb * block_k
            k1 = 1 if n_k == 1 else min(n_k, k0 + block_k)
            not_clear = 0.0
            not_hidden = 0.0
            for i in range(q0, q1):
                c, v = row_not_clear_not_hidden(mask[b, h, i, k0:k1], is_bool, like, lowest)
                not_clear += c
                not_hidden += v
                if not_clear > 0 and not_hidden > 0:
                    break  # MIXED already: the rest of the tile cannot change that
            states[b, h, qb, kb] = CLEAR if not_clear == 0 else (
                HIDDEN if not_hidden == 0 else MIXED)
