"""Tile-level steps of attention, each in a SIMD form and a portable pure-Numba form.

All arrays are contiguous 1-D scratch buffers addressed as row-major tiles: element ``(r, c)``
of a tile at ``off`` with row stride ``ld`` is ``buf[off + r*ld + c]``. Tile widths are whole
vectors (callers pad), so no step has a tail.

``portable=True`` selects plain loops that any CPU Numba supports runs; the tests run both.
The branch is taken once per tile, never inside an inner loop.
"""
import math

import numpy as np

from .. import config
from . import simd
from ._jit import helper, inlined_helper, micro_helper

MR = config.MICRO_ROWS
MAX_VECS = config.MICRO_VECS  # vectors per micro-tile row: the panel width of packed B


def _micro_dispatch(mr):
    """``micro(c, ..., k, nv, accumulate)``: the ``mr``-row tile product of ``nv`` vectors of
    columns (1..MAX_VECS), picked at run time among the shapes built ahead by ``_make_gemm``."""
    set1, set2, set3, set4 = [simd._make_gemm(mr, nv, accumulate=False) for nv in range(1, 5)]
    acc1, acc2, acc3, acc4 = [simd._make_gemm(mr, nv, accumulate=True) for nv in range(1, 5)]

    def micro(c, c_off, ldc, a, a_off, lda, a_ks, b, b_off, ldb, k, nv, accumulate):
        if accumulate:
            if nv == 4:
                acc4(c, c_off, ldc, a, a_off, lda, a_ks, b, b_off, ldb, k)
            elif nv == 3:
                acc3(c, c_off, ldc, a, a_off, lda, a_ks, b, b_off, ldb, k)
            elif nv == 2:
                acc2(c, c_off, ldc, a, a_off, lda, a_ks, b, b_off, ldb, k)
            else:
                acc1(c, c_off, ldc, a, a_off, lda, a_ks, b, b_off, ldb, k)
        else:
            if nv == 4:
                set4(c, c_off, ldc, a, a_off, lda, a_ks, b, b_off, ldb, k)
            elif nv == 3:
                set3(c, c_off, ldc, a, a_off, lda, a_ks, b, b_off, ldb, k)
            elif nv == 2:
                set2(c, c_off, ldc, a, a_off, lda, a_ks, b, b_off, ldb, k)
            else:
                set1(c, c_off, ldc, a, a_off, lda, a_ks, b, b_off, ldb, k)

    micro.__name__ = micro.__qualname__ = f"_micro_{mr}rows"
    return micro_helper(micro)


def _micro_ahead_dispatch(mr):
    """``micro(c, ..., k, nv, ahead)``: as ``_micro_dispatch``'s in set mode, and each row of B
    it reads is also prefetched ``ahead`` elements further on."""
    g1, g2, g3, g4 = [simd._make_gemm(mr, nv, accumulate=False, prefetch=True)
                      for nv in range(1, 5)]

    def micro(c, c_off, ldc, a, a_off, lda, a_ks, b, b_off, ldb, k, nv, ahead):
        if nv == 4:
            g4(c, c_off, ldc, a, a_off, lda, a_ks, b, b_off, ldb, k, ahead)
        elif nv == 3:
            g3(c, c_off, ldc, a, a_off, lda, a_ks, b, b_off, ldb, k, ahead)
        elif nv == 2:
            g2(c, c_off, ldc, a, a_off, lda, a_ks, b, b_off, ldb, k, ahead)
        else:
            g1(c, c_off, ldc, a, a_off, lda, a_ks, b, b_off, ldb, k, ahead)

    micro.__name__ = micro.__qualname__ = f"_micro_ahead_{mr}rows"
    return micro_helper(micro)


# The products that sum in partial sums (simd.PARTIAL_TERMS): those over the head dim, the
# scores S = Q K^T (forward: "rowmax"; backward: "store") and dP = dO V^T ("store",
# "softmax_grad"), whose rounding moves every probability; and dQ = dS K over a key tile
# ("add"), whose error in a row does not average out over later sums as dK's and dV's do over
# query rows (8 seeds x 8 heads, N=512 D=64: dq max 8.4e-7 in one sum per tile, 5.4e-7 in
# parts, torch 7.4e-7). P V, dK and dV keep one sum: their errors were below torch's already,
# and every partial sum costs vector adds.
PARTIAL_SUM_EPILOGUES = ("rowmax", "store", "softmax_grad", "add")


