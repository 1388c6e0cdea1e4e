"""KVCache and the float16/int8 K/V caches: decode through the cache against the reference on
the dequantized cache, and against the last rows of a full forward pass; append, overflow and
bad input."""
import json
import re
import subprocess
import sys

import numpy as np
import pytest

import cpuflash
from cpuflash import reference
from cpuflash._cpu import bfloat16, decode
from conftest import on_threads, rand

D = 32


def dequantized(cache, layer):
    k, v, scales = cache.view(layer)
    if scales:
        return k * scales["k_scale"][..., None], v * scales["v_scale"][..., None]
    return k.astype(np.float64), v.astype(np.float64)


@pytest.mark.parametrize("dtype", [np.float32, np.float16, "bfloat16", np.int8])
@pytest.mark.parametrize("h_kv", [4, 2, 1])
@pytest.mark.parametrize("n_splits", [1, 5])
def test_decode_from_cache_against_reference(dtype, h_kv, n_splits, monkeypatch):
    """Every cache dtype, GQA ratio and split count: 1 split, or 5 (splits are whole chunks:
    at 300 keys, two full, a ragged third and two empty ones)."""
    monkeypatch.setattr(decode, "split_count", lambda n_b, n_hkv, n_k: n_splits)
    n_k = 300
    cache = cpuflash.KVCache(2, 2, h_kv, 512, D, dtype=dtype)
    k, v = rand((2, h_kv, n_k, D), seed=2), rand((2, h_kv, n_k, D), seed=3)
    cache.append(1, k[:, :, :n_k - 3], v[:, :, :n_k - 3])
    cache.append(1, k[:, :, n_k - 3:], v[:, :, n_k - 3:])  # 3 new tokens after a prefill
    q = rand((2, 4, 3, D), seed=1)
    out, lse = cache.attention(1, q, causal=True, return_lse=True)
    kd, vd = dequantized(cache, 1)
    ref, ref_lse = reference.attention(q, kd, vd, causal=True, return_lse=True)
    np.testing.assert_allclose(out, ref, rtol=0, atol=2e-6)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [np.float32, np.float16, "bfloat16"])
@pytest.mark.parametrize("d", [64, 20])
def test_decode_over_several_splits(dtype, d):
    """A transposed K read a chunk at a time over splits of many chunks and a ragged last one
    (3 splits of 2944 keys, the last 2604), the hints running past each split's end, D=20 with
    a tail of 4 dims past the last whole vector, bottom-right causal rows, a window whose band
    starts off a chunk and a kv_len short of the array: against the reference on the cache's
    keys."""
    n_k = 2 * 4096 + 300
    assert decode.split_count(1, 8, n_k) == 3
    n_q = 8
    cache = cpuflash.KVCache(1, 1, 8, n_k + 40, d, dtype=dtype)
    cache.append(0, rand((1, 8, n_k, d), seed=2), rand((1, 8, n_k, d), seed=3))
    q = rand((1, 8, n_q, d), seed=1)
    kd, vd = dequantized(cache, 0)
    for opts in ({"causal": True}, {"window": (3000, 0)},
                 {"kv_lens": np.array([n_k - 1111]), "causal": True}):
        out, lse = cache.attention(0, q, return_lse=True, **opts)
        ref, ref_lse = reference.attention(q, kd, vd, return_lse=True, **opts)
        np.testing.assert_allclose(out, ref, rtol=0, atol=2e-6)
        np.testing.assert_allclose(lse, ref_lse, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [np.float16, "bfloat16", np.int8])
def test_cache_with_kv_lens_and_options(dtype):
    """kv_lens (a ragged batch in one cache), ALiBi and softcap read the same dequantized keys."""
    cache = cpuflash.KVCache(1, 2, 2, 256, D, dtype=dtype)
    cache.append(0, rand((2, 2, 200, D), seed=2), rand((2, 2, 200, D), seed=3))
    q = rand((2, 4, 1, D), seed=1)
    opts = {"kv_lens": np.array([200, 57]), "alibi_slopes": np.array([0.1, 0.2, 0.3, 0.4]),
            "softcap": 5.0}
    kd, vd = dequantized(cache, 0)
    np.testing.assert_allclose(cache.attention(0, q, **opts),
                               reference.attention(q, kd, vd, **opts), rtol=0, atol=2e-6)


@pytest.mark.parametrize("dtype", [np.float32, np.float16, "bfloat16", np.int8])
def test_decode_equals_last_rows_of_full_forward(dtype):
    """Token by token through the cache = the matching rows of one causal forward pass over
    the same (dequantized) keys and values."""
    n = 40
    q, k, v = rand((1, 4, n, D), seed=1), rand((1, 2, n, D), seed=2), rand((1, 2, n, D), seed=3)
    cache = cpuflash.KVCache(1, 1, 2, n, D, dtype=dtype)
    steps = []
    for t in range(n):
        cache.append(0, k[:, :, t:t + 1], v[:, :, t:t + 1])
        steps.append(cache.attention(0, q[:, :, t:t + 1], causal=True))
    kd, vd = dequantized(cache, 0)
    full = cpuflash.attention(q, kd.astype(np.float32), vd.astype(np.float32), causal=True)
    np.testing.assert_allclose(np.concatenate(steps, axis=2), full, rtol=0, atol=2e-6)


