"""A streaming read at the machine's best: the yardstick of the decode benchmarks."""
import numba
import numpy as np
from numba import prange

from . import simd
from ._jit import kernel


def stream_sum(x):
    """Sum of the float32 ``x`` (any length), read once by the kernels' threads
    (``read_sum``)."""
    return read_sum(x, numba.get_num_threads())


@kernel
def read_sum(x, n_parts):
    """Sum of the float32 ``x`` (any length), read once in ``n_parts`` contiguous parts, one a
    thread (the thread count: asked for inside, it would keep Numba from caching the kernel);
    four vector accumulators hide the add latency, and the tail past the last group of four
    vectors is added on this thread. The sum only keeps the reads from being optimized away;
    how the parts are rounded depends on ``n_parts``.

    The step and the offsets of the inner loop are computed inside the ``prange`` body on
    purpose. Numba outlines that body into a function of its own, and any variable defined
    outside it (``lanes``, say) becomes a run-time argument there. With a run-time step, LLVM
    unrolled the loop with one address register per load, spilled them, and reloaded one from
    the stack before each load. Measured on the Zen 4 (stop 38; 640 MiB, two threads, the
    two loops in alternation): 29-44 GB/s against 32-52, 20-30 % slower in fast spells. Until
    stop 38 the decode benchmarks' streaming read was that slow loop (over blocks of 64 KiB),
    so their "of stream" shares were too high by as much."""
    n_steps = x.size // (4 * simd.lanes_of(x))  # groups of four vectors
    per_part = n_steps // n_parts
    partial = np.zeros(n_parts, dtype=np.float64)
    for part in prange(n_parts):
        lanes = simd.lanes_of(x)  # a constant here, not an argument (see above)
        step = 4 * lanes
        start = part * per_part * step
        stop = n_steps * step if part == n_parts - 1 else start + per_part * step
        a0 = simd.vsplat(x, 0.0)
        a1, a2, a3 = a0, a0, a0
        for i in range(start, stop, step):
            a0 = simd.vadd(a0, simd.vload(x, i))
            a1 = simd.vadd(a1, simd.vload(x, i + lanes))
            a2 = simd.vadd(a2, simd.vload(x, i + 2 * lanes))
            a3 = simd.vadd(a3, simd.vload(x, i + 3 * lanes))
        partial[part] = simd.vhsum(simd.vadd(simd.vadd(a0, a1), simd.vadd(a2, a3)))
    total = partial.sum()
    for i in range(n_steps * 4 * simd.lanes_of(x), x.size):
        total += x[i]
    return total
