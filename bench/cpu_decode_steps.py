"""Time per key of the decode kernel's steps on one thread, keys in L2: the scores of a sweep
over a transposed K (``decode.sweep_scores``, ``--dim-groups`` dims a pass), the online softmax
of its chunks, and P V with the rescale, for one GQA group of ``--rows`` query rows. With
``--k-pad 0,16`` the rows of K^T are also laid out without and with KVCache's padding (one
64-byte line; ``kvcache.K_ROW_PAD_BYTES``). Best of 5 runs of ``--reps`` sweeps each. Run with
``NUMBA_NUM_THREADS=1``. Not collected by pytest.

    NUMBA_NUM_THREADS=1 python bench/cpu_decode_steps.py [--keys 1024] [--rows 4]
                                                         [--dim-groups 8,64] [--k-pad 0,16]
"""
import argparse
import sys
import time
from pathlib import Path

import numba
import numpy as np

from cpuflash._cpu import decode
from cpuflash._cpu.tiles import online_softmax, rescale_add, tile_product

sys.path.insert(0, str(Path(__file__).resolve().parent))
from arg_types import int_list  # noqa: E402  (after its folder is on the path)

SCORES, SOFTMAX, PV = 1, 2, 4
CHUNK = decode.CHUNK


@numba.njit
def steps(kind, reps, q_s, kt, k_step, v, rows, d, n, s, m_i, l_t, a_i, pv, acc, dim_group):
    """``reps`` times over ``n`` keys, in sweeps of ``n`` keys, the steps in ``kind``."""
    for _ in range(reps):
        if kind & SCORES:
            decode.sweep_scores(s, n, q_s, rows, d, dim_group, kt, 0, k_step, n, 0)
        for c0 in range(0, n, CHUNK):
            if kind & SOFTMAX:
                online_softmax(s, c0, n, CHUNK, rows, m_i, l_t, a_i, l_t, False, False)
            if kind & PV:
                tile_product(pv, 0, d, s, c0, n, 1, v, c0 * d, d, 1, rows, d, CHUNK, False,
                             False)
                rescale_add(acc, pv, d, rows, a_i, False)
    return s[0]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--keys", type=int, default=1024)
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--dim-groups", type=lambda t: int_list(t, at_least=1), default=[8, 64])
    p.add_argument("--k-pad", type=lambda t: int_list(t, at_least=0), default=[0, 16])
    p.add_argument("--reps", type=int, default=2000)
    a = p.parse_args(argv)
    if a.keys < CHUNK or a.keys % CHUNK or a.rows < 1 or a.reps < 1:
        p.error(f"--keys: a multiple of {CHUNK}; --rows, --reps at least 1")
    d, n, rows = 64, a.keys, a.rows
    rng = np.random.default_rng(0)
    q_s = (rng.standard_normal(rows * d) * 0.1).astype(np.float32)
    v = rng.standard_normal(n * d).astype(np.float32)
    s = np.zeros(rows * n, np.float32)
    m_i = np.full(rows, -np.inf, np.float32)
    l_t, a_i = np.zeros(rows, np.float32), np.zeros(rows, np.float32)
    pv, acc = np.zeros(rows * d, np.float32), np.zeros(rows * d, np.float32)
    print(f"ns per key, {rows} rows, {n} keys, D={d}, threads {numba.get_num_threads()}")
    for k_pad in a.k_pad:
        kt = rng.standard_normal(d * (n + k_pad)).astype(np.float32)
        for name, kind in (("scores", SCORES), ("softmax", SOFTMAX), ("P V", PV),
                           ("all", SCORES | SOFTMAX | PV)):
            for dim_group in (a.dim_groups if kind & SCORES else a.dim_groups[:1]):
                args = (q_s, kt, n + k_pad, v, rows, d, n, s, m_i, l_t, a_i, pv, acc,
                        dim_group)
                steps(kind, 1, *args)
                best = float("inf")
                for _ in range(5):
                    t = time.perf_counter()
                    steps(kind, a.reps, *args)
                    best = min(best, time.perf_counter() - t)
                where = f", {dim_group} dims a pass" if kind & SCORES else ""
                print(f"K^T row pad {k_pad:3d}: {name}{where}: "
                      f"{best / a.reps / n * 1e9:.2f}", flush=True)


if __name__ == "__main__":
    main()