def _micro_epilogue_dispatch(epilogue, whole_panels, mr=MR):
    """``micro(c, ..., k, nv, e, e_off, f, f_off)``: ``mr`` rows as ``_micro_dispatch``'s in
    set mode, with one of ``simd.EPILOGUES``. ``whole_panels``: only ``nv = MAX_VECS`` is ever
    asked for (a product over whole key tiles), so only that shape is built: each shape is
    compiled into every kernel that calls the dispatch, and compile time grows with them.
    The products of ``PARTIAL_SUM_EPILOGUES`` sum in partial sums (``simd.PARTIAL_TERMS``)."""
    terms = simd.PARTIAL_TERMS if epilogue in PARTIAL_SUM_EPILOGUES else 0
    if whole_panels:
        g = simd._make_gemm(mr, MAX_VECS, accumulate=False, epilogue=epilogue,
                            partial_terms=terms)

        def micro_whole(c, c_off, ldc, a, a_off, lda, a_ks, b, b_off, ldb, k, nv, e, e_off, f,
                        f_off):
            g(c, c_off, ldc, a, a_off, lda, a_ks, b, b_off, ldb, k, e, e_off, f, f_off)

        micro_whole.__name__ = micro_whole.__qualname__ = f"_micro_{epilogue}_whole_{mr}rows"
        return micro_helper(micro_whole)
    g1, g2, g3, g4 = [simd._make_gemm(mr, nv, accumulate=False, epilogue=epilogue,
                                      partial_terms=terms) for nv in range(1, 5)]

    def micro(c, c_off, ldc, a, a_off, lda, a_ks, b, b_off, ldb, k, nv, e, e_off, f, f_off):
        if nv == 4:
            g4(c, c_off, ldc, a, a_off, lda, a_ks, b, b_off, ldb, k, e, e_off, f, f_off)
        elif nv == 3:
            g3(c, c_off, ldc, a, a_off, lda, a_ks, b, b_off, ldb, k, e, e_off, f, f_off)
        elif nv == 2:
            g2(c, c_off, ldc, a, a_off, lda, a_ks, b, b_off, ldb, k, e, e_off, f, f_off)
        else:
            g1(c, c_off, ldc, a, a_off, lda, a_ks, b, b_off, ldb, k, e, e_off, f, f_off)

    micro.__name__ = micro.__qualname__ = f"_micro_{epilogue}_{mr}rows"
    return micro_helper(micro)


# Where an epilogue's ``e`` holds row r's values (``simd.EPILOGUES``): one value per row, one
# vector per row, or an array laid out as C (element (r, c) at e_off + r * ldc + c).
E_PER_ROW, E_VECTOR_PER_ROW, E_AS_C = 0, 1, 2


