"""CUDA tests: the simulator in CI (``NUMBA_ENABLE_CUDASIM=1``, tiny shapes) or a real GPU
(``CPUFLASH_CUDA_BIG=1`` adds shapes past one tile). Run by tests/test_cuda_path.py, or by hand:

    CPUFLASH_CUDA_TESTS=1 NUMBA_ENABLE_CUDASIM=1 python -m pytest tests/cuda -q
"""
import pytest
from cuda_env import SIMULATED, cuda


def pytest_collection_modifyitems(config, items):
    if not SIMULATED and not cuda.is_available():
        skip = pytest.mark.skip(reason="no CUDA GPU (set NUMBA_ENABLE_CUDASIM=1)")
        for item in items:
            if "ptx" not in item.nodeid:
                item.add_marker(skip)
