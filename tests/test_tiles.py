"""The fused tile products against the two-step forms they replace: the same bits.

Each ``tile_product_<epilogue>`` finishes the product in the micro-kernel's registers (the row
maxima, ``alpha * acc + P V``, the dQ sum, the Kahan sums of dK and dV, dS from dP); each must
give exactly what ``tile_product`` followed by the pass it replaces gives, so the kernels'
results are the same bits as before the fusion, on the SIMD and on the portable kernels.
"""
import math
import re

import numba
import numpy as np
import pytest

from cpuflash import config
from cpuflash._cpu import simd
from cpuflash._cpu.tiles import (REST_MR, rescale_add, row_max, scale_row, softmax_grad_row,
                                 tile_product, tile_product_add, tile_product_ahead,
                                 tile_product_kahan, tile_product_max, tile_product_rescale,
                                 tile_product_softmax_grad, tile_product_store)

MR = config.MICRO_ROWS
LANES = config.VECTOR_BYTES // 4  # float32


# The backward pass's passes over a stored product before stop 18, which the "add" and "kahan"
# epilogues replaced (the same operations, in the same order).
@numba.njit(fastmath={"contract"})
def add_into(acc, off, x, n, portable):
    """``acc[off:off+n] += x[:n]`` (n whole vectors)."""
    if portable:
        for j in range(n):
            acc[off + j] += x[j]
        return
    lanes = simd.lanes_of(acc)
    for j in range(0, n, lanes):
        simd.vstore(acc, off + j, simd.vadd(simd.vload(acc, off + j), simd.vload(x, j)))


@numba.njit(fastmath={"contract"})
def add_into_compensated(acc, comp, x, n, portable):
    """``acc[:n] += x[:n]`` with Kahan compensation carried in ``comp``."""
    if portable:
        for j in range(n):
            y = x[j] - comp[j]
            t = acc[j] + y
            comp[j] = (t - acc[j]) - y
            acc[j] = t
        return
    lanes = simd.lanes_of(acc)
    for j in range(0, n, lanes):
        a = simd.vload(acc, j)
        y = simd.vsub(simd.vload(x, j), simd.vload(comp, j))
        t = simd.vadd(a, y)
        simd.vstore(comp, j, simd.vsub(simd.vsub(t, a), y))
        simd.vstore(acc, j, t)


@numba.njit
def _store(c, ld, a, a_rs, a_ks, b, b_ld, b_panel, rows, cols, k, portable):
    """``C = A @ B`` by the head-dim product (partial sums, ``simd.PARTIAL_TERMS``)."""
    none = np.empty(0, dtype=c.dtype)
    tile_product_store(c, 0, ld, a, 0, a_rs, a_ks, b, 0, b_ld, b_panel, rows, cols, k, none, 0,
                       none, 0, np.empty(rows * cols, dtype=c.dtype), portable)


@numba.njit
def _in_partial_sums(c, ldc, a, a_rs, a_ks, b, b_ld, rows, cols, k):
    """``C += A @ B`` as the products in partial sums form it: each part of PARTIAL_TERMS
    terms a one-sum product of its own, added to C in order (B row-major)."""
    part = np.zeros(rows * ldc, dtype=c.dtype)
    for k0 in range(0, k, simd.PARTIAL_TERMS):
        n = min(simd.PARTIAL_TERMS, k - k0)
        tile_product(part, 0, ldc, a, k0 * a_ks, a_rs, a_ks, b, k0 * b_ld, b_ld, 1, rows, cols,
                     n, False, False)
        for i in range(rows * ldc):
            c[i] += part[i]


@numba.njit
def _max_two_steps(a, b, rows, cols, k, ld):
    c = np.zeros(rows * ld, dtype=a.dtype)
    _store(c, ld, a, k, 1, b, 0, k, rows, cols, k, False)
    maxima = np.empty(rows, dtype=a.dtype)
    for r in range(rows):
        maxima[r] = row_max(c, r * ld, cols, False)
    return c, maxima


@numba.njit
def _max_fused(a, b, rows, cols, k, ld, lanes):
    c = np.zeros(rows * ld, dtype=a.dtype)
    maxima = np.empty(rows, dtype=a.dtype)
    tile_product_max(c, 0, ld, a, 0, k, 1, b, 0, k, rows, cols, k,
                     np.empty(rows * lanes, dtype=a.dtype), maxima, 0, False)
    return c, maxima