@pytest.mark.parametrize("dtype,bound", [(np.float16, 2e-3), ("bfloat16", 1.6e-2),
                                         (np.int8, 3e-2)])
def test_cache_accuracy_vs_float32(dtype, bound):
    """The storage error: output against float32 attention on the original keys and values
    (the README's accuracy table comes from bench/test_decode.py on bigger shapes)."""
    q, k, v = rand((1, 4, 1, 64), seed=1), rand((1, 2, 2000, 64), seed=2), rand((1, 2, 2000, 64),
                                                                               seed=3)
    cache = cpuflash.KVCache(1, 1, 2, 2000, 64, dtype=dtype)
    cache.append(0, k, v)
    err = np.abs(cache.attention(0, q) - reference.attention(q, k, v)).max()
    assert 0 < err < bound


def test_quantize_int8_round_trip():
    x = rand((3, 5, 64), seed=4, scale=3.0)
    x8, scale = cpuflash.quantize_int8(x)
    assert x8.dtype == np.int8 and scale.dtype == np.float32 and scale.shape == (3, 5)
    assert np.all(np.abs(x8 * scale[..., None] - x) <= scale[..., None] / 2 * (1 + 1e-6))
    assert np.all(np.abs(x8).max(axis=-1) == 127)
    z8, z_scale = cpuflash.quantize_int8(np.zeros((2, 8), np.float32))
    assert np.all(z8 == 0) and np.all(z_scale == 0)
    with pytest.raises(ValueError, match="finite"):
        cpuflash.quantize_int8(np.array([[1.0, np.nan]], np.float32))


def _quantized_by_definition(x):
    """int8 quantization as numpy expressions, in float32: the definition ``quantize_int8``'s
    one-pass kernel (``_cpu/quantize.py``) must match bit for bit."""
    x32 = np.asarray(x).astype(np.float32)
    amax = np.max(np.abs(x32), axis=-1) if x32.shape[-1] else np.zeros(x32.shape[:-1], np.float32)
    scale = (amax / np.float32(127.0)).astype(np.float32)
    safe = np.where(scale > 0, scale, np.float32(1.0))
    return np.clip(np.rint(x32 / safe[..., None]), -127, 127).astype(np.int8), scale


@pytest.mark.parametrize("seed", range(6))
def test_quantize_int8_matches_its_definition_bitwise(seed):
    """Random shapes (empty axes too), dtypes, magnitudes, strides, rows of zeros and values on
    the rounding ties (ties go to even): the same int8 values and float32 scales as the numpy
    definition; NaN and Inf anywhere raise."""
    ties = np.array([[127.0, 0.5, 1.5, 2.5, -0.5, -2.5, 126.5]], np.float32)  # scale 1
    np.testing.assert_array_equal(cpuflash.quantize_int8(ties)[0], [[127, 0, 2, 2, 0, -2, 126]])
    rng = np.random.default_rng(seed)
    for case in range(40):
        shape = tuple(int(n) for n in rng.integers(0, 6, size=int(rng.integers(1, 5))))
        dtype = (np.float16, np.float32, np.float64)[case % 3]
        with np.errstate(over="ignore"):
            x = (rng.standard_normal(shape) * 10.0 ** rng.uniform(-3, 3)).astype(dtype)
        if case % 4 == 0:  # halves of a step of a row whose max is 127.0: ties
            x = (np.round(rng.standard_normal(shape) * 254) / 2).astype(dtype)
        if case % 5 == 0 and x.ndim > 1:
            x = x.swapaxes(0, -1)
        if case % 7 == 0 and x.size:
            x[..., :1] = 0.0
            x[(0,) * (x.ndim - 1)] = 0.0  # one whole row of zeros
        x8, scale = cpuflash.quantize_int8(x)
        want8, want_scale = _quantized_by_definition(x)
        assert x8.dtype == np.int8 and scale.dtype == np.float32
        np.testing.assert_array_equal(x8, want8)
        np.testing.assert_array_equal(scale.view(np.uint32), want_scale.view(np.uint32))
        if x.size and x.shape[-1]:
            bad = x.astype(np.float32)
            bad.flat[int(rng.integers(bad.size))] = (np.nan, np.inf, -np.inf)[case % 3]
            with pytest.raises(ValueError, match="finite"):
                cpuflash.quantize_int8(bad)


