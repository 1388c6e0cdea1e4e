"""How a ``prange`` task number maps to the work it owns.

Every kernel's parallel loop runs over ``n_b * n_h * n_inner`` tasks, batch outermost: task
``t`` owns batch ``b``, head ``h`` and inner index ``i`` (a query block, key block, key chunk
or split). Numba's prange index is unsigned; dividing it by a signed count would give floats,
so it is made int64 here, once.

``run_dynamic`` runs a kernel with its tasks handed out one at a time.
"""
import numba
import numpy as np

from ._jit import helper


@helper
def unravel(task, n_h, n_inner):
    """``(b, h, i)`` of task ``task`` over ``(B, n_h, n_inner)``."""
    bh, i = divmod(np.int64(task), n_inner)
    b, h = divmod(bh, n_h)
    return b, h, i


def run_dynamic(kernel, *args):
    """``kernel(*args)`` with its ``prange`` tasks handed to the threads one at a time as they
    finish (dynamic scheduling), not split up front into one contiguous range per thread: a
    thread slowed by other work on its core then takes fewer tasks instead of holding up the
    whole call. Measured side by side, B=1, H=8, N=2048, D=64, 2 threads, four rounds: the
    same 188-191 GFLOP/s in quiet rounds, 169 and 191 against 146 and 115 in rounds where the
    machine was busy. The tasks write disjoint outputs (``unravel``), so the bits do not
    change. 3.5 us a call (Numba's chunk-size setting, set and restored: per thread, so a
    caller's own parallel code keeps its schedule); kept off the short decode steps."""
    old = numba.set_parallel_chunksize(1)
    try:
        return kernel(*args)
    finally:
        numba.set_parallel_chunksize(old)
