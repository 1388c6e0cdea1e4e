"""The fused tile products against the two-step forms they replace: the same bits.

``tile_product_max`` takes each row's maximum from the product's registers, and
``tile_product_rescale`` adds the product to ``alpha * acc`` there; both must give exactly what
``tile_product`` followed by ``row_max`` or ``rescale_add`` gives, so the forward kernel's
results are the same bits as before the fusion.
"""
import numba
import numpy as np
import pytest

from cpuflash import config
from cpuflash._cpu.tiles import (rescale_add, row_max, tile_product, tile_product_max,
                                 tile_product_rescale)

MR = config.MICRO_ROWS
LANES = config.VECTOR_BYTES // 4  # float32


@numba.njit
def _max_two_steps(a, b, rows, cols, k, ld):
    c = np.zeros(rows * ld, dtype=a.dtype)
    tile_product(c, 0, ld, a, 0, k, 1, b, 0, 0, k, rows, cols, k, False, False)
    maxima = np.empty(rows, dtype=a.dtype)
    for r in range(rows):
        maxima[r] = row_max(c, r * ld, cols, False)
    return c, maxima


@numba.njit
def _max_fused(a, b, rows, cols, k, ld, lanes):
    c = np.zeros(rows * ld, dtype=a.dtype)
    maxima = np.empty(rows, dtype=a.dtype)
    tile_product_max(c, 0, ld, a, 0, k, 1, b, 0, k, rows, cols, k,
                     np.empty(rows * lanes, dtype=a.dtype), maxima)
    return c, maxima


@numba.njit
def _rescale_two_steps(acc, alpha, a, b, rows, cols, b_rows, k, lda, portable):
    pv = np.empty(rows * cols, dtype=a.dtype)
    tile_product(pv, 0, cols, a, 0, lda, 1, b, 0, 0, b_rows, rows, cols, k, False, portable)
    rescale_add(acc, pv, cols, rows, alpha, portable)


@numba.njit
def _rescale_fused(acc, alpha, a, b, rows, cols, b_rows, k, lda, portable):
    tile_product_rescale(acc, cols, a, 0, lda, 1, b, 0, b_rows, rows, cols, k, alpha,
                         np.empty(rows * cols, dtype=a.dtype), portable)


SHAPES = [(MR, LANES, 3), (2 * MR + 1, 9 * LANES, 17), (1, 4 * LANES, 64), (MR - 1, 2 * LANES, 5)]


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
@pytest.mark.parametrize("rows,cols,k", SHAPES)
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
