"""The forward kernel against the float64 reference: shapes, dtypes, causal, GQA, strides."""
import re

import numpy as np
import pytest

import cpuflash
from cpuflash import config, reference
from conftest import PLAIN_CALL_REFUSALS, assert_close_to_reference, rand, rands

BQ, BK = config.BLOCK_Q, config.BLOCK_K


def check(q, k, v, causal=False, scale=None):
    out, lse = cpuflash.attention(q, k, v, causal=causal, scale=scale, return_lse=True)
    ref, ref_lse = reference.attention(q, k, v, causal=causal, scale=scale, return_lse=True)
    assert out.dtype == q.dtype
    assert lse.dtype == (np.float64 if q.dtype == np.float64 else np.float32)
    assert lse.shape == q.shape[:-1]
    assert_close_to_reference(out, ref, q, k, v, causal, scale)
    seen = np.isfinite(ref_lse)
    assert np.array_equal(np.isfinite(lse), seen)
    tol = 1e-12 if q.dtype == np.float64 else 1e-5
    np.testing.assert_allclose(lse[seen], ref_lse[seen], rtol=tol, atol=tol)
    return out, lse


@pytest.mark.parametrize("n_q,n_k", [(1, 1), (1, BK + 1), (BQ - 1, BK - 1), (BQ, BK),
                                     (BQ + 1, 2 * BK + 1), (37, 200), (200, 37), (13, 13)])
@pytest.mark.parametrize("causal", [False, True])
def test_sequence_lengths(kernels, n_q, n_k, causal):
    check(rand((1, 2, n_q, 16), seed=1), rand((1, 2, n_k, 16), seed=2),
          rand((1, 2, n_k, 16), seed=3), causal)


@pytest.mark.parametrize("l2_kib", [None, 128, 256, 1024])
@pytest.mark.parametrize("d", [16, 64, 128, 256, 512])
def test_key_tiles_fit_half_the_l2(monkeypatch, l2_kib, d):
    """``config.block_k``: whole panels, at most ``BLOCK_K``, and a K tile and a V tile
    (float32, Dv = D) within half of the L2 where it is known, down to one panel."""
    monkeypatch.setattr(config, "L2_BYTES", l2_kib and l2_kib << 10)
    width = config.panel_width(np.dtype(np.float32))
    keys = config.block_k(d, 1 << 40)
    assert keys % width == 0 and width <= keys <= BK
    if l2_kib is None:
        assert keys == BK
    else:
        assert keys == width or keys * 2 * d * 4 <= (l2_kib << 10) // 2
        assert keys == BK or 2 * keys * 2 * d * 4 > (l2_kib << 10) // 2  # the widest that fits


@pytest.mark.parametrize("causal", [False, True])
def test_a_small_l2_narrows_the_key_tiles_and_keeps_the_answer(kernels, monkeypatch, causal):
    """With a 64 KiB L2 the tiles of a 128-wide head narrow to one panel: tile edges at other
    keys, the reference's answer all the same."""
    monkeypatch.setattr(config, "L2_BYTES", 64 << 10)
    assert config.block_k(128, 1 << 40) == config.panel_width(np.dtype(np.float32))
    check(rand((1, 2, 70, 128), seed=1), rand((1, 2, 3 * BK + 5, 128), seed=2),
          rand((1, 2, 3 * BK + 5, 128), seed=3), causal)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("causal", [False, True])
def test_dtypes(kernels, dtype, causal):
    check(rand((2, 3, 67, 24), dtype, 1), rand((2, 3, 131, 24), dtype, 2),
          rand((2, 3, 131, 24), dtype, 3), causal)


@pytest.mark.parametrize("d,dv", [(1, 1), (5, 3), (64, 64), (97, 16), (128, 128), (257, 33),
                                  (512, 512)])
def test_head_dims(kernels, d, dv):
    check(rand((1, 1, 19, d), seed=1), rand((1, 1, 150, d), seed=2),
          rand((1, 1, 150, dv), seed=3), causal=True)


@pytest.mark.parametrize("h_kv", [1, 2, 3, 6])
def test_gqa_and_mqa(kernels, h_kv):
    check(rand((2, 6, 33, 16), seed=1), rand((2, h_kv, 70, 16), seed=2),
          rand((2, h_kv, 70, 8), seed=3), causal=True)


