"""Decode steps (B=1, Nq=1, Hq=8, D=64) on a KVCache in float32/float16/bfloat16/int8 against
torch SDPA
(enable_gqa, float32 K/V), grouped per case so that pytest-benchmark prints them side by side:

    python -m pytest bench/test_decode.py --benchmark-group-by=group \\
        --benchmark-columns=min,median,ops

extra_info holds the unique K/V bytes per step, GB/s, and the machine's streaming-read
bandwidth for as many bytes (measured in the same test). Targets (issue 5): float32 cache,
Nk=32768, Hkv=2: at least 80 % of the streaming read and 4x torch; float16 1.6x faster than
float32. `cpuflash bench --section decode` prints the same as one table, with cold (DRAM) runs.
"""
import time

import pytest
from conftest import record

from cpuflash import _measure, reference

CASES = [(h_kv, n_k) for n_k in (4096, 32768) for h_kv in (8, 2)]


@pytest.mark.parametrize("impl", ["float32", "float16", "bfloat16", "int8", "torch"])
@pytest.mark.parametrize("h_kv,n_k", CASES, ids=[f"Hkv{h}-Nk{n}" for h, n in CASES])
def test_decode(benchmark, impl, h_kv, n_k, request):
    q, k, v = _measure.make_qkv(1, 8, n_k, 64, n_q=1, h_kv=h_kv, seed=1)
    if impl == "torch":
        run = request.getfixturevalue("torch_run")
        del run  # the fixture only skips without torch; decode goes through enable_gqa
        torch_step = _measure.torch_decode()
        fn = lambda: torch_step(q, k, v)  # noqa: E731
        nbytes = k.nbytes + v.nbytes
    else:
        cache, nbytes = _measure.decode_cache(k, v, impl)
        fn = lambda: cache.attention(0, q)  # noqa: E731
    err = float(abs(fn() - reference.attention(q, k, v)).max())
    assert err < (1e-5 if impl in ("float32", "torch") else 5e-3)
    benchmark.group = f"decode Hq=8 Hkv={h_kv} Nk={n_k} D=64"
    record(benchmark, impl=impl, Hq=8, Hkv=h_kv, Nk=n_k, D=64, kv_bytes=nbytes, err=err)
    stream = _measure.stream_read_bandwidth(nbytes)
    time.sleep(0.5)  # let the threads of earlier numpy calls go to sleep
    benchmark.pedantic(fn, rounds=10, iterations=max(1, 32768 // n_k * 2), warmup_rounds=1)
    best = benchmark.stats.stats.min
    benchmark.extra_info.update({"gbs": nbytes / best / 1e9, "stream_gbs": stream / 1e9,
                                 "of_stream": nbytes / best / stream})
