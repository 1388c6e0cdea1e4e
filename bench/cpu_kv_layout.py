"""Decode steps over K/V in KVCache's layouts, side by side in one process: "panels", its blocks
of KEY_BLOCK keys in panels of the micro-kernel's width (since stop 39: K^T in panels of 16
float32 keys, V in panels of 16 columns on AVX2; on AVX-512 one panel a block, as before);
"one panel", each block's K^T whole and V by rows (stops 37-38); "rows", a transposed K of
whole rows (up to stop 36: K^T rows of ``max_len`` keys, padded to 512 bytes past a multiple
of 4 KiB) and V by rows, through ``cpuflash.attention`` on views. The same keys, values and
int8 scales in each (the same bits out). A model's worth of layers (so that K/V come from
DRAM, or one layer with ``--hot``), then the steps of each and the machine's streaming read of
as many bytes timed round by round (``_measure.time_side_by_side``), so that the machine's
drift hits all alike. Prints ms a step
and GB/s of unique K/V for each layout, a line a round. Not collected by pytest.

    python bench/cpu_kv_layout.py [--dtype float32] [--keys 32768] [--kv-heads 2]
                                  [--rounds 4] [--hot]
"""
import argparse
import contextlib

import numpy as np

import cpuflash
from cpuflash import kvcache
from cpuflash._cpu.decode import KEY_BLOCK
from cpuflash._cpu.pack import on_line
from cpuflash._measure import (COLD_BYTES, decode_cache, make_qkv, step_bytes, stream_reader,
                               time_side_by_side)

ROW_PHASE_BYTES, PAGE = 512, 4096  # the padding of the rows' layout


def rows_of(cache, layer):
    """The layer's keys as K^T of whole rows (B, Hkv, D, row) on a cache line, each row padded
    as KVCache's were, viewed as (B, Hkv, Nk, D)."""
    k, _, _ = cache.view(layer)
    n_b, n_h, n_k, d = k.shape
    row_bytes = n_k * k.itemsize
    pad = (ROW_PHASE_BYTES - row_bytes) % PAGE if row_bytes >= PAGE else 64
    k_t = on_line((n_b, n_h, d, n_k + pad // k.itemsize), k.dtype)
    k_t[..., :n_k] = k.transpose(0, 1, 3, 2)
    return k_t[..., :n_k].transpose(0, 1, 3, 2)


@contextlib.contextmanager
def one_panel_a_block():
    """KVCaches made inside have stops 37-38's layout: a K^T block whole, V by rows."""
    widths = kvcache.key_panel_width, kvcache.value_panel_width
    kvcache.key_panel_width = lambda dtype: KEY_BLOCK
    kvcache.value_panel_width = lambda dtype, dv: dv
    try:
        yield
    finally:
        kvcache.key_panel_width, kvcache.value_panel_width = widths


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="float32", choices=("float32", "float16", "int8"))
    p.add_argument("--keys", type=int, default=32768)
    p.add_argument("--kv-heads", type=int, default=2, choices=(1, 2, 4, 8))
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--hot", action="store_true", help="one layer, again and again")
    a = p.parse_args(argv)
    for name in ("keys", "rounds"):
        if getattr(a, name) < 1:
            p.error(f"--{name} must be at least 1")
    q, k, v = make_qkv(1, 8, a.keys, 64, n_q=1, h_kv=a.kv_heads, seed=0)
    layer_bytes = step_bytes(k.shape, 64, a.dtype)
    layers = 1 if a.hot else -(-COLD_BYTES // layer_bytes)
    cache = decode_cache(k, v, a.dtype, layers)[0]
    with one_panel_a_block():
        whole = decode_cache(k, v, a.dtype, layers)[0]
    rows = [(rows_of(cache, layer), *cache.view(layer)[1:]) for layer in range(layers)]

    def blocks_step(of):
        def step():
            for layer in range(layers):
                of.attention(layer, q)
        return step

    def rows_step():
        for k_rows, v_view, scales in rows:
            cpuflash.attention(q, k_rows, v_view, **scales)

    assert np.array_equal(cache.attention(0, q), cpuflash.attention(q, rows[0][0], rows[0][1],
                                                                    **rows[0][2]))
    assert np.array_equal(cache.attention(0, q), whole.attention(0, q))
    steps = {"panels": blocks_step(cache), "one panel": blocks_step(whole), "rows": rows_step}
    read, n_read = stream_reader(layer_bytes * layers)
    print(f"Hkv={a.kv_heads} Nk={a.keys} {a.dtype}, {layers} layer(s) a step "
          f"({'hot' if a.hot else 'from DRAM'}); ms a layer (GB/s of K/V)")
    for _ in range(a.rounds):
        best = time_side_by_side(dict(steps, stream=read), repeats=15, budget_s=3.0)
        cells = [f"{name} {best[name] / layers * 1e3:.3f} ms "
                 f"({layer_bytes * layers / best[name] / 1e9:.1f})" for name in steps]
        print("  ".join(cells) + f"  stream {n_read / best['stream'] / 1e9:.1f} GB/s",
              flush=True)


if __name__ == "__main__":
    main()
