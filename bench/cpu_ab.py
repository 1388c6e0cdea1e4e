"""This tree's cpuflash against an earlier commit's, in one process, alternating call by call:
whether a call gives the same bits, and the median time of each, with and without attention
sinks. The earlier package is ``git archive``d into a temporary directory as ``cpuflash_base``
(its modules import each other relatively), with Numba caches of its own there: its first
calls compile (a minute or two).

Cases: ``KVCache.attention`` decode steps (Nq=1, D=64; Hq=8 Hkv=2 at Nk=64 and 32768, GPT-2
small's Hq=Hkv=12 at Nk=1024) and forward calls (D=64; H=8 N=2048, causal N=2048, N=512; a
GPT-2-small layer's causal prompts, H=12 N=64 and 256, and of lengths that are not a whole
number of 64-key panels, N=37 and 200, and N=100 without a mask), few queries on few keys
(``CHUNKS``: a 16-token prompt, chunks of 4-16 queries on 128-4096 keys, a GQA 64-token
prompt) and a MiniLM batch of 32 sentences through ``attention_varlen``; backward passes
(``attention_backward``, D=64, H=12 N=65 and causal N=200, H=8 N=2048; without sinks).
``--forward-only``: the forward calls alone.
A/A spread: two identical caches differ by up to 1.5 % (stop 57). Not collected by pytest.

    python bench/cpu_ab.py --base REV [--rounds 300] [--forward-only]
"""
import argparse
import pathlib
import subprocess
import sys
import tempfile

import numpy as np

import cpuflash
from cpuflash._measure import medians_side_by_side

REPO = pathlib.Path(__file__).resolve().parents[1]
STEPS = ((8, 2, 64), (8, 2, 32768), (12, 12, 1024))  # (Hq, Hkv, Nk)
FORWARDS = ((8, 2048, False), (8, 2048, True), (8, 512, False), (12, 64, True),
            (12, 256, True), (12, 37, True), (12, 200, True), (12, 100, False))  # (H, N, causal)
BACKWARDS = ((12, 65, False), (12, 65, True), (12, 200, True), (8, 2048, False))
# Few queries on few keys: a 16-token prompt, chunks of a chunked prefill (Hq, Hkv, Nq, Nk,
# causal); since stop 63 those of 8 to 16 queries on few keys take the tiled path
# (``decode.takes_decode``: the first five here), the others stay on the decode path. The
# last: a GQA model's 64-token prompt, one key tile a head (its tasks pack their own tiles
# since stop 64, ``forward.packs_own_tiles``).
CHUNKS = ((12, 12, 16, 16, True), (8, 2, 16, 256, True), (12, 12, 8, 128, True),
          (8, 2, 16, 1024, True), (8, 2, 16, 2048, True), (12, 12, 8, 512, True),
          (12, 12, 4, 512, True), (8, 2, 16, 4096, True), (8, 2, 64, 64, True))
SHORT = 512  # forward calls up to this N run ``--rounds`` times, longer ones a quarter of it


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", required=True, help="the commit to compare against")
    p.add_argument("--rounds", type=int, default=300,
                   help="decode steps of each, alternating (forward calls: as many up to "
                        "N=512, rounds // 8 beyond)")
    p.add_argument("--forward-only", action="store_true", help="no decode steps")
    a = p.parse_args(argv)
    if a.rounds < 8:
        p.error(f"--rounds must be at least 8, got {a.rounds}")
    known = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--verify", "--quiet",
                            f"{a.base}^{{commit}}"], capture_output=True)
    if known.returncode != 0:
        p.error(f"--base: no commit {a.base!r} in {REPO}")
    return a


