"""Attention sinks on the GPU: their fold and gradient (``cpuflash/sinks.py`` has the math), as
two small kernels after the attention kernels, which stay as they are (the CPU kernels add the
sinks to each row's sum instead, since stop 58).

    fold:   one thread a row (b, h, i): lse' = logaddexp(lse, c), out *= e^(lse - lse')
    dsinks: one thread a sink (its batch row or all batches, h), summing in row order (no
            atomics): dc = -sum_i e^(c - lse'_i) delta_i, delta_i = rowsum(dO_i * out'_i)
            from the backward pass's prep kernel

In float32 (the fold's ``lse`` is float32 here), the gradient's sum in float64.
"""
import math

import numpy as np
from numba import float32, float64, int64

from .arrays import as_nd, uploaded
from .launch import compiled
from .runtime import load
from .tiles import NEG_INF, ZERO, signature

cuda = load()

FOLD_ARGS = "XLS"     # out (in place), lse (in place), sinks (B or 1, Hq)
DSINKS_ARGS = "LLSS"  # delta, lse, sinks, dsinks (B or 1, Hq)
THREADS = 128


def fold(out, lse, sinks):
    """Row (b, h, i) of ``out`` (B, Hq, Nq, Dv) and ``lse`` (B, Hq, Nq) with the sink
    ``sinks[b or 0, h]`` folded in, both in place; a sink of -inf leaves the row as it is, a
    row that saw no key gets ``lse = c`` and its output times 0."""
    n_hq, n_q, dv = out.shape[1], out.shape[2], out.shape[3]
    idx = int64(cuda.blockIdx.x) * int64(cuda.blockDim.x) + int64(cuda.threadIdx.x)
    if idx >= out.shape[0] * n_hq * n_q:
        return
    b = idx // (n_hq * n_q)
    h = (idx // n_q) % n_hq
    i = idx % n_q
    c = sinks[b if sinks.shape[0] > 1 else 0, h]
    if c == NEG_INF:
        return
    x = lse[b, h, i]
    if x == NEG_INF:
        new = c
        factor = ZERO
    else:
        new = max(x, c) + math.log1p(math.exp(-abs(x - c)))
        factor = math.exp(x - new)
    lse[b, h, i] = new
    for col in range(dv):
        out[b, h, i, col] = float32(out[b, h, i, col]) * factor


def dsinks(delta, lse, sinks, grad):
    """``grad[s, h] = -sum e^(c - lse'_i) delta_i`` over the rows of head ``h`` in batch ``s``
    (every batch where ``sinks`` has one row), in order; rows with ``lse' = -inf`` (no key, no
    sink) add nothing."""
    n_b, n_hq, n_q = lse.shape
    n_s = sinks.shape[0]
    idx = int64(cuda.blockIdx.x) * int64(cuda.blockDim.x) + int64(cuda.threadIdx.x)
    if idx >= n_s * n_hq:
        return
    s = idx // n_hq
    h = idx % n_hq
    c = sinks[s, h]
    acc = float64(0.0)
    for b in range(s if n_s > 1 else 0, s + 1 if n_s > 1 else n_b):
        for i in range(n_q):
            x = lse[b, h, i]
            if x != NEG_INF:
                acc -= float64(math.exp(c - x) * delta[b, h, i])
    grad[s, h] = float32(acc)


_kernels = {}


def _kernel(fn, dtype, pattern):
    key = (fn.__name__, dtype)
    found = _kernels.get(key)
    if found is None:
        found = _kernels[key] = compiled(fn, signature(dtype, pattern))
    return found


def logits_on_device(logits):
    """The checked sink logits (``sinks.check``, float64 (B or 1, Hq) on the host) as the
    kernels read them, float32 on the device (uploaded once per content)."""
    return uploaded(logits.astype(np.float32))


def run_fold(out, lse, sinks, stream):
    """Launch ``fold`` on the 4-D ``out`` and 3-D ``lse`` ``GpuArray``s (float32 lse)."""
    rows = out.shape[0] * out.shape[1] * out.shape[2]
    if rows:
        _kernel(fold, np.dtype(out.dtype).str, FOLD_ARGS)(
            -(-rows // THREADS), THREADS, stream, out, lse, sinks)


def run_dsinks(delta, lse, sinks, grad, stream):
    """Launch ``dsinks``: ``grad`` a ``GpuArray`` of the sinks' shape, float32."""
    grad2 = as_nd(grad, 2)
    n = grad2.shape[0] * grad2.shape[1]
    if n:
        _kernel(dsinks, np.dtype(np.float32).str, DSINKS_ARGS)(
            -(-n // THREADS), THREADS, stream, delta, lse, sinks, grad2)
