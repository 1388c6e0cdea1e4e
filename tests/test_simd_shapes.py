"""The kernels with the tile shapes of a narrower host (AVX2: 6 x 16 micro-tiles, 48 x 64
tiles), forced by ``CPUFLASH_SIMD`` on this one, in a subprocess (the shapes are fixed at
import). Their tile loops have rests the AVX-512 shapes never have: a key tile of 64 rows is not
a whole number of 6-row micro-tiles (the dK and dV products). Forward, backward and decode
against the float64 reference. (128-bit SIMD, ``CPUFLASH_SIMD=128``: 6 x 8 micro-tiles, 48 x 32
tiles, the same 6 rows; not run here, to keep the suite's compile time down.)"""
import os
import subprocess
import sys

import pytest

from background import BackgroundRuns
from cpuflash import config

SCRIPT = r"""
import numpy as np
import cpuflash
from cpuflash import config, reference
assert config.VECTOR_BYTES == {vector_bytes}, config.describe()
rng = np.random.default_rng(0)
worst = 0.0
CASES = [(4, 2, 70, 130, 40, 24, True), (2, 2, 97, 97, 64, 64, False),
         (2, 1, 3, 300, 32, 32, True)]  # (Hq, Hkv, Nq, Nk, D, Dv, causal); the last: decode
for (h, h_kv, n_q, n_k, d, dv, causal) in CASES:
    q = rng.standard_normal((1, h, n_q, d))
    k = rng.standard_normal((1, h_kv, n_k, d))
    v = rng.standard_normal((1, h_kv, n_k, dv))
    dout = rng.standard_normal((1, h, n_q, dv))
    # float32 only: each dtype compiles its own kernels, and these shapes compile them afresh
    args = [x.astype(np.float32) for x in (q, k, v)]
    out, lse = cpuflash.attention(*args, causal=causal, return_lse=True)
    ref = reference.attention(q, k, v, causal=causal)
    grads = cpuflash.attention_backward(dout.astype(np.float32), *args, out, lse, causal=causal)
    ref_grads = reference.attention_backward(dout, q, k, v, causal=causal)
    for got, want in [(out, ref), *zip(grads, ref_grads)]:
        err = float(np.max(np.abs(got - want)))
        worst = max(worst, err)
        assert err < 1e-4, (h, n_q, n_k, d, causal, err)
print("ok", worst)
"""


# The subprocess mostly compiles (its kernels' tile shapes are new to the cache), on one core,
# as this suite mostly does: started in the background when the session is collected
# (conftest.py: pytest_collection_finish), it overlaps with the rest of the suite on a 2-core
# machine, as the CUDA runs do (tests/test_cuda_path.py); its test waits for it.
RUNS = {"test_narrower_hosts_tile_shapes[avx2-32]": ("avx2", 32)}
_runs = BackgroundRuns()


def start_in_background(name):
    """Start the subprocess behind the test ``name`` (once; not where the host is no wider)."""
    if name not in RUNS or config.VECTOR_BYTES < RUNS[name][1]:
        return
    simd, vector_bytes = RUNS[name]
    _runs.start(name, [sys.executable, "-c", SCRIPT.format(vector_bytes=vector_bytes)],
                env=dict(os.environ, CPUFLASH_SIMD=simd))


stop_all = _runs.stop_all  # conftest.py: the runs no test waited for


@pytest.mark.parametrize("simd,vector_bytes", [("avx2", 32)])
def test_narrower_hosts_tile_shapes(request, simd, vector_bytes):
    if config.VECTOR_BYTES < vector_bytes:
        pytest.skip("this host's shapes are already these or narrower")
    start_in_background(request.node.name)  # not started yet if the collection hook did not run
    output = _runs.wait(request.node.name, timeout=600)
    assert output.startswith("ok"), output[-3000:]


def test_unknown_setting_warns_and_keeps_the_hosts_shapes():
    code = "from cpuflash import config; print(config.VECTOR_BYTES)"
    host = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={k: v for k, v in os.environ.items() if k != "CPUFLASH_SIMD"},
                          timeout=120)
    typo = subprocess.run([sys.executable, "-W", "always", "-c", code], capture_output=True,
                          text=True, env=dict(os.environ, CPUFLASH_SIMD="avx-2"), timeout=120)
    assert host.returncode == 0 and typo.returncode == 0, host.stderr + typo.stderr
    assert typo.stdout == host.stdout == f"{config.VECTOR_BYTES}\n"
    assert "CPUFLASH_SIMD='avx-2'" in typo.stderr and "expected one of" in typo.stderr