def test_strided_and_broadcast_views(kernels):
    # (B, N, H, D) buffers viewed as (B, H, N, D); keys broadcast over heads; reversed queries.
    q = rand((2, 45, 4, 16), seed=1).transpose(0, 2, 1, 3)[:, :, ::-1]
    k = np.broadcast_to(rand((2, 1, 90, 16), seed=2), (2, 2, 90, 16))
    v = rand((2, 90, 2, 32), seed=3).transpose(0, 2, 1, 3)[..., ::2]
    assert not q.flags.c_contiguous and not v.flags.c_contiguous
    out, _ = check(q, k, v, causal=True)
    dense = cpuflash.attention(np.ascontiguousarray(q), np.ascontiguousarray(k),
                               np.ascontiguousarray(v), causal=True)
    assert np.array_equal(out, dense)  # strides never change a bit of the result


@pytest.mark.parametrize("rank", [2, 3])
def test_ranks(rank):
    shape = (3,) * (rank - 2)
    q, k, v = rands(shape + (20, 8), shape + (30, 8), shape + (30, 4))
    out, lse = check(q, k, v, causal=True)
    assert out.shape == shape + (20, 4) and lse.shape == shape + (20,)


def test_scale(kernels):
    check(rand((1, 1, 10, 8), seed=1), rand((1, 1, 12, 8), seed=2), rand((1, 1, 12, 8), seed=3),
          scale=-0.3)


@pytest.mark.parametrize("shape_q,shape_k", [
    ((0, 2, 5, 8), (0, 2, 5, 8)), ((1, 0, 5, 8), (1, 0, 5, 8)),
    ((1, 2, 0, 8), (1, 2, 5, 8)), ((1, 2, 5, 8), (1, 2, 0, 8))])
def test_empty_sizes(shape_q, shape_k):
    q, k = rand(shape_q), rand(shape_k)
    out, lse = cpuflash.attention(q, k, k, return_lse=True)
    assert out.shape == shape_q and lse.shape == shape_q[:-1]
    assert np.all(out == 0) and np.all(lse == -np.inf)


def test_rows_that_see_no_key_give_zero_and_minus_inf(kernels):
    # Nq > Nk with causal bottom-right: the first Nq - Nk rows see nothing.
    q, k, v = rand((1, 1, 150, 8), seed=1), rand((1, 1, 20, 8), seed=2), rand((1, 1, 20, 8), seed=3)
    out, lse = check(q, k, v, causal=True)
    assert np.all(out[0, 0, :130] == 0) and np.all(lse[0, 0, :130] == -np.inf)
    assert np.all(np.isfinite(out))


def test_peaked_scores(kernels):
    # q = k = v scaled up: each row's softmax is nearly one-hot; a prototype lost 3x to torch here.
    x = rand((1, 2, 300, 64), seed=4, scale=6.0)
    check(x, x, x)
    check(x, x, x, causal=True)


def test_nan_propagates_to_the_rows_it_touches(kernels):
    q, k, v = rand((1, 1, 40, 8), seed=1), rand((1, 1, 40, 8), seed=2), rand((1, 1, 40, 8), seed=3)
    q[0, 0, 5, 2] = np.nan
    out = cpuflash.attention(q, k, v)
    assert np.all(np.isnan(out[0, 0, 5])) and np.all(np.isfinite(np.delete(out[0, 0], 5, 0)))
    k2 = k.copy()
    k2[0, 0, 30, 0] = np.nan  # a key only rows >= 30 see under causal
    out = cpuflash.attention(q[..., :5, :] * 0 + 1, k2, v, causal=True)[0, 0]
    # 5 queries against 40 keys: query i sees keys j <= i + 35, so every row sees key 30.
    assert np.all(np.isnan(out))
    out = cpuflash.attention(rand((1, 1, 40, 8), seed=5), k2, v, causal=True)[0, 0]
    assert np.all(np.isfinite(out[:30])) and np.all(np.isnan(out[30:]))


