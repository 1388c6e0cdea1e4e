"""Attention sinks on the GPU: their gradient (``cpuflash/sinks.py`` has the math), as a small
kernel after the backward pass's; the forward kernels add each head's sink to its rows' sums
where they store them (``tiles.finish_lines``, since stop 59; until then a kernel like this
one folded them in after the forward's).

    dsinks: one thread a sink (its batch row or all batches, h), summing in row order (no
            atomics): dc = -sum_i e^(c - lse'_i) delta_i, delta_i = rowsum(dO_i * out'_i)
            from the backward pass's prep kernel

The gradient's sum in float64.
"""
import functools
import math

import numpy as np
from numba import float32, float64, int64

from .arrays import as_nd, uploaded
from .launch import compiled
from .runtime import load
from .tiles import NEG_INF, signature

cuda = load()

DSINKS_ARGS = "LLSS"  # delta, lse, sinks, dsinks (B or 1, Hq)
THREADS = 128


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


@functools.cache
def _dsinks_kernel():
    return compiled(dsinks, signature(np.float32, DSINKS_ARGS))


def logits_on_device(logits):
    """The checked sink logits (``sinks.check``, float64 (B or 1, Hq) on the host) as the
    kernels read them, float32 on the device (uploaded once per content)."""
    return uploaded(logits.astype(np.float32))


def run_dsinks(delta, lse, sinks, grad, stream):
    """Launch ``dsinks``: ``grad`` a ``GpuArray`` of the sinks' shape, float32."""
    grad2 = as_nd(grad, 2)
    n = grad2.shape[0] * grad2.shape[1]
    if n:
        _dsinks_kernel()(-(-n // THREADS), THREADS, stream, delta, lse, sinks, grad2)
