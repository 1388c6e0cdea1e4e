"""``cpuflash.attention`` against the float64 reference on random shapes and options, for a while:
batch 1-2, kv heads 1/2/4, GQA groups 1-8, Nq 1-16 (the decode path, its chunks of up to 1024
keys and their splits), Nk up to ``--max-nk``, head dims 8/16/20/64, float32 and float64, and at
random causal, a window, ``kv_lens``, softcap, ALiBi, a bool mask, dropout and a transposed K.
A case fails if its output or lse is further from the reference than ``--tol32`` (float32) or
``--tol64`` (float64), or if its rows that see a key and those that see none differ from the
reference's. Prints the first failing case and exits 1, else the count of cases and the worst
error. Stop 38's run found softcap's float64 tanh (1e-8) and dropout's scale (1e-10) this way.
Not collected by pytest (tests/test_bench_scripts.py runs a few cases).

    python bench/cpu_fuzz.py [--seconds 120] [--seed 0] [--max-nk 6000]
"""
import argparse
import math
import sys
import time

import numpy as np

import cpuflash
from cpuflash import reference


def random_case(rng, max_nk):
    """``(q, k, v, options)`` of one random case."""
    b, hkv = int(rng.integers(1, 3)), int(rng.choice([1, 2, 4]))
    hq, nq = hkv * int(rng.choice([1, 2, 4, 8])), int(rng.integers(1, 17))
    nk, d = int(rng.integers(1, max_nk + 1)), int(rng.choice([8, 16, 20, 64]))
    dtype = np.float32 if rng.random() < 0.5 else np.float64
    q, k, v = (rng.standard_normal(shape).astype(dtype)
               for shape in ((b, hq, nq, d), (b, hkv, nk, d), (b, hkv, nk, d)))
    opts = {}
    if rng.random() < 0.5:
        opts["causal"] = True
    if rng.random() < 0.4:
        opts["window"] = (int(rng.integers(0, nk + 5)), int(rng.integers(0, 50)))
    if rng.random() < 0.4:
        opts["kv_lens"] = rng.integers(0, nk + 1, size=b)
    if rng.random() < 0.3:
        opts["softcap"] = float(rng.uniform(1, 30))
    if rng.random() < 0.3:
        opts["alibi_slopes"] = rng.uniform(0, 0.1, size=hq)
    if rng.random() < 0.3:
        opts["mask"] = rng.random((b, hq, nq, nk)) < 0.8
    if rng.random() < 0.2:
        opts.update(dropout_p=0.3, seed=int(rng.integers(0, 100)))
    if rng.random() < 0.3:  # K transposed in memory: keys along the unit stride
        k = np.ascontiguousarray(k.transpose(0, 1, 3, 2)).transpose(0, 1, 3, 2)
    return q, k, v, opts


def check(q, k, v, opts, tol):
    """The case's max output error, or None if it fails (``tol``, or which rows see a key)."""
    out, lse = cpuflash.attention(q, k, v, return_lse=True, **opts)
    ref, ref_lse = reference.attention(q, k, v, return_lse=True, **opts)
    err = float(np.max(np.abs(out - ref))) if out.size else 0.0
    seen = np.isfinite(ref_lse)
    lse_err = float(np.max(np.abs(lse[seen] - ref_lse[seen]))) if seen.any() else 0.0
    if err > tol or lse_err > tol or np.isnan(out).any() or (np.isfinite(lse) != seen).any():
        return None
    return err


def describe(q, k, v, opts):
    shapes = {"q": q.shape, "k": k.shape, "dtype": q.dtype.name,
              "k transposed": k.strides[3] != k.itemsize}
    return shapes, {n: (x if np.isscalar(x) or isinstance(x, tuple) else f"array{np.shape(x)}")
                    for n, x in opts.items()}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=120.0)
    p.add_argument("--cases", type=int, default=0, help="stop after this many (0: no limit)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-nk", type=int, default=6000)
    p.add_argument("--tol32", type=float, default=3e-4)
    p.add_argument("--tol64", type=float, default=1e-12)
    a = p.parse_args(argv)
    if not (math.isfinite(a.seconds) and a.seconds > 0):
        p.error("--seconds must be positive")
    if a.cases < 0:
        p.error("--cases must be 0 (no limit) or positive")
    if a.max_nk < 1:
        p.error("--max-nk must be at least 1")
    if not all(math.isfinite(t) and t > 0 for t in (a.tol32, a.tol64)):
        p.error("--tol32 and --tol64 must be positive")
    rng = np.random.default_rng(a.seed)
    start, n, worst = time.perf_counter(), 0, {"float32": 0.0, "float64": 0.0}
    while time.perf_counter() - start < a.seconds and (a.cases == 0 or n < a.cases):
        q, k, v, opts = random_case(rng, a.max_nk)
        err = check(q, k, v, opts, a.tol64 if q.dtype == np.float64 else a.tol32)
        if err is None:
            print("MISMATCH", *describe(q, k, v, opts))
            return 1
        worst[q.dtype.name] = max(worst[q.dtype.name], err)
        n += 1
    print(f"{n} cases, no mismatch; worst error float32 {worst['float32']:.2e}, "
          f"float64 {worst['float64']:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
