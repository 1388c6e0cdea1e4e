"""Masks and variants against plain causal, side by side (B=1, H=8, D=64, float32):

    python -m pytest bench/test_variants.py --benchmark-group-by=group \\
        --benchmark-columns=min,median,ops -s

Each variant's time over plain causal, timed in turns within its test, is printed (``-s``)
and kept as ``x_causal`` in ``extra_info`` (``--benchmark-json``).

Targets (issue 4): a broadcast bool key-padding mask (B, 1, 1, Nk) within 5 % of no mask;
window=(256, 0) at N=16384 at least 10x faster than causal; each variant within 15 % of plain
causal on the tiles it computes.
"""
import time

import numpy as np
import pytest

import cpuflash
from cpuflash import _measure
from conftest import record

N = 2048
VARIANTS = {
    "causal": {},
    "key-padding mask": {"mask": "keypad"},
    "2-D bool mask": {"mask": "tril"},
    "float mask": {"mask": "float"},
    "float mask, arbitrary values": {"mask": "float_values"},
    "softcap": {"softcap": 30.0},
    "alibi": {"alibi_slopes": "slopes"},
    "dropout": {"dropout_p": 0.1, "seed": 0},
    "kv_lens": {"kv_lens": "lens"},
}


def _options(spec, n):
    rng = np.random.default_rng(0)
    made = {"keypad": np.ones((1, 1, 1, n), bool), "tril": np.tril(np.ones((n, n), bool)),
            "float": np.where(np.tril(np.ones((n, n), bool)), 0.0, -np.inf).astype(np.float32)
            + np.triu(rng.standard_normal((n, n)).astype(np.float32) * 0, 1),
            "float_values": np.where(np.tril(np.ones((n, n), bool)),
                                     rng.standard_normal((n, n)).astype(np.float32) * 0.1,
                                     np.float32(-np.inf)),
            "slopes": np.geomspace(0.5, 0.004, 8), "lens": np.array([n])}
    return {k: made[v] if isinstance(v, str) else v for k, v in spec.items()}


def _variant_and_plain(name, backward):
    """Zero-argument calls of the variant and of plain causal: the forward pass, or the
    backward pass from each one's own forward output."""
    q, k, v = _measure.make_qkv(1, 8, N, 64, seed=1)
    opts = _options(VARIANTS[name], N)
    opts["causal"] = "mask" not in opts or VARIANTS[name]["mask"] == "keypad"
    plain_opts = {"causal": True}
    if not backward:
        return (lambda: cpuflash.attention(q, k, v, **opts),
                lambda: cpuflash.attention(q, k, v, **plain_opts))
    dout = _measure.make_qkv(1, 8, N, 64, seed=2)[0]

    def backward_of(o):
        out, lse = cpuflash.attention(q, k, v, return_lse=True, **o)
        return lambda: cpuflash.attention_backward(dout, q, k, v, out, lse, **o)

    return backward_of(opts), backward_of(plain_opts)


def _bench_variant(benchmark, name, backward):
    fn, plain = _variant_and_plain(name, backward)
    fn()
    pass_name = "backward" if backward else "forward"
    benchmark.group = f"variants, {pass_name}, B=1 H=8 N={N} D=64 (causal tiles)"
    record(benchmark, impl="cpuflash", variant=name, B=1, H=8, N=N, D=64, pass_=pass_name)
    # The ratio to plain causal, timed call by call in turns (best of 15 each), so that the
    # machine's drift over the run does not enter it as it enters the separate tests' times.
    best = _measure.time_side_by_side({"variant": fn, "causal": plain}, repeats=15)
    benchmark.extra_info["x_causal"] = best["variant"] / best["causal"]
    print(f"\n{pass_name} {name}: {benchmark.extra_info['x_causal']:.3f}x plain causal "
          f"(in turns)")
    time.sleep(0.5)
    benchmark.pedantic(fn, rounds=5, iterations=2 if not backward else 1, warmup_rounds=1)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_variant(benchmark, name):
    _bench_variant(benchmark, name, backward=False)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_variant_backward(benchmark, name):
    _bench_variant(benchmark, name, backward=True)


@pytest.mark.parametrize("window", [None, (256, 0)])
def test_sliding_window_vs_causal(benchmark, window):
    n = 16384
    q, k, v = _measure.make_qkv(1, 8, n, 64, seed=1)

    def fn():
        return cpuflash.attention(q, k, v, causal=True, window=window)

    fn()
    benchmark.group = f"sliding window B=1 H=8 N={n} D=64"
    record(benchmark, impl="cpuflash", window=str(window), B=1, H=8, N=n, D=64)
    time.sleep(0.5)
    benchmark.pedantic(fn, rounds=2 if window is None else 5, iterations=1, warmup_rounds=0)