@numba.njit
def _rescale_two_steps(acc, alpha, a, b, rows, cols, b_rows, k, lda, portable):
    pv = np.empty(rows * cols, dtype=a.dtype)
    tile_product(pv, 0, cols, a, 0, lda, 1, b, 0, 0, b_rows, rows, cols, k, False, portable)
    rescale_add(acc, pv, cols, rows, alpha, portable)


@numba.njit
def _rescale_fused(acc, alpha, a, b, rows, cols, b_rows, k, lda, portable):
    tile_product_rescale(acc, 0, cols, a, 0, lda, 1, b, 0, 0, b_rows, rows, cols, k, alpha, 0,
                         alpha, 0, np.empty(rows * cols, dtype=a.dtype), portable)


PANEL = config.MICRO_VECS * LANES
# rows: whole micro-tiles and a rest (a key tile's 64 rows with MR = 6 on AVX2: dK, dV); cols:
# whole panels, or a narrower last panel (Dv not a multiple of the panel width), which the
# row-max and dS products never get
SHAPES = [(MR, PANEL, 3), (3 * MR, 2 * PANEL, 17), (2 * MR, PANEL, 64), (2 * MR + 1, PANEL, 9),
          (max(1, MR - 1), 2 * PANEL, 5)]
NARROW = [(MR, LANES, 3), (2 * MR, 2 * PANEL + LANES, 17), (MR, PANEL + 3 * LANES, 5)]


def test_micro_kernels_are_inlined_into_the_tile_products():
    """The micro-kernel dispatches (``_jit.micro_helper``) leave no call behind: a call per
    micro-tile, with its arguments on the stack, cost the score product 6 % (stop 43), and LLVM
    alone did not inline the micro-kernels that sum in partial sums."""
    a, b = np.ones(MR * 64, dtype=np.float32), np.ones(64 * PANEL, dtype=np.float32)
    _max_fused(a, b, MR, PANEL, 64, PANEL + LANES, LANES)
    acc, alpha = np.zeros(MR * PANEL, dtype=np.float32), np.ones(MR, dtype=np.float32)
    _rescale_fused(acc, alpha, a, b, MR, PANEL, 64, 64, 64, False)
    for fn in (_max_fused, _rescale_fused):
        for ir in fn.inspect_llvm().values():
            callees = re.findall(r'call [^@\n]*@"?([^"(\s]+)', ir)
            assert not [name for name in callees if "_micro_" in name]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("rows,cols,k", SHAPES)
