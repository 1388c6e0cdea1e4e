"""Max abs error of cpuflash's and torch's CPU SDPA forward (and gradients) against the float64
reference, per head, over several seeds: float32 rounding differs from head to head, so one
head of one draw (what ``cpuflash bench`` reports beside its timings) says little about which
is more accurate. Prints, per shape, the max and mean over all heads and seeds for each, and in
how many heads cpuflash's error is at most torch's. ``--peaked F``: q = k = v scaled by F (sharp,
peaked rows), where an early prototype's error was 3x torch's. Not collected by pytest.

    python bench/cpu_accuracy.py [--seeds 3] [--backward] [--peaked 2.0]
"""
import argparse

import numpy as np

import cpuflash
from cpuflash import _measure, reference

SHAPES = [(512, 64, False), (512, 128, False), (2048, 64, False), (2048, 64, True)]


def per_head_error(x, ref):
    return np.max(np.abs(x.astype(np.float64) - ref), axis=(0, 2, 3))  # (H,)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--backward", action="store_true", help="gradients (dq, dk, dv) too")
    p.add_argument("--peaked", type=float, default=0.0, metavar="F",
                   help="q = k = v, scaled by F (F = 4 makes most rows one-hot)")
    a = p.parse_args(argv)
    if a.seeds < 1:
        p.error("--seeds must be at least 1")
    if not a.peaked >= 0:  # NaN too
        p.error("--peaked must be 0 (off) or positive")
    torch_run, _ = _measure.torch_sdpa()
    torch_grad = _measure.torch_sdpa_grad() if a.backward else None
    if torch_run is None:
        p.error("torch is not installed: pip install torch==2.13.0")
    print(f"B=1, H=8, float32, {a.seeds} seeds; max / mean over heads and seeds"
          + (f", peaked (q = k = v, x{a.peaked})" if a.peaked else ""))
    for n, d, causal in SHAPES:
        errs = {"fwd": ([], [])}
        if a.backward:
            errs.update({g: ([], []) for g in ("dq", "dk", "dv")})
        for seed in range(a.seeds):
            q, k, v = _measure.make_qkv(1, 8, n, d, seed=seed)
            if a.peaked:
                q = k = v = (a.peaked * q).astype(q.dtype)
            ours = cpuflash.attention(q, k, v, causal=causal, return_lse=True)
            ref = reference.attention(q, k, v, causal=causal)
            errs["fwd"][0].append(per_head_error(ours[0], ref))
            errs["fwd"][1].append(per_head_error(torch_run(q, k, v, causal=causal), ref))
            if a.backward:
                dout = _measure.make_qkv(1, 8, n, d, seed=seed + 100)[0]
                mine = cpuflash.attention_backward(dout, q, k, v, *ours, causal=causal)
                theirs = torch_grad(q, k, v, dout, causal=causal)
                want = reference.attention_backward(dout, q, k, v, causal=causal)
                for name, m, t, w in zip(("dq", "dk", "dv"), mine, theirs, want):
                    errs[name][0].append(per_head_error(m, w))
                    errs[name][1].append(per_head_error(t, w))
        for name, (mine, theirs) in errs.items():
            mine, theirs = np.concatenate(mine), np.concatenate(theirs)
            print(f"N={n:5d} D={d:3d} causal={causal!s:5} {name:3}: cpuflash max {mine.max():.2e} "
                  f"mean {mine.mean():.2e} | torch max {theirs.max():.2e} mean "
                  f"{theirs.mean():.2e} | cpuflash <= torch in {(mine <= theirs).sum()}/"
                  f"{mine.size} heads", flush=True)


if __name__ == "__main__":
    main()
