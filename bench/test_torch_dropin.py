"""``cpuflash.torch.scaled_dot_product_attention`` against torch's own CPU SDPA on torch tensors,
forward and forward+backward (autograd), side by side per shape: the core benchmark's shapes
(B=1, H=8, D in {64, 128}, N in {512, 2048, 8192}, causal and not).

    python -m pytest bench/test_torch_dropin.py --benchmark-group-by=group \\
        --benchmark-columns=min,median,ops
"""
import time

import pytest

from cpuflash import _measure
from conftest import add_gflops, record

torch = pytest.importorskip("torch")
cpuflash_torch = pytest.importorskip("cpuflash.torch")

SHAPES = [(n, d, causal) for d in (64, 128) for n in (512, 2048, 8192) for causal in (False, True)]
IDS = [f"N{n}-D{d}-{'causal' if c else 'full'}" for n, d, c in SHAPES]
SDPA = {"cpuflash": cpuflash_torch.scaled_dot_product_attention,
        "torch": torch.nn.functional.scaled_dot_product_attention}


def _tensors(n, d, grad):
    q, k, v = (torch.from_numpy(x).requires_grad_(grad)
               for x in _measure.make_qkv(1, 8, n, d, seed=1))
    return q, k, v, torch.from_numpy(_measure.make_qkv(1, 8, n, d, seed=2)[0])


def _check(out, q, k, v, causal):
    arrays = [x.detach().numpy() for x in (q, k, v)]
    assert _measure.max_error_vs_reference(out.detach().numpy(), *arrays, causal) < 1e-4


def _rounds(n):
    return {"rounds": 3 if n <= 2048 else 1, "iterations": max(1, 2048 // n),
            "warmup_rounds": 1 if n <= 2048 else 0}


@pytest.mark.parametrize("impl", ["cpuflash", "torch"])
@pytest.mark.parametrize("n,d,causal", SHAPES, ids=IDS)
def test_dropin_forward(benchmark, impl, n, d, causal):
    q, k, v, _ = _tensors(n, d, grad=False)
    sdpa = SDPA[impl]

    def fn():
        with torch.no_grad():
            return sdpa(q, k, v, is_causal=causal)

    _check(fn(), q, k, v, causal)  # warm-up (compile), then check the answer once
    benchmark.group = f"torch drop-in forward B=1 H=8 N={n} D={d} causal={causal}"
    record(benchmark, impl=impl, B=1, H=8, N=n, D=d, causal=causal, dtype="float32")
    time.sleep(0.5)
    benchmark.pedantic(fn, **_rounds(n))
    add_gflops(benchmark, _measure.forward_flops(1, 8, n, n, d, causal))


@pytest.mark.parametrize("impl", ["cpuflash", "torch"])
@pytest.mark.parametrize("n,d,causal", SHAPES, ids=IDS)
def test_dropin_forward_backward(benchmark, impl, n, d, causal):
    q, k, v, dout = _tensors(n, d, grad=True)
    sdpa = SDPA[impl]

    def fn():
        out = sdpa(q, k, v, is_causal=causal)
        return out, torch.autograd.grad(out, (q, k, v), dout)

    _check(fn()[0], q, k, v, causal)
    benchmark.group = f"torch drop-in forward+backward B=1 H=8 N={n} D={d} causal={causal}"
    record(benchmark, impl=impl, B=1, H=8, N=n, D=d, causal=causal, dtype="float32")
    time.sleep(0.5)
    benchmark.pedantic(fn, **_rounds(n))
    add_gflops(benchmark, 3.5 * _measure.forward_flops(1, 8, n, n, d, causal))
