"""A/B of the CPU kernels' tile sizes, query-block rows (``config.block_q``) and keys per tile
(``config.block_k``, or ``config.backward_block_k`` with ``--backward``), side by side with
torch's CPU SDPA: each (rows, keys) pair in turn and torch, in rounds in one process (this
machine drifts by 10-20 % over minutes, so separate runs would not compare); per round the best
of ``--calls`` calls, the median over rounds printed. The last column says whether every pair
gave the first one's bits (the rows never change them; the keys change how the sums are split).
Not collected by pytest.

    python bench/cpu_block_ab.py [--rows 0,64,128] [--keys 0] [--shapes 512x128,512x64]
                                 [--h 8] [--causal] [--backward] [--rounds 12] [--calls 7]

``--rows``, ``--keys``: 0 is the config's own choice; rows must be multiples of the host's
micro-tile rows (``config.MICRO_ROWS``), keys of its panel width (``config.panel_width``).
``--backward``: forward and backward (``attention_vjp`` against torch's autograd; ``--rows``
then applies to the forward only). B=1, float32, the threads Numba has.
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
    p.add_argument("--keys", type=lambda t: int_list(t, at_least=0), default=[0],
                   help="keys per tile to compare (0: the config's choice)")
    p.add_argument("--shapes", type=shape_list, default=[(512, 128), (512, 64)])
    p.add_argument("--h", type=int, default=8)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--backward", action="store_true")
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
    width = config.panel_width(np.dtype(np.float32))
    if any(k % width for k in a.keys):
        p.error(f"--keys: each must be 0 or a multiple of this host's panel width ({width}), "
                f"got {a.keys}")
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
    keys_of = "backward_block_k" if a.backward else "block_k"
    chosen = {"block_q": config.block_q, keys_of: getattr(config, keys_of)}
    pairs = [(rows, keys) for rows in a.rows for keys in a.keys]

    def use(pair):  # the tile sizes of the calls that follow
        rows, keys = pair
        config.block_q = chosen["block_q"] if rows == 0 else (lambda *args: rows)
        setattr(config, keys_of, chosen[keys_of] if keys == 0 else (lambda *args: keys))

    rng = np.random.default_rng(0)
    print(f"rows x keys {[f'{r}x{k}' for r, k in pairs]} (0: the config's), H={a.h}, "
          f"causal={a.causal}, backward={a.backward}; ms (x torch)")
    try:
        for n, d in a.shapes:
            q, k, v, dout = (rng.standard_normal((1, a.h, n, d)).astype(np.float32)
                             for _ in range(4))
            tq, tk, tv = (torch.from_numpy(x).requires_grad_(a.backward) for x in (q, k, v))
            tdout = torch.from_numpy(dout)

            def ours():
                if a.backward:
                    return cpuflash.attention_vjp(q, k, v, dout, causal=a.causal)[1]
                return cpuflash.attention(q, k, v, causal=a.causal)

            def theirs():
                out = F.scaled_dot_product_attention(tq, tk, tv, is_causal=a.causal)
                if a.backward:
                    out.backward(tdout)
                return out

            outs, times = {}, {key: [] for key in [*pairs, "torch"]}
            for pair in pairs:
                use(pair)
                outs[pair] = ours()
            for _ in range(a.rounds):
                for pair in pairs:
                    use(pair)
                    times[pair].append(best_of(ours, a.calls))
                times["torch"].append(best_of(theirs, a.calls))
            median = {key: float(np.median(t)) for key, t in times.items()}
            cells = " | ".join(f"{r}x{k}: {median[(r, k)] * 1e3:.3f} "
                               f"({median['torch'] / median[(r, k)]:.3f})" for r, k in pairs)
            same = all(np.array_equal(outs[pairs[0]], outs[pair]) for pair in pairs)
            print(f"| {n} | {d} | {cells} | torch {median['torch'] * 1e3:.3f} | bitwise {same} |",
                  flush=True)
    finally:
        config.block_q = chosen["block_q"]
        setattr(config, keys_of, chosen[keys_of])


if __name__ == "__main__":
    main(parse())
