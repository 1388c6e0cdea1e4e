"""A streaming read at the machine's best: the yardstick of the decode benchmarks."""
import numpy as np
from numba import prange

from . import simd
from ._jit import kernel

BLOCK = 1 << 14  # elements per task: 64 KiB of float32


@kernel
def stream_sum(x):
    """Sum of ``x`` (float32, length a multiple of 4 vectors), read once in ``BLOCK`` pieces
    spread over the threads; four vector accumulators hide the add latency."""
    lanes = simd.lanes_of(x)
    step = 4 * lanes
    n_blocks = (x.size + BLOCK - 1) // BLOCK
    partial = np.zeros(n_blocks, dtype=np.float64)
    for blk in prange(n_blocks):
        start = blk * BLOCK
        stop = min(start + BLOCK, x.size) // step * step
        a0 = simd.vsplat(x, 0.0)
        a1, a2, a3 = a0, a0, a0
        for i in range(start, stop, step):
            a0 = simd.vadd(a0, simd.vload(x, i))
            a1 = simd.vadd(a1, simd.vload(x, i + lanes))
            a2 = simd.vadd(a2, simd.vload(x, i + 2 * lanes))
            a3 = simd.vadd(a3, simd.vload(x, i + 3 * lanes))
        partial[blk] = simd.vhsum(simd.vadd(simd.vadd(a0, a1), simd.vadd(a2, a3)))
    return partial.sum()
