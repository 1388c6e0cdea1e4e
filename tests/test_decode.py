"""The decode path (few queries, K/V read in place, split over keys) against the reference."""
import re

import numpy as np
import pytest

import cpuflash
from cpuflash import masks, reference
from cpuflash._cpu import decode
from conftest import (PLAIN_CALL_REFUSALS, assert_close_to_reference, on_threads, rand,
                      rands)


def takes_decode_path(q, k, v, causal=False):
    """Whether the decode kernel (not the tiled one) takes these arrays, with no other option."""
    n_b, n_hq, n_q, _ = q.shape
    n_k = k.shape[2]
    return decode.run_decode(q, k, v, 0.1, masks.band(causal, None, None, n_b, n_k),
                             masks.modifiers(None, None, n_b, n_hq),
                             masks.UserMask(None, n_b, n_hq, n_q, n_k, q.dtype),
                             masks.dropout(0.0, None)) is not None


def check(q, k, v, causal=False):
    out, lse = cpuflash.attention(q, k, v, causal=causal, return_lse=True)
    ref, ref_lse = reference.attention(q, k, v, causal=causal, return_lse=True)
    assert_close_to_reference(out, ref, q, k, v, causal)
    tol = 1e-12 if q.dtype == np.float64 else 1e-5
    np.testing.assert_allclose(lse, ref_lse, rtol=tol, atol=tol)
    return out


@pytest.mark.parametrize("n_q", [1, 3, decode.MAX_NQ])
@pytest.mark.parametrize("h_kv", [1, 2, 4])
@pytest.mark.parametrize("causal", [False, True])
def test_decode_against_reference(n_q, h_kv, causal):
    # 2 * MIN_SPLIT_KEYS + 37 keys: two or three splits, a ragged last split and last chunk.
    n_k = 2 * decode.MIN_SPLIT_KEYS + 37
    assert decode.split_count(2, h_kv, n_k) in (2, 3)
    q = rand((2, 4, n_q, 32), seed=1)
    k, v = rand((2, h_kv, n_k, 32), seed=2), rand((2, h_kv, n_k, 32), seed=3)
    assert takes_decode_path(q, k, v, causal)  # this path, not the tiled one
    check(q, k, v, causal)


