"""How a ``prange`` task number maps to the work it owns.

Every kernel's parallel loop runs over ``n_b * n_h * n_inner`` tasks, batch outermost: task
``t`` owns batch ``b``, head ``h`` and inner index ``i`` (a query block, key block, key chunk
or split). Numba's prange index is unsigned; dividing it by a signed count would give floats,
so it is made int64 here, once.
"""
import numpy as np

from ._jit import helper


@helper
def unravel(task, n_h, n_inner):
    """``(b, h, i)`` of task ``task`` over ``(B, n_h, n_inner)``."""
    bh, i = divmod(np.int64(task), n_inner)
    b, h = divmod(bh, n_h)
    return b, h, i
