"""GFLOP/s of the forward pass's tile steps alone, on one thread, hot in the caches: the score
product with its row maxima (``tiles.tile_product_max``: S = Q K^T over packed K panels, in
partial sums), the online softmax of the tile (``tiles.online_softmax``, scores already
maximized), and P V with the rescale (``tiles.tile_product_rescale``: ``acc = alpha * acc + P
V``, in ``MICRO_ROWS``-row micro-tiles), at the shapes of one forward tile (``--rows`` query
rows x ``--keys`` keys, head dim ``--d``), each step called again and again over ``--tiles``
K/V tiles in turn. Beside them an FMA-only loop (12 independent chains of vector multiply-adds):
the core's peak. Best of 5 runs of ``--reps`` calls. Run with ``NUMBA_NUM_THREADS=1`` (and
nothing else on the machine). Not collected by pytest.

    NUMBA_NUM_THREADS=1 python bench/cpu_tile_products.py [--rows 128] [--keys 128] [--d 64]
                                                          [--tiles 4] [--reps 2000]
"""
import argparse
import time

import numba
import numpy as np

from cpuflash import config
from cpuflash._cpu import simd, tiles
from cpuflash._cpu.pack import on_line


@numba.njit(fastmath={"contract"})
def scores(s, ld_s, q_s, kt, rows, keys, d, row_vmax, tile_max, reps, n_tiles):
    for it in range(reps):
        tiles.tile_product_max(s, 0, ld_s, q_s, 0, d, 1, kt, (it % n_tiles) * d * keys, d,
                               rows, keys, d, row_vmax, tile_max, 0, False)


@numba.njit(fastmath={"contract"})
def softmax(s, ld_s, rows, keys, m_i, l_t, alpha_i, tile_max, reps, n_tiles):
    for _ in range(reps):
        for r in range(rows):
            m_i[r] = tile_max[r]  # the same shift each time: no rescale, no growth
        tiles.online_softmax(s, 0, ld_s, keys, rows, rows, m_i, l_t, alpha_i, tile_max, True,
                             True, False)


@numba.njit(fastmath={"contract"})
def values(acc, s, ld_s, vt, rows, keys, dv, alpha_i, reps, n_tiles):
    no_scratch = np.empty(0, dtype=acc.dtype)
    for it in range(reps):
        tiles.tile_product_rescale(acc, 0, dv, s, 0, ld_s, 1, vt, (it % n_tiles) * keys * dv, 0,
                                   keys, rows, dv, keys, alpha_i, 0, alpha_i, 0, no_scratch,
                                   False)


@numba.njit(fastmath={"contract"})
def fma_peak(x, reps):
    """12 independent chains of vector FMAs: ``reps`` steps of 12 each."""
    w = simd.lanes_of(x)
    a0, a1, a2, a3 = (simd.vload(x, 0), simd.vload(x, w), simd.vload(x, 2 * w),
                      simd.vload(x, 3 * w))
    a4, a5, a6, a7 = (simd.vload(x, 4 * w), simd.vload(x, 5 * w), simd.vload(x, 6 * w),
                      simd.vload(x, 7 * w))
    a8, a9, a10, a11 = (simd.vload(x, 8 * w), simd.vload(x, 9 * w), simd.vload(x, 10 * w),
                        simd.vload(x, 11 * w))
    b, c = simd.vload(x, 12 * w), simd.vload(x, 13 * w)
    for _ in range(reps):
        a0, a1, a2, a3 = simd.vfma(a0, b, c), simd.vfma(a1, b, c), simd.vfma(a2, b, c), \
            simd.vfma(a3, b, c)
        a4, a5, a6, a7 = simd.vfma(a4, b, c), simd.vfma(a5, b, c), simd.vfma(a6, b, c), \
            simd.vfma(a7, b, c)
        a8, a9, a10, a11 = simd.vfma(a8, b, c), simd.vfma(a9, b, c), simd.vfma(a10, b, c), \
            simd.vfma(a11, b, c)
    total = simd.vadd(simd.vadd(simd.vadd(a0, a1), simd.vadd(a2, a3)),
                      simd.vadd(simd.vadd(a4, a5), simd.vadd(a6, a7)))
    simd.vstore(x, 0, simd.vadd(total, simd.vadd(simd.vadd(a8, a9), simd.vadd(a10, a11))))


