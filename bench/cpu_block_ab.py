"""A/B of the CPU forward's query-block rows (``config.block_q``) side by side with torch's CPU
SDPA: each block size in turn and torch, in rounds in one process (this machine drifts by 10-20 %
over minutes, so separate runs would not compare); per round the best of ``--calls`` calls, the
median over rounds printed. The last column says whether every block size gave the first one's
bits. Not collected by pytest.

    python bench/cpu_block_ab.py [--rows 0,64,128] [--shapes 512x128,512x64] [--h 8]
                                 [--causal] [--rounds 12] [--calls 7]

``--rows``: 0 is ``config.block_q``'s own choice; others must be multiples of the host's
micro-tile rows (``config.MICRO_ROWS``). B=1, float32, the threads Numba has.
"""
import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from arg_types import int_list  # noqa: E402  (after its folder is on the path)


def shape_list(text):
    try:
        shapes = [tuple(int(x) for x in s.split("x")) for s in text.split(",")]
    except ValueError:
        shapes = None
    if not shapes or any(len(s) != 2 or min(s) < 1 for s in shapes):
        raise argparse.ArgumentTypeError(f"expected NxD,NxD,... with N, D >= 1, got {text!r}")
    return shapes


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=lambda t: int_list(t, at_least=0), default=[0, 64, 128],
                   help="query rows per block to compare (0: config.block_q's choice)")
    p.add_argument("--shapes", type=shape_list, default=[(512, 128), (512, 64)])
    p.add_argument("--h", type=int, default=8)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--calls", type=int, default=7)
    a = p.parse_args(argv)
    for name in ("h", "rounds", "calls"):
        if getattr(a, name) < 1:
            p.error(f"--{name} must be at least 1, got {getattr(a, name)}")
    from cpuflash import config
    if any(r % config.MICRO_ROWS for r in a.rows):  # the kernel steps its rows by micro-tiles
        p.error(f"--rows: each must be 0 or a multiple of this host's micro-tile rows "
                f"({config.MICRO_ROWS}), got {a.rows}")
    return a


def best_of(fn, calls):
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main(a):
    import torch
    import torch.nn.functional as F

    import cpuflash
    from cpuflash import config

    torch.set_num_threads(cpuflash.get_num_threads())
    chosen = config.block_q

    def use(rows):  # the block size of the calls that follow
        config.block_q = chosen if rows == 0 else (lambda *args: rows)

    rng = np.random.default_rng(0)
    print(f"rows {a.rows} (0: config.block_q), H={a.h}, causal={a.causal}; ms (x torch)")
    try:
        for n, d in a.shapes:
            q, k, v = (rng.standard_normal((1, a.h, n, d)).astype(np.float32) for _ in range(3))
            tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))

            def ours():
                return cpuflash.attention(q, k, v, causal=a.causal)

            def theirs():
                return F.scaled_dot_product_attention(tq, tk, tv, is_causal=a.causal)

            outs, times = {}, {key: [] for key in [*a.rows, "torch"]}
            for rows in a.rows:
                use(rows)
                outs[rows] = ours()
            for _ in range(a.rounds):
                for rows in a.rows:
                    use(rows)
                    times[rows].append(best_of(ours, a.calls))
                times["torch"].append(best_of(theirs, a.calls))
            median = {key: float(np.median(t)) for key, t in times.items()}
            cells = " | ".join(f"{r}: {median[r] * 1e3:.3f} ({median['torch'] / median[r]:.3f})"
                               for r in a.rows)
            same = all(np.array_equal(outs[a.rows[0]], outs[r]) for r in a.rows)
            print(f"| {n} | {d} | {cells} | torch {median['torch'] * 1e3:.3f} | bitwise {same} |",
                  flush=True)
    finally:
        config.block_q = chosen


if __name__ == "__main__":
    main(parse())
