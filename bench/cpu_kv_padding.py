"""Decode steps over KVCaches whose K^T rows are padded by different byte counts, side by side
in one process: each padding's caches built first (a model's worth of layers, so that K/V
come from DRAM, or one layer with ``--hot``), then the steps of each and the machine's
streaming read of as many bytes timed round by round (``_measure.time_side_by_side``), so
that the machine's drift hits all alike. Prints ms a step and GB/s of unique K/V for each
padding, a line a round. Not collected by pytest.

    python bench/cpu_kv_padding.py [--pads 64,512,2112] [--dtype float32] [--keys 32768]
                                   [--rounds 4] [--hot]
"""
import argparse
import sys
from pathlib import Path

import cpuflash
from cpuflash import kvcache
from cpuflash._measure import COLD_BYTES, make_qkv, stream_reader, time_side_by_side

sys.path.insert(0, str(Path(__file__).resolve().parent))
from arg_types import int_list  # noqa: E402  (after its folder is on the path)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pads", type=lambda t: int_list(t, at_least=0), default=[64, 512, 2112])
    p.add_argument("--dtype", default="float32", choices=("float32", "float16", "int8"))
    p.add_argument("--keys", type=int, default=32768)
    p.add_argument("--kv-heads", type=int, default=2, choices=(1, 2, 4, 8))
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--hot", action="store_true", help="one layer, again and again")
    a = p.parse_args(argv)
    if any(pad % 64 for pad in a.pads):
        p.error("--pads: multiples of 64 bytes (whole cache lines)")
    for name in ("keys", "kv_heads", "rounds"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    q, k, v = make_qkv(1, 8, a.keys, 64, n_q=1, h_kv=a.kv_heads, seed=0)
    chosen = kvcache.k_row_length
    steps = {}
    try:
        for pad in a.pads:
            kvcache.k_row_length = lambda n, itemsize, pad=pad: n + pad // itemsize
            caches, nbytes = [], 0
            while not caches or (not a.hot and nbytes < COLD_BYTES):
                cache = cpuflash.KVCache(1, 1, a.kv_heads, a.keys, 64, dtype=a.dtype)
                cache.append(0, k, v)
                caches.append(cache)
                nbytes += cache.nbytes

            def step(caches=caches):
                for cache in caches:
                    cache.attention(0, q)

            steps[f"pad {pad}"] = step
    finally:
        kvcache.k_row_length = chosen
    k_view, v_view, scales = caches[0].view(0)  # the unique K/V bytes a step reads
    layer = k_view.nbytes + v_view.nbytes + sum(x.nbytes for x in scales.values())
    read, n_read = stream_reader(layer * len(caches))
    print(f"Hkv={a.kv_heads} Nk={a.keys} {a.dtype}, {len(caches)} layer(s) a step "
          f"({'hot' if a.hot else 'from DRAM'}); ms a layer (GB/s of K/V)")
    for _ in range(a.rounds):
        best = time_side_by_side(dict(steps, stream=read), repeats=15, budget_s=3.0)
        cells = [f"{name} {best[name] / len(caches) * 1e3:.3f} ms "
                 f"({layer * len(caches) / best[name] / 1e9:.1f})" for name in steps]
        print("  ".join(cells) + f"  stream {n_read / best['stream'] / 1e9:.1f} GB/s",
              flush=True)


if __name__ == "__main__":
    main()
