"""Score modifiers applied to each score tile right after ``S = Q K^T``, before masking.

In the units of the kernel's scores: natural in the forward and backward passes; base 2 in the
decode kernel, which folds ``log2(e)`` into Q and its caller into the constants here:

* softcap: ``s = c * tanh(s / c)`` (``c = softcap``, or ``softcap * log2(e)`` in base 2).
* ALiBi: ``s -= slope * |i + off - j|`` (``slope = alibi_slope``, or times ``log2(e)``).

``tanh`` by two branches, both computed, one selected per lane: below a threshold its odd
Taylor series to ``y^9``, so small scores keep their relative precision; above,
``(1 - e) / (1 + e)`` with ``e = 2^(-2 |y| log2(e))``. The series' truncation is
``0.0089 y^10`` relative, and ``1 - e`` loses about ``1 / (2 |y|)`` ulps to cancellation: the
threshold is ``1/4`` for float32 (truncation below 1e-8, ``e <= 0.61``) and ``0.04`` for
float64 (truncation below 1e-16, at most about 13 ulps lost; with float32's threshold float64
results were off by up to 1e-8 relative). The backward pass needs ``tanh`` again for
``ds_raw = ds * (1 - t^2)``: ``modify_row`` leaves ``t`` in ``t_out`` when asked.
"""
import math

import numpy as np

from . import simd
from ._jit import helper

LOG2_E = 1.0 / math.log(2.0)
TANH_SERIES = (1.0, -1.0 / 3.0, 2.0 / 15.0, -17.0 / 315.0, 62.0 / 2835.0)  # y, y^3, ..., y^9
SERIES_BELOW = 0.25      # |y| below which the series is used, float32 (and float16 inputs)
SERIES_BELOW_F64 = 0.04  # the same for float64


@helper
def series_below(s):
    """The series' threshold for the element type of ``s`` (see the module's docstring)."""
    return SERIES_BELOW_F64 if s.itemsize == 8 else SERIES_BELOW


@helper
def tanh_scalar(y, small):
    a = abs(y)
    if a < small:
        y2 = y * y
        return y * (1.0 + y2 * (-1.0 / 3.0 + y2 * (2.0 / 15.0 + y2 * (-17.0 / 315.0
                                                                    + y2 * (62.0 / 2835.0)))))
    e = np.exp2(-2.0 * a * LOG2_E)
    t = (1.0 - e) / (1.0 + e)
    return t if y >= 0 else -t


@helper
def tanh_series_over_y(s, y):
    """``tanh(y) / y`` by the odd series (a polynomial in ``y^2``), for ``|y|`` below
    ``series_below(s)``."""
    y2 = simd.vmul(y, y)
    poly = simd.vsplat(s, TANH_SERIES[4])
    poly = simd.vfma(poly, y2, simd.vsplat(s, TANH_SERIES[3]))
    poly = simd.vfma(poly, y2, simd.vsplat(s, TANH_SERIES[2]))
    poly = simd.vfma(poly, y2, simd.vsplat(s, TANH_SERIES[1]))
    return simd.vfma(poly, y2, simd.vsplat(s, TANH_SERIES[0]))


@helper
def tanh_vec(s, y, small):
    """tanh of the vector ``y`` (``s`` gives the element type; ``small``: ``series_below(s)``
    in every lane)."""
    poly = tanh_series_over_y(s, y)
    a = simd.vabs(y)
    if simd.vall_lt(a, small):  # every lane small (common: softcap >> scores)
        return simd.vmul(y, poly)
    e = simd.vexp2(simd.vmul(a, simd.vsplat(s, -2.0 * LOG2_E)))
    one = simd.vsplat(s, 1.0)
    t_abs = simd.vdiv(simd.vsub(one, e), simd.vadd(one, e))
    zero = simd.vsplat(s, 0.0)
    t = simd.vwhere_lt(y, zero, simd.vsub(zero, t_abs), t_abs)
    return simd.vwhere_lt(a, small, simd.vmul(y, poly), t)


@helper
def modifies(softcap, slopes):
    """Whether the modifiers change any score: a softcap, or any nonzero (or NaN) slope of the
    2-D ``slopes``. On the calling thread: written in a parallel kernel as ``np.any(slopes !=
    0.0)``, the array expression was a parallel loop of Numba's own, a region of its own
    before the kernel's ``prange`` (the threads woken and joined twice a call: about 2 us
    more; stop 63, in the forward, backward and decode kernels)."""
    if softcap != 0.0:
        return True
    for i in range(slopes.shape[0]):
        for j in range(slopes.shape[1]):
            if slopes[i, j] != 0.0:
                return True
    return False


@helper
def modify_row(s, off, n, i_rel, k0, softcap2, slope2, t_out, portable):
    """Softcap then ALiBi on the scores ``s[off:off+n]`` of a row whose keys start at ``k0``.

    ``i_rel = i + kv_len - Nq``: the query's position among the keys. ``softcap2 = 0`` and
    ``slope2 = 0`` turn the modifiers off. ``t_out`` (same layout as ``s``, or empty) keeps
    ``tanh`` for the backward pass.
    """
    keep_t = t_out.size > 0
    if portable:
        for j in range(n):
            x = s[off + j]
            if softcap2 != 0.0:
                t = tanh_scalar(x / softcap2, series_below(s))
                if keep_t:
                    t_out[off + j] = t
                x = softcap2 * t
            if slope2 != 0.0:
                x -= slope2 * abs(i_rel - (k0 + j))
            s[off + j] = x
        return
    lanes = simd.lanes_of(s)
    inv_cap = simd.vsplat(s, 1.0 / softcap2 if softcap2 != 0.0 else 0.0)
    cap = simd.vsplat(s, softcap2)
    small = simd.vsplat(s, series_below(s))
    neg_slope = simd.vsplat(s, -slope2)
    iota = simd.viota(s)
    for j in range(0, n, lanes):
        x = simd.vload(s, off + j)
        if softcap2 != 0.0:
            y = simd.vmul(x, inv_cap)
            if not keep_t and simd.vall_lt(simd.vabs(y), small):
                # the common case (softcap >> scores): c tanh(x / c) = x * (tanh(y) / y)
                x = simd.vmul(x, tanh_series_over_y(s, y))
            else:
                t = tanh_vec(s, y, small)
                if keep_t:
                    simd.vstore(t_out, off + j, t)
                x = simd.vmul(cap, t)
        if slope2 != 0.0:
            dist = simd.vabs(simd.vsub(simd.vsplat(s, i_rel - (k0 + j)), iota))
            x = simd.vfma(neg_slope, dist, x)
        simd.vstore(s, off + j, x)


@helper
def tanh_grad_row(ds, t, off, n, portable):
    """``ds[off:off+n] *= 1 - t^2``: through ``s = c * tanh(s_raw / c)`` back to ``s_raw``
    (``n`` whole vectors)."""
    if portable:
        for j in range(off, off + n):
            ds[j] *= 1.0 - t[j] * t[j]
        return
    one = simd.vsplat(ds, 1.0)
    for j in range(off, off + n, simd.lanes_of(ds)):
        t_v = simd.vload(t, j)
        simd.vstore(ds, j, simd.vmul(simd.vload(ds, j), simd.vsub(one, simd.vmul(t_v, t_v))))
