"""Forward + backward: cpuflash (attention_vjp) vs torch SDPA with autograd, side by side per
shape, and the backward pass's peak memory vs N.

    python -m pytest bench/test_backward.py --benchmark-group-by=group \\
        --benchmark-columns=min,median,ops -s
"""
import time

import numpy as np
import pytest

import cpuflash
from cpuflash import _measure
from conftest import add_gflops, record

SHAPES = [(n, causal) for n in (512, 2048, 8192) for causal in (False, True)]
MIB = 2**20


@pytest.fixture(scope="session")
def torch_grad():
    run = _measure.torch_sdpa_grad()
    if run is None:
        pytest.skip("torch is not installed (pip install torch==2.13.0)")
    return run


@pytest.mark.parametrize("impl", ["cpuflash", "torch"])
@pytest.mark.parametrize("n,causal", SHAPES,
                         ids=[f"N{n}-{'causal' if c else 'full'}" for n, c in SHAPES])
def test_forward_backward(benchmark, impl, n, causal, request):
    q, k, v = _measure.make_qkv(1, 8, n, 64, np.float32, seed=1)
    dout = _measure.make_qkv(1, 8, n, 64, np.float32, seed=2)[0]
    if impl == "cpuflash":
        def fn():
            return cpuflash.attention_vjp(q, k, v, dout, causal=causal)[1:]
    else:
        run = request.getfixturevalue("torch_grad")

        def fn():
            return run(q, k, v, dout, causal)
    grads = fn()  # warm-up (compile), then check the answer once
    assert _measure.max_grad_error_vs_reference(grads, q, k, v, dout, causal) < 1e-4
    benchmark.group = f"forward+backward B=1 H=8 N={n} D=64 causal={causal}"
    record(benchmark, impl=impl, B=1, H=8, N=n, D=64, causal=causal, dtype="float32")
    time.sleep(0.5)
    benchmark.pedantic(fn, rounds=3 if n <= 2048 else 1, iterations=max(1, 2048 // n),
                       warmup_rounds=1 if n <= 2048 else 0)
    add_gflops(benchmark, 3.5 * _measure.forward_flops(1, 8, n, n, 64, causal))


@pytest.mark.parametrize("n", [4096, 16384, 65536])
def test_backward_peak_memory(benchmark, n):
    growth = benchmark.pedantic(_measure.peak_memory_growth, args=(1, 1, n, 64),
                                kwargs={"impl": "cpuflash-grad"}, rounds=1)
    record(benchmark, impl="cpuflash", B=1, H=1, N=n, D=64, peak_growth_mib=growth / MIB)
    print(f"\nbackward N={n}: peak RSS growth {growth / MIB:.1f} MiB beyond inputs, outputs, "
          "lse and gradients")
    assert growth < 128 * MIB * n / 65536 + 8 * MIB  # the budget, scaled: O(N)