def test_append_is_in_place_and_view_gives_the_keys():
    """Appends write the storage in place; ``view`` gives K as an array (a copy out of the
    blocks), V as a view where its blocks hold whole rows (else a copy), the scales as views of
    the storage."""
    cache = cpuflash.KVCache(2, 1, 2, 16, D)
    k_store = cache.k_blocks
    cache.append(0, rand((1, 2, 5, D), seed=1), rand((1, 2, 5, D), seed=2))
    cache.append(0, rand((1, 2, 3, D), seed=3), rand((1, 2, 3, D), seed=4))
    assert cache.k_blocks is k_store and list(cache.lengths) == [8, 0]
    k, v, scales = cache.view(0)
    assert k.shape == (1, 2, 8, D) and not np.shares_memory(k, cache.k_blocks)
    whole_rows = cache.v_blocks.shape[4] == 1
    assert np.shares_memory(v, cache.v_blocks) == whole_rows and scales == {}
    np.testing.assert_array_equal(k[:, :, 5:], rand((1, 2, 3, D), seed=3))
    np.testing.assert_array_equal(v[:, :, :5], rand((1, 2, 5, D), seed=2))
    cache.reset()
    assert list(cache.lengths) == [0, 0]


@pytest.mark.parametrize("dtype", [np.float32, np.float16, "bfloat16", np.int8])
@pytest.mark.parametrize("dv", [D, 128])
def test_appending_no_tokens_changes_nothing(dtype, dv):
    """An append of zero tokens (an empty prompt, a chunk with nothing left) is a no-op, as
    numpy's empty slices are, on an empty layer and on a filled one; V by rows or in panels
    (on AVX-512, 32 columns are stored by rows and 128 in two 64-wide panels)."""
    cache = cpuflash.KVCache(1, 1, 2, 70, D, v_head_dim=dv, dtype=dtype)
    empty_k, empty_v = np.empty((1, 2, 0, D), np.float32), np.empty((1, 2, 0, dv), np.float32)
    cache.append(0, empty_k, empty_v)
    assert cache.lengths[0] == 0 and not cache.k_blocks.any() and not cache.v_blocks.any()
    cache.append(0, rand((1, 2, 65, D), seed=1), rand((1, 2, 65, dv), seed=2))
    k_before, v_before = cache.k_blocks.copy(), cache.v_blocks.copy()
    cache.append(0, empty_k, empty_v)
    assert cache.lengths[0] == 65
    assert np.array_equal(cache.k_blocks, k_before) and np.array_equal(cache.v_blocks, v_before)


def test_storage_starts_on_a_cache_line():
    """K/V rows are whole AVX-512 vectors that never straddle two cache lines."""
    for dtype in (np.float32, np.float16, "bfloat16", np.int8):
        cache = cpuflash.KVCache(2, 1, 2, 1000, D, dtype=dtype)
        for x in (cache.k_blocks, cache.v_blocks):
            assert x.ctypes.data % 64 == 0 and x.flags.c_contiguous and not x.any()


