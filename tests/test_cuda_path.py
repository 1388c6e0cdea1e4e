"""The CUDA path from the CPU suite: its tests run in separate processes (the simulator, and
PTX compilation for sm_90), so neither numba.cuda nor the simulator loads into this one."""
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from background import BackgroundRuns

ROOT = Path(__file__).resolve().parents[1]
HAS_NUMBA_CUDA = importlib.util.find_spec("numba_cuda") is not None


# Each CUDA run is a pytest session of its own that mostly compiles (PTX) or interprets (the
# simulator), on one core: started in the background as soon as the session knows it will run
# them (conftest.py: pytest_collection_finish), they take the other core of a 2-core machine
# while this process runs the rest of the suite; their tests below wait for them, last. The
# PTX compilations run as two halves (the tensor-core kernels, the rest: 1.5 min each on one
# core), so that once this process is done both cores can work on them.
PTX_ENV = {"CPUFLASH_PTX_QUICK": os.environ.get("CPUFLASH_PTX_QUICK", "1")}
RUNS = {
    "test_cuda_simulator": (["tests/cuda/test_cuda.py"], {"NUMBA_ENABLE_CUDASIM": "1"}),
    "test_cuda_ptx_sm90": (["tests/cuda/test_ptx.py", "-k", "not tensor_core"], PTX_ENV),
    "test_cuda_ptx_sm90_tensor_cores": (["tests/cuda/test_ptx.py", "-k", "tensor_core"],
                                        PTX_ENV),
}
_runs = BackgroundRuns()


def start_in_background(name):
    """Start the CUDA run behind the test ``name`` (once; not without numba-cuda)."""
    if name not in RUNS or not HAS_NUMBA_CUDA:
        return
    args, env = RUNS[name]
    environment = dict(os.environ, CPUFLASH_CUDA_TESTS="1", **env)
    environment["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT / "src")] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    _runs.start(name, [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
                cwd=ROOT, env=environment)


stop_all = _runs.stop_all  # conftest.py: the runs no test waited for


def _wait_for(name):
    start_in_background(name)  # not started yet if the collection hook did not run
    _runs.wait(name, timeout=1800)


@pytest.mark.skipif(not HAS_NUMBA_CUDA, reason="numba-cuda is not installed")
def test_cuda_simulator():
    _wait_for("test_cuda_simulator")


@pytest.mark.skipif(not HAS_NUMBA_CUDA, reason="numba-cuda is not installed")
def test_cuda_ptx_sm90():
    _wait_for("test_cuda_ptx_sm90")


@pytest.mark.skipif(not HAS_NUMBA_CUDA, reason="numba-cuda is not installed")
def test_cuda_ptx_sm90_tensor_cores():
    _wait_for("test_cuda_ptx_sm90_tensor_cores")


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