def test_product_max_equals_product_then_row_max(dtype, rows, cols, k):
    cols = cols // LANES * (config.VECTOR_BYTES // np.dtype(dtype).itemsize)
    rng = np.random.default_rng(rows * cols + k)
    a = rng.standard_normal(rows * k).astype(dtype)
    b = rng.standard_normal(k * cols).astype(dtype)
    a[0] = np.nan             # row 0 all NaN: its max is taken over nothing, -inf
    if rows > 2:
        a[2 * k:3 * k] = -np.inf  # row 2: -inf or NaN (inf * 0 never arises: b has no zeros)
    b[1] = np.inf             # column 1 of every row: +-inf or NaN
    ld = cols + LANES
    c2, max2 = _max_two_steps(a, b, rows, cols, k, ld)
    c1, max1 = _max_fused(a, b, rows, cols, k, ld, config.VECTOR_BYTES // a.itemsize)
    assert np.array_equal(c1, c2, equal_nan=True)
    assert np.array_equal(max1, max2, equal_nan=True)
    expect = np.array([np.max(row[~np.isnan(row)], initial=-np.inf)
                       for row in c2.reshape(rows, ld)[:, :cols]])
    assert np.array_equal(max1, expect)


@pytest.mark.parametrize("portable", [False, True], ids=["simd", "portable"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("rows,cols,k", SHAPES + NARROW)
def test_product_rescale_equals_product_then_rescale_add(portable, dtype, rows, cols, k):
    lanes = config.VECTOR_BYTES // np.dtype(dtype).itemsize
    cols = max(lanes, cols // LANES * lanes)
    b_rows = k + 3  # the panels hold more rows (keys) than the product reads: kv_lens
    rng = np.random.default_rng(rows + cols * k)
    a = rng.standard_normal(rows * (b_rows + 1)).astype(dtype)
    b = rng.standard_normal(b_rows * cols).astype(dtype)
    alpha = rng.random(rows).astype(dtype)
    alpha[0] = 0.0
    acc = rng.standard_normal(rows * cols).astype(dtype)
    fused, two_steps = acc.copy(), acc.copy()
    _rescale_two_steps(two_steps, alpha, a, b, rows, cols, b_rows, k, b_rows + 1, portable)
    _rescale_fused(fused, alpha, a, b, rows, cols, b_rows, k, b_rows + 1, portable)
    assert np.array_equal(fused, two_steps)
    expect = (alpha[:, None] * acc.reshape(rows, cols).astype(np.float64)
              + _panels_product(a, b, rows, cols, b_rows, k, b_rows + 1, lanes))
    np.testing.assert_allclose(fused.reshape(rows, cols), expect,
                               rtol=0, atol=k * 8 * np.finfo(dtype).eps * 10)


def _panels_product(a, b, rows, cols, b_rows, k, lda, lanes):
    """``A @ B`` in float64 with B read from its column panels (``tiles.tile_product``)."""
    width = config.MICRO_VECS * lanes
    dense = np.zeros((b_rows, cols))
    for c0 in range(0, cols, width):
        w = min(width, cols - c0)
        dense[:, c0:c0 + w] = b[c0 * b_rows:c0 * b_rows + b_rows * w].reshape(b_rows, w)
    a2 = a[:rows * lda].reshape(rows, lda)[:, :k].astype(np.float64)
    return a2 @ dense[:k]


@numba.njit
def _backward_two_steps(kind, c, e, f, a, b, rows, cols, k, ldc, portable):
    """A read transposed (``a_rs = 1``, as dS^T and P^T are), B row-major: the backward's form."""
    x = np.zeros(rows * ldc, dtype=a.dtype)
    if kind == 1 or portable:  # dK, dV: one sum (as every portable product)
        tile_product(x, 0, ldc, a, 0, 1, rows, b, 0, cols, 1, rows, cols, k, False, portable)
    else:  # dQ (add) and dP (softmax_grad): in partial sums
        _in_partial_sums(x, ldc, a, 1, rows, b, cols, rows, cols, k)
    if kind == 0:
        add_into(c, 0, x, rows * ldc, portable)
    elif kind == 1:
        add_into_compensated(c, e, x, rows * ldc, portable)
    else:  # c holds dP: the pass reads it from c, with P in e
        for r in range(rows):
            for j in range(cols):
                c[r * ldc + j] = x[r * ldc + j]
        for r in range(rows):
            softmax_grad_row(e, c, r * ldc, cols, f[r], portable)


@numba.njit
def _backward_fused(kind, c, e, f, a, b, rows, cols, k, ldc, portable):
    scratch = np.empty(rows * cols, dtype=a.dtype)
    if kind == 0:
        tile_product_add(c, 0, ldc, a, 0, 1, rows, b, 0, cols, 1, rows, cols, k, e, 0, f, 0,
                         scratch, portable)
    elif kind == 1:
        tile_product_kahan(c, 0, ldc, a, 0, 1, rows, b, 0, cols, 1, rows, cols, k, e, 0, f, 0,
                           scratch, portable)
    else:
        tile_product_softmax_grad(c, 0, ldc, a, 0, 1, rows, b, 0, cols, 1, rows, cols, k, e, 0,
                                  f, 0, scratch, portable)


BACKWARD_CASES = ([pytest.param(kind, *shape, id=f"{name}-{shape}")
                   for kind, name in ((0, "add"), (1, "kahan")) for shape in SHAPES + NARROW]
                  + [pytest.param(2, *shape, id=f"softmax_grad-{shape}")  # whole key tiles only
                     for shape in SHAPES])


@pytest.mark.parametrize("portable", [False, True], ids=["simd", "portable"])
@pytest.mark.parametrize("kind,rows,cols,k", BACKWARD_CASES)
def test_backward_epilogues_equal_their_passes(portable, kind, rows, cols, k):
    rng = np.random.default_rng(kind * 7 + rows + cols + k)
    lanes = LANES
    ldc = cols  # the passes it replaces run over whole contiguous rows (dK, dV, dQ)
    if kind == 2:
        ldc = cols + lanes  # S and dS rows one vector longer (forward.py)
    a = rng.standard_normal(k * rows).astype(np.float32)
    b = rng.standard_normal(k * cols).astype(np.float32)
    c0 = rng.standard_normal(rows * ldc).astype(np.float32) * 1e3  # a running sum
    e0 = (rng.standard_normal(rows * ldc) * 1e-5).astype(np.float32)  # compensation terms
    if kind == 2:  # P: with exact zeros (masked keys) and one NaN
        e0 = rng.random(rows * ldc).astype(np.float32)
        e0[::3] = 0.0
        e0[1] = np.nan
    f = rng.standard_normal(rows).astype(np.float32)  # delta
    results = []
    for fn in (_backward_two_steps, _backward_fused):
        c, e = c0.copy(), e0.copy()
        fn(kind, c, e, f, a, b, rows, cols, k, ldc, portable)
        results.append((c, e))
    (c2, e2), (c1, e1) = results
    assert np.array_equal(c1, c2, equal_nan=True)
    assert np.array_equal(e1, e2, equal_nan=True)
    product = a.reshape(k, rows).T.astype(np.float64) @ b.reshape(k, cols).astype(np.float64)
    got = c1.reshape(rows, ldc)[:, :cols]
    if kind == 2:
        p = e0.reshape(rows, ldc)[:, :cols]
        expect = np.where(p != 0, p * (product - f[:, None]), 0.0)
        assert np.isnan(got.flat[1]) == np.isnan(expect.flat[1])
    else:
        expect = c0.reshape(rows, ldc)[:, :cols] + product
    np.testing.assert_allclose(got, expect, rtol=1e-5, atol=1e-4 * np.sqrt(k))


@pytest.mark.parametrize("k", [1, 31, 32, 33, 64, 100, 128])
def test_head_dim_products_sum_in_partial_sums(k):
    """S = Q K^T and dP = dO V^T sum over the head dim in partial sums of PARTIAL_TERMS terms,
    added in order: bit for bit the float32 sum of the one-sum products of each part (and not
    one running sum's bits, once there are two parts)."""
    rows, cols = 2 * MR + 1, 2 * PANEL
    rng = np.random.default_rng(k)
    a = rng.standard_normal(rows * k).astype(np.float32)
    b = rng.standard_normal(k * cols).astype(np.float32)
    got = np.zeros(rows * cols, dtype=np.float32)
    _store(got, cols, a, k, 1, b, cols, 1, rows, cols, k, False)
    want = np.zeros(rows * cols, dtype=np.float32)
    _in_partial_sums(want, cols, a, k, 1, b, cols, rows, cols, k)
    assert np.array_equal(got, want)
    one = np.zeros(rows * cols, dtype=np.float32)
    tile_product(one, 0, cols, a, 0, k, 1, b, 0, cols, 1, rows, cols, k, False, False)
    assert np.array_equal(got, one) == (k <= simd.PARTIAL_TERMS)


def test_partial_sums_are_closer_to_the_exact_product():
    """What the partial sums are for: over 64-term dot products of normal numbers (a D = 64
    score), the head-dim product's errors against float64 are smaller than one running sum's,
    in the mean and at the maximum (fixed draw)."""
    rows, cols, k = 64, 8 * PANEL, 64
    rng = np.random.default_rng(0)
    a = rng.standard_normal((rows, k)).astype(np.float32)
    b = rng.standard_normal((k, cols)).astype(np.float32)
    exact = a.astype(np.float64) @ b.astype(np.float64)
    split = np.zeros(rows * cols, dtype=np.float32)
    _store(split, cols, a.ravel(), k, 1, b.ravel(), cols, 1, rows, cols, k, False)
    one = np.zeros(rows * cols, dtype=np.float32)
    tile_product(one, 0, cols, a.ravel(), 0, k, 1, b.ravel(), 0, cols, 1, rows, cols, k, False,
                 False)
    err_split = np.abs(split.reshape(rows, cols) - exact)
    err_one = np.abs(one.reshape(rows, cols) - exact)
    assert err_split.mean() < 0.8 * err_one.mean()
    assert err_split.max() < err_one.max()


@numba.njit
def _row_blocks(a, b, rows, cols, k, ahead):
    """The product of all ``rows`` in one call (blocks of MR, then REST_MR, then single rows),
    and the same rows one call each; B row-major, as the decode kernel reads it."""
    whole = np.zeros(rows * cols, dtype=a.dtype)
    single = np.zeros(rows * cols, dtype=a.dtype)
    if ahead:
        tile_product_ahead(whole, 0, cols, a, 0, k, 1, b, 0, cols, 1, rows, cols, k, 2 * cols)
    else:
        tile_product(whole, 0, cols, a, 0, k, 1, b, 0, cols, 1, rows, cols, k, False, False)
    for r in range(rows):
        if ahead:
            tile_product_ahead(single, r * cols, cols, a, r * k, k, 1, b, 0, cols, 1, 1, cols,
                               k, 2 * cols)
        else:
            tile_product(single, r * cols, cols, a, r * k, k, 1, b, 0, cols, 1, 1, cols, k,
                         False, False)
    return whole, single


@pytest.mark.parametrize("ahead", [False, True], ids=["plain", "prefetching"])
@pytest.mark.parametrize("rows", sorted({1, 2, 4, 5, MR - 1, MR, MR + 4, MR + 5, 2 * MR + 3}))
def test_row_blocking_never_changes_the_bits(ahead, rows):
    """Decoding's query rows (a GQA group: 4 with Hq=8, Hkv=2) come in blocks of MR, then of
    REST_MR (4 where MR is 6), then one at a time: each row's sums run in the same order in
    every block shape, so a row gets the same bits alone as in any group, and the float64
    product within rounding."""
    assert REST_MR in (0, 4)
    k, cols = 37, 2 * PANEL + LANES
    rng = np.random.default_rng(rows)
    a = rng.standard_normal(rows * k).astype(np.float32)
    b = rng.standard_normal(k * cols).astype(np.float32)
    whole, single = _row_blocks(a, b, rows, cols, k, ahead)
    assert np.array_equal(whole, single)
    expect = a.reshape(rows, k).astype(np.float64) @ b.reshape(k, cols).astype(np.float64)
    np.testing.assert_allclose(whole.reshape(rows, cols), expect, rtol=0, atol=1e-5 * k)


def test_prefetching_product_hints_each_row_into_l2_and_l1():
    """The decode kernel's prefetching product (``tile_product_ahead``) hints each row of B
    ``ahead`` elements on into L2 (locality 2) and ``simd.NEAR_ROWS`` rows on into L1
    (locality 3). A hint changes no result: the prefetching product's bits are checked in
    ``test_row_blocking_never_changes_the_bits``."""
    a = np.ones(4 * 8, dtype=np.float32)
    b = np.ones(8 * 2 * PANEL, dtype=np.float32)
    _row_blocks(a, b, 4, 2 * PANEL, 8, True)
    (llvm,) = _row_blocks.inspect_llvm().values()
    hints = [line for line in llvm.splitlines() if "call void @llvm.prefetch" in line]
    localities = {line.rsplit("i32", 2)[1].strip(" ,") for line in hints}
    assert localities == {"2", "3"}, hints[:4]


@numba.njit
def _scaled_rows(x, scale, portable):
    rows, n = x.shape
    out = np.empty(rows * n, dtype=x.dtype)
    for r in range(rows):
        scale_row(out, r * n, x[r], n, scale, portable)
    return out


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n", [1, 15, 16, 17, 64, 131])
@pytest.mark.parametrize("layout", ["rows", "columns", "reversed"])
def test_scale_row_rounds_once_from_the_float64_product(dtype, n, layout):
    """The forward's Q scaled: ``x * scale`` formed in float64 and rounded once, in vectors on
    unit-stride rows and element by element on strided ones, the same bits either way (and
    those of numpy's float64 product rounded to the dtype)."""
    rng = np.random.default_rng(n)
    base = rng.standard_normal((n, 3)).astype(dtype) * 37
    x = {"rows": np.ascontiguousarray(base.T), "columns": base.T,
         "reversed": np.ascontiguousarray(base.T)[:, ::-1]}[layout]
    scale = 1.0 / math.sqrt(n + 0.3)  # a float64 that float32 cannot hold exactly
    expect = (x.astype(np.float64) * scale).astype(dtype).reshape(-1)
    assert np.array_equal(_scaled_rows(x, scale, False), expect)
    assert np.array_equal(_scaled_rows(x, scale, True), expect)
