"""CUDA tests: the simulator in CI (``NUMBA_ENABLE_CUDASIM=1``, tiny shapes) or a real GPU
(``CPUFLASH_CUDA_BIG=1`` adds shapes past one tile). Run by tests/test_cuda_path.py, or by hand:

    CPUFLASH_CUDA_TESTS=1 NUMBA_ENABLE_CUDASIM=1 python -m pytest tests/cuda -q
"""
import sys
import threading

import numpy as np
import pytest
from cuda_env import SIMULATED, cuda


def _speed_up_the_simulator():
    """The simulator runs each CUDA thread of a block as a Python thread, and its block manager
    polls them in a loop until all of them wait at a barrier: with Python's default 5 ms GIL
    switch interval, most of a kernel's time goes to that loop holding the GIL. At 0.5 ms the
    same kernels run 3-4x faster (a causal forward of the first shape: 3.75 s -> 1.02 s a call).

    Threads then interleave more finely, which exposes a race in the simulator itself: a
    block's ``cuda.shared.array`` is made by the first thread to reach its line (a dict lookup,
    then an insert), and two threads could each make their own, one of them reading the other's
    writes from memory it never sees (``np.empty`` garbage, seen in dQ). The lookup and insert
    go under a lock here; the arrays are still keyed by the calling line, as before."""
    from numba.cuda.simulator import kernelapi

    original = kernelapi.FakeCUDAShared.array
    lock = threading.Lock()

    def array(self, shape, dtype, alignment=None):
        if shape == 0 or alignment is not None:  # dynamic memory, or the simulator's error
            return original(self, shape, dtype, alignment)
        caller = sys._getframe(1)
        with lock:
            key = (caller.f_code.co_filename, caller.f_lineno)
            res = self._allocations.get(key)
            if res is None:
                res = self._allocations[key] = np.empty(shape, kernelapi.numpy_support.as_dtype(
                    dtype) if isinstance(dtype, kernelapi.types.Type) else dtype)
            return res

    kernelapi.FakeCUDAShared.array = array
    sys.setswitchinterval(5e-4)


if SIMULATED:
    _speed_up_the_simulator()


def pytest_collection_modifyitems(config, items):
    if not SIMULATED and not cuda.is_available():
        skip = pytest.mark.skip(reason="no CUDA GPU (set NUMBA_ENABLE_CUDASIM=1)")
        for item in items:
            if "ptx" not in item.nodeid:
                item.add_marker(skip)
