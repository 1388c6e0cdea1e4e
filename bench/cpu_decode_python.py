"""What the Python of a decode step costs from DRAM: one float32 step per layer of a
``--layers`` deep KVCache (K/V from DRAM, as the decode benchmark's cold steps), in rounds in
one process, through

* ``planned``: ``cache.attention(layer, q)``, which runs from the layer's step plan
  (``decode.StepPlan``: the kernel's arguments of a checked step, kept; since stop 49),
* ``plain``: the plain decode path with its checks (``api._plain_decode``, through
  ``api.attention_on_blocks``), as ``cache.attention`` ran every step before stop 49,
* ``general``: ``cache.attention(layer, q, return_lse=True)``, which takes the general checks,
* ``kernel``: the decode kernel alone, called with the arguments a plan gave it,

and the streaming read of the same bytes (``_cpu/stream.py``). Medians of the rounds, ms a
layer. A step runs right after its kernel has streamed K/V through every cache, so its
Python runs from cold caches. ``--grow``: every call sees one key fewer than the one before
(a new length each step, as a growing cache, set through ``cache.lengths``; the kernel alone
keeps the first calls' length).
Not collected by pytest.

    python bench/cpu_decode_python.py [--nk 32768] [--hkv 2] [--layers 19] [--rounds 12]
                                      [--grow]
"""
import argparse
import itertools
import time

import numpy as np

import cpuflash
from cpuflash import api
from cpuflash._cpu import decode
from cpuflash._cpu.stream import stream_sum


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nk", type=int, default=32768)
    p.add_argument("--hkv", type=int, default=2)
    p.add_argument("--layers", type=int, default=19)
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--grow", action="store_true", help="a new cache length every call")
    a = p.parse_args(argv)
    for name in ("nk", "hkv", "layers", "rounds"):
        if getattr(a, name) < 1:
            p.error(f"--{name} must be at least 1, got {getattr(a, name)}")
    if a.grow and a.nk < 2:
        p.error(f"--grow needs --nk of at least 2, got {a.nk}")
    if 8 % a.hkv:
        p.error(f"--hkv must divide the 8 query heads, got {a.hkv}")
    return a


def main(argv=None):
    a = parse(argv)
    rng = np.random.default_rng(0)
    cache = cpuflash.KVCache(a.layers, 1, a.hkv, a.nk, 64)
    kv = [rng.standard_normal((1, a.hkv, a.nk, 64), dtype=np.float32) for _ in range(2)]
    for layer in range(a.layers):
        cache.append(layer, *kv)
    q = rng.standard_normal((1, 8, 1, 64), dtype=np.float32)
    for layer in range(a.layers):
        cache.attention(layer, q)  # checked: each layer's plan
    kernel_args = []
    kernel = decode.decode

    class Capture:  # the kernel, keeping the arguments of each plan's call (``call_built``)
        def call_built(self, args):
            kernel_args.append(args)
            return kernel.call_built(args)

    decode.decode = Capture()
    try:
        for layer in range(a.layers):
            cache.attention(layer, q)  # from the plan
    finally:
        decode.decode = kernel
    assert len(kernel_args) == a.layers, "cache.attention took no step plan"
    everything = np.concatenate([cache.k_blocks.reshape(-1), cache.v_blocks.reshape(-1)])
    shorter = itertools.count(1)

    def now(layer):  # the layer, its length set as this call sees it
        if a.grow:
            cache.lengths[layer] = a.nk - next(shorter) % (a.nk // 2)
        return layer

    def plain(layer):
        layer = now(layer)
        return api.attention_on_blocks(q, cache._layers[layer], int(cache.lengths[layer]), {})

    ways = {
        "planned": lambda: [cache.attention(now(layer), q) for layer in range(a.layers)],
        "plain": lambda: [plain(layer) for layer in range(a.layers)],
        "general": lambda: [cache.attention(now(layer), q, return_lse=True)
                            for layer in range(a.layers)],
        "kernel": lambda: [kernel(*args) for args in kernel_args],
        "stream": lambda: stream_sum(everything),
    }
    for way in ways.values():
        way()
    ms = {name: [] for name in ways}
    for r in range(a.rounds):
        for name, way in (list(ways.items()) if r % 2 == 0 else list(ways.items())[::-1]):
            t0 = time.perf_counter()
            way()
            ms[name].append((time.perf_counter() - t0) / a.layers * 1e3)
    stream = np.median(ms["stream"])
    print(f"Hkv={a.hkv} Nk={a.nk} float32, {a.layers} layers in turn, {a.rounds} rounds"
          + (", a new length every call" if a.grow else ""))
    for name, times in ms.items():
        m = np.median(times)
        print(f"{name:8s} {m:6.3f} ms a layer  {100 * stream / m:4.0f} % of the stream  "
              f"[{' '.join(f'{t:.2f}' for t in times)}]")
    for fast, slow in (("planned", "plain"), ("plain", "general")):
        gain = np.array(ms[slow]) - np.array(ms[fast])
        print(f"{fast} faster than {slow} in {int((gain > 0).sum())} of {a.rounds} rounds, by "
              f"{np.median(gain) * 1e3:.0f} us a layer (median)")


if __name__ == "__main__":
    main()
