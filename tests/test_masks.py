"""window, kv_lens, ALiBi, softcap, masks, dropout and merge, forward and backward, crossed
with causal, GQA, Nq != Nk and dtypes; property-based where the grid would explode."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import cpuflash
from cpuflash import reference
from conftest import on_threads, rand, rands


def check_all(q, k, v, dout, **opts):
    out, lse = cpuflash.attention(q, k, v, return_lse=True, **opts)
    ref, ref_lse = reference.attention(q, k, v, return_lse=True, **opts)
    tol = 1e-12 if q.dtype == np.float64 else 2e-5
    np.testing.assert_allclose(out, ref, rtol=tol, atol=tol * max(1.0, np.abs(ref).max()))
    assert np.array_equal(np.isfinite(lse), np.isfinite(ref_lse))
    seen = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse[seen], ref_lse[seen], rtol=tol, atol=tol)
    assert np.all(out[~seen] == 0)
    grads = cpuflash.attention_backward(dout, q, k, v, out, lse, **opts)
    want = reference.attention_backward(dout, q, k, v, **opts)
    for g, w in zip(grads, want):
        np.testing.assert_allclose(g, w, rtol=tol, atol=tol * 10)
        assert np.all(np.isfinite(g))


@settings(max_examples=40, deadline=None)
@given(n_q=st.integers(1, 140), n_k=st.integers(1, 300), group=st.sampled_from([1, 2]),
       causal=st.booleans(), left=st.sampled_from([None, -1, 0, 1, 17, 130]),
       right=st.sampled_from([None, -1, 0, 3, 64]), use_lens=st.booleans(),
       softcap=st.sampled_from([None, 1.5, 30.0]), alibi=st.sampled_from([None, "h", "bh"]),
       dropout_p=st.sampled_from([0.0, 0.0, 0.2]), seed=st.integers(0, 2**16),
       portable=st.booleans())
def test_options_against_reference(n_q, n_k, group, causal, left, right, use_lens, softcap,
                                   alibi, dropout_p, seed, portable):
    from cpuflash import config
    old = config.PORTABLE
    config.PORTABLE = portable
    try:
        rng = np.random.default_rng(seed)
        q, k, v = rand((2, 2 * group, n_q, 8), seed=seed), rand((2, 2, n_k, 8), seed=seed + 1), \
            rand((2, 2, n_k, 8), seed=seed + 2)
        dout = rand((2, 2 * group, n_q, 8), seed=seed + 3)
        kv_lens = rng.integers(0, n_k + 1, size=2) if use_lens else None
        window = None if left is None and right is None else (left, right)
        slopes = None if alibi is None else rng.uniform(0, 0.3, (2, 2 * group)[-len(alibi):])
        check_all(q, k, v, dout, causal=causal, window=window, kv_lens=kv_lens,
                  softcap=softcap, alibi_slopes=slopes, dropout_p=dropout_p, seed=seed)
    finally:
        config.PORTABLE = old


@pytest.mark.parametrize("dtype", [np.float16, np.float64])
def test_band_dtypes(dtype):
    q, k, v = (rand(s, dtype, i) for i, s in enumerate([(1, 2, 90, 16), (1, 1, 200, 16),
                                                        (1, 1, 200, 16)]))
    out = cpuflash.attention(q, k, v, window=(30, 5), kv_lens=np.array([150]))
    ref = reference.attention(q, k, v, window=(30, 5), kv_lens=np.array([150]))
    assert out.dtype == dtype
    tol = 1e-12 if dtype == np.float64 else 4e-3
    np.testing.assert_allclose(out, ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("n_q", [1, 5, 100])  # decode path and tiled path
def test_keys_past_kv_lens_are_never_read(n_q):
    q, k, v, do = rand((2, 2, n_q, 16), seed=1), rand((2, 2, 300, 16), seed=2), \
        rand((2, 2, 300, 16), seed=3), rand((2, 2, n_q, 16), seed=4)
    lens = np.array([140, 7])
    clean = cpuflash.attention_vjp(q, k, v, do, causal=True, kv_lens=lens)
    k2, v2 = k.copy(), v.copy()
    for b, n in enumerate(lens):  # an uninitialized cache: NaN and Inf past the fill
        k2[b, :, n:] = np.nan
        v2[b, :, n:] = np.inf
    dirty = cpuflash.attention_vjp(q, k2, v2, do, causal=True, kv_lens=lens)
    for a, b_ in zip(clean[:3], dirty[:3]):
        assert np.array_equal(a, b_)
    dv = dirty[3]
    assert np.all(dv[0, :, 140:] == 0) and np.all(dv[1, :, 7:] == 0)


def test_kv_lens_equal_slicing_the_cache():
    q, k, v = rands((2, 4, 3, 16), (2, 2, 64, 16), (2, 2, 64, 16))
    lens = np.array([40, 64])
    out = cpuflash.attention(q, k, v, causal=True, kv_lens=lens)
    for b, n in enumerate(lens):
        want = cpuflash.attention(q[b:b + 1], k[b:b + 1, :, :n], v[b:b + 1, :, :n], causal=True)
        np.testing.assert_allclose(out[b:b + 1], want, rtol=1e-5, atol=1e-6)


def test_window_matches_dense_band_and_skips_tiles():
    q, k, v = rands((1, 1, 600, 16), (1, 1, 600, 16), (1, 1, 600, 16))
    out = cpuflash.attention(q, k, v, window=(40, 0))
    want = reference.attention(q, k, v, window=(40, 0))
    np.testing.assert_allclose(out, want, rtol=2e-5, atol=2e-6)
    np.testing.assert_array_equal(out, cpuflash.attention(q, k, v, window=(40, 7), causal=True))


def test_merge_is_exact_over_disjoint_key_sets():
    q, k, v = rand((2, 2, 7, 8), seed=1), rand((2, 2, 50, 8), seed=2), rand((2, 2, 50, 8), seed=3)
    cuts = [(0, 13), (13, 14), (14, 50), (50, 50)]  # including an empty key set
    parts = [cpuflash.attention(q, k[:, :, a:b], v[:, :, a:b], return_lse=True) for a, b in cuts]
    out, lse = cpuflash.merge([p[0] for p in parts], [p[1] for p in parts])
    want, want_lse = reference.attention(q, k, v, return_lse=True)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-5, atol=1e-6)


def test_merge_of_rows_that_saw_nothing():
    out, lse = cpuflash.merge([np.zeros((3, 4), np.float32)] * 2,
                              [np.full(3, -np.inf, np.float32)] * 2)
    assert np.all(out == 0) and np.all(lse == -np.inf)


Q, K, V = rand((2, 2, 8, 4)), rand((2, 2, 9, 4)), rand((2, 2, 9, 4))


@pytest.mark.parametrize("n_q", [1, 64])  # decode path and tiled path
def test_softcap_saturates_and_alibi_prefers_near_keys(n_q):
    q, k, v = rand((1, 2, n_q, 8), seed=1, scale=20.0), rand((1, 2, 80, 8), seed=2), \
        rand((1, 2, 80, 8), seed=3)
    capped = cpuflash.attention(q, k, v, softcap=1e-3)  # every score ~0: uniform weights
    np.testing.assert_allclose(capped, np.broadcast_to(v.mean(axis=2, keepdims=True),
                                                       capped.shape), rtol=1e-3, atol=1e-3)
    near = cpuflash.attention(q * 0, k, v, alibi_slopes=np.array([50.0, 50.0]))
    np.testing.assert_allclose(near[0, :, -1], v[0, :, -1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n_q", [1, 100])  # decode path and tiled path
def test_dropout_keeps_the_expected_value_and_repeats(n_q):
    q, k, v = rands((1, 2, n_q, 8), (1, 2, 120, 8), (1, 2, 120, 8))
    plain = cpuflash.attention(q, k, v)
    runs = [cpuflash.attention(q, k, v, dropout_p=0.5, seed=s) for s in range(300)]
    assert np.array_equal(runs[7], cpuflash.attention(q, k, v, dropout_p=0.5, seed=7))
    assert not np.array_equal(runs[7], runs[8])
    mean = np.mean(runs, axis=0)
    spread = np.std(runs, axis=0) / np.sqrt(len(runs))
    assert np.all(np.abs(mean - plain) < 5 * spread + 1e-3)  # unbiased: E[out] = out


def test_dropout_is_the_same_for_any_thread_count():
    q, k, v = rands((1, 2, 200, 8), (1, 2, 300, 8), (1, 2, 300, 8))
    outs = on_threads(lambda: cpuflash.attention_vjp(q, k, v, q, dropout_p=0.3, seed=11),
                      (1, None))
    for a, b in zip(*outs):
        assert np.array_equal(a, b)


@pytest.mark.parametrize("kwargs,exc,words", [
    ({"dropout_p": 1.0, "seed": 1}, ValueError, r"dropout_p: expected a number in \[0, 1\)"),
    ({"dropout_p": -0.1, "seed": 1}, ValueError, "dropout_p"),
    ({"dropout_p": "0.1", "seed": 1}, TypeError, "dropout_p"),
    ({"dropout_p": 0.1}, ValueError, "seed: required"),
    ({"dropout_p": 0.1, "seed": 1.5}, TypeError, "seed: expected an int"),
    ({"dropout_p": 0.1, "seed": -1}, ValueError, "seed: expected 0 <= seed"),
    ({"softcap": -1.0}, ValueError, "softcap: expected a finite number > 0"),
    ({"softcap": float("nan")}, ValueError, "softcap"),
    ({"softcap": "2"}, TypeError, "softcap"),
    ({"alibi_slopes": [0.5, 0.5]}, TypeError, "alibi_slopes: expected a real numpy array"),
    ({"alibi_slopes": np.ones(3)}, ValueError, r"alibi_slopes: expected shape \(2,\)"),
    ({"alibi_slopes": np.array([np.nan, 1.0])}, ValueError, "alibi_slopes: expected finite"),
    ({"window": 5}, TypeError, "window: expected"),
    ({"window": (1, 2, 3)}, TypeError, "window: expected"),
    ({"window": (-2, 0)}, ValueError, "window: left side must be >= -1"),
    ({"window": (0, 1.5)}, TypeError, "window: right side must be an int"),
    ({"kv_lens": [3, 4]}, TypeError, "kv_lens: expected an integer numpy array"),
    ({"kv_lens": np.array([3.0, 4.0])}, TypeError, "kv_lens: expected an integer"),
    ({"kv_lens": np.array([3])}, ValueError, r"kv_lens: expected shape \(2,\)"),
    ({"kv_lens": np.array([3, 10])}, ValueError, r"kv_lens: expected lengths in \[0, 9\]"),
    ({"kv_lens": np.array([-1, 3])}, ValueError, "kv_lens: expected lengths"),
])
def test_bad_band_arguments(kwargs, exc, words):
    with pytest.raises(exc, match=words):
        cpuflash.attention(Q, K, V, **kwargs)
    out, lse = cpuflash.attention(Q, K, V, return_lse=True)
    with pytest.raises(exc, match=words):
        cpuflash.attention_backward(out, Q, K, V, out, lse, **kwargs)


@pytest.mark.parametrize("outs,lses,exc,words", [
    ([], [], ValueError, "non-empty"),
    ([np.zeros((3, 4), np.float32)], [np.zeros(3, np.float32)] * 2, ValueError, "equally long"),
    ([np.zeros((3, 4), np.float32)], [np.zeros(4, np.float32)], ValueError,
     r"lses\[0\]: expected shape"),
    ([np.zeros((3, 4), np.float32), np.zeros((3, 5), np.float32)], [np.zeros(3, np.float32)] * 2,
     ValueError, r"outs\[1\]: expected shape"),
    ([np.zeros((3, 4), np.int32)], [np.zeros(3, np.float32)], TypeError, r"outs\[0\]"),
    ("x", [], TypeError, "lists"),
])
def test_bad_merge_arguments(outs, lses, exc, words):
    with pytest.raises(exc, match=words):
        cpuflash.merge(outs, lses)


MASKS = {
    "bool 2-D": lambda rng, n_q, n_k: rng.random((n_q, n_k)) > 0.3,
    "key padding (B,1,1,Nk)": lambda rng, n_q, n_k: rng.random((2, 1, 1, n_k)) > 0.2,
    "float per head (H,Nq,1)": lambda rng, n_q, n_k: np.where(
        rng.random((4, n_q, 1)) > 0.4, 0.0, -np.inf).astype(np.float32),
    "float dense f64": lambda rng, n_q, n_k: rng.standard_normal((2, 4, n_q, n_k)),
    "float16 bias": lambda rng, n_q, n_k: rng.standard_normal((n_q, n_k)).astype(np.float16),
    "all False": lambda rng, n_q, n_k: np.zeros((n_q, n_k), bool),
}


@pytest.mark.parametrize("name", list(MASKS))
@pytest.mark.parametrize("n_q", [1, 5, 130])  # decode path and tiled path
@pytest.mark.parametrize("more", [False, True])
def test_user_masks_against_reference(name, n_q, more):
    rng = np.random.default_rng(5)
    n_k = 300
    mask = MASKS[name](rng, n_q, n_k)
    q, k, v = rands((2, 4, n_q, 16), (2, 2, n_k, 16), (2, 2, n_k, 16))
    opts = dict(causal=True, softcap=3.0, kv_lens=np.array([250, 299])) if more else {}
    check_all(q, k, v, rand((2, 4, n_q, 16), seed=4), mask=mask, **opts)


def test_mask_is_never_expanded():
    # A (Nq, Nk) bool mask at N=4096 is 16 MiB; a dense float copy over 8 heads would be 512 MiB.
    from cpuflash import _measure
    q, k, v = _measure.make_qkv(1, 8, 4096, 16)
    mask = np.tril(np.ones((4096, 4096), bool))
    import tracemalloc
    tracemalloc.start()
    out = cpuflash.attention(q, k, v, mask=mask)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 64 * 2**20, f"peak numpy allocation {peak / 2**20:.0f} MiB"
    np.testing.assert_allclose(out[0, :2], cpuflash.attention(q, k, v, causal=True)[0, :2],
                               rtol=1e-5, atol=1e-6)


def test_rows_that_a_mask_hides_entirely():
    q, k, v = rands((1, 1, 10, 8), (1, 1, 200, 8), (1, 1, 200, 8))
    mask = np.ones((10, 200), bool)
    mask[3] = False
    k[0, 0, 150] = np.nan  # a NaN key that the mask hides from every row
    mask[:, 150] = False
    out, lse = cpuflash.attention(q, k, v, mask=mask, return_lse=True)
    assert np.all(out[0, 0, 3] == 0) and lse[0, 0, 3] == -np.inf
    assert np.all(np.isfinite(np.delete(out[0, 0], 3, 0)))
    grads = cpuflash.attention_backward(np.ones_like(out), q, k, v, out, lse, mask=mask)
    assert all(np.all(np.isfinite(g)) for g in grads)  # the hidden NaN key reaches nothing
    assert np.all(grads[1][0, 0, 150] == 0) and np.all(grads[2][0, 0, 150] == 0)


def test_against_torch_with_a_float_mask():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(3)
    q, k, v = rands((2, 4, 70, 16), (2, 4, 90, 16), (2, 4, 90, 16))
    mask = rng.standard_normal((2, 1, 70, 90)).astype(np.float32)
    mask[..., ::7] = -np.inf
    ours = cpuflash.attention(q, k, v, mask=mask)
    theirs = torch.nn.functional.scaled_dot_product_attention(
        *(torch.from_numpy(x) for x in (q, k, v)), attn_mask=torch.from_numpy(mask)).numpy()
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("mask,exc,words", [
    ([[True]], TypeError, "mask: expected a numpy array"),
    (np.ones((8, 9), np.int32), TypeError, "mask: expected a bool or float array"),
    (np.ones((8, 3), bool), ValueError, "does not broadcast"),
    (np.ones((1, 1, 1, 8, 9), bool), ValueError, "at most 4 dimensions"),
])
def test_bad_masks(mask, exc, words):
    with pytest.raises(exc, match=words):
        cpuflash.attention(Q, K, V, mask=mask)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, bool])
@pytest.mark.parametrize("n_k", [37, 256])
def test_tile_states_against_a_direct_classification(dtype, n_k):
    """The tile table (HIDDEN / MIXED / CLEAR per tile) equals a plain numpy classification,
    with -0.0 (clear), NaN (neither), +inf and tiny values (neither) planted in some tiles."""
    from cpuflash._cpu.masking import CLEAR, HIDDEN, MIXED
    from cpuflash.masks import UserMask
    n_q, bq, bk = 50, 16, 64
    rng = np.random.default_rng(5)
    if dtype is bool:
        m = rng.random((n_q, n_k)) < 0.5
        m[:16] = True
        m[16:32] = False
        m[40, 3] = False
    else:
        m = np.where(rng.random((n_q, n_k)) < 0.5, 0.0, -np.inf).astype(dtype)
        m[:16] = 0.0
        m[16:32] = -np.inf
        m[0, 1] = -0.0          # still clear
        m[17, 2] = np.nan       # neither: mixed
        m[33:40] = 0.0
        m[34, n_k - 1] = 1e-30  # changes the score: not clear
        m[41:48] = -np.inf
        m[45, 0] = np.inf
    got = np.asarray(UserMask(m, 1, 2, n_q, n_k, np.float64 if dtype is np.float64
                              else np.float32).tile_states(bq, bk))[0, 0]
    want = np.empty_like(got)
    for qb in range(got.shape[0]):
        for kb in range(got.shape[1]):
            t = m[qb * bq:(qb + 1) * bq, kb * bk:(kb + 1) * bk]
            clear = np.all(t) if dtype is bool else np.all(t == 0)
            hidden = np.all(~t) if dtype is bool else np.all(t == -np.inf)
            want[qb, kb] = CLEAR if clear else HIDDEN if hidden else MIXED
    np.testing.assert_array_equal(got, want)
    if n_k > bk:  # one key block: the planted entries leave no tile hidden
        assert (got == CLEAR).any() and (got == HIDDEN).any() and (got == MIXED).any()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_steep_alibi_gradients(dtype):
    """Slopes so steep that most probabilities of a row lie below 2^-64 of its total: the
    backward pass sets those to 0 (no subnormal products, see tiles.P_FLUSH_BELOW) and the
    gradients still match the reference."""
    q, k, v = rands((1, 4, 150, 16), (1, 2, 300, 16), (1, 2, 300, 16))
    q, k, v = (x.astype(dtype) for x in (q, k, v))
    slopes = np.array([0.5, 2.0, 4.0, 8.0])
    check_all(q, k, v, rand((1, 4, 150, 16), seed=4).astype(dtype), causal=True,
              alibi_slopes=slopes)


@pytest.mark.parametrize("n_q", [1, 40])  # decode path and tiled path
def test_softcap_keeps_float64_precision(kernels, n_q):
    """float64 computes in float64, softcap's tanh too: caps that put the scores on both sides
    of the series' range (|s / cap| below and above its threshold), forward and gradients,
    within a few hundred ulps of the reference (a float32-grade tanh left 1e-8)."""
    q, k, v, do = rands((1, 2, n_q, 16), (1, 1, 90, 16), (1, 1, 90, 16), (1, 2, n_q, 16),
                        dtype=np.float64)
    q *= 4.0  # scores up to ~10
    for cap in (0.5, 3.0, 30.0, 300.0):
        opts = dict(softcap=cap, causal=True)
        out, dq, dk, dv = cpuflash.attention_vjp(q, k, v, do, **opts)
        np.testing.assert_allclose(out, reference.attention(q, k, v, **opts), rtol=0, atol=1e-13)
        for got, want in zip((dq, dk, dv), reference.attention_backward(do, q, k, v, **opts)):
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("n_q", [1, 40])  # decode path and tiled path
def test_dropout_scales_by_one_over_one_minus_p_in_float64(kernels, n_q):
    """Kept probabilities are scaled by exactly ``1 / (1 - p)``, as the API says and the
    reference does: in float64 the results agree to rounding (the hash's own keep rate,
    ``1 - round(p 2^32) / 2^32``, left up to 1e-10 relative)."""
    q, k, v, do = rands((1, 2, n_q, 16), (1, 1, 90, 16), (1, 1, 90, 16), (1, 2, n_q, 16),
                        dtype=np.float64)
    for p in (0.1, 0.3, 0.77):
        opts = dict(dropout_p=p, seed=11, causal=True)
        out, dq, dk, dv = cpuflash.attention_vjp(q, k, v, do, **opts)
        np.testing.assert_allclose(out, reference.attention(q, k, v, **opts), rtol=0, atol=1e-13)
        for got, want in zip((dq, dk, dv), reference.attention_backward(do, q, k, v, **opts)):
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)
    cu = np.array([0, n_q], np.int64)
    ref_opts = dict(dropout_p=0.3, seed=cpuflash.varlen._sequence_seed(11, 0), causal=True)
    packed = cpuflash.varlen.attention_varlen(q[0].transpose(1, 0, 2), k[0].transpose(1, 0, 2),
                                              v[0].transpose(1, 0, 2), cu,
                                              np.array([0, 90], np.int64), dropout_p=0.3, seed=11,
                                              causal=True)
    np.testing.assert_allclose(packed.transpose(1, 0, 2)[None],
                               reference.attention(q, k, v, **ref_opts), rtol=0, atol=1e-13)


@pytest.mark.parametrize("portable", [False, True])
@pytest.mark.parametrize("band", [(0, 0), (0, 7), (5, 0), (3, 2), (10**9, 0), (0, 10**9)],
                         ids=str)
@pytest.mark.parametrize("tile", [(0, 0), (0, 64), (32, 64), (96, 0), (40, 128)], ids=str)
def test_mask_tile_sets_exactly_the_keys_outside_each_rows_band(portable, band, tile):
    """``masking.mask_tile`` (whole vectors, then scalars; scalars only when portable) against
    numpy: a row ``i`` sees keys ``[i + off - left, i + off + right]`` within ``[0, kv_len)``
    (``off = kv_len - n_q``: bottom-right); every other score of the tile becomes ``-inf``,
    the rest keeps its bits, and the columns past the tile (``ld > block_k``) are untouched."""
    from cpuflash._cpu.masking import mask_tile
    left, right = band
    q0, k0 = tile
    rows, block_k, ld, n_q, kv_len = 37, 64, 80, 140, 150
    rng = np.random.default_rng(sum(tile) + left % 97 + right % 89)
    s = rng.standard_normal(rows * ld).astype(np.float32)
    expected = s.copy().reshape(rows, ld)
    i = q0 + np.arange(rows)[:, None]
    j = k0 + np.arange(block_k)[None, :]
    off = kv_len - n_q
    seen = (j >= np.maximum(0, i + off - left)) & (j <= np.minimum(kv_len - 1, i + off + right))
    expected[:, :block_k][~seen] = -np.inf
    mask_tile(s, ld, rows, q0, k0, block_k, n_q, kv_len, left, right, -np.inf, portable)
    assert np.array_equal(s.reshape(rows, ld), expected)


@pytest.mark.parametrize("banded", [True, False])
@pytest.mark.parametrize("portable", [False, True])
@pytest.mark.parametrize("case", [
    # (q0, rows, k0, n_q, n_k, left, right): a causal diagonal tile, bottom-right offsets, a
    # window, kv_len inside the tile, padding rows, row blocks that see no key of the tile
    (0, 128, 0, 512, 512, 10**9, 0), (128, 128, 128, 300, 300, 10**9, 0),
    (0, 70, 0, 70, 70, 10**9, 0), (0, 128, 64, 256, 200, 10**9, 0),
    (0, 128, 0, 256, 90, 10**9, 10**9), (64, 128, 128, 512, 512, 30, 5),
    (0, 128, 128, 256, 256, 10**9, 0), (0, 70, 0, 70, 60, 10**9, 0)], ids=str)
def test_band_scores_leave_the_masked_tile_as_the_whole_product_does(banded, portable, case):
    """``forward.band_scores`` skips, per run of micro-tile row blocks (``band_runs``), the
    vectors of keys past the last key one of its rows sees (since stop 61; whole panels
    before); after ``mask_tile`` the tile is the same, bit for bit, as the whole product's
    (``tile_product_max``), the skipped scores' garbage (NaN here) included; not ``banded``, it
    is the whole product itself. A causal diagonal tile has runs that end inside a panel."""
    from cpuflash import config
    from cpuflash._cpu.forward import band_scores
    from cpuflash._cpu.masking import band_runs, mask_tile
    from cpuflash._cpu.tiles import tile_product_max
    q0, rows, k0, n_q, n_k, left, right = case
    bq, block_k, d = 128, 2 * config.panel_width(np.dtype(np.float32)), 32
    lanes = config.LANES_F32
    ld_s = block_k + lanes
    rng = np.random.default_rng(sum(case) % 1000)
    q_s = rng.standard_normal(bq * d).astype(np.float32)
    q_s[rows * d:] = 0.0  # padding rows, as the forward kernel's
    kt = rng.standard_normal(d * block_k).astype(np.float32)
    results = []
    for by_band in (False, True):
        s = np.full(bq * ld_s, np.nan, dtype=np.float32)
        row_vmax = np.empty(bq * lanes, dtype=np.float32)
        tile_max = np.empty(bq, dtype=np.float32)
        if by_band:
            runs = np.empty((bq // config.MICRO_ROWS + 1, 3), dtype=np.int64)
            n_runs = band_runs(runs, bq, banded, rows, q0, k0, n_q, n_k, left, right, block_k,
                               lanes)  # in vectors of keys, as the forward kernel's
            band_scores(s, ld_s, q_s, d, kt, 0, runs, n_runs, row_vmax, tile_max, portable)
            if banded and case == (0, 128, 0, 512, 512, 10**9, 0):  # causal diagonal
                assert (runs[:n_runs, 2] % (block_k // 2) != 0).any()
        else:
            tile_product_max(s, 0, ld_s, q_s, 0, d, 1, kt, 0, d, bq, block_k, d, row_vmax,
                             tile_max, 0, portable)
        if not (by_band and not banded):  # a tile not banded is the whole product, unmasked
            mask_tile(s, ld_s, rows, q0, k0, block_k, n_q, n_k, left, right, -np.inf,
                      portable)
        results.append(s.reshape(bq, ld_s)[:, :block_k])
    whole, by_band = results
    assert np.isfinite(whole[rows:]).all()  # padding rows: computed whole, never garbage
    if banded:
        np.testing.assert_array_equal(by_band, whole)
    else:  # the whole product, every score computed
        assert np.isfinite(by_band).all()
        masked = whole == -np.inf
        np.testing.assert_array_equal(by_band[~masked], whole[~masked])


BAND_CASES = [(0, 128, 0, 512, 512, 10**9, 0), (128, 128, 128, 300, 300, 10**9, 0),
              (0, 70, 0, 70, 70, 10**9, 0), (0, 128, 64, 256, 200, 10**9, 0),
              (0, 128, 0, 256, 90, 10**9, 10**9), (64, 128, 128, 512, 512, 30, 5),
              (0, 128, 128, 256, 256, 10**9, 0), (0, 64, 0, 64, 64, 10**9, 0),
              (64, 64, 0, 128, 128, 10**9, 0), (0, 128, 0, 128, 128, 20, 20)]


@pytest.mark.parametrize("case", BAND_CASES, ids=str)
def test_band_runs_cover_the_rows_in_order_by_their_panels(case):
    """``masking.band_runs``: runs of whole micro-tile row blocks that cover ``[0, bq)`` in
    order, each block's ``band_columns`` its run's ``need``, neighbouring runs unequal (as long
    as they can be); a tile not banded is one run of every row and column. Runs in vectors of
    keys (the forward's) are the runs in panels (the backward's) cut finer."""
    from cpuflash import config
    from cpuflash._cpu.masking import band_columns, band_runs
    q0, rows, k0, n_q, n_k, left, right = case
    mr, width = config.MICRO_ROWS, config.panel_width(np.dtype(np.float32))
    bq, block_k = -(-rows // mr) * mr, 2 * width
    runs = np.full((bq // mr + 1, 3), -1, dtype=np.int64)
    n = band_runs(runs, bq, True, rows, q0, k0, n_q, n_k, left, right, block_k, width)
    got = runs[:n].copy()
    assert got[0, 0] == 0 and got[-1, 1] == bq and np.array_equal(got[1:, 0], got[:-1, 1])
    assert np.all(got[:, 1] > got[:, 0]) and np.all((got[:, :2] % mr == 0) | (got[:, :2] == bq))
    assert np.all(got[1:, 2] != got[:-1, 2])
    for r0, r1, need in got:
        for b0 in range(r0, r1, mr):
            assert band_columns(b0, mr, rows, q0, k0, n_q, n_k, left, right, block_k,
                                width) == need
    n = band_runs(runs, bq, False, rows, q0, k0, n_q, n_k, left, right, block_k, width)
    assert n == 1 and list(runs[0]) == [0, bq, block_k]
    # runs in vectors of keys: each needs whole vectors, within its panel run's panels
    lanes = config.LANES_F32
    by_vector = np.full_like(runs, -1)
    n_v = band_runs(by_vector, bq, True, rows, q0, k0, n_q, n_k, left, right, block_k, lanes)
    assert np.all(by_vector[:n_v, 2] % lanes == 0) and n_v >= len(got)
    for r0, r1, need in by_vector[:n_v]:
        panel_run = got[(got[:, 0] <= r0) & (r1 <= got[:, 1])]
        assert len(panel_run) == 1 and -(-need // width) * width == panel_run[0, 2]


@pytest.mark.parametrize("n_q,n_k,options", [
    (130, 130, dict(causal=True)), (200, 317, dict(causal=True)),
    (256, 256, dict(window=(40, 3))), (100, 300, dict(window=(70, 0), softcap=3.0)),
    (192, 192, dict(causal=True, alibi_slopes=np.array([0.2, 0.5, 0.3, 0.1])))], ids=str)
@pytest.mark.parametrize("h_kv", [4, 2])
def test_backward_band_skip_is_the_masks_gradients(kernels, n_q, n_k, options, h_kv):
    """The backward pass computes S, dP and dQ on tiles that cross a band edge only over the
    key panels each run of row blocks sees, and dK and dV only for the keys some run sees
    (``masking.band_runs``); its gradients equal those of the same band given as a bool mask,
    whose tiles are computed whole: bit for bit with one query head per key head. With two,
    dK's and dV's compensated sums may fold their compensation one block later (a skipped
    add of 0): within two ulps of the largest gradient."""
    import cpuflash
    from cpuflash import reference
    rng = np.random.default_rng(n_q + n_k)
    q = rng.standard_normal((1, 4, n_q, 64)).astype(np.float32)
    k, v = (rng.standard_normal((1, h_kv, n_k, 64)).astype(np.float32) for _ in range(2))
    dout = rng.standard_normal(q.shape).astype(np.float32)
    seen = reference.visible(n_q, n_k, options.get("causal", False), options.get("window"))
    as_mask = {key: x for key, x in options.items() if key not in ("causal", "window")}
    got, want = [], []
    for opts, sink in ((options, got), (dict(as_mask, mask=seen), want)):
        out, lse = cpuflash.attention(q, k, v, return_lse=True, **opts)
        sink.extend(cpuflash.attention_backward(dout, q, k, v, out, lse, **opts))
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        if h_kv == 4 or name == "dq":
            np.testing.assert_array_equal(g, w, err_msg=name)
        else:
            ulp = np.spacing(np.max(np.abs(w)))
            np.testing.assert_allclose(g, w, rtol=0, atol=2 * ulp, err_msg=name)