def test_out_argument(kernels):
    q, k, v = rand((2, 2, 33, 8), seed=1), rand((2, 2, 40, 8), seed=2), rand((2, 2, 40, 8), seed=3)
    want = cpuflash.attention(q, k, v, causal=True)
    out = np.empty_like(want)
    assert cpuflash.attention(q, k, v, causal=True, out=out) is out
    assert np.array_equal(out, want)
    strided = np.empty((2, 33, 2, 8), np.float32).transpose(0, 2, 1, 3)
    cpuflash.attention(q, k, v, causal=True, out=strided)
    assert np.array_equal(strided, want)
    q_copy = q.copy()
    cpuflash.attention(q_copy, k, v, causal=True, out=q_copy)  # out aliasing an input
    assert np.array_equal(q_copy, want)


def test_against_torch_when_installed():
    torch = pytest.importorskip("torch")
    q, k, v = rands((1, 4, 100, 32), (1, 4, 100, 32), (1, 4, 100, 32))
    ref = reference.attention(q, k, v, causal=True)
    theirs = torch.nn.functional.scaled_dot_product_attention(
        *(torch.from_numpy(x) for x in (q, k, v)), is_causal=True).numpy()
    ours = cpuflash.attention(q, k, v, causal=True)
    err_t, err_o = np.abs(theirs - ref).max(), np.abs(ours - ref).max()
    assert err_o <= 2 * err_t + 1e-6, (err_o, err_t)


@pytest.mark.parametrize("causal", [False, True])
def test_values_read_in_place_equal_the_packed_copy(causal):
    """A contiguous V whose rows already have the packed layout (one panel wide, whole key
    tiles) is read in place; a read-only or strided V of the same values is packed. Both give
    the same bits."""
    n = 2 * config.BLOCK_K
    q, k, v = rands((1, 2, n, 64), (1, 2, n, 64), (1, 2, n, 64))
    in_place = cpuflash.attention(q, k, v, causal=causal)
    read_only = v.copy()
    read_only.flags.writeable = False
    strided = np.empty((1, 2, n, 128), dtype=v.dtype)[..., ::2]
    strided[...] = v
    for other in (read_only, strided):
        assert np.array_equal(cpuflash.attention(q, k, other, causal=causal), in_place)
    assert_close_to_reference(in_place, reference.attention(q, k, v, causal=causal), q, k, v,
                              causal=causal)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n,d", [(1, 16), (130, 64), (256, 128), (77, 24), (37, 64), (100, 32),
                                 (5, 64), (47, 64)])