def import_base(rev, into):
    """``src/cpuflash`` of commit ``rev`` imported as ``cpuflash_base`` from directory ``into``."""
    archive = subprocess.run(["git", "-C", str(REPO), "archive", rev, "src/cpuflash"],
                             check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    (pathlib.Path(into) / "src" / "cpuflash").rename(pathlib.Path(into) / "cpuflash_base")
    sys.path.insert(0, str(into))
    import cpuflash_base
    return cpuflash_base


def options(sinks):
    """A call's options: none, or the sinks and ``return_lse`` (to compare the lse too)."""
    return {} if sinks is None else {"sinks": sinks, "return_lse": True}


def same_bits(a, b):
    a, b = (x if isinstance(x, tuple) else (x,) for x in (a, b))
    return all(np.array_equal(x, y) for x, y in zip(a, b))


def compare(case, mods, call, sinks, rounds, unit, factor):
    """One case: ``call(mod, sinks)`` for the base and this tree, without and with sinks."""
    base, new = mods
    plain_bits = same_bits(call(base, None), call(new, None))
    with_base, with_new = call(base, sinks), call(new, sinks)
    diff = max(float(np.abs(x - y).max()) for x, y in zip(with_base, with_new))
    t = medians_side_by_side({"base": lambda: call(base, None), "new": lambda: call(new, None),
                              "base+s": lambda: call(base, sinks),
                              "new+s": lambda: call(new, sinks)}, rounds)
    t = {name: value * factor for name, value in t.items()}
    print(f"{case:>30} | {'yes' if plain_bits else 'NO':>4} {t['base']:9.1f} {t['new']:9.1f} "
          f"{t['new'] / t['base']:6.3f} | {t['base+s'] - t['base']:8.1f} "
          f"{t['new+s'] - t['new']:8.1f} {diff:9.1e}  ({unit})")


def compare_backward(case, mods, call, rounds, unit, factor):
    """One backward case, ``call(mod)`` for the base and this tree: the same bits (dq, dk,
    dv) and the medians (no sinks: their gradient is a column of its own)."""
    base, new = mods
    bits = same_bits(call(base), call(new))
    t = medians_side_by_side({"base": lambda: call(base), "new": lambda: call(new)}, rounds)
    t = {name: value * factor for name, value in t.items()}
    print(f"{case:>30} | {'yes' if bits else 'NO':>4} {t['base']:9.1f} {t['new']:9.1f} "
          f"{t['new'] / t['base']:6.3f} |  ({unit})")


def main(argv=None):
    a = parse(argv)
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as into:
        base = import_base(a.base, into)
        mods = (base, cpuflash)
        print(f"{a.base} against this tree, {cpuflash.get_num_threads()} threads; medians; "
              "sinks: what they add, and the largest difference of out and lse between the two")
        print(f"{'case':>30} | {'bits':>4} {'base':>9} {'new':>9} {'ratio':>6} | "
              f"{'+s base':>8} {'+s new':>8} {'diff':>9}")
        for n_hq, n_hkv, n_k in () if a.forward_only else STEPS:
            kv = [rng.standard_normal((1, n_hkv, n_k, 64)).astype(np.float32) for _ in range(2)]
            caches = {}
            for mod in mods:
                caches[mod] = mod.KVCache(1, 1, n_hkv, n_k, 64)
                caches[mod].append(0, *kv)
            q = rng.standard_normal((1, n_hq, 1, 64)).astype(np.float32)
            compare(f"step Hq={n_hq} Hkv={n_hkv} Nk={n_k}", mods,
                    lambda mod, s: caches[mod].attention(0, q, **options(s)),
                    rng.standard_normal(n_hq).astype(np.float32), a.rounds, "us", 1e6)
        for n_h, n, causal in FORWARDS:
            q, k, v = (rng.standard_normal((1, n_h, n, 64)).astype(np.float32) for _ in range(3))
            compare(f"forward H={n_h} N={n}{' causal' if causal else ''}", mods,
                    lambda mod, s: mod.attention(q, k, v, causal=causal, **options(s)),
                    rng.standard_normal(n_h).astype(np.float32),
                    *((a.rounds, "us", 1e6) if n <= SHORT else (a.rounds // 8, "ms", 1e3)))
        for n_hq, n_hkv, n_q, n_k, causal in CHUNKS:
            q = rng.standard_normal((1, n_hq, n_q, 64)).astype(np.float32)
            k, v = (rng.standard_normal((1, n_hkv, n_k, 64)).astype(np.float32)
                    for _ in range(2))
            compare(f"Hq={n_hq} Hkv={n_hkv} Nq={n_q} Nk={n_k}{' causal' if causal else ''}",
                    mods, lambda mod, s: mod.attention(q, k, v, causal=causal, **options(s)),
                    rng.standard_normal(n_hq).astype(np.float32), a.rounds, "us", 1e6)
        # A MiniLM batch: 32 sentences of 5-128 tokens packed, H=12, D=32, q, k and v the
        # slices of a fused projection (the last tile of every sequence ends past its keys)
        lens = rng.integers(5, 129, size=32)
        cu = np.concatenate(([0], np.cumsum(lens))).astype(np.int64)
        qkv = rng.standard_normal((int(cu[-1]), 3, 12, 32)).astype(np.float32)
        compare("varlen 32 x 5-128 H=12 D=32", mods,
                lambda mod, s: mod.attention_varlen(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu, cu,
                                                    **options(s)),
                rng.standard_normal(12).astype(np.float32), a.rounds, "us", 1e6)
        for n_h, n, causal in () if a.forward_only else BACKWARDS:
            q, k, v, dout = (rng.standard_normal((1, n_h, n, 64)).astype(np.float32)
                             for _ in range(4))
            out, lse = cpuflash.attention(q, k, v, causal=causal, return_lse=True)
            compare_backward(f"backward H={n_h} N={n}{' causal' if causal else ''}", mods,
                             lambda mod: mod.attention_backward(dout, q, k, v, out, lse,
                                                                causal=causal),
                             *((a.rounds, "us", 1e6) if n <= SHORT else
                               (a.rounds // 8, "ms", 1e3)))


if __name__ == "__main__":
    main()
