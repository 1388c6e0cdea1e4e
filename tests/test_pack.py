"""``pack_tiles``: each combination of the copies asked for (None for one not wanted) is its
own specialization, and each copy holds the same bytes whichever others come with it. The
buffers the products read start on a cache line."""
import numba
import numpy as np
import pytest

import cpuflash
from cpuflash import config, reference
from cpuflash._cpu import pack
from cpuflash._cpu.pack import pack_tiles
from conftest import rands


@pytest.mark.parametrize("n_k", [1, 37, 300])
def test_each_copy_alone_equals_it_among_all(n_k):
    k, v = rands((1, 2, n_k, 16), (1, 2, n_k, 16), seed=n_k)
    k[0, 1, 0, 3] = np.nan  # kn stores NaN/Inf as 0, the others keep them
    block_k, w = 64, config.panel_width(np.dtype(np.float32))
    n_kb = -(-n_k // block_k)

    def fresh():
        return [np.full((2, n_kb, 16 * block_k), 7.0, np.float32) for _ in range(4)]

    every = fresh()
    pack_tiles(k, v, block_k, w, *every)
    for wanted in ((0, 3), (0, 1, 2), (0,), (2,), (3,)):
        alone = fresh()
        pack_tiles(k, v, block_k, w, *[a if i in wanted else None for i, a in enumerate(alone)])
        for i in wanted:
            np.testing.assert_array_equal(alone[i], every[i], err_msg=f"copy {i} of {wanted}")
    assert np.isnan(every[0]).any() and not np.isnan(every[2]).any()


@pytest.mark.parametrize("n_valid, d", [(16, 64), (37, 64), (5, 20), (0, 16)])
def test_a_padded_tile_writes_only_its_keys(n_valid, d):
    """``padded``: the packing helpers leave the whole vectors past a tile's keys as they find
    them (the zeros a tile of as many keys left there: the forward's own tiles after a
    worker's first task) and write the same bytes as a fresh pack everywhere else. K^T's
    panels keep the zeros that fill the last vector of keys; V's rows past ``n_valid`` are
    left alone."""
    lanes, block_k = config.lanes(np.dtype(np.float32)), 64
    w, dv_pad = config.panel_width(np.dtype(np.float32)), -(-d // lanes) * lanes
    k = rands((block_k, d), seed=n_valid + d)[0].reshape(-1)
    kt_fresh, kt = np.full(d * block_k, 7.0, np.float32), np.full(d * block_k, 7.0, np.float32)
    pack.keys_transposed_task(k, 0, d, n_valid, d, block_k, w, kt_fresh, 0, False)
    pack.keys_transposed_task(k, 0, d, n_valid, d, block_k, w, kt, 0, True)
    kt_fresh, kt = kt_fresh.reshape(d, block_k), kt.reshape(d, block_k)  # one panel of 64 keys
    keys_up = -(-n_valid // lanes) * lanes if d % lanes == 0 else n_valid
    np.testing.assert_array_equal(kt[:, :keys_up], kt_fresh[:, :keys_up])
    np.testing.assert_array_equal(kt_fresh[:, :n_valid], k.reshape(block_k, d)[:n_valid].T)
    assert (kt_fresh[:, n_valid:] == 0.0).all()
    if d % lanes == 0:
        assert (kt[:, keys_up:] == 7.0).all()
    vt_fresh = np.full(block_k * dv_pad, 7.0, np.float32)
    vt = np.full(block_k * dv_pad, 7.0, np.float32)
    pack.values_task(k, 0, d, n_valid, d, dv_pad, block_k, w, False, vt_fresh, 0, False)
    pack.values_task(k, 0, d, n_valid, d, dv_pad, block_k, w, False, vt, 0, True)
    vt_fresh, vt = vt_fresh.reshape(block_k, dv_pad), vt.reshape(block_k, dv_pad)
    np.testing.assert_array_equal(vt[:n_valid], vt_fresh[:n_valid])
    np.testing.assert_array_equal(vt_fresh[:n_valid, :d], k.reshape(block_k, d)[:n_valid])
    assert (vt_fresh[:n_valid, d:] == 0.0).all() and (vt_fresh[n_valid:] == 0.0).all()
    assert (vt[n_valid:] == 7.0).all()


def _off_line(shape, dtype=np.float32, off_bytes=16):
    """A C-contiguous array starting ``off_bytes`` past a cache line (numpy gives 16 bytes)."""
    n = int(np.prod(shape)) * np.dtype(dtype).itemsize
    raw = np.empty(n + 2 * pack.ALIGN_BYTES, np.uint8)
    start = -raw.ctypes.data % pack.ALIGN_BYTES + off_bytes
    return raw[start:start + n].view(dtype).reshape(shape)


@pytest.mark.parametrize("n", [1, 100, 5000, 300_000, 9_000_000])
def test_buffers_start_on_a_cache_line(n):
    """The products' B operands (packed K/V, the workspaces) and the kernels' scratch start on
    a cache line: a vector load off it spans two lines (ALIGN_BYTES)."""
    x = pack.empty((n,), np.float32)
    assert pack.aligned(x) and x.flags.c_contiguous and x.flags.writeable and x.shape == (n,)
    w = pack.workspace("test_aligned", (3, n), np.float32)
    assert pack.aligned(w) and w.shape == (3, n)
    assert _scratch_offsets(n) == 0


@pytest.mark.parametrize("shape", [(1, 1, 17, 16), (1, 16, 64, 64), (2, 3, 1000, 40)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_outputs_and_addresses(shape, dtype):
    """A call's output (``pack.output``): from numpy below ALIGNED_OUTPUT_FROM_BYTES, on a cache
    line from there on; ``pack.address`` is ``ctypes.data`` for writeable, read-only, strided
    and empty arrays alike."""
    x = pack.output(shape, dtype)
    assert x.shape == shape and x.dtype == dtype and x.flags.c_contiguous and x.flags.writeable
    small = x.nbytes < pack.ALIGNED_OUTPUT_FROM_BYTES
    assert (x.base is None) == small
    assert small or pack.aligned(x)
    read_only = x[:, ::2]
    read_only.flags.writeable = False
    for y in (x, x[:, 1:], x[..., ::3], read_only, x[:, :0]):
        assert pack.address(y) == y.ctypes.data


@numba.njit
def _scratch_offsets(n):
    worst = 0
    like = np.empty(1, np.float32)
    for extra in range(16):  # allocations of every size around n
        worst = max(worst, pack.scratch(n + extra, like).ctypes.data % pack.ALIGN_BYTES)
    return worst


@pytest.mark.parametrize("off_bytes", [0, 16])
def test_values_off_a_cache_line_are_packed_not_read_in_place(off_bytes):
    """V whose rows have the packed layout is read in place only from a cache line; off it, a
    copy is read, and the output is the same bits either way."""
    d, block_k = config.panel_width(np.dtype(np.float32)), 64
    rng = np.random.default_rng(0)
    v = _off_line((1, 2, 2 * block_k, d), off_bytes=off_bytes)
    v[...] = rng.standard_normal(v.shape)
    vn = pack.packed_rows(v, block_k, config.lanes(np.dtype(np.float32)), d, "test_values")
    assert pack.aligned(vn)
    assert np.shares_memory(vn, v) == (off_bytes == 0)
    q = rng.standard_normal((1, 2, 40, d)).astype(np.float32)
    k = rng.standard_normal(v.shape).astype(np.float32)
    got = cpuflash.attention(q, k, v)
    assert np.array_equal(got, cpuflash.attention(q, k, np.ascontiguousarray(v).copy()))
    np.testing.assert_allclose(got, reference.attention(q, k, v), atol=2e-6)


def test_values_on_and_off_a_cache_line_share_one_packing_compilation(monkeypatch):
    """Whether V is read in place depends on where numpy put it; either way the forward packs
    K (and V) with one specialization of ``pack_tiles`` (an empty ``vn`` where V is read in
    place), so a first call never compiles another for where its V happens to lie. Packed K
    and in-place V give the same bits as K and V both packed. (100 queries: two query blocks,
    so the forward packs in ``pack_tiles``, not in its own tasks.)"""
    d, block_k = config.panel_width(np.dtype(np.float32)), 64
    rng = np.random.default_rng(1)
    q = rng.standard_normal((1, 2, 100, d)).astype(np.float32)
    k = rng.standard_normal((1, 2, 2 * block_k, d)).astype(np.float32)
    calls = []

    def recording(*args):
        calls.append(pack_tiles.canonical(args))
        return pack_tiles(*args)

    monkeypatch.setattr(pack, "pack_tiles", recording)
    outs = []
    for off_bytes in (0, 16):
        v = _off_line((1, 2, 2 * block_k, d), off_bytes=off_bytes)
        v[...] = np.linspace(-2.0, 2.0, v.size, dtype=np.float32).reshape(v.shape)
        kt, vn = pack.packed_kv(k, v, block_k, config.lanes(np.dtype(np.float32)), d)
        assert np.shares_memory(vn, v) == (off_bytes == 0)
        outs.append(cpuflash.attention(q, k, v))
        assert np.array_equal(kt, pack.packed_transposed(k, block_k, d, "test_keys"))
    assert len(calls) == 6 and calls[0] == calls[1] == calls[3] == calls[4]
    assert np.array_equal(outs[0], outs[1])
    np.testing.assert_allclose(outs[0], reference.attention(q, k, v), atol=2e-6)


def _plan(q, v, threads=2):
    """The forward's ``tiling`` of a call of ``q`` on K/V of ``v``'s shape."""
    from cpuflash._cpu import forward
    (n_b, n_hq, n_q, d), (_, n_hkv, n_k, dv) = q.shape, v.shape
    return forward.tiling(n_b, n_hq, n_hkv, n_q, n_k, d, dv, q.dtype, threads)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n_hkv", [3, 1])
@pytest.mark.parametrize("n_q, n_k, d, dv", [(16, 16, 64, 64), (9, 61, 37, 48), (64, 64, 64, 32),
                                             (8, 3, 8, 20)])
def test_tasks_that_pack_their_own_tiles_give_the_packed_bits(n_q, n_k, d, dv, n_hkv, causal,
                                                              dtype, kernels, monkeypatch):
    """A call whose heads are one query block on one key tile each packs its K/V tiles in the
    forward's own tasks (``forward.packs_own_tiles``), with no call of ``pack_tiles``; its
    output and lse are those of the same call packed in ``pack_tiles``, bit for bit, and match
    the reference. B=2: each task finds its own batch's rows. Three heads, or a GQA group of
    three on one K/V head, whose next head on the same worker reads the tile packed for the
    one before. (At least 8 queries: fewer take the decode path. Dv=20, not whole vectors:
    its own tiles padded as ``pack_values`` pads the packed ones.)"""
    from cpuflash._cpu import forward
    q, k, v = rands((2, 3, n_q, d), (2, n_hkv, n_k, d), (2, n_hkv, n_k, dv), seed=n_q + n_k,
                    dtype=dtype)
    assert forward.packs_own_tiles(_plan(q, v), k, v)
    packed = []
    monkeypatch.setattr(forward, "packed_kv", lambda *a: packed.append(1) or pack.packed_kv(*a))
    own = cpuflash.attention(q, k, v, causal=causal, return_lse=True)
    assert not packed
    monkeypatch.setattr(forward, "packs_own_tiles", lambda *a: False)
    shared = cpuflash.attention(q, k, v, causal=causal, return_lse=True)
    assert len(packed) == 1
    for a, b in zip(own, shared):
        assert np.array_equal(a, b, equal_nan=True)
    ref_out, ref_lse = reference.attention(q, k, v, causal=causal, return_lse=True)
    tol = 2e-6 if dtype == np.float32 else 1e-12
    np.testing.assert_allclose(own[0], ref_out, atol=tol)
    np.testing.assert_allclose(own[1], ref_lse, atol=tol * 10)


def test_what_packs_in_one_region():
    """What ``packs_own_tiles`` leaves to ``pack_tiles``: K or V not C-contiguous, and more
    than one query block or key tile a head. GQA groups of any size pack their own (their
    heads share their K/V head's tile): their bits are the packed ones."""
    from cpuflash._cpu import forward
    q, k, v = rands((2, 4, 16, 64), (2, 4, 16, 64), (2, 4, 16, 64), seed=3)
    assert forward.packs_own_tiles(_plan(q, v), k, v)
    pair, one = (k[:, :2].copy(), v[:, :2].copy()), (k[:, :1].copy(), v[:, :1].copy())
    assert forward.packs_own_tiles(_plan(q, pair[1]), *pair)  # two heads a K/V head
    many = rands((2, 8, 16, 64), seed=6)[0]
    assert forward.packs_own_tiles(_plan(many, one[1]), *one)  # eight heads on one
    assert not forward.packs_own_tiles(
        _plan(q, v), k.transpose(0, 1, 3, 2).copy().transpose(0, 1, 3, 2), v)
    assert not forward.packs_own_tiles(_plan(q, v), k, v[..., ::-1])
    long_q = rands((2, 4, 100, 64), seed=4)[0]
    assert not forward.packs_own_tiles(_plan(long_q, v), k, v)
    long_k = rands((2, 4, 300, 64), seed=5)[0]
    assert not forward.packs_own_tiles(_plan(q, long_k), long_k, long_k)
    for queries, (group_k, group_v) in ((q, pair), (q, one), (many, one)):
        own = cpuflash.attention(queries, group_k, group_v, causal=True, return_lse=True)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(forward, "packs_own_tiles", lambda *a: False)
            shared = cpuflash.attention(queries, group_k, group_v, causal=True,
                                        return_lse=True)
        for a, b in zip(own, shared):
            assert np.array_equal(a, b)
        np.testing.assert_allclose(
            own[0], reference.attention(queries, group_k, group_v, causal=True), atol=2e-6)
