"""Exact (erf-based) GELU, ``0.5 * x * (1 + erf(x / sqrt(2)))``, as BERT's ``"gelu"``.

numpy has no erf and scipy is not a dependency. libm's ``erf`` called per element from Numba
is a scalar call (about 12 ns); instead erf is the odd/even rational function of Eigen's
``generic_fast_erf_float`` (numerator degree 13, denominator degree 8 in ``x``, argument
clamped to [-4, 4] where erf is within 1.6e-8 of +-1), evaluated in float64: no branch and no
call, so LLVM vectorizes the loop. Max abs error against ``math.erf`` 6.5e-8 (checked in
``tests/test_minilm.py``), torch's own CPU erf is within 1.5e-7. Rounded once on the store.

Own ``njit`` here, not ``_cpu/_jit.py``: that module stamps its cache with the kernel sources
of ``_cpu/`` only, and this file's own stamp is what must invalidate this cache.
"""
import math
import warnings

import numba
import numpy as np

_SQRT_HALF = 1.0 / math.sqrt(2.0)
# numerator coefficients of x^1, x^3, ..., x^13 and denominator of x^0, x^2, ..., x^8
_A1, _A3, _A5, _A7 = -1.60960333262415e-02, -2.95459980854025e-03, -7.34990630326855e-04, \
    -5.69250639462346e-05
_A9, _A11, _A13 = -2.10102402082508e-06, 2.77068142495902e-08, -2.72614225801306e-10
_B0, _B2, _B4, _B6, _B8 = -1.42647390514189e-02, -7.37332916720468e-03, \
    -1.68282697438203e-03, -2.13374055278905e-04, -1.45660718464996e-05


def _erf(x):
    x = min(max(x, -4.0), 4.0)
    x2 = x * x
    p = ((((((_A13 * x2 + _A11) * x2 + _A9) * x2 + _A7) * x2 + _A5) * x2 + _A3) * x2 + _A1) * x
    q = (((_B8 * x2 + _B6) * x2 + _B4) * x2 + _B2) * x2 + _B0
    return p / q


def _gelu_rows(x, out):
    n_rows, n_cols = x.shape
    for r in numba.prange(n_rows):
        for c in range(n_cols):
            v = np.float64(x[r, c])
            out[r, c] = 0.5 * v * (1.0 + _erf_jit(v * _SQRT_HALF))


def _njit(fn, **flags):
    try:
        return numba.njit(cache=True, fastmath={"contract"}, **flags)(fn)
    except Exception as exc:  # no writable cache location: compile in memory
        warnings.warn(f"cpuflash: Numba cache unavailable ({exc}); GELU compiles per process",
                      RuntimeWarning, stacklevel=2)
        return numba.njit(fastmath={"contract"}, **flags)(fn)


_erf_jit = _njit(_erf, inline="always")
_gelu_kernel = _njit(_gelu_rows, parallel=True, nogil=True)


def erf(x):
    """The erf above on any float array (float64 result), for tests."""
    return np.vectorize(_erf_jit, otypes=[np.float64])(np.asarray(x, np.float64))


def gelu(x):
    """Exact GELU of a 2-D float array, a new array of the same dtype."""
    x = np.ascontiguousarray(x)
    out = np.empty_like(x)
    _gelu_kernel(x, out)
    return out
