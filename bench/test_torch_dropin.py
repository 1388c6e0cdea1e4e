"""``cpuflash.torch.scaled_dot_product_attention`` against torch's own CPU SDPA on torch tensors,
forward and forward+backward (autograd), side by side per shape: the core benchmark's shapes
(B=1, H=8, D in {64, 128}, N in {512, 2048, 8192}, causal and not) in float32, and some of them
in bfloat16 (which cpuflash widens to float32 and computes in it, torch in its own bfloat16
kernels).

    python -m pytest bench/test_torch_dropin.py --benchmark-group-by=group \\
        --benchmark-columns=min,median,ops -s

The two implementations' separate tests run one after the other, and this machine drifts by
10-20 % over such a run. So the cpuflash test also times both call by call in turns (best of
several each) and prints that ratio (``-s``), kept as ``x_torch`` in ``extra_info`` (> 1:
cpuflash faster).
"""
import time

import pytest

from cpuflash import _measure
from conftest import add_gflops, record

torch = pytest.importorskip("torch")
cpuflash_torch = pytest.importorskip("cpuflash.torch")

SHAPES = [(n, d, causal, "float32") for d in (64, 128) for n in (512, 2048, 8192)
          for causal in (False, True)]
SHAPES += [(n, d, causal, "bfloat16") for n, d in ((512, 64), (2048, 64), (512, 128))
           for causal in (False, True)]
IDS = [f"N{n}-D{d}-{'causal' if c else 'full'}-{dtype}" for n, d, c, dtype in SHAPES]
SDPA = {"cpuflash": cpuflash_torch.scaled_dot_product_attention,
        "torch": torch.nn.functional.scaled_dot_product_attention}
# Largest error against the float64 reference of the inputs' values: float32's, and bfloat16's
# half an ulp of 2 (outputs of random V lie within 4 here) with float32's on top
TOLERANCE = {"float32": 1e-4, "bfloat16": 2.0**-7 + 1e-4}


def _tensors(n, d, grad, dtype):
    q, k, v = (torch.from_numpy(x).to(getattr(torch, dtype)).requires_grad_(grad)
               for x in _measure.make_qkv(1, 8, n, d, seed=1))
    dout = torch.from_numpy(_measure.make_qkv(1, 8, n, d, seed=2)[0]).to(getattr(torch, dtype))
    return q, k, v, dout


def _check(out, q, k, v, causal, dtype):
    arrays = [x.detach().float().numpy() for x in (q, k, v)]
    error = _measure.max_error_vs_reference(out.detach().float().numpy(), *arrays, causal)
    assert error < TOLERANCE[dtype]


def _in_turns(benchmark, calls, n, label):
    """torch's best time over cpuflash's, the two called in turns."""
    best = _measure.time_side_by_side(calls, repeats=9 if n <= 512 else 5 if n <= 2048 else 3,
                                      budget_s=60)
    benchmark.extra_info["x_torch"] = best["torch"] / best["cpuflash"]
    print(f"\n{label}: {benchmark.extra_info['x_torch']:.3f}x torch (in turns)")


def _rounds(n):
    return {"rounds": 3 if n <= 2048 else 1, "iterations": max(1, 2048 // n),
            "warmup_rounds": 1 if n <= 2048 else 0}


@pytest.mark.parametrize("impl", ["cpuflash", "torch"])
@pytest.mark.parametrize("n,d,causal,dtype", SHAPES, ids=IDS)
def test_dropin_forward(benchmark, impl, n, d, causal, dtype):
    q, k, v, _ = _tensors(n, d, grad=False, dtype=dtype)
    sdpa = SDPA[impl]

    def call(sdpa):
        def fn():
            with torch.no_grad():
                return sdpa(q, k, v, is_causal=causal)
        return fn

    fn = call(sdpa)
    _check(fn(), q, k, v, causal, dtype)  # warm-up (compile), then check the answer once
    benchmark.group = f"torch drop-in forward B=1 H=8 N={n} D={d} causal={causal} {dtype}"
    record(benchmark, impl=impl, B=1, H=8, N=n, D=d, causal=causal, dtype=dtype)
    if impl == "cpuflash":
        _in_turns(benchmark, {name: call(f) for name, f in SDPA.items()}, n,
                  f"forward N={n} D={d} causal={causal} {dtype}")
    time.sleep(0.5)
    benchmark.pedantic(fn, **_rounds(n))
    add_gflops(benchmark, _measure.forward_flops(1, 8, n, n, d, causal))


@pytest.mark.parametrize("impl", ["cpuflash", "torch"])
@pytest.mark.parametrize("n,d,causal,dtype", SHAPES, ids=IDS)
def test_dropin_forward_backward(benchmark, impl, n, d, causal, dtype):
    q, k, v, dout = _tensors(n, d, grad=True, dtype=dtype)
    sdpa = SDPA[impl]

    def call(sdpa):
        def fn():
            out = sdpa(q, k, v, is_causal=causal)
            return out, torch.autograd.grad(out, (q, k, v), dout)
        return fn

    fn = call(sdpa)
    _check(fn()[0], q, k, v, causal, dtype)
    benchmark.group = (f"torch drop-in forward+backward B=1 H=8 N={n} D={d} causal={causal} "
                       f"{dtype}")
    record(benchmark, impl=impl, B=1, H=8, N=n, D=d, causal=causal, dtype=dtype)
    if impl == "cpuflash":
        _in_turns(benchmark, {name: call(f) for name, f in SDPA.items()}, n,
                  f"forward+backward N={n} D={d} causal={causal} {dtype}")
    time.sleep(0.5)
    benchmark.pedantic(fn, **_rounds(n))
    add_gflops(benchmark, 3.5 * _measure.forward_flops(1, 8, n, n, d, causal))
