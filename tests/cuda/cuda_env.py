"""What the CUDA tests run on: the simulator or a GPU, tiny or larger shapes."""
import os

import pytest

pytest.importorskip("numba_cuda", reason="numba-cuda is not installed")
from numba import cuda

__all__ = ["BIG", "SIMULATED", "cuda"]

SIMULATED = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"
BIG = os.environ.get("CPUFLASH_CUDA_BIG") == "1" and not SIMULATED
