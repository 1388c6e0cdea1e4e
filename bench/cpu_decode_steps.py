"""Time per key of the decode kernel's steps on one thread, keys in L2: the scores of a chunk
over a transposed K (``decode.transposed_scores``, all D rows in one tile product), the online
softmax of the chunk, and P V with the rescale, for one GQA group of ``--rows`` query rows;
``--hints 0,1``: without and with the kernel's prefetch hints (``decode.AHEAD`` chunks ahead,
into L2). ``--k-pad 0,16,128``: the rows of K^T padded by that many floats (16: one 64-byte
line, KVCache's padding of rows under 4 KiB up to stop 36; 128: 512 bytes, its padding then
for ``--keys`` a multiple of 1024; KVCache stores K in blocks of 64 keys since stop 37, whose
rows are ``KEY_BLOCK`` keys). The steps here are ``decode.CHUNK`` (128) keys; since stop 38 the
kernel's chunks are up to 1024 (``decode.chunk_keys``), which pays the per-step work less
often. ``--panels``: K and V as KVCache stores them since stop 39 instead, blocks of
``KEY_BLOCK`` keys in panels of the micro-kernel's width (``decode.key_panel_width``; P V a
product per block; no hints, as the kernel gives none there); ``--k-pad`` then does not apply.
Best of 5 runs of ``--reps`` passes over the keys each. Run with ``NUMBA_NUM_THREADS=1``. Not
collected by pytest.

    NUMBA_NUM_THREADS=1 python bench/cpu_decode_steps.py [--keys 1024] [--rows 4]
                                                         [--hints 0,1] [--k-pad 0,16,128]
                                                         [--panels]
"""
import argparse
import sys
import time
from pathlib import Path

import numba
import numpy as np

from cpuflash._cpu import decode
from cpuflash._cpu.tiles import online_softmax, rescale_add, tile_product, tile_product_ahead

sys.path.insert(0, str(Path(__file__).resolve().parent))
from arg_types import int_list  # noqa: E402  (after its folder is on the path)

SCORES, SOFTMAX, PV = 1, 2, 4
CHUNK = decode.CHUNK


@numba.njit
def steps(kind, reps, q_s, kt, k_step, v, rows, d, n, s, m_i, l_t, a_i, pv, acc, hints,
          panel):
    """``reps`` times over ``n`` keys, a chunk at a time, the steps in ``kind``; ``panel``:
    K and V in KVCache's blocks of panels that wide (``k_step`` unused), or 0: K^T in rows
    ``k_step`` apart and V by rows."""
    ahead = decode.AHEAD * CHUNK if hints else 0
    block = decode.KEY_BLOCK
    for _ in range(reps):
        for c0 in range(0, n, CHUNK):
            if kind & SCORES and panel > 0:
                decode.transposed_scores(s, CHUNK, q_s, rows, d, kt, c0 * d, panel, block * d,
                                         d, CHUNK, 0, 0)
            elif kind & SCORES:
                decode.transposed_scores(s, CHUNK, q_s, rows, d, kt, c0, k_step, block, 1,
                                         CHUNK, ahead, CHUNK)
            if kind & SOFTMAX:
                online_softmax(s, 0, CHUNK, CHUNK, rows, rows, m_i, l_t, a_i, l_t, False, False,
                               False)
            if kind & PV and panel > 0:
                for j0 in range(c0, c0 + CHUNK, block):
                    tile_product(pv, 0, d, s, j0 - c0, CHUNK, 1, v, j0 * d, panel, block, rows,
                                 d, block, j0 > c0, False)
                rescale_add(acc, pv, d, rows, a_i, False)
            elif kind & PV:
                if hints:
                    tile_product_ahead(pv, 0, d, s, 0, CHUNK, 1, v, c0 * d, d, 1, rows, d, CHUNK,
                                       ahead * d)
                else:
                    tile_product(pv, 0, d, s, 0, CHUNK, 1, v, c0 * d, d, 1, rows, d, CHUNK,
                                 False, False)
                rescale_add(acc, pv, d, rows, a_i, False)
    return s[0]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--keys", type=int, default=1024)
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--hints", type=lambda t: int_list(t, at_least=0), default=[0, 1])
    p.add_argument("--k-pad", type=lambda t: int_list(t, at_least=0), default=[0, 16, 128])
    p.add_argument("--reps", type=int, default=2000)
    p.add_argument("--panels", action="store_true", help="KVCache's blocks of panels")
    a = p.parse_args(argv)
    if a.keys < CHUNK or a.keys % CHUNK or a.rows < 1 or a.reps < 1:
        p.error(f"--keys: a multiple of {CHUNK}; --rows, --reps at least 1")
    d, n, rows = 64, a.keys, a.rows
    rng = np.random.default_rng(0)
    q_s = (rng.standard_normal(rows * d) * 0.1).astype(np.float32)
    v = rng.standard_normal(n * d).astype(np.float32)
    s = np.zeros(rows * CHUNK, np.float32)
    m_i = np.full(rows, -np.inf, np.float32)
    l_t, a_i = np.zeros(rows, np.float32), np.zeros(rows, np.float32)
    pv, acc = np.zeros(rows * d, np.float32), np.zeros(rows * d, np.float32)
    print(f"ns per key, {rows} rows, {n} keys, D={d}, threads {numba.get_num_threads()}")
    panel = decode.key_panel_width(np.float32) if a.panels else 0  # V's alike at D = 64
    for k_pad in [0] if a.panels else a.k_pad:
        kt = rng.standard_normal(d * (n + k_pad)).astype(np.float32)
        for name, kind in (("scores", SCORES), ("softmax", SOFTMAX), ("P V", PV),
                           ("all", SCORES | SOFTMAX | PV)):
            for hints in [0] if a.panels else a.hints:
                args = (q_s, kt, n + k_pad, v, rows, d, n, s, m_i, l_t, a_i, pv, acc,
                        hints, panel)
                steps(kind, 1, *args)
                best = float("inf")
                for _ in range(5):
                    t = time.perf_counter()
                    steps(kind, a.reps, *args)
                    best = min(best, time.perf_counter() - t)
                layout = (f"panels of {panel}" if panel else
                          f"K^T row pad {k_pad:3d}, hints {'on' if hints else 'off'}")
                print(f"{layout}: {name}: {best / a.reps / n * 1e9:.2f}", flush=True)


if __name__ == "__main__":
    main()