def best_seconds(fn, *args, runs=5):
    fn(*args)  # compile, warm the caches
    best = float("inf")
    for _ in range(runs):
        t0 = time.perf_counter()
        fn(*args)
        best = min(best, time.perf_counter() - t0)
    return best


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=128, help="query rows of the tile")
    p.add_argument("--keys", type=int, default=128, help="keys of the tile")
    p.add_argument("--d", type=int, default=64, help="head dim (and value head dim)")
    p.add_argument("--tiles", type=int, default=4, help="K/V tiles called in turn")
    p.add_argument("--reps", type=int, default=2000, help="calls per run")
    a = p.parse_args(argv)
    for name in ("rows", "keys", "d", "tiles", "reps"):
        if getattr(a, name) < 1:
            p.error(f"--{name} must be at least 1, got {getattr(a, name)}")
    panel = config.panel_width(np.dtype(np.float32))
    if a.keys % panel:
        p.error(f"--keys must be a multiple of the panel width {panel}, got {a.keys}")
    if a.d % config.LANES_F32:
        p.error(f"--d must be a multiple of {config.LANES_F32} (whole vectors), got {a.d}")
    return a


def main(argv=None):
    a = parse(argv)
    rows, keys, d = a.rows, a.keys, a.d
    lanes = config.LANES_F32
    ld_s = keys + lanes  # as the forward kernel's score rows
    rng = np.random.default_rng(0)

    def filled(n, scale=1.0):
        x = on_line((n,), np.float32)
        x[:] = rng.standard_normal(n) * scale
        return x

    q_s, kt, vt = filled(rows * d, 0.1), filled(a.tiles * d * keys), filled(a.tiles * keys * d)
    s, acc = filled(rows * ld_s), filled(rows * d)
    row_vmax = on_line((rows * lanes,), np.float32)
    tile_max = np.zeros(rows, np.float32)
    m_i, l_t = np.zeros(rows, np.float32), np.zeros(rows, np.float32)
    alpha_i = np.ones(rows, np.float32)
    product_flops = 2.0 * rows * keys * d * a.reps
    print(f"one thread (NUMBA_NUM_THREADS={numba.config.NUMBA_NUM_THREADS}), {rows} rows x "
          f"{keys} keys, D={d}, {a.tiles} tiles, micro-tiles {config.MICRO_ROWS} rows x "
          f"{config.MICRO_VECS * lanes} columns")
    t = best_seconds(scores, s, ld_s, q_s, kt, rows, keys, d, row_vmax, tile_max, a.reps,
                     a.tiles)
    print(f"S = Q K^T, row maxima: {t / a.reps * 1e6:8.2f} us a tile {product_flops / t / 1e9:7.1f}"
          " GFLOP/s")
    s[:] = rng.standard_normal(s.size).astype(np.float32)
    for r in range(rows):
        tile_max[r] = s[r * ld_s:r * ld_s + keys].max()
    t = best_seconds(softmax, s, ld_s, rows, keys, m_i, l_t, alpha_i, tile_max, a.reps, a.tiles)
    print(f"online softmax:        {t / a.reps * 1e6:8.2f} us a tile "
          f"{rows * keys * a.reps / t / 1e9:7.2f} G scores/s")
    t = best_seconds(values, acc, s, ld_s, vt, rows, keys, d, alpha_i, a.reps, a.tiles)
    print(f"acc = alpha acc + P V: {t / a.reps * 1e6:8.2f} us a tile {product_flops / t / 1e9:7.1f}"
          " GFLOP/s")
    x = np.full(16 * lanes, 0.999, np.float32)
    steps = 10 ** 7
    t = best_seconds(fma_peak, x, steps, runs=3)
    print(f"FMA-only loop:                           {12 * lanes * 2 * steps / t / 1e9:7.1f} "
          "GFLOP/s")


if __name__ == "__main__":
    main()