@pytest.mark.parametrize("dtype", [np.float32, np.float16, "bfloat16", np.int8])
def test_keys_in_blocks_across_block_edges(dtype):
    """Appends of 1, 63, 130 and 300 keys (crossing the edges of blocks of KEY_BLOCK keys, one
    append spanning five blocks) store each key in its block, K transposed in panels of w keys
    and V in panels of u columns: ``view`` gives them back, and the storage holds key j, dim c
    of K at [j // KEY_BLOCK, j % KEY_BLOCK // w, c, j % w] and of V at [j // KEY_BLOCK, c // u,
    j % KEY_BLOCK, c % u]."""
    n_k, block, dv = 494, decode.KEY_BLOCK, 48
    k, v = rand((1, 2, n_k, D), seed=11), rand((1, 2, n_k, dv), seed=12)
    cache = cpuflash.KVCache(1, 1, 2, 600, D, v_head_dim=dv, dtype=dtype)
    start = 0
    for n in (1, 63, 130, 300):
        cache.append(0, k[:, :, start:start + n], v[:, :, start:start + n])
        start += n
    w, u = decode.key_panel_width(np.float32), decode.value_panel_width(np.float32, dv)
    assert cache.k_blocks.shape == (1, 1, 2, -(-600 // block), block // w, D, w)
    assert cache.v_blocks.shape == (1, 1, 2, -(-600 // block), dv // u, block, u)
    stored_k, stored_v, scales = cache.view(0)
    if dtype == np.int8:
        (want_k, k_scale), (want_v, v_scale) = cpuflash.quantize_int8(k), cpuflash.quantize_int8(v)
        np.testing.assert_array_equal(scales["k_scale"], k_scale)
        np.testing.assert_array_equal(scales["v_scale"], v_scale)
    elif dtype == "bfloat16":  # the nearest bfloat16s, stored as their bits
        want_k, want_v = (bfloat16.from_float32(x) for x in (k, v))
        stored_k, stored_v = (bfloat16.from_float32(x) for x in (stored_k, stored_v))
    else:
        want_k, want_v = k.astype(dtype), v.astype(dtype)
    np.testing.assert_array_equal(stored_k, want_k)
    np.testing.assert_array_equal(stored_v, want_v)
    for j in (0, 15, 16, 63, 64, 193, 493):
        np.testing.assert_array_equal(
            cache.k_blocks[0, :, :, j // block, j % block // w, :, j % w], want_k[:, :, j])
        for c in (0, u - 1, dv - 1):
            np.testing.assert_array_equal(
                cache.v_blocks[0, :, :, j // block, c // u, j % block, c % u], want_v[:, :, j, c])
    last = cache.k_blocks[0, :, :, n_k // block].transpose(0, 1, 2, 4, 3).reshape(1, 2, block, D)
    assert not last[:, :, n_k % block:].any()  # past the last key
    assert not cache.v_blocks[0, :, :, n_k // block, :, n_k % block:].any()


@pytest.mark.parametrize("layout", ["panels", "one panel"])
@pytest.mark.parametrize("dtype", [np.float32, np.float16, "bfloat16", np.int8, np.float64])
def test_block_layouts_against_reference(layout, dtype, monkeypatch):
    """K and V in blocks of panels of the micro-kernel's width (this host's layout), or in one
    panel a block (a K^T block whole, V by rows: AVX-512's layout at D = Dv = 64), whichever
    this host is: decode through the cache with the options that move where the products
    start and stop (a window starting inside a block, a short ``kv_lens``, causal rows,
    softcap, ALiBi) against the reference on the dequantized cache. Dv = 48 takes three
    panels of 16 float32 on AVX2 (six of 8 float64); D = 20 has a tail of keys past the last
    whole vector."""
    if layout == "one panel":
        monkeypatch.setattr(cpuflash.kvcache, "key_panel_width", lambda dt: decode.KEY_BLOCK)
        monkeypatch.setattr(cpuflash.kvcache, "value_panel_width", lambda dt, dv: dv)
    n_k, d, dv = 1500, 20, 48
    cache = cpuflash.KVCache(1, 2, 2, n_k + 13, d, v_head_dim=dv, dtype=dtype)
    compute = np.float64 if dtype == np.float64 else np.float32
    k, v = (rand((2, 2, n_k, width), seed=seed).astype(compute)
            for width, seed in ((d, 21), (dv, 22)))
    for lo, hi in ((0, 700), (700, 701), (701, n_k)):
        cache.append(0, k[:, :, lo:hi], v[:, :, lo:hi])
    assert (cache.v_blocks.shape[4] == 1) == (layout == "one panel"
                                              or dv % cpuflash.config.panel_width(
                                                  np.dtype(compute)) != 0)
    q = rand((2, 4, 3, d), seed=23).astype(compute)
    kd, vd = dequantized(cache, 0)
    for opts in ({"causal": True}, {"window": (1000, 0), "kv_lens": np.array([1433, n_k])},
                 {"softcap": 5.0, "alibi_slopes": np.array([0.5, 0.25, 0.125, 0.0625])}):
        out = cache.attention(0, q, **opts)
        want = reference.attention(q.astype(np.float64), kd, vd, **opts)
        np.testing.assert_allclose(out, want, atol=1e-13 if compute == np.float64 else 3e-6,
                                   rtol=0, err_msg=str(opts))


def test_blocks_of_another_hosts_panels_are_copied_out(monkeypatch):
    """A cache whose panels this host's micro-kernel does not read (made under another
    ``CPUFLASH_SIMD`` or on another machine: here 32 wide, neither a whole block nor this
    host's width) takes the tiled path on K and V copied out of the blocks, not a wrong read:
    as the reference."""
    monkeypatch.setattr(cpuflash.kvcache, "key_panel_width", lambda dt: 32)
    monkeypatch.setattr(cpuflash.kvcache, "value_panel_width", lambda dt, dv: 32)
    n_k, d = 300, 64
    cache = cpuflash.KVCache(1, 1, 2, n_k, d)
    k, v = rand((1, 2, n_k, d), seed=31), rand((1, 2, n_k, d), seed=32)
    cache.append(0, k, v)
    assert cache.k_blocks.shape[-1] == 32 and cache.v_blocks.shape[-1] == 32
    q = rand((1, 4, 2, d), seed=33)
    for opts in ({}, {"causal": True, "return_lse": True}):
        got = cache.attention(0, q, **opts)
        want = reference.attention(q, k, v, **opts)
        for g, w in zip(*((got, want) if opts else ((got,), (want,)))):
            np.testing.assert_allclose(g, w, atol=2e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_blocks_read_as_a_transposed_k(dtype):
    """The decode kernel reads the blocks as a chunk of K^T each: the same bits as the same
    keys passed as a transposed K, over splits and a ragged last chunk (the same tile
    products in the same order)."""
    n_k = 4096 + 300
    cache = cpuflash.KVCache(1, 1, 2, n_k, D, dtype=dtype)
    cache.append(0, rand((1, 2, n_k, D), seed=13), rand((1, 2, n_k, D), seed=14))
    k, v, _ = cache.view(0)
    k_t = np.ascontiguousarray(k.transpose(0, 1, 3, 2)).transpose(0, 1, 3, 2)
    q = rand((1, 8, 2, D), seed=15)
    for opts in ({}, {"causal": True}, {"window": (1000, 0)}):
        np.testing.assert_array_equal(cache.attention(0, q, **opts),
                                      cpuflash.attention(q, k_t, v, **opts))


@pytest.mark.parametrize("dtype", [np.float32, np.int8])
def test_many_queries_take_the_tiled_path_from_the_blocks(dtype):
    """More than MAX_NQ queries (a prefill through the cache) take the tiled path on K copied
    out of the blocks: as the reference on the dequantized cache."""
    n_k = 300
    cache = cpuflash.KVCache(1, 1, 2, 400, D, dtype=dtype)
    cache.append(0, rand((1, 2, n_k, D), seed=8), rand((1, 2, n_k, D), seed=9))
    q = rand((1, 4, decode.MAX_NQ + 5, D), seed=10)
    out = cache.attention(0, q, causal=True)
    kd, vd = dequantized(cache, 0)
    want = reference.attention(q.astype(np.float64), kd, vd, causal=True)
    np.testing.assert_allclose(out, want, atol=2e-6, rtol=0)


def test_int8_cache_scales_are_not_options():
    cache = cpuflash.KVCache(1, 1, 1, 8, D, dtype=np.int8)
    cache.append(0, rand((1, 1, 2, D)), rand((1, 1, 2, D)))
    with pytest.raises(TypeError, match="k_scale: the cache's own"):
        cache.attention(0, rand((1, 1, 1, D)), k_scale=np.ones((1, 1, 2), np.float32))


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.int8])
def test_prefetch_hints_change_no_bit(dtype, monkeypatch):
    """The tile products hint K and V ahead into L2: the same bits without. (A cache for each:
    a cache's step plan keeps the hints of its first step.)"""
    n_k = 5 * decode.CHUNK + 7  # the hints run past the last chunk and the array's end
    k, v = rand((1, 2, n_k, D), seed=5), rand((1, 2, n_k, D), seed=6)
    q = rand((1, 8, 1, D), seed=7)
    outs = []
    for prefetch in (True, False):
        monkeypatch.setattr(decode, "PREFETCH", prefetch)
        cache = cpuflash.KVCache(1, 1, 2, n_k, D, dtype=dtype)
        cache.append(0, k, v)
        outs.append(cache.attention(0, q))
    np.testing.assert_array_equal(outs[1], outs[0])


def test_empty_layer_gives_zeros():
    cache = cpuflash.KVCache(1, 1, 1, 8, D)
    out = cache.attention(0, rand((1, 1, 1, D)))
    assert np.all(out == 0)


def test_overflow_is_an_error_and_writes_nothing():
    cache = cpuflash.KVCache(1, 1, 1, 10, D)
    cache.append(0, rand((1, 1, 8, D)), rand((1, 1, 8, D)))
    with pytest.raises(ValueError, match="overflow.*holds 8 of max_len 10.*appending 3"):
        cache.append(0, rand((1, 1, 3, D)), rand((1, 1, 3, D)))
    assert cache.lengths[0] == 8


@pytest.mark.parametrize("x,exc,words", [
    (np.arange(8, dtype=np.int32), TypeError, "x: expected a float array"),
    (np.float32(1.0), ValueError, "x: expected at least one axis"),
    (np.array([[1.0, np.inf]]), ValueError, "x: int8 quantization needs finite"),
])
def test_quantize_int8_bad_input(x, exc, words):
    with pytest.raises(exc, match=words):
        cpuflash.quantize_int8(x)


def test_int8_append_of_nan_names_the_argument_and_writes_nothing():
    cache = cpuflash.KVCache(1, 1, 1, 8, D, dtype=np.int8)
    v = rand((1, 1, 2, D))
    v[0, 0, 1, 3] = np.nan
    with pytest.raises(ValueError, match="v: int8 quantization needs finite"):
        cache.append(0, rand((1, 1, 2, D)), v)
    assert cache.lengths[0] == 0 and not cache.k_blocks.any()


@pytest.mark.parametrize("kwargs,exc,words", [
    ({"layers": 0}, ValueError, "layers"),
    ({"batch": -1}, ValueError, "batch"),
    ({"kv_heads": True}, TypeError, "kv_heads"),
    ({"head_dim": 0}, ValueError, "head_dim"),
    ({"v_head_dim": 0}, ValueError, "v_head_dim"),
    ({"max_len": 2.5}, TypeError, "max_len"),
    ({"dtype": np.int32}, TypeError, "dtype"),
    ({"dtype": "bogus"}, TypeError, "dtype"),
    ({"dtype": "bf16"}, TypeError, "dtype: expected one of .*'bfloat16'"),
])
def test_bad_construction(kwargs, exc, words):
    args = {"layers": 1, "batch": 1, "kv_heads": 1, "max_len": 4, "head_dim": D, **kwargs}
    with pytest.raises(exc, match=words):
        cpuflash.KVCache(**args)


@pytest.mark.parametrize("layer,k_shape,v_shape,exc,words", [
    (2, (1, 1, 1, D), (1, 1, 1, D), ValueError, "layer: expected 0..1"),
    ("0", (1, 1, 1, D), (1, 1, 1, D), TypeError, "layer"),
    (0, (1, 2, 1, D), (1, 1, 1, D), ValueError, "k: expected shape"),
    (0, (1, 1, 1, D), (1, 1, 1, 7), ValueError, "v: expected shape"),
    (0, (1, 1, 2, D), (1, 1, 1, D), ValueError, "same number of new tokens"),
])
def test_bad_append(layer, k_shape, v_shape, exc, words):
    cache = cpuflash.KVCache(2, 1, 1, 4, D)
    with pytest.raises(exc, match=words):
        cache.append(layer, rand(k_shape), rand(v_shape))


@pytest.mark.parametrize("q_dtype,kv_dtype,scales,exc,words", [
    (np.float32, np.int8, None, TypeError, "k_scale: required"),
    (np.float64, np.int8, "ok", TypeError, "q: expected float32 or float16"),
    (np.float32, np.float32, "ok", TypeError, "only for int8"),
    (np.float16, np.float32, None, TypeError, "expected one dtype"),
    # int16 stands for bfloat16 bits inside the package (KVCache's storage) only
    (np.float32, np.int16, None, TypeError, "k: expected dtype float16, float32, float64 or int8"),
    (np.float32, np.int8, "bad-shape", ValueError, "k_scale: expected shape"),
    (np.float32, np.int8, "bad-dtype", TypeError, "k_scale: expected dtype float32"),
])
def test_bad_cache_formats(q_dtype, kv_dtype, scales, exc, words):
    q = rand((1, 2, 1, D), q_dtype)
    k = rand((1, 1, 6, D)).astype(kv_dtype)
    v = rand((1, 1, 6, D)).astype(kv_dtype)
    kwargs = {}
    if scales == "ok":
        kwargs = {"k_scale": np.ones((1, 1, 6), np.float32), "v_scale": np.ones((1, 1, 6),
                                                                                np.float32)}
    elif scales == "bad-shape":
        kwargs = {"k_scale": np.ones((1, 6), np.float32), "v_scale": np.ones((1, 1, 6),
                                                                            np.float32)}
    elif scales == "bad-dtype":
        kwargs = {"k_scale": np.ones((1, 1, 6)), "v_scale": np.ones((1, 1, 6), np.float32)}
    with pytest.raises(exc, match=words):
        cpuflash.attention(q, k, v, **kwargs)


def test_backward_refuses_a_cache_format():
    q = rand((1, 2, 1, D))
    k = rand((1, 1, 6, D)).astype(np.float16)
    out, lse = cpuflash.attention(q, k, k, return_lse=True)
    with pytest.raises(TypeError, match="one dtype"):
        cpuflash.attention_backward(out, q, k, k, out, lse)


_STEP_MEMORY = r"""
import json, sys
import numpy as np
import cpuflash
n_k = int(sys.argv[1])
cache = cpuflash.KVCache(1, 1, 2, n_k, 64, dtype=np.float16)
rng = np.random.default_rng(0)
for start in range(0, n_k, 4096):  # filled in pieces: no float32 copy of the whole cache
    n = min(4096, n_k - start)
    cache.append(0, rng.standard_normal((1, 2, n, 64), dtype=np.float32),
                 rng.standard_normal((1, 2, n, 64), dtype=np.float32))
q = rng.standard_normal((1, 8, 1, 64), dtype=np.float32)
out = np.empty((1, 8, 1, 64), np.float32)
cache.attention(0, q, out=out)  # compile/load, thread pool up
def rss(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
before = rss("VmRSS")
cache.attention(0, q, out=out)
print(json.dumps((rss("VmHWM") - before) * 1024))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_decode_step_allocates_nothing_that_grows_with_the_cache():
    """Peak RSS growth of one step at Nk = 16384 and 262144 (16x): the same few pages."""
    growth = []
    for n_k in (16384, 262144):
        proc = subprocess.run([sys.executable, "-c", _STEP_MEMORY, str(n_k)],
                              capture_output=True, text=True, timeout=300, check=False)
        assert proc.returncode == 0, proc.stderr[-2000:]
        growth.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    assert growth[1] <= growth[0] + (256 << 10) and growth[1] < (1 << 20), growth


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.int8])
@pytest.mark.parametrize("causal", [False, True])
def test_cache_attention_takes_the_plain_decode_path(dtype, causal, monkeypatch):
    """``cache.attention`` with no option but causal and scale goes straight to the decode path
    (the general path never runs; an int8 cache's own scales included) and gives the general
    path's bits."""
    from cpuflash import api
    cache = cpuflash.KVCache(1, 2, 2, 400, D, dtype=dtype)
    cache.append(0, rand((2, 2, 300, D), seed=5), rand((2, 2, 300, D), seed=6))
    q = rand((2, 4, 3, D), seed=4)
    general, _ = cache.attention(0, q, causal=causal, scale=0.3, return_lse=True)

    def no_general_path(*args, **kwargs):
        raise AssertionError("cache.attention took the general path")

    monkeypatch.setattr(api, "run_forward", no_general_path)
    np.testing.assert_array_equal(cache.attention(0, q, causal=causal, scale=0.3), general)


@pytest.mark.parametrize("q_shape, q_dtype, options, error, message", [
    ((1, 2, 1, D), np.float16, {}, TypeError, "q, k, v: expected one dtype"),
    ((2, 1, D), np.float32, {}, ValueError, "q, k, v: expected the same rank"),
    ((1, 3, 1, D), np.float32, {}, ValueError, "k: query heads"),
    ((1, 2, 1, 16), np.float32, {}, ValueError, "k: expected head dim"),
    ((1, 2, 1, D), np.float32, {"scale": 0.0}, ValueError, "scale:"),
    ((1, 2, 1, D), np.float32, {"causal": 1}, TypeError, "causal:"),
    ((1, 2, 1, D), np.float32, {"window": (-2, 0)}, ValueError, "window"),
])
def test_cache_attention_bad_input_names_the_argument(q_shape, q_dtype, options, error,
                                                      message):
    """Through the cache, bad queries and options meet ``attention``'s checks (K's stand-in
    has the cache's shape and dtype)."""
    cache = cpuflash.KVCache(1, 1, 2, 8, D)
    cache.append(0, rand((1, 2, 5, D), seed=1), rand((1, 2, 5, D), seed=2))
    with pytest.raises(error, match=re.escape(message)):
        cache.attention(0, rand(q_shape, seed=3).astype(q_dtype), **options)


@pytest.mark.parametrize("q_dtype", [np.float64, np.float16])
def test_bfloat16_cache_takes_float32_queries(q_dtype):
    cache = cpuflash.KVCache(1, 1, 2, 8, D, dtype="bfloat16")
    cache.append(0, rand((1, 2, 5, D), seed=1), rand((1, 2, 5, D), seed=2))
    for n_q in (1, 20):  # the decode path's queries and the tiled path's
        with pytest.raises(TypeError, match=f"q: expected float32 with a bfloat16 K/V cache, "
                                            f"got {np.dtype(q_dtype)}"):
            cache.attention(0, rand((1, 2, n_q, D), seed=3).astype(q_dtype))


def test_bfloat16_cache_rounds_as_torch_and_keeps_what_float32_holds():
    """Appends round to the nearest bfloat16 (ties to even) of their float32 values (float64
    through float32); infinities, NaN and values past float16's range are kept, as a float32
    cache keeps them; pickled and copied caches hold the same bits."""
    import copy
    import pickle
    cache = cpuflash.KVCache(1, 1, 1, 8, 4, dtype="bfloat16")
    k = np.array([[[[1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, 1e5, -3e38],
                    [np.inf, -np.inf, 2.0**-130, 0.1]]]])  # float64
    v = np.array([[[[np.nan, 0.0, -0.0, 1.0], [65520.0, 1.5, 2.0, 3.0]]]], dtype=np.float32)
    cache.append(0, k, v)
    assert cache.dtype == "bfloat16" and cache.k_blocks.dtype == bfloat16.BITS
    stored_k, stored_v, scales = cache.view(0)
    assert stored_k.dtype == stored_v.dtype == np.float32 and scales == {}
    want_k = bfloat16.to_float32(bfloat16.from_float32(k.astype(np.float32)))
    np.testing.assert_array_equal(stored_k, want_k)
    assert stored_k[0, 0, 0, :2].tolist() == [1.0, 1.0 + 4 * 2.0**-8]  # ties to even
    assert np.isinf(stored_k[0, 0, 1, :2]).all() and np.isnan(stored_v[0, 0, 0, 0])
    assert stored_v[0, 0, 1, 0] == 65536.0 and np.signbit(stored_v[0, 0, 0, 2])
    for twin in (pickle.loads(pickle.dumps(cache)), copy.deepcopy(cache)):
        assert twin.dtype == "bfloat16"
        np.testing.assert_array_equal(twin.view(0)[0], stored_k)


@pytest.mark.parametrize("dtype", [np.float32, "bfloat16", np.int8])
def test_cache_attention_bitwise_identical_across_threads(dtype):
    """The splits of the key axis depend on the shapes only: the same bits on 1 thread and on
    all of them, K read from the blocks."""
    cache = cpuflash.KVCache(1, 1, 2, 5000, D, dtype=dtype)
    cache.append(0, rand((1, 2, 5000, D), seed=21), rand((1, 2, 5000, D), seed=22))
    q = rand((1, 4, 2, D), seed=23)
    outs = on_threads(lambda: cache.attention(0, q, causal=True), (1, None))
    np.testing.assert_array_equal(outs[0], outs[1])


@pytest.mark.parametrize("blocks", [True, False])
def test_values_before_a_window_are_not_read(blocks):
    """A window's first chunk starts on a multiple of CHUNK, before the band: the keys there
    are read and masked, but their values take no part in P @ V, so a NaN value hidden from
    every row (key 140 under a window of keys 199..299) reaches nothing; from the cache's
    blocks and from a transposed K alike."""
    n_k = 300
    k, v = rand((1, 2, n_k, D), seed=31), rand((1, 2, n_k, D), seed=32)
    v[:, :, 140] = np.nan
    q = rand((1, 4, 1, D), seed=33)
    if blocks:
        cache = cpuflash.KVCache(1, 1, 2, n_k, D)
        cache.append(0, k, v)
        out = cache.attention(0, q, window=(100, 0))
    else:
        k_t = np.ascontiguousarray(k.transpose(0, 1, 3, 2)).transpose(0, 1, 3, 2)
        out = cpuflash.attention(q, k_t, v, window=(100, 0))
    want = reference.attention(q, k[:, :, 199:], v[:, :, 199:])
    np.testing.assert_allclose(out, want, atol=2e-6, rtol=0)


@pytest.mark.parametrize("dtype", [np.float32, np.float16, "bfloat16", np.int8])
def test_reorder_copies_each_sequence_from_its_index(dtype):
    """``reorder(indices)`` (beam search): every layer's sequence ``b`` becomes the old
    sequence ``indices[b]``, scales included, a repeated index twice; layers of other lengths
    (an empty one, one across a block edge) alike; a step plan made before it reads the new
    order; the result equals the reference over the reordered K/V."""
    n_b, h_kv, lengths = 3, 2, (70, 0, 5)
    cache = cpuflash.KVCache(3, n_b, h_kv, 128, D, dtype=dtype)
    for layer, n in enumerate(lengths):
        cache.append(layer, rand((n_b, h_kv, n, D), seed=layer),
                     rand((n_b, h_kv, n, D), seed=10 + layer))
    q = rand((n_b, 4, 1, D), seed=20)
    cache.attention(0, q)  # a step plan, made before
    before = [(k.copy(), v.copy(), {name: x.copy() for name, x in scales.items()})
              for k, v, scales in (cache.view(layer) for layer in range(3))]  # (views: copied)
    indices = np.array([2, 0, 2])
    cache.reorder(indices)
    for layer, n in enumerate(lengths):
        k, v, scales = cache.view(layer)
        k0, v0, scales0 = before[layer]
        np.testing.assert_array_equal(k, k0[indices])
        np.testing.assert_array_equal(v, v0[indices])
        for name in scales:
            np.testing.assert_array_equal(scales[name], scales0[name][indices])
        assert k.shape[2] == n
    out = cache.attention(0, q)
    kd, vd = dequantized(cache, 0)
    np.testing.assert_allclose(out, reference.attention(q, kd, vd), rtol=0, atol=2e-6)
    same_q = cache.attention(0, q[[0, 0, 0]])  # sequences 0 and 2 now hold the same tokens
    np.testing.assert_array_equal(same_q[0], same_q[2])


@pytest.mark.parametrize("indices,exc,words", [
    ([0, 1], ValueError, "indices: expected shape (3,)"),
    ([[0, 1, 2]], ValueError, "indices: expected shape (3,)"),
    ([0, 1, 3], ValueError, "indices: expected values in 0..2"),
    ([0, -1, 2], ValueError, "indices: expected values in 0..2"),
    ([0.0, 1.0, 2.0], TypeError, "indices: expected integers"),
    (np.array([True, False, True]), TypeError, "indices: expected integers"),
    (None, TypeError, "indices: expected integers"),
    ([[0, 1], [2]], TypeError, "indices: expected 3 integers")], ids=str)
def test_reorder_bad_indices_name_the_argument_and_change_nothing(indices, exc, words):
    cache = cpuflash.KVCache(1, 3, 1, 64, D)
    cache.append(0, rand((3, 1, 5, D), seed=1), rand((3, 1, 5, D), seed=2))
    k_before = cache.k_blocks.copy()
    with pytest.raises(exc, match=re.escape(words)):
        cache.reorder(indices)
    np.testing.assert_array_equal(cache.k_blocks, k_before)


def test_reorder_checks_every_length_before_it_writes():
    cache = cpuflash.KVCache(2, 2, 1, 64, D)
    cache.append(0, rand((2, 1, 5, D), seed=1), rand((2, 1, 5, D), seed=2))
    cache.lengths[1] = 65  # past max_len: the storage cannot back it
    k_before = cache.k_blocks.copy()
    with pytest.raises(ValueError, match=re.escape("lengths[1]")):
        cache.reorder([1, 0])
    np.testing.assert_array_equal(cache.k_blocks, k_before)
