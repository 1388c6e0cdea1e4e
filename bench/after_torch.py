"""CPU: cpuflash timed in a process that runs only cpuflash, or right after a torch SDPA call on
the same inputs before each of its calls (same process, torch called once first in both, as
the benchmarks do). Run each mode in its own process, in turns:

    python bench/after_torch.py alone fwd 2048 64 0 15
    python bench/after_torch.py after fwd 2048 64 0 15

Arguments: mode (alone | after), section (fwd | fwdbwd), N, D, causal (0 | 1), repeats; B=1,
H=8, float32. Prints the best and the median time of cpuflash's calls. Not collected by pytest.
"""
import argparse
import time

import numpy as np
import torch
import torch.nn.functional as F

import cpuflash
from cpuflash._measure import make_qkv


def positive(text):
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def main(mode, section, n, d, causal, reps):
    q, k, v = make_qkv(1, 8, n, d)
    do = np.random.default_rng(1).standard_normal(q.shape, dtype=np.float32)
    tq, tk, tv, tdo = (torch.from_numpy(x) for x in (q, k, v, do))

    def ours():
        if section == "fwd":
            cpuflash.attention(q, k, v, causal=causal)
        else:
            o, lse = cpuflash.attention(q, k, v, causal=causal, return_lse=True)
            cpuflash.attention_backward(do, q, k, v, o, lse, causal=causal)

    def theirs():
        if section == "fwd":
            with torch.no_grad():
                F.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)
        else:
            a, b, c = (x.clone().requires_grad_() for x in (tq, tk, tv))
            F.scaled_dot_product_attention(a, b, c, is_causal=causal).backward(tdo)

    theirs()  # torch's thread pool first (README: "Torch in the same process")
    ours()
    times = []
    for _ in range(reps):
        if mode == "after":
            theirs()
        t0 = time.perf_counter()
        ours()
        times.append(time.perf_counter() - t0)
    print(f"{mode:5s} {section} N={n} D={d} causal={causal}: best {min(times) * 1e3:.1f} ms, "
          f"median {np.median(times) * 1e3:.1f} ms")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("mode", choices=["alone", "after"])
    p.add_argument("section", choices=["fwd", "fwdbwd"])
    p.add_argument("n", type=positive)
    p.add_argument("d", type=positive)
    p.add_argument("causal", type=int, choices=[0, 1])
    p.add_argument("reps", type=positive)
    a = p.parse_args()
    main(a.mode, a.section, a.n, a.d, a.causal == 1, a.reps)
