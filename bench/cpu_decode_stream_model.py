"""A model of a float32 decode step's memory traffic from DRAM, without its softmax: how much
the arithmetic between the loads, and prefetch hints at a given distance, cost a stream that
a streaming read (``_measure.stream_reader``) reads at full speed.

Each of ``--layers`` layers holds K and V of 2 kv heads x ``--nk`` keys x 64 floats, as the
decode benchmark's cache; a layer is one parallel call over 16 tasks (2 heads x 8 splits, the
kernel's ``split_count``), each reading its split of K and of V in turns of 1024 keys (the
kernel's chunks: 256 KiB of K, then 256 KiB of V). Per vector it loads a task does ``--fmas``
vector multiply-adds (4: as the kernel's products for a group of 4 query rows, scores or P V;
1: about what a plain read costs), in 4 independent chains, and with a distance
``d`` > 0 hints each line it reads ``d`` bytes ahead into L2 (``simd.prefetch_line``, as the
kernel's products do ``decode.AHEAD`` chunks ahead). Each round times every distance's best of
``--repeats`` passes over all layers, and the streaming read of as many bytes beside them; GB/s
of K/V read. Measured at stop 54 (Intel Xeon, 19 layers): 4 FMAs a vector without hints
16.8-17.2 GB/s, with hints 2, 32 or 64 KiB ahead 21.3-24.2, against a read of 27.6-28.5; 1 FMA
a vector without hints 26.3 (read 28.3-28.4). Not
collected by pytest.

    python bench/cpu_decode_stream_model.py [--rounds 4] [--fmas 4] [--distances 0,512,2048,8192,32768]
"""
import argparse
import sys
import time
from pathlib import Path

import numba
import numpy as np
from numba import prange

from cpuflash import _measure
from cpuflash._cpu import simd
from cpuflash._cpu.pack import on_line

sys.path.insert(0, str(Path(__file__).resolve().parent))
from arg_types import int_list  # noqa: E402  (after its folder is on the path)

HEADS, D, SPLITS, PHASE = 2, 64, 8, 1024


@numba.njit(inline="always")
def row_fmas(acc, q, b0, b1, b2, b3):
    """One query row's 4 accumulators plus ``q`` times the 4 vectors ``b``."""
    return (simd.vfma(q, b0, acc[0]), simd.vfma(q, b1, acc[1]), simd.vfma(q, b2, acc[2]),
            simd.vfma(q, b3, acc[3]))


@numba.njit(inline="always")
def phase(x, start, n, accs, qs, heavy, dist):
    """Over ``n`` floats of ``x`` from ``start``, a 256-byte row at a time, 4 vectors at a time:
    each vector times query row 0's constant into its own accumulator, and with ``heavy`` times
    rows 1-3's as well (16 independent accumulators, as the kernel's 4-row products); each
    line hinted ``dist`` floats ahead if ``dist`` > 0."""
    r0, r1, r2, r3 = accs
    lanes = simd.lanes_of(x)
    for i in range(start, start + n, D):
        if dist > 0:
            for line in range(0, D, 16):
                simd.prefetch_line(x, i + dist + line)
        for c in range(0, D, 4 * lanes):
            b0, b1 = simd.vload(x, i + c), simd.vload(x, i + c + lanes)
            b2, b3 = simd.vload(x, i + c + 2 * lanes), simd.vload(x, i + c + 3 * lanes)
            r0 = row_fmas(r0, qs[0], b0, b1, b2, b3)
            if heavy:
                r1 = row_fmas(r1, qs[1], b0, b1, b2, b3)
                r2 = row_fmas(r2, qs[2], b0, b1, b2, b3)
                r3 = row_fmas(r3, qs[3], b0, b1, b2, b3)
    return r0, r1, r2, r3


@numba.njit
def task_pass(k, v, head, split, n_k, heavy, dist, like):
    """One task: its split of one head's K and V, in turns of PHASE keys. A function of its
    own, not the parallel loop's body: Numba's array analysis of a parallel loop fails on
    tuples of vectors."""
    split_len = n_k // SPLITS
    qs = (simd.vsplat(like, 0.5), simd.vsplat(like, 0.25), simd.vsplat(like, 0.125),
          simd.vsplat(like, 0.0625))
    zero = simd.vsplat(like, 0.0)
    row = (zero, zero, zero, zero)
    accs = (row, row, row, row)
    for c0 in range(split * split_len, (split + 1) * split_len, PHASE):
        at = (head * n_k + c0) * D
        n = min(PHASE, (split + 1) * split_len - c0) * D
        accs = phase(k, at, n, accs, qs, heavy, dist)
        accs = phase(v, at, n, accs, qs, heavy, dist)
    total = zero
    for r in range(4):
        for j in range(4):
            total = simd.vadd(total, accs[r][j])
    return simd.vhsum(total)


@numba.njit(parallel=True)
def layer_pass(k, v, n_k, heavy, dist, out):
    """One layer: K and V of HEADS heads, each (n_k, D) in one piece, over 16 tasks."""
    for task in prange(HEADS * SPLITS):
        out[task] = task_pass(k, v, task // SPLITS, task % SPLITS, n_k, heavy, dist, out)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--repeats", type=int, default=4, help="best of this many passes a round")
    p.add_argument("--layers", type=int, default=19)
    p.add_argument("--nk", type=int, default=32768)
    p.add_argument("--fmas", type=int, choices=(1, 4), default=4,
                   help="vector multiply-adds per vector loaded")
    p.add_argument("--distances", type=lambda t: int_list(t, at_least=0),
                   default=[0, 512, 2048, 8192, 32768], help="hint distances in bytes (0: none)")
    a = p.parse_args(argv)
    if a.rounds < 1 or a.repeats < 1 or a.layers < 1:
        p.error("--rounds, --repeats and --layers must be at least 1")
    if a.nk < SPLITS * PHASE or a.nk % (SPLITS * PHASE):
        p.error(f"--nk must be a positive multiple of {SPLITS * PHASE}")
    if any(dist % 64 for dist in a.distances):
        p.error("--distances must be multiples of 64 bytes")
    floats = HEADS * a.nk * D
    ks = [on_line((floats,), np.float32) for _ in range(a.layers)]
    vs = [on_line((floats,), np.float32) for _ in range(a.layers)]
    for x in ks + vs:
        x[:] = 1.0
    out = np.zeros(HEADS * SPLITS, np.float32)
    nbytes = 2 * floats * 4 * a.layers
    read, n_read = _measure.stream_reader(nbytes)
    passes = {"read": read}
    for dist in a.distances:
        passes[f"{dist} B" if dist else "no hints"] = (
            lambda dist: lambda: [layer_pass(k, v, a.nk, a.fmas == 4, dist // 4, out)
                                  for k, v in zip(ks, vs)])(dist)
    for run in passes.values():
        run()
    print(f"{a.layers} layers of 2 x {a.nk} keys x 64 floats (K and V), {a.fmas} FMA(s) a vector loaded; "
          f"GB/s a round, by hint distance")
    print("  ".join(f"{name:>8}" for name in passes))
    for _ in range(a.rounds):
        gbs = []
        for name, run in passes.items():
            best = float("inf")
            for _ in range(a.repeats):
                t = time.perf_counter()
                run()
                best = min(best, time.perf_counter() - t)
            gbs.append((n_read if name == "read" else nbytes) / best / 1e9)
        print("  ".join(f"{g:8.1f}" for g in gbs), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
