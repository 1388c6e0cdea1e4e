"""Forward pass: cpuflash vs torch SDPA vs naive numpy, grouped per shape so that
pytest-benchmark prints them side by side with ratios.

    python -m pytest bench/test_forward.py --benchmark-group-by=group \
        --benchmark-columns=min,median,ops
"""
import time

import numpy as np
import pytest

import cpuflash
from cpuflash import _measure
from conftest import add_gflops, record

SHAPES = [(n, d, causal) for d in (64, 128) for n in (512, 2048, 8192) for causal in (False, True)]
NAIVE_MAX_N = 2048  # the naive peer materializes B*H*N*N scores


def _inputs(n, d):
    return _measure.make_qkv(1, 8, n, d, np.float32, seed=1)


@pytest.mark.parametrize("impl", ["cpuflash", "torch", "naive"])
@pytest.mark.parametrize("n,d,causal", SHAPES, ids=[f"N{n}-D{d}-{'causal' if c else 'full'}"
                                                    for n, d, c in SHAPES])
def test_forward(benchmark, impl, n, d, causal, request):
    q, k, v = _inputs(n, d)
    if impl == "cpuflash":
        fn = lambda: cpuflash.attention(q, k, v, causal=causal)  # noqa: E731
    elif impl == "torch":
        run = request.getfixturevalue("torch_run")
        fn = lambda: run(q, k, v, causal)  # noqa: E731
    else:
        if n > NAIVE_MAX_N:
            pytest.skip("naive numpy needs O(N^2) memory and minutes here")
        fn = lambda: _measure.naive_attention(q, k, v, causal)  # noqa: E731
    out = fn()  # warm-up (compile), then check the answer once
    assert _measure.max_error_vs_reference(out, q, k, v, causal) < 1e-4
    benchmark.group = f"forward B=1 H=8 N={n} D={d} causal={causal}"
    record(benchmark, impl=impl, B=1, H=8, N=n, D=d, causal=causal, dtype="float32")
    time.sleep(0.5)  # OpenBLAS threads of an earlier numpy call spin for a while: let them sleep
    # Back-to-back calls in each round: single calls with pytest-benchmark's bookkeeping between
    # them pay a thread wake-up on this VM (measured: 3.7 ms instead of 2.6 ms at N=512).
    benchmark.pedantic(fn, rounds=5 if n <= 2048 else 2, iterations=max(1, 2048 // n * 2),
                       warmup_rounds=1)
    add_gflops(benchmark, _measure.forward_flops(1, 8, n, n, d, causal))
