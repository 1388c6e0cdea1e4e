"""``cpuflash.attention`` against the float64 reference on random shapes and options, for a while.

Each case is of one kind (``--kinds``, taken in turn):
- ``decode``: batch 1-2, kv heads 1/2/4, GQA groups 1-8, Nq 1-16 (the decode path, its chunks
  of up to 1024 keys and their splits), Nk up to ``--max-nk``, head dims 8/16/20/64;
- ``tiled``: Nq 17-300 (the tiled path, its query and key tiles and their edges), Nk up to
  700, head dims 1-130, a value head dim that differs from D at times, float16 inputs too;
- ``backward``: ``attention_backward``'s gradients (Nq and Nk up to 200).
float32 and float64 (float16 too for ``tiled``), and at random causal, a window, ``kv_lens``,
softcap, ALiBi, a bool or an additive float mask (with ``-inf`` entries), dropout and a
transposed K.
A case fails if an output (or gradient) or lse is further from the reference than
``--tol32`` (float32), ``--tol64`` (float64) or ``--tol16`` (float16, relative to the largest
reference value), or if its rows that see a key and those that see none differ from the
reference's. Prints the first failing case and exits 1, else the count of cases and the worst
error. Stop 38's run found softcap's float64 tanh (1e-8) and dropout's scale (1e-10) this way.
Not collected by pytest (tests/test_bench_scripts.py runs a few cases).

    python bench/cpu_fuzz.py [--seconds 120] [--seed 0] [--max-nk 6000]
                             [--kinds decode,tiled,backward]
"""
import argparse
import math
import sys
import time

import numpy as np

import cpuflash
from cpuflash import reference


KINDS = ("decode", "tiled", "backward")


def random_case(rng, max_nk, kind="decode"):
    """``(q, k, v, options)`` of one random case of ``kind`` (``KINDS``)."""
    b, hkv = int(rng.integers(1, 3)), int(rng.choice([1, 2, 4]))
    if kind == "decode":
        hq, nq = hkv * int(rng.choice([1, 2, 4, 8])), int(rng.integers(1, 17))
        nk, d = int(rng.integers(1, max_nk + 1)), int(rng.choice([8, 16, 20, 64]))
        dv = d
    else:
        hq = hkv * int(rng.choice([1, 2]))
        top = 300 if kind == "tiled" else 200
        nq = int(rng.integers(17 if kind == "tiled" else 1, top + 1))
        nk = int(rng.integers(1, min(max_nk, 700 if kind == "tiled" else 200) + 1))
        d = int(rng.choice([1, 7, 16, 33, 64, 130]))
        dv = d if rng.random() < 0.7 else int(rng.choice([5, 16, 64]))
    if kind == "tiled":
        dtype = (np.float16, np.float32, np.float64)[int(rng.integers(3))]
    else:
        dtype = np.float32 if rng.random() < 0.5 else np.float64
    q, k, v = (rng.standard_normal(shape).astype(dtype)
               for shape in ((b, hq, nq, d), (b, hkv, nk, d), (b, hkv, nk, dv)))
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
    elif kind != "decode" and rng.random() < 0.3:  # additive, broadcast over heads at times
        shape = (b, hq, nq, nk) if rng.random() < 0.5 else (nq, nk)
        adds = rng.standard_normal(shape)
        adds[rng.random(shape) < 0.1] = -np.inf
        opts["mask"] = adds.astype(dtype if dtype != np.float16 else np.float32)
    if rng.random() < 0.2:
        opts.update(dropout_p=0.3, seed=int(rng.integers(0, 100)))
    if rng.random() < 0.3:  # K transposed in memory: keys along the unit stride
        k = np.ascontiguousarray(k.transpose(0, 1, 3, 2)).transpose(0, 1, 3, 2)
    return q, k, v, opts


def _far(x, ref, tol, relative):
    """Max abs difference of ``x`` from ``ref``, and whether it is beyond ``tol`` (times the
    largest reference value if ``relative``) or NaN where the reference is not."""
    if not x.size:
        return 0.0, False
    diff = np.abs(x.astype(np.float64) - ref)
    err = float(np.max(np.where(np.isnan(ref), 0.0, diff)))
    bound = tol * max(1.0, float(np.max(np.abs(ref)))) if relative else tol
    return err, not err <= bound or bool(np.any(np.isnan(x) & ~np.isnan(ref)))


def check(q, k, v, opts, tol, kind="decode"):
    """The case's max error, or None if it fails (``tol``, or which rows see a key)."""
    relative = q.dtype == np.float16
    out, lse = cpuflash.attention(q, k, v, return_lse=True, **opts)
    ref, ref_lse = reference.attention(q, k, v, return_lse=True, **opts)
    err, bad = _far(out, ref, tol, relative)
    seen = np.isfinite(ref_lse)
    lse_err = float(np.max(np.abs(lse[seen] - ref_lse[seen]))) if seen.any() else 0.0
    if (bad or not lse_err <= tol * (max(1.0, float(np.max(np.abs(ref_lse[seen]))))
                                     if seen.any() else 1.0)
            or (np.isfinite(lse) != seen).any()):
        return None
    if kind == "backward":
        dout = np.random.default_rng(out.size).standard_normal(out.shape).astype(q.dtype)
        grads = cpuflash.attention_backward(dout, q, k, v, out, lse, **opts)
        refs = reference.attention_backward(dout, q, k, v, **opts)
        for g, r in zip(grads, refs):
            g_err, g_bad = _far(g, r, tol, True)  # gradients grow with the scores' spread
            if g_bad:
                return None
            err = max(err, g_err)
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
    p.add_argument("--tol16", type=float, default=4e-3)
    p.add_argument("--kinds", default=",".join(KINDS),
                   help=f"kinds of case, comma-separated, taken in turn: {', '.join(KINDS)}")
    a = p.parse_args(argv)
    if not (math.isfinite(a.seconds) and a.seconds > 0):
        p.error("--seconds must be positive")
    if a.cases < 0:
        p.error("--cases must be 0 (no limit) or positive")
    if a.max_nk < 1:
        p.error("--max-nk must be at least 1")
    if not all(math.isfinite(t) and t > 0 for t in (a.tol32, a.tol64, a.tol16)):
        p.error("--tol32, --tol64 and --tol16 must be positive")
    kinds = a.kinds.split(",")
    if not kinds or any(kind not in KINDS for kind in kinds):
        p.error(f"--kinds: expected some of {', '.join(KINDS)}, got {a.kinds!r}")
    rng = np.random.default_rng(a.seed)
    tols = {"float16": a.tol16, "float32": a.tol32, "float64": a.tol64}
    start, n, worst = time.perf_counter(), 0, {}
    while time.perf_counter() - start < a.seconds and (a.cases == 0 or n < a.cases):
        kind = kinds[n % len(kinds)]
        q, k, v, opts = random_case(rng, a.max_nk, kind)
        err = check(q, k, v, opts, tols[q.dtype.name], kind)
        if err is None:
            print("MISMATCH", kind, *describe(q, k, v, opts))
            return 1
        key = f"{kind} {q.dtype.name}"
        worst[key] = max(worst.get(key, 0.0), err)
        n += 1
    print(f"{n} cases, no mismatch; worst error: "
          + ", ".join(f"{key} {e:.2e}" for key, e in sorted(worst.items())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