def _product_with_epilogue(epilogue, e_layout, whole_panels=False):
    """``product(c, c_off, ldc, a, a_off, a_rs, a_ks, b, b_off, b_ld, b_panel, rows, cols, k,
    e, e_off, f, f_off, scratch, portable)``: ``C[:rows, :cols] = epilogue(A @ B)``, A and B
    addressed as by ``tile_product``, each micro-tile finished in registers (``simd.EPILOGUES``).
    Rows in blocks of ``MR``, then any rest one row at a time (the dK and dV products have a
    key tile's rows: 64 with ``MR = 6`` on AVX2). ``whole_panels``: ``cols`` a multiple of the
    panel width (whole key tiles). The portable form forms the product in ``scratch`` (``rows *
    cols``) and finishes it element by element with the same operations.
    """
    micro = _micro_epilogue_dispatch(epilogue, whole_panels)
    micro_row = _micro_epilogue_dispatch(epilogue, whole_panels, mr=1)

    def product(c, c_off, ldc, a, a_off, a_rs, a_ks, b, b_off, b_ld, b_panel, rows, cols, k,
                e, e_off, f, f_off, scratch, portable):
        lanes = simd.lanes_of(c)
        e_step = ldc if e_layout == E_AS_C else lanes if e_layout == E_VECTOR_PER_ROW else 1
        if portable:
            product_portable(scratch, 0, cols, a, a_off, a_rs, a_ks, b, b_off, b_ld, b_panel,
                             rows, cols, k, False)
            for r in range(rows):
                for j in range(cols):
                    i = c_off + r * ldc + j
                    x = scratch[r * cols + j]
                    ei = e_off + r * e_step + (j if e_layout == E_AS_C else 0)
                    if epilogue == "rescale":
                        c[i] = e[ei] * c[i] + x
                    elif epilogue == "add":
                        c[i] += x
                    elif epilogue == "kahan":
                        y = x - e[ei]
                        t = c[i] + y
                        e[ei] = (t - c[i]) - y
                        c[i] = t
                    elif epilogue == "softmax_grad":
                        c[i] = e[ei] * (x - f[f_off + r]) if e[ei] != 0.0 else 0.0
                    else:  # store; rowmax: tile_product_max's portable form finds the maxima
                        c[i] = x
            return
        step = MAX_VECS * lanes
        whole = rows // MR * MR
        for c0 in range(0, cols, step):
            width = min(step, cols - c0)
            panel = b_off + c0 * b_panel
            ldb = b_ld if b_ld > 0 else width
            e_col = e_off + (c0 if e_layout == E_AS_C else 0)
            for r0 in range(0, whole, MR):
                micro(c, c_off + r0 * ldc + c0, ldc, a, a_off + r0 * a_rs, a_rs, a_ks, b, panel,
                      ldb, k, width // lanes, e, e_col + r0 * e_step, f, f_off + r0)
            for r in range(whole, rows):
                micro_row(c, c_off + r * ldc + c0, ldc, a, a_off + r * a_rs, a_rs, a_ks, b,
                          panel, ldb, k, width // lanes, e, e_col + r * e_step, f, f_off + r)

    product.__name__ = product.__qualname__ = f"tile_product_{epilogue}"
    return helper(product)


_micro_simd = _micro_dispatch(MR)
_micro_ahead = _micro_ahead_dispatch(MR)
# The rows past the last whole MR block (decoding: a GQA group's query rows, often fewer than
# MR) in blocks of REST_MR where MR is wider (6 on AVX2), then one row at a time. A one-row tile
# has MAX_VECS accumulators, too few chains of fused multiply-adds to hide their latency (4
# cycles on Zen 3, two issued a cycle): decoding Hq=8, Hkv=2 (4 rows) one row at a time ran at
# a third of the streaming bandwidth on Zen 3 (stop 25), where AVX-512's MR = 4 takes the group
# whole. Where there is no such block the name stands for MR's own (never called).
REST_MR = 4 if MR > 4 else 0
_micro_rest = _micro_dispatch(REST_MR) if REST_MR else _micro_simd
_micro_ahead_rest = _micro_ahead_dispatch(REST_MR) if REST_MR else _micro_ahead
_micro_row = _micro_dispatch(1)
_micro_ahead_row = _micro_ahead_dispatch(1)


@helper
def rest_blocks_end(whole, rows):
    """The end of the REST_MR-row blocks that follow the ``whole`` rows of MR blocks."""
    return whole + (rows - whole) // REST_MR * REST_MR if REST_MR > 0 else whole


@helper
def product_portable(c, c_off, ldc, a, a_off, a_rs, a_ks, b, b_off, b_ld, b_panel, rows, cols,
                     k, accumulate):
    """``tile_product``'s portable form: plain loops, the same panels."""
    step = MAX_VECS * simd.lanes_of(c)
    for c0 in range(0, cols, step):
        width = min(step, cols - c0)
        panel = b_off + c0 * b_panel
        ldb = b_ld if b_ld > 0 else width
        for r in range(rows):
            c_row = c_off + r * ldc + c0
            if not accumulate:
                for j in range(width):
                    c[c_row + j] = 0.0
            for kk in range(k):
                a_rk = a[a_off + r * a_rs + kk * a_ks]
                for j in range(width):
                    c[c_row + j] += a_rk * b[panel + kk * ldb + j]


@helper
def tile_product(c, c_off, ldc, a, a_off, a_rs, a_ks, b, b_off, b_ld, b_panel, rows, cols, k,
                 accumulate, portable):
    """``C[:rows, :cols] (+)= A[:rows, :k] @ B[:k, :cols]``; cols whole vectors. Rows in blocks
    of MR, then of REST_MR, then any rest one row at a time.

    ``A[r, k]`` is ``a[a_off + r*a_rs + k*a_ks]`` (row-major, or transposed with ``a_rs = 1``).
    B is read one column panel of ``panel_width`` columns at a time (the last may be narrower):
    the panel of columns ``[c0, c0 + w)`` starts at ``b_off + c0 * b_panel`` and has row stride
    ``b_ld``, or ``w`` if ``b_ld == 0``. So ``b_panel = 1, b_ld = ld`` reads a plain row-major
    B, and ``b_panel = rows of B, b_ld = 0`` reads B packed as contiguous panels (pack.py). A
    panel read with a row stride of a whole wide tile touches only some L1 sets and thrashes
    them (measured at D=128: -20 %); a contiguous panel uses all of them.
    """
    if portable:
        product_portable(c, c_off, ldc, a, a_off, a_rs, a_ks, b, b_off, b_ld, b_panel, rows,
                         cols, k, accumulate)
        return
    lanes = simd.lanes_of(c)
    step = MAX_VECS * lanes
    whole = rows // MR * MR
    rest_end = rest_blocks_end(whole, rows)
    for c0 in range(0, cols, step):  # panels outer: one panel of B stays in L1 for all rows
        width = min(step, cols - c0)
        panel = b_off + c0 * b_panel
        ldb = b_ld if b_ld > 0 else width
        for r0 in range(0, whole, MR):
            _micro_simd(c, c_off + r0 * ldc + c0, ldc, a, a_off + r0 * a_rs, a_rs, a_ks,
                        b, panel, ldb, k, width // lanes, accumulate)
        for r0 in range(whole, rest_end, max(REST_MR, 1)):
            _micro_rest(c, c_off + r0 * ldc + c0, ldc, a, a_off + r0 * a_rs, a_rs, a_ks,
                        b, panel, ldb, k, width // lanes, accumulate)
        for r in range(rest_end, rows):
            _micro_row(c, c_off + r * ldc + c0, ldc, a, a_off + r * a_rs, a_rs, a_ks,
                       b, panel, ldb, k, width // lanes, accumulate)


# S = Q K^T with its row maxima: over whole key tiles, and over whole vectors of keys (a causal
# diagonal tile's runs of rows compute only the vectors of keys they see: ``band_scores``).
_product_rowmax = _product_with_epilogue("rowmax", E_VECTOR_PER_ROW, whole_panels=True)
_product_rowmax_vectors = _product_with_epilogue("rowmax", E_VECTOR_PER_ROW)
# C = A @ B over whole key tiles: the backward pass's S and dP. (A kernel that calls only the
# products with epilogues compiles a few micro-kernel shapes, not tile_product's sixteen.)
tile_product_store = _product_with_epilogue("store", E_PER_ROW, whole_panels=True)
# acc[r, :] = alpha_i[r] * acc[r, :] + (A @ B)[r, :]: the forward pass's P V of one tile formed
# on its own (a short sum), then added to the running output with one fused multiply-add.
tile_product_rescale = _product_with_epilogue("rescale", E_PER_ROW)
# C += A @ B: the backward pass's dQ partial (the product a short sum of its own, as above).
tile_product_add = _product_with_epilogue("add", E_PER_ROW)
# C += A @ B with Kahan compensation in e: the backward pass's dK and dV over query blocks.
tile_product_kahan = _product_with_epilogue("kahan", E_AS_C)
# dS = P * (dO V^T - delta) where P != 0, else 0: e = P, f = delta per row.
tile_product_softmax_grad = _product_with_epilogue("softmax_grad", E_AS_C, whole_panels=True)


@inlined_helper
def tile_product_max(c, c_off, ldc, a, a_off, a_rs, a_ks, b, b_off, b_panel, rows, cols, k,
                     row_vmax, tile_max, tm_off, portable):
    """``C[:rows, :cols] = A[:rows, :k] @ B[:k, :cols]`` (B in packed panels of the
    micro-kernel's width, ``MAX_VECS`` vectors; cols whole vectors, the last panel read only in
    part if cols ends inside it) and ``tile_max[tm_off + r] = max(C[r, :cols])``, NaN passed
    over as by ``row_max``. The SIMD form takes the maxima from the registers as each
    micro-tile is stored, with no second pass over C; ``row_vmax``: scratch of ``rows``
    vectors, the lane-wise maxima over the panels. ``tm_off`` and stores, not views of
    ``tile_max`` and ``row_vmax``: each view costs two atomic operations on its reference
    count, and this runs once a tile or a run of row blocks (``forward.band_scores``)."""
    panel_ld = MAX_VECS * simd.lanes_of(c)  # a panel's row stride, however much of it is read
    if portable:
        product_portable(c, c_off, ldc, a, a_off, a_rs, a_ks, b, b_off, panel_ld, b_panel, rows,
                         cols, k, False)
        for r in range(rows):
            tile_max[tm_off + r] = row_max(c, c_off + r * ldc, cols, True)
        return
    lanes = simd.lanes_of(c)
    lowest = simd.vsplat(row_vmax, -np.inf)
    for r in range(rows):
        simd.vstore(row_vmax, r * lanes, lowest)
    if cols % panel_ld == 0:
        _product_rowmax(c, c_off, ldc, a, a_off, a_rs, a_ks, b, b_off, panel_ld, b_panel, rows,
                        cols, k, row_vmax, 0, row_vmax, 0, row_vmax, False)
    else:
        _product_rowmax_vectors(c, c_off, ldc, a, a_off, a_rs, a_ks, b, b_off, panel_ld,
                                b_panel, rows, cols, k, row_vmax, 0, row_vmax, 0, row_vmax,
                                False)
    for r in range(rows):
        tile_max[tm_off + r] = simd.vhmax(simd.vload(row_vmax, r * lanes))


@helper
def tile_product_ahead(c, c_off, ldc, a, a_off, a_rs, a_ks, b, b_off, b_ld, b_panel, rows,
                       cols, k, ahead):
    """``C[:rows, :cols] = A[:rows, :k] @ B[:k, :cols]`` as ``tile_product`` (SIMD, B's rows
    ``b_ld`` apart, its panel of columns ``[c0, c0 + w)`` at ``b_off + c0 * b_panel``),
    prefetching every row of B it reads ``ahead`` elements further on as well (into L2:
    ``simd.PREFETCH_LOCALITY``): for B streamed once from far caches, the decode kernel's K^T
    and V, where the hardware prefetcher does not keep up with the many rows of a transposed K
    (``decode.AHEAD``)."""
    lanes = simd.lanes_of(c)
    step = MAX_VECS * lanes
    whole = rows // MR * MR
    rest_end = rest_blocks_end(whole, rows)
    for c0 in range(0, cols, step):
        nv = min(step, cols - c0) // lanes
        for r0 in range(0, whole, MR):
            _micro_ahead(c, c_off + r0 * ldc + c0, ldc, a, a_off + r0 * a_rs, a_rs, a_ks,
                         b, b_off + c0 * b_panel, b_ld, k, nv, ahead)
        for r0 in range(whole, rest_end, max(REST_MR, 1)):
            _micro_ahead_rest(c, c_off + r0 * ldc + c0, ldc, a, a_off + r0 * a_rs, a_rs, a_ks,
                              b, b_off + c0 * b_panel, b_ld, k, nv, ahead)
        for r in range(rest_end, rows):
            _micro_ahead_row(c, c_off + r * ldc + c0, ldc, a, a_off + r * a_rs, a_rs, a_ks,
                             b, b_off + c0 * b_panel, b_ld, k, nv, ahead)


# Probabilities below 2^-64 of their row's total are set to 0 in the backward pass: they change
# no gradient by a float32 ulp, and products of them (dS = P * (dP - delta), then dS @ K)
# would fall below 2^-126 into subnormals, which cost a microcode assist each (measured at
# N=2048 with ALiBi, whose far keys get P ~ 2^-100: backward 1.40x plain causal -> 1.05x).
P_FLUSH_BELOW = -64.0
P_FLUSH_BELOW_E = P_FLUSH_BELOW * math.log(2.0)  # the same, for natural exponents


@helper
def exp_shifted(s, off, n, shift, portable):
    """``s[j] = e**(s[j] - shift)`` in place over ``s[off:off+n]``: the backward pass's
    ``P = exp(S - lse)``. The difference first: where ``P`` matters, ``s`` is close to
    ``shift`` and ``s - shift`` is exact, so a one-hot row's ``P`` is exactly 1, as the forward
    pass's (its lse is that row's largest score: see ``online_softmax``)."""
    if portable:
        for j in range(off, off + n):
            x = s[j] - shift
            s[j] = np.exp(x) if not x < P_FLUSH_BELOW_E else 0.0
        return
    lanes = simd.lanes_of(s)
    shift_v = simd.vsplat(s, shift)
    flush_v = simd.vsplat(s, P_FLUSH_BELOW_E)
    zero = simd.vsplat(s, 0.0)
    for j in range(off, off + n, lanes):
        x = simd.vsub(simd.vload(s, j), shift_v)
        simd.vstore(s, j, simd.vwhere_lt(x, flush_v, zero, simd.vexp(x)))


@helper
def row_max(s, off, n, portable):
    """Max of ``s[off:off+n]``, passing over NaN; ``-inf`` if every entry is ``-inf``."""
    if portable:
        best = -np.inf
        for j in range(n):
            if s[off + j] > best:
                best = s[off + j]
        return best
    lanes = simd.lanes_of(s)
    best_v = simd.vsplat(s, -np.inf)
    for j in range(0, n, lanes):
        best_v = simd.vmax(best_v, simd.vload(s, off + j))
    return simd.vhmax(best_v)


@helper
def exp_shifted_sum(s, off, n, shift, natural, portable):
    """``s[j] = e**(s[j] - shift)`` (``natural``) or ``2**(s[j] - shift)`` in place over
    ``s[off:off+n]``; returns the sum. The difference first: exact where ``s`` is near
    ``shift`` (the probabilities that matter), and 1 exactly at a row's maximum. e^x by
    ``simd.vexp_once`` (``x log2(e)`` rounded once: the forward pass's probabilities)."""
    if portable:
        total = 0.0
        for j in range(n):
            x = s[off + j] - shift
            p = np.exp(x) if natural else np.exp2(x)
            s[off + j] = p
            total += p
        return total
    lanes = simd.lanes_of(s)
    shift_v = simd.vsplat(s, shift)
    total_v = simd.vsplat(s, 0.0)
    for j in range(0, n, lanes):
        x = simd.vsub(simd.vload(s, off + j), shift_v)
        p = simd.vexp_once(x) if natural else simd.vexp2(x)
        simd.vstore(s, off + j, p)
        total_v = simd.vadd(total_v, p)
    return simd.vhsum(total_v)


@helper
def exp_inplace(x, off, n, natural, portable):
    """``x[off:off+n] = e**x`` (``natural``) or ``2**x``, for any ``n`` (whole vectors, then
    scalars)."""
    n_vec = 0 if portable else n // simd.lanes_of(x) * simd.lanes_of(x)
    for j in range(0, n_vec, simd.lanes_of(x)):
        v = simd.vload(x, off + j)
        simd.vstore(x, off + j, simd.vexp(v) if natural else simd.vexp2(v))
    for j in range(n_vec, n):
        x[off + j] = np.exp(x[off + j]) if natural else np.exp2(x[off + j])


@helper
def online_softmax(s, off, ld, n, rows, n_alpha, m_i, l_i, alpha_i, tile_max, max_given,
                   natural, portable):
    """One key tile of online softmax for ``rows`` rows of ``n`` scores, rows ``ld`` apart in
    ``s`` from ``s[off]``; ``natural``: the scores are in natural units (else base 2: the
    decode kernel folds ``log2(e)`` into Q). ``max_given``: ``tile_max[r]`` already holds each
    row's maximum (found by the pass that masked the tile); else the rows are read for it here.
    ``n_alpha >= rows``: the rescale factors are exponentiated over that many rows (those past
    ``rows`` set to 1), in whole vectors and then one by one (``exp_inplace``), so a row's
    factor comes from the vector or the scalar exponential as it would with ``n_alpha`` rows:
    the forward pass's last query block computes its own rows only (since stop 62) and still
    passes its block's size here, which keeps the bits of every row.

    In place: ``s`` becomes ``P = e^(s - m_new)`` (or ``2^(s - m_new)``), exactly 1 at the row's
    maximum; ``m_i`` the new running max; ``l_i`` this tile's row sums ``rowsum(P)``;
    ``alpha_i = e^(m_old - m_new)``, the factor by which the caller must rescale what it
    accumulated from earlier tiles (``l`` and ``acc``). So a one-hot row's output is its value
    row exactly, and its lse, ``m + ln(l)``, its largest score.

    All row maxima first, then all exponentials: a row's exp pass waits on its max reduction,
    and two separate loops let the CPU overlap the rows instead (measured: -30 % per tile).
    """
    for r in range(rows):
        m_old = m_i[r]
        t_max = tile_max[r] if max_given else row_max(s, off + r * ld, n, portable)
        m_new = max(m_old, t_max)
        # A row that has seen only masked keys keeps m = -inf; shift by 0 then, so that
        # e^(-inf - shift) is 0 and never e^(-inf - (-inf)) = NaN.
        shift = m_new if m_new > -np.inf else 0.0
        alpha_i[r] = m_old - shift  # an exponent <= 0 until the exp below
        l_i[r] = shift              # parked here until the exponentials
        m_i[r] = m_new
    for r in range(rows):
        l_i[r] = exp_shifted_sum(s, off + r * ld, n, l_i[r], natural, portable)
    for r in range(rows, n_alpha):
        alpha_i[r] = 0.0
    exp_inplace(alpha_i, 0, n_alpha, natural, portable)  # all rows' factors in a few vectors


@helper
def rescale_add(acc, tile, ld, rows, alpha_i, portable):
    """``acc[r, :] = alpha_i[r] * acc[r, :] + tile[r, :]`` for ``rows`` rows of width ``ld``."""
    if portable:
        for r in range(rows):
            for j in range(ld):
                acc[r * ld + j] = alpha_i[r] * acc[r * ld + j] + tile[r * ld + j]
        return
    lanes = simd.lanes_of(acc)
    for r in range(rows):
        alpha = simd.vsplat(acc, alpha_i[r])
        for j in range(r * ld, (r + 1) * ld, lanes):
            simd.vstore(acc, j, simd.vfma(simd.vload(acc, j), alpha, simd.vload(tile, j)))


@inlined_helper
def scale_row(dst, dst_off, src, n, scale, portable):
    """``dst[dst_off:dst_off+n] = src[:n] * scale`` for a 1-D ``src`` of any stride, each
    product in float64 and rounded once (``scale`` a float64, as Numba's scalar product): in
    vectors (``simd.vload_scaled``) where ``src`` is unit-stride, then a scalar tail; a
    strided ``src`` element by element. The forward pass's Q block, scaled."""
    start = 0
    if not portable and src.strides[0] == src.itemsize:
        lanes = simd.lanes_of(dst)
        start = n // lanes * lanes
        for c in range(0, start, lanes):
            simd.vstore(dst, dst_off + c, simd.vload_scaled(src, c, scale))
    for c in range(start, n):
        dst[dst_off + c] = src[c] * scale


@helper
def divide_row(dst, dst_off, src, src_off, n, divisor, portable):
    """``dst[dst_off:dst_off+n] = src[src_off:src_off+n] / divisor``, a true division (one
    rounding) in vectors, then a scalar tail: the forward pass's ``out = acc / l``."""
    start = 0
    if not portable:
        lanes = simd.lanes_of(dst)
        start = n // lanes * lanes
        div_v = simd.vsplat(dst, divisor)
        for c in range(0, start, lanes):
            simd.vstore(dst, dst_off + c, simd.vdiv(simd.vload(src, src_off + c), div_v))
    for c in range(start, n):
        dst[dst_off + c] = src[src_off + c] / divisor


@helper
def softmax_grad_row(p, dp, off, n, delta, portable):
    """``dp[off:off+n] = p * (dp - delta)``: dS from dP for one row (``delta = rowsum(dO * O)``),
    and exactly 0 where ``p == 0``: a masked key's dP may be NaN (garbage values past kv_lens)
    and must not leak into dQ."""
    if portable:
        for j in range(off, off + n):
            dp[j] = p[j] * (dp[j] - delta) if p[j] != 0.0 else 0.0
        return
    lanes = simd.lanes_of(p)
    delta_v = simd.vsplat(p, delta)
    zero = simd.vsplat(p, 0.0)
    for j in range(off, off + n, lanes):
        p_v = simd.vload(p, j)
        ds = simd.vmul(p_v, simd.vsub(simd.vload(dp, j), delta_v))
        simd.vstore(dp, j, simd.vselect_nonzero(p_v, ds, zero))