def test_contiguous_packing_equals_the_strided_packing(dtype, n, d):
    """The packers' fast paths for C-contiguous K/V (register transposes of whole vectors of
    keys, vector copies, NaN/Inf zeroed for the backward pass) write the bits of the any-stride
    loops, padding keys and all: whole panels (256), panels that end past Nk inside a vector of
    keys (1, 5, 37, 47, 100, 130: whole vectors of keys in register transposes, the last few
    in a transpose whose other rows are zero, then zero vectors), and shapes that have no whole
    vector (77 with D=24)."""
    from cpuflash._cpu import pack
    block_k, lanes, width = config.block_k(d, n), config.lanes(np.dtype(dtype)), config.panel_width(
        np.dtype(dtype))
    k = rand((2, 3, n, d), seed=4).astype(dtype)
    k[0, 1, n // 2, d // 2], k[1, 2, 0, 0] = np.nan, -np.inf
    strided = np.empty((2, 3, n, 2 * d), dtype)[..., ::2]
    strided[...] = k
    fast = pack.packed_transposed(k, block_k, width, "test_fast").copy()
    assert np.array_equal(pack.packed_transposed(strided, block_k, width, "test_slow"), fast,
                          equal_nan=True)
    for zero_nonfinite in (False, True):
        fast = pack.packed_rows(k, block_k, lanes, width, "test_fast", zero_nonfinite).copy()
        slow = pack.packed_rows(strided, block_k, lanes, width, "test_slow", zero_nonfinite)
        assert np.array_equal(slow, fast, equal_nan=True)
        assert np.isfinite(fast).all() == zero_nonfinite
    # the same copies made together in one parallel region (pack.pack_tiles), as the forward
    # pass (K^T, V rows) and the backward pass (K^T, V^T, K rows with NaN/Inf as 0) make them
    if d % lanes == 0:
        v = rand((2, 3, n, d), seed=5).astype(dtype)
        v[1, 0, n - 1, 0] = np.nan
        want = [pack.packed_transposed(k, block_k, width, "test_slow").copy(),
                pack.packed_transposed(v, block_k, width, "test_slow").copy(),
                pack.packed_rows(k, block_k, lanes, width, "test_slow", True).copy(),
                pack.packed_rows(v, block_k, lanes, width, "test_slow", pack=True).copy()]
        got = [np.full_like(w, 7.0) for w in want]
        pack.pack_tiles(k, v, block_k, width, *got)
        for g, w in zip(got, want):
            assert np.array_equal(g, w, equal_nan=True)
        kt, vn = pack.packed_kv(k, v, block_k, lanes, width)
        assert np.array_equal(kt, want[0], equal_nan=True)
        assert np.array_equal(vn, want[3], equal_nan=True)


def test_a_sharp_row_keeps_the_sum_of_many_tiny_tiles(kernels):
    # One key with probability ~1, then 2047 keys each e^-22.3 ~ 2e-10 of it: every later key
    # tile adds ~3e-8 to the row sum, under half an ulp of 1 (6e-8). Summed over tiles in
    # float32 the row sum stayed exactly 1 and the output 1.0, 4e-7 (7 ulps) above the true
    # 1 / (1 + 4e-7); the sum over tiles runs in float64 (forward.py). What remains: the
    # first tile's own float32 sum (its tiny keys next to the 1) and l rounded to float32
    # for the division: 1.8e-7 (3 ulps) on AVX-512.
    n, d = 2048, 16
    q = np.zeros((1, 1, 1, d), dtype=np.float32)
    q[..., 0] = 1.0
    k = np.zeros((1, 1, n, d), dtype=np.float32)
    k[0, 0, 1:, 0] = -22.3
    v = np.zeros((1, 1, n, d), dtype=np.float32)
    v[0, 0, 0] = 1.0
    q8 = np.repeat(q, 8, axis=2)  # 8 query rows: the tiled path, not decoding
    out, lse = cpuflash.attention(q8, k, v, scale=1.0, return_lse=True)
    want, want_lse = reference.attention(q8, k, v, scale=1.0, return_lse=True)
    assert 1.0 - want[0, 0, 0, 0] > 3e-7  # the tiny keys matter at float32 precision
    assert np.abs(out - want).max() <= 2.5e-7 and np.abs(lse - want_lse).max() <= 2.5e-7


def _gqa(n_q):  # 4 query heads on 2 key/value heads
    return (rand((2, 4, n_q, 32), seed=4), rand((2, 2, 50, 32), seed=5),
            rand((2, 2, 50, 32), seed=6))


def _strided(n_q):  # q and k as transposed views, v a broadcast (read-only, stride 0) view
    q = rand((2, 32, 4, n_q), seed=4).transpose(0, 2, 3, 1)
    k = rand((50, 32, 2, 2), seed=5).transpose(2, 3, 0, 1)
    v = np.broadcast_to(rand((1, 1, 50, 24), seed=6), (2, 2, 50, 24))
    return q, k, v


def _few_keys(n_q):  # Nk < Nq (causal: the first rows see no key), Dv != D
    return rand((1, 3, n_q, 16), seed=4), rand((1, 3, 7, 16), seed=5), rand((1, 3, 7, 40), seed=6)


@pytest.mark.parametrize("arrays", [_gqa, _strided, _few_keys])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("scale", [None, 0.3])
def test_plain_forward_call_skips_the_general_checks(arrays, dtype, causal, scale, monkeypatch):
    """A forward call with no option but causal, scale and return_lse (more than ``MAX_NQ``
    queries) goes straight to ``run_forward`` (``api._plain_forward``), without the general
    checks, and gives the general path's bits (``api._attention``) and the reference's
    values."""
    from cpuflash import api
    from cpuflash._cpu.decode import MAX_NQ
    q, k, v = (x.astype(dtype) if x.dtype != dtype else x for x in arrays(MAX_NQ + 1))
    general, general_lse = api._attention(q, k, v, None, causal=causal, scale=scale,
                                          return_lse=True)

    def no_general_path(*args, **kwargs):
        raise AssertionError("the plain forward call took the general path")

    monkeypatch.setattr(api, "_prepare", no_general_path)
    plain = cpuflash.attention(q, k, v, causal=causal, scale=scale)
    assert plain.dtype == dtype and plain.shape == q.shape[:3] + v.shape[3:]
    np.testing.assert_array_equal(plain, general)
    plain_too, lse = cpuflash.attention(q, k, v, causal=causal, scale=scale, return_lse=True)
    np.testing.assert_array_equal(plain_too, general)
    assert lse.dtype == general_lse.dtype and lse.shape == q.shape[:3]
    np.testing.assert_array_equal(lse, general_lse)
    ref, ref_lse = reference.attention(q, k, v, causal=causal, scale=scale, return_lse=True)
    assert_close_to_reference(plain, ref, q, k, v, causal, scale)
    seen = np.isfinite(ref_lse)
    assert np.array_equal(np.isfinite(lse), seen)
    np.testing.assert_allclose(lse[seen], ref_lse[seen], rtol=1e-5, atol=1e-5)


def _v_float64(a):
    a["v"] = a["v"].astype(np.float64)


def _all_float16(a):  # valid, but not the plain path's: computed in float32
    a.update((name, x.astype(np.float16)) for name, x in a.items())


@pytest.mark.parametrize("edit, options, error, message", PLAIN_CALL_REFUSALS + [
    (_v_float64, {}, TypeError, "k, v: expected one dtype"),
    (None, dict(return_lse=1), TypeError, "return_lse:"),
    (None, dict(causal=np.bool_(True)), None, None),
    (None, dict(scale=np.float32(0.3)), None, None),
    (None, dict(scale=1), None, None),
    (_all_float16, {}, None, None),
])
def test_plain_forward_call_leaves_the_rest_to_the_checks(edit, options, error, message,
                                                           monkeypatch):
    """What the plain forward path does not take goes to the general checks: bad input raises
    there, naming the argument; valid calls of other kinds (numpy scalars, an int scale,
    float16) are computed there."""
    from cpuflash import api
    args = dict(q=rand((1, 4, 20, 32), seed=7), k=rand((1, 2, 64, 32), seed=8),
                v=rand((1, 2, 64, 32), seed=9))
    if edit is not None:
        edit(args)
    if error is not None:
        with pytest.raises(error, match=re.escape(message)):
            cpuflash.attention(args["q"], args["k"], args["v"], **options)
        return
    checked = []
    real = api._prepare
    monkeypatch.setattr(api, "_prepare", lambda *a, **kw: checked.append(1) or real(*a, **kw))
    out = cpuflash.attention(args["q"], args["k"], args["v"], **options)
    assert checked, "the call skipped the general checks"
    assert out.dtype == args["q"].dtype
    causal, scale = bool(options.get("causal", False)), options.get("scale")
    q, k, v = args["q"], args["k"], args["v"]
    ref = reference.attention(q, k, v, causal=causal, scale=scale)
    assert_close_to_reference(out, ref, q, k, v, causal, scale)


@pytest.mark.parametrize("n_q", [65, 100, 129, 200])
def test_a_row_gives_the_same_bits_in_a_short_last_query_block(n_q):
    """A query block computes its own rows in whole micro-tiles, not its padding, and a key
    tile's exponentials stop at the vector that holds the last key (stop 62): each row's
    output and lse are those it gets among 256 query rows, where its block is full, bit for
    bit (200 keys: a second key tile of 72, so the rescale factors count too)."""
    q, k, v = rands((1, 3, 256, 64), (1, 3, 200, 64), (1, 3, 200, 64), seed=n_q)
    full, full_lse = cpuflash.attention(q, k, v, return_lse=True)
    part, part_lse = cpuflash.attention(q[:, :, :n_q], k, v, return_lse=True)
    assert np.array_equal(part, full[:, :, :n_q])
    assert np.array_equal(part_lse, full_lse[:, :, :n_q])
    assert_close_to_reference(part, reference.attention(q[:, :, :n_q], k, v), q[:, :, :n_q], k, v)
