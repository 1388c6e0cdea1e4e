"""What attention sinks (``sinks=``) add to a call: the same call with and without them,
alternating in one process, median microseconds of each and their difference.

Cases: ``KVCache.attention`` decode steps (Nq=1, Hq=8, D=64; Hkv=2 at Nk=64 and 32768, and
GPT-2 small's Hkv=Hq=12 at Nk=1024), where the sinks' Python and fold come after a kernel that
swept K/V through the caches, and one forward call at N=2048 (H=8, D=64). Not collected by
pytest.

    python bench/cpu_sinks_cost.py [--rounds 400]
"""
import argparse

import numpy as np

import cpuflash
from cpuflash._measure import medians_side_by_side

STEPS = ((8, 2, 64), (8, 2, 32768), (12, 12, 1024))  # (Hq, Hkv, Nk)


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=400, help="calls of each, alternating")
    a = p.parse_args(argv)
    if a.rounds < 1:
        p.error(f"--rounds must be at least 1, got {a.rounds}")
    return a


def main(argv=None):
    a = parse(argv)
    rng = np.random.default_rng(0)
    print(f"{cpuflash.get_num_threads()} threads; median us a call over {a.rounds} rounds")
    print(f"{'case':>34} | {'without':>8} {'with':>8} {'added':>7}")
    for n_hq, n_hkv, n_k in STEPS:
        cache = cpuflash.KVCache(1, 1, n_hkv, n_k, 64)
        cache.append(0, *(rng.standard_normal((1, n_hkv, n_k, 64)).astype(np.float32)
                          for _ in range(2)))
        q = rng.standard_normal((1, n_hq, 1, 64)).astype(np.float32)
        sinks = rng.standard_normal(n_hq).astype(np.float32)
        t = medians_side_by_side({"without": lambda: cache.attention(0, q),
                                  "with": lambda: cache.attention(0, q, sinks=sinks)},
                                 a.rounds)
        report(f"decode step Hq={n_hq} Hkv={n_hkv} Nk={n_k}", t)
    q, k, v = (rng.standard_normal((1, 8, 2048, 64)).astype(np.float32) for _ in range(3))
    sinks = rng.standard_normal(8).astype(np.float32)
    t = medians_side_by_side({"without": lambda: cpuflash.attention(q, k, v),
                              "with": lambda: cpuflash.attention(q, k, v, sinks=sinks)},
                             max(1, a.rounds // 8))
    report("forward H=8 N=2048 D=64", t)


def report(case, t):
    print(f"{case:>34} | {t['without'] * 1e6:8.1f} {t['with'] * 1e6:8.1f} "
          f"{(t['with'] - t['without']) * 1e6:7.1f}")


if __name__ == "__main__":
    main()
