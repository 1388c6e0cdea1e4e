"""The CUDA path from the CPU suite: its tests run in separate processes (the simulator, and
PTX compilation for sm_90), so neither numba.cuda nor the simulator loads into this one."""
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HAS_NUMBA_CUDA = importlib.util.find_spec("numba_cuda") is not None


def _pytest(args, **env):
    environment = dict(os.environ, CPUFLASH_CUDA_TESTS="1", **env)
    environment["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT / "src")] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           *args], cwd=ROOT, env=environment, capture_output=True, text=True,
                          check=False, timeout=900)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]


@pytest.mark.skipif(not HAS_NUMBA_CUDA, reason="numba-cuda is not installed")
def test_cuda_simulator():
    _pytest(["tests/cuda/test_cuda.py"], NUMBA_ENABLE_CUDASIM="1")


@pytest.mark.skipif(not HAS_NUMBA_CUDA, reason="numba-cuda is not installed")
def test_cuda_ptx_sm90():
    _pytest(["tests/cuda/test_ptx.py"], CPUFLASH_PTX_QUICK=os.environ.get(
        "CPUFLASH_PTX_QUICK", "1"))


def test_import_stays_light_and_cuda_error_says_what_to_install():
    code = """
import sys
sys.modules["numba_cuda"] = None  # as if numba-cuda were not installed
import numpy as np
import cpuflash
assert "numba.cuda" not in sys.modules and "cpuflash._cuda.forward" not in sys.modules
x = np.ones((4, 8), np.float32)
cpuflash.attention(x, x, x)  # the CPU path, untouched
try:
    cpuflash.attention(x, x, x, device="cuda")
except ImportError as e:
    assert 'pip install "cpuflash[cuda]"' in str(e), e
else:
    raise AssertionError("no ImportError")
"""
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, check=False,
                          env=dict(os.environ, PYTHONPATH=str(ROOT / "src")))
    assert done.returncode == 0, done.stderr[-3000:]
