"""The vector exponentials (``simd.vexp``, ``simd.vexp_once``, ``simd.vexp2``) against numpy's in
float64.

They run on every score of every kernel, with two code paths by the host's width (``vrndscale``
and ``vscalef`` on AVX-512, the magic-number rounding and the exponent bits elsewhere; the
narrower path also runs end to end in ``test_simd_shapes.py``). The contract: ``x <= 0``,
relative error of a float32 ulp or two (``vexp_once``: plus up to ``eps |x|``, the rounding of
``x log2(e)``), ``e^0 = 1`` exactly (a one-hot row's P), ``e^-inf = 0`` exactly (masked scores),
results below ``2^-126`` flushed to 0, NaN kept.
"""
import numba
import numpy as np
import pytest

from cpuflash._cpu import simd


BASE2, NATURAL, NATURAL_ONCE = 0, 1, 2  # simd.vexp2, simd.vexp, simd.vexp_once
MODES = pytest.mark.parametrize("mode", [NATURAL, NATURAL_ONCE, BASE2], ids=["e", "e-once", "2"])


@numba.njit
def exp_all(x, out, mode):
    """``out = 2**x``, ``e**x`` or ``e**x`` with ``x log2(e)`` rounded once (``mode``), by whole
    vectors."""
    for j in range(0, x.size, simd.lanes_of(x)):
        v = simd.vload(x, j)
        if mode == NATURAL:
            simd.vstore(out, j, simd.vexp(v))
        elif mode == NATURAL_ONCE:
            simd.vstore(out, j, simd.vexp_once(v))
        else:
            simd.vstore(out, j, simd.vexp2(v))


def run(x, mode):
    lanes = simd.lanes(numba.from_dtype(x.dtype))
    padded = np.zeros(-(-x.size // lanes) * lanes, dtype=x.dtype)
    padded[:x.size] = x
    out = np.empty_like(padded)
    exp_all(padded, out, mode)
    return out[:x.size]


def once_error(x64, dtype, mode):
    """What ``vexp_once`` may add to the relative error of e^x: y = x log2(e) is off by half an
    ulp of its own and by log2(e)'s rounding to the dtype (1.3e-8 relative in float32), within
    an ulp of y, and 2^y by ln(2) times that: below ``eps * |x|``."""
    return np.abs(x64) * np.finfo(dtype).eps if mode == NATURAL_ONCE else 0.0


@pytest.mark.parametrize("dtype, rtol", [(np.float32, 2.5e-7), (np.float64, 5e-16)])
@MODES
def test_exponential_is_within_an_ulp_or_two(dtype, rtol, mode):
    natural = mode != BASE2
    rng = np.random.default_rng(0)
    lowest = -80.0 if natural else -120.0  # results stay normal floats
    x = np.concatenate([rng.uniform(lowest, 0.0, 20000), -rng.exponential(2.0, 20000),
                        np.arange(-40.0, 0.5, 0.5)]).astype(dtype)  # halves: rounding ties
    got = run(x, mode)
    x64 = x.astype(np.float64)
    want = np.exp(x64) if natural else np.exp2(x64)
    rel = np.abs(got.astype(np.float64) - want) / want
    bound = rtol + once_error(x64, dtype, mode)
    assert np.all(rel <= bound), (rel.max(), x[np.argmax(rel - bound)])
    if mode == NATURAL_ONCE:  # what that adds is small against the row's maximum, e^0 = 1
        assert np.max(np.abs(got.astype(np.float64) - want)) <= rtol


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@MODES
def test_exponential_edges(dtype, mode):
    natural = mode != BASE2
    tiny = np.finfo(dtype).tiny  # 2^-126 / 2^-1022
    log_tiny = np.log(tiny) if natural else np.log2(tiny)
    x = np.array([0.0, -0.0, -np.inf, np.nan, log_tiny - 1.0, 2.0 * log_tiny, -1e30,
                  np.finfo(dtype).min], dtype=dtype)
    got = run(x, mode)
    assert got[0] == 1.0 and got[1] == 1.0  # a row's own maximum: P = 1 exactly
    assert got[2] == 0.0 and not np.signbit(got[2])  # masked: exactly +0
    assert np.isnan(got[3])  # a NaN score shows in the output
    assert np.all(got[4:] == 0.0)  # below the smallest normal float: flushed, never subnormal
    near = np.array([log_tiny + 1.0], dtype=dtype)  # just above: a normal result
    assert run(near, mode)[0] >= tiny
    # Densely across the flush (where the clamp of x or of x log2(e) sits): 0, or at least
    # half the smallest normal float (2^n p with n = -126 and p >= 2^-1/2), never the garbage
    # of a borrow from the magic number's bits; an ulp or two off where the result is twice
    # the smallest normal float or more.
    sweep = np.linspace(log_tiny - 2.0, log_tiny + 2.0, 4001).astype(dtype)
    got = run(sweep, mode).astype(np.float64)
    assert np.all((got == 0.0) | (got >= tiny / 2)) and np.all(got < 8.0 * tiny)
    want = (np.exp if natural else np.exp2)(sweep.astype(np.float64))
    normal = want >= 2.0 * tiny
    rtol = 5e-7 + once_error(sweep.astype(np.float64), dtype, mode)
    assert normal.any() and np.all(np.abs(got - want)[normal] <= (rtol * want)[normal])
