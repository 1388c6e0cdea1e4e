"""Every kernel template compiled to PTX for sm_90 (Hopper) without a GPU: catches what the
simulator cannot judge, such as float64 arithmetic creeping into float32 kernels, register
tiles spilled to local memory, or calls that do not exist on the device."""
import os

import numpy as np
import pytest

if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
    pytest.skip("compile_ptx is not in the simulator", allow_module_level=True)

from numba import cuda

from cpuflash._cuda import backward, forward, tiles

# one head dim per tile shape (tiles.forward_shape/backward_shape); softcap and ALiBi on,
# the superset of the code
CASES = [(64, np.float32), (16, np.float16), (128, np.float32), (256, np.float32)]
if os.environ.get("CPUFLASH_PTX_QUICK") == "1":  # CI: one shape class, the float16 loads
    CASES = [(64, np.float16)]


def _check(ptx):
    assert ".f64" not in ptx, "float64 arithmetic in a float32 kernel"
    assert "ld.local" not in ptx and "st.local" not in ptx, "register tile spilled to local memory"


@pytest.mark.parametrize("d, dtype", CASES, ids=str)
def test_ptx(d, dtype):
    fn = forward.make_forward(d, d, True)[0]
    _check(cuda.compile_ptx(fn, tiles.signature(dtype, tiles.FORWARD_ARGS), cc=(9, 0))[0])
    fn = backward.make_dkdv(d, d, True)[0]
    _check(cuda.compile_ptx(fn, tiles.signature(dtype, tiles.DKDV_ARGS), cc=(9, 0))[0])
    fn = backward.make_dq(d, d, True)[0]
    _check(cuda.compile_ptx(fn, tiles.signature(dtype, tiles.DQ_ARGS), cc=(9, 0))[0])
    ptx = cuda.compile_ptx(backward.prep, tiles.signature(dtype, tiles.PREP_ARGS), cc=(9, 0))[0]
    _check(ptx)