@pytest.mark.parametrize("n_b, n_hkv", [(1, 1), (1, 2), (1, 8), (4, 8), (64, 32)])
def test_split_count(n_b, n_hkv):
    """Enough tasks for the threads where splits stay long; splits no longer than the cap
    unless the count cap binds; never more than MAX_SPLITS."""
    for n_k in (1, 100, 1024, 1025, 4096, 32768, 10**6):
        n = decode.split_count(n_b, n_hkv, n_k)
        assert 1 <= n <= decode.MAX_SPLITS
        assert -(-n_k // n) <= decode.MAX_SPLIT_KEYS or n == decode.MAX_SPLITS
        if n > 1:  # more than one split only where each keeps its minimum length ...
            assert -(-n_k // (n - 1)) > decode.MIN_SPLIT_KEYS
            # ... and only as many as the threads or the length cap ask for
            assert (n_b * n_hkv * (n - 1) < decode.TASKS
                    or -(-n_k // (n - 1)) > decode.MAX_SPLIT_KEYS)


@pytest.mark.parametrize("max_chunk", [decode.CHUNK, 3 * decode.CHUNK, 1024])
@pytest.mark.parametrize("n_q", [1, 3])
def test_chunk_lengths_with_every_option(max_chunk, n_q, monkeypatch):
    """Several chunks a split, of each length the chunk rule can pick (with 3 query rows a
    group of 2 heads has 6 rows: 640 keys under a cap of 1024), a ragged last one and a
    window's first one aligned before its band, with every option the decode path takes
    (dropout's keep/drop of a key is a function of its row and key, not of the chunk), against
    the reference: a chunk's length changes only the roundings."""
    monkeypatch.setattr(decode, "MAX_CHUNK", max_chunk)
    n_b, n_hkv, n_hq, n_k = 2, 8, 16, 3000
    assert decode.split_count(n_b, n_hkv, n_k) == 1  # 16 tasks already: one split of 3072
    assert decode.chunk_keys(n_hq // n_hkv * n_q, 4) == min(max_chunk, 1024 if n_q == 1 else 640)
    q = rand((n_b, n_hq, n_q, 16), seed=1)
    k, v = rand((n_b, n_hkv, n_k, 16), seed=2), rand((n_b, n_hkv, n_k, 16), seed=3)
    mask = np.random.default_rng(4).random((n_b, n_hq, n_q, n_k)) < 0.9
    opts = dict(causal=True, window=(1900, 0), kv_lens=np.array([3000, 2222]), softcap=3.0,
                alibi_slopes=np.linspace(0.001, 0.01, n_hq), mask=mask, dropout_p=0.2, seed=5)
    assert takes_decode_path(q, k, v, causal=True)
    out = cpuflash.attention(q, k, v, **opts)
    np.testing.assert_allclose(out, reference.attention(q, k, v, **opts), rtol=2e-5, atol=2e-6)


def test_parallel_merge_equals_serial_merge(monkeypatch):
    """The split merge spread over the threads (large merges) gives the same bits as on one
    thread (small ones)."""
    q = rand((2, 4, 3, 16), seed=1)
    k, v = rand((2, 2, 3000, 16), seed=2), rand((2, 2, 3000, 16), seed=3)
    assert decode.split_count(2, 2, 3000) > 1
    serial = cpuflash.attention(q, k, v, return_lse=True)
    monkeypatch.setattr(decode, "SERIAL_COMBINE", 0)
    parallel = cpuflash.attention(q, k, v, return_lse=True)
    for a, b in zip(serial, parallel):
        np.testing.assert_array_equal(a, b)
    check(q, k, v)


def test_decode_equals_last_rows_of_a_full_forward():
    q, k, v = rands((1, 4, 40, 16), (1, 2, 40, 16), (1, 2, 40, 16))
    full = cpuflash.attention(q, k, v, causal=True)
    last = cpuflash.attention(q[:, :, -3:], k, v, causal=True)  # bottom-right: same rows
    np.testing.assert_allclose(last, full[:, :, -3:], rtol=2e-6, atol=2e-7)


@pytest.mark.parametrize("dtype", [np.float16, np.float64])
def test_decode_dtypes(dtype):
    check(rand((1, 2, 1, 24), dtype, 1), rand((1, 2, 300, 24), dtype, 2),
          rand((1, 2, 300, 24), dtype, 3))


def test_decode_value_width_not_whole_vectors():
    check(rand((1, 2, 2, 20), seed=1), rand((1, 1, 70, 20), seed=2), rand((1, 1, 70, 5), seed=3))


def test_kv_cache_views_are_read_in_place():
    cache_k, cache_v = rand((1, 2, 512, 16), seed=2), rand((1, 2, 512, 16), seed=3)
    k, v = cache_k[:, :, :300], cache_v[:, :, :300]  # a partly filled cache: a strided view
    q = rand((1, 2, 1, 16), seed=1)
    assert takes_decode_path(q, k, v)
    check(q, k, v)


@pytest.mark.parametrize("n_k", [1, 50, 300])
def test_transposed_k_is_read_in_place(n_k):
    """K with contiguous keys (KVCache's layout): scores by the tile product, a ragged tail."""
    k = rand((2, 2, 16, n_k), seed=2).transpose(0, 1, 3, 2)
    v = rand((2, 2, n_k, 16), seed=3)
    q = rand((2, 4, 2, 16), seed=1)
    assert takes_decode_path(q, k, v)
    check(q, k, v, causal=True)


def test_neither_axis_unit_stride_takes_the_tiled_path():
    k = rand((1, 1, 100, 32), seed=2)[:, :, ::2, ::2]
    v = rand((1, 1, 50, 16), seed=3)
    q = rand((1, 1, 1, 16), seed=1)
    assert not takes_decode_path(q, k, v)
    check(q, k, v)


def test_decode_rows_that_see_no_key():
    q, k, v = rand((1, 1, 5, 8), seed=1), rand((1, 1, 3, 8), seed=2), rand((1, 1, 3, 8), seed=3)
    out, lse = cpuflash.attention(q, k, v, causal=True, return_lse=True)
    assert np.all(out[0, 0, :2] == 0) and np.all(lse[0, 0, :2] == -np.inf)
    check(q, k, v, causal=True)


def test_decode_bitwise_identical_across_threads():
    q, k, v = rands((1, 4, 1, 32), (1, 2, 5000, 32), (1, 2, 5000, 32))
    outs = on_threads(lambda: cpuflash.attention(q, k, v), (1, None))
    assert np.array_equal(outs[0], outs[1])


@pytest.mark.parametrize("dtype, cache", [(np.float32, np.float32), (np.float64, np.float64),
                                          (np.float32, np.float16)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("scale", [None, 0.3])
def test_plain_decode_call_skips_the_general_checks(dtype, cache, causal, scale, monkeypatch):
    """A decode call with no option but causal and scale goes straight to the decode path
    (api._plain_decode) and gives the general path's bits (``api._attention``; since stop 63 a
    plain call that asks for the lse takes ``api._plain_forward``, no longer the general path)
    and the reference's values."""
    from cpuflash import api
    q = rand((2, 4, 3, 32), seed=4).astype(dtype)
    k, v = (rand((2, 2, 300, 32), seed=s).astype(cache) for s in (5, 6))
    general, general_lse = api._attention(q, k, v, None, causal=causal, scale=scale,
                                          return_lse=True)

    def no_general_path(*args, **kwargs):
        raise AssertionError("the plain decode call took the general path")

    if cache == dtype:  # with the lse: api._plain_forward, then the decode path (same bits)
        monkeypatch.setattr(api, "_prepare", no_general_path)
        plain_out, plain_lse = cpuflash.attention(q, k, v, causal=causal, scale=scale,
                                                  return_lse=True)
        np.testing.assert_array_equal(plain_out, general)
        np.testing.assert_array_equal(plain_lse, general_lse)
    monkeypatch.setattr(api, "run_forward", no_general_path)
    plain = cpuflash.attention(q, k, v, causal=causal, scale=scale)
    assert plain.dtype == dtype and plain.shape == (2, 4, 3, 32)
    np.testing.assert_array_equal(plain, general)
    ref = reference.attention(q, k.astype(dtype), v.astype(dtype), causal=causal, scale=scale)
    np.testing.assert_allclose(plain, ref, rtol=0, atol=1e-12 if dtype == np.float64 else 2e-6)


@pytest.mark.parametrize("n_q, n_k, group, cache, decodes", [
    (1, 16, 1, False, True), (3, 16, 1, False, True), (4, 64, 1, False, False),
    (4, 65, 1, False, True), (7, 112, 1, False, False), (7, 113, 1, False, True),
    (7, 16, 2, False, True), (8, 128, 1, False, False),
    (8, 129, 1, False, True), (16, 16, 1, False, False), (16, 256, 1, False, False),
    (16, 257, 1, False, True), (16, 2048, 4, False, False), (16, 2049, 4, False, True),
    (8, 512, 2, False, False), (8, 513, 2, False, True),
    (17, 16, 1, False, False), (16, 16, 1, True, True), (1, 32768, 4, True, True),
    (17, 64, 1, True, False)])
def test_takes_decode(n_q, n_k, group, cache, decodes):
    """The decode path takes up to MAX_NQ queries, but not 4 or more in q's dtype with at most
    16 keys a query without GQA, nor 8 or more with at most 32 keys a query row of a GQA group
    (the tiled kernel is faster there); a KVCache's blocks or a float16/int8 cache (``cache``)
    it always takes up to MAX_NQ queries."""
    assert decode.takes_decode(n_q, n_k, group, cache) is decodes


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_short_prompt_takes_the_tiled_path(causal, dtype, monkeypatch):
    """A 16-token prompt (8 to MAX_NQ queries on few keys, decode.takes_decode) runs the tiled
    kernel, plain call or not, with or without the lse: its rows are bit for bit the first 16
    of a 17-token prompt's (the decode path's are not), and match the reference."""
    from cpuflash import api
    from cpuflash._cpu import forward
    q, k, v = (rand((1, 4, 17, 32), seed=s).astype(dtype) for s in (11, 12, 13))
    k, v = k[:, :2], v[:, :2]  # GQA
    longer, longer_lse = cpuflash.attention(q, k, v, causal=causal, return_lse=True)
    q16, k16, v16 = (x[:, :, :16] for x in (q, k, v))
    rows = (slice(None), slice(None), slice(0, 16))
    if not causal:  # the same keys, one query fewer
        k16, v16 = k, v

    def no_decode(*args, **kwargs):
        raise AssertionError("the short prompt took the decode path")

    monkeypatch.setattr(forward, "run_decode", no_decode)
    monkeypatch.setattr(api, "decode", no_decode)
    general_checks = []
    prepare = api._prepare
    monkeypatch.setattr(api, "_prepare", lambda *a: general_checks.append(1) or prepare(*a))
    out = cpuflash.attention(q16, k16, v16, causal=causal)
    np.testing.assert_array_equal(out, longer[rows])
    out_too, lse = cpuflash.attention(q16, k16, v16, causal=causal, return_lse=True)
    np.testing.assert_array_equal(out_too, longer[rows])
    np.testing.assert_array_equal(lse, longer_lse[rows])
    assert not general_checks  # both plain calls: api._plain_forward
    general = cpuflash.attention(q16, k16, v16, causal=causal, out=np.empty_like(q16))
    np.testing.assert_array_equal(general, longer[rows])
    assert general_checks
    ref = reference.attention(q16, k16, v16, causal=causal)
    assert_close_to_reference(out, ref, q16, k16, v16, causal)


def _k_float64(a):
    a["k"] = a["k"].astype(np.float64)


def _q_float16(a):  # float16 q with a float32 K/V
    a["q"] = a["q"].astype(np.float16)


@pytest.mark.parametrize("edit, options, error, message", PLAIN_CALL_REFUSALS + [
    (_k_float64, {}, TypeError, "k, v: expected one dtype"),
    (_q_float16, {}, TypeError, "q, k, v: expected one dtype"),
])
def test_plain_decode_call_leaves_bad_input_to_the_checks(edit, options, error, message):
    """What the plain decode path does not take goes to the general checks, which name it."""
    args = dict(q=rand((1, 4, 1, 32), seed=7), k=rand((1, 2, 64, 32), seed=8),
                v=rand((1, 2, 64, 32), seed=9))
    if edit is not None:
        edit(args)
    with pytest.raises(error, match=re.escape(message)):
        cpuflash.attention(args["q"], args["k"], args["v"], **options)


@pytest.mark.parametrize("values_hinted", [False, True], ids=["amd-policy", "intel-policy"])
def test_prefetch_hint_policy(values_hinted, monkeypatch):
    """``decode.hinted``: both streams for storage types and a transposed K of whole rows; for
    the compute dtype, K and V on Intel's cores (``HINT_VALUES``), else neither (KVCache's
    blocks or rows); nothing for AVX2's panels, nor with the hints off."""
    monkeypatch.setattr(decode, "HINT_VALUES", values_hinted)
    both = decode.HINT_K | decode.HINT_V
    assert decode.hinted(True, True, True) == both
    assert decode.hinted(False, True, False) == both
    assert decode.hinted(False, True, True) == (both if values_hinted else 0)
    assert decode.hinted(False, False, False) == (both if values_hinted else 0)
    assert decode.hinted(True, True, True, panels=True) == 0
    monkeypatch.setattr(decode, "PREFETCH", False)
    assert decode.hinted(True, True, False) == 0


@pytest.mark.parametrize("n_hq, n_hkv, options", [(8, 2, {}), (2, 2, {}),
                                                   (8, 2, {"window": (400, 0)})])
@pytest.mark.parametrize("layout", ["cache", "rows"])
def test_every_hint_policy_gives_the_same_bits(layout, n_hq, n_hkv, options, monkeypatch):
    """Hints change no bit: float32 K/V in a KVCache and as plain arrays, read with each set of
    hints (the last chunk's hints run past the array's end). A KVCache hints no key past its
    own: its one chunk's P V runs as two products, the keys hinted and the rest (the first
    from the band's first key with the window), whose sums are the one product's."""
    n_k = 5 * decode.CHUNK + 7
    k, v = rand((1, n_hkv, n_k, 64), seed=5), rand((1, n_hkv, n_k, 64), seed=6)
    q = rand((1, n_hq, 1, 64), seed=7)
    outs = []
    for bits in (0, decode.HINT_K, decode.HINT_V, decode.HINT_K | decode.HINT_V):
        monkeypatch.setattr(decode, "hinted", lambda *args, bits=bits, **kw: bits)
        cache = cpuflash.KVCache(1, 1, n_hkv, 2 * n_k, 64)  # a cache of its own: its step
        cache.append(0, k, v)                               # plan keeps the hints it met
        outs.append(cache.attention(0, q, **options) if layout == "cache"
                    else cpuflash.attention(q, k, v, **options))
    for out in outs[1:]:
        np.testing.assert_array_equal(out, outs[0])
    assert_close_to_reference(outs[0], reference.attention(q, k, v, **options), q, k, v)
