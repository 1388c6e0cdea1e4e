"""Attention sinks (``sinks=``): the reference against a direct softmax with one more column and
against finite differences; the kernels' results with sinks (one more term of each row's sum)
against the reference, forward and backward, across the options, dtypes, the decode path,
KVCache and varlen; the identities (a sink of -inf is none, bit for bit; a sink is a part of
``merge`` with output 0); rows that see no key; bad sinks."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import cpuflash
from cpuflash import api, reference
from conftest import on_threads, rand, rands


def check_with_sinks(q, k, v, dout, sinks, **opts):
    """Forward, lse and backward (dsinks too) against the reference; returns the results."""
    out, lse = cpuflash.attention(q, k, v, sinks=sinks, return_lse=True, **opts)
    ref, ref_lse = reference.attention(q, k, v, sinks=sinks, return_lse=True, **opts)
    tol = 1e-12 if q.dtype == np.float64 else 2e-5
    np.testing.assert_allclose(out, ref, rtol=tol, atol=tol * max(1.0, np.abs(ref).max()))
    assert np.array_equal(np.isfinite(lse), np.isfinite(ref_lse))
    seen = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse[seen], ref_lse[seen], rtol=tol, atol=tol)
    grads = cpuflash.attention_backward(dout, q, k, v, out, lse, sinks=sinks, **opts)
    want = reference.attention_backward(dout, q, k, v, sinks=sinks, **opts)
    assert len(grads) == 4 and grads[3].shape == sinks.shape and grads[3].dtype == lse.dtype
    for g, w in zip(grads, want):
        np.testing.assert_allclose(g, w, rtol=tol, atol=tol * 10)
        assert np.all(np.isfinite(g))
    return out, lse, grads


def test_reference_sinks_are_one_more_column():
    q, k, v = rands((2, 3, 5, 4), (2, 3, 7, 4), (2, 3, 7, 6), dtype=np.float64)
    sinks = np.array([[0.3, -2.0, 5.0], [1.0, -np.inf, 0.0]])
    s = q @ np.swapaxes(k, -1, -2) / 2.0
    s = np.concatenate([s, np.broadcast_to(sinks[:, :, None, None], s.shape[:3] + (1,))], -1)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    out, lse = reference.attention(q, k, v, sinks=sinks, return_lse=True)
    np.testing.assert_allclose(out, p[..., :-1] @ v, rtol=1e-13, atol=1e-13)
    m = s.max(-1)
    np.testing.assert_allclose(lse, m + np.log(np.exp(s - m[..., None]).sum(-1)), rtol=1e-13)


@pytest.mark.parametrize("shape", ["h", "bh"])
def test_reference_dsinks_by_finite_differences(shape):
    q, k, v, dout = rands((2, 2, 6, 4), (2, 2, 9, 4), (2, 2, 9, 3), (2, 2, 6, 3),
                          dtype=np.float64, seed=5)
    sinks = np.array([0.7, -1.3]) if shape == "h" else np.array([[0.7, -1.3], [2.0, 0.1]])
    opts = dict(causal=True, window=(4, 0), kv_lens=np.array([9, 3]))
    *_, dsinks = reference.attention_backward(dout, q, k, v, sinks=sinks, **opts)

    def loss(s):
        return float((dout * reference.attention(q, k, v, sinks=s, **opts)).sum())

    h = 1e-6
    for idx in np.ndindex(sinks.shape):
        up, down = sinks.copy(), sinks.copy()
        up[idx] += h
        down[idx] -= h
        assert dsinks[idx] == pytest.approx((loss(up) - loss(down)) / (2 * h), rel=1e-6,
                                            abs=1e-9)


@settings(max_examples=30, deadline=None)
@given(n_q=st.integers(1, 100), n_k=st.integers(1, 200), group=st.sampled_from([1, 2]),
       causal=st.booleans(), window=st.sampled_from([None, (17, 0), (5, 40)]),
       use_lens=st.booleans(), softcap=st.sampled_from([None, 20.0]),
       alibi=st.booleans(), dropout_p=st.sampled_from([0.0, 0.0, 0.2]),
       per_batch=st.booleans(), seed=st.integers(0, 2**16))
def test_sinks_across_options(n_q, n_k, group, causal, window, use_lens, softcap, alibi,
                              dropout_p, per_batch, seed):
    rng = np.random.default_rng(seed)
    q, k, v, dout = rands((2, 2 * group, n_q, 8), (2, 2, n_k, 8), (2, 2, n_k, 8),
                          (2, 2 * group, n_q, 8), seed=seed)
    sinks = rng.uniform(-4, 4, (2, 2 * group) if per_batch else (2 * group,)).astype(np.float32)
    sinks.flat[0] = -np.inf if rng.random() < 0.3 else sinks.flat[0]
    check_with_sinks(q, k, v, dout, sinks, causal=causal, window=window,
                     kv_lens=rng.integers(0, n_k + 1, size=2) if use_lens else None,
                     softcap=softcap,
                     alibi_slopes=rng.uniform(0, 0.3, 2 * group) if alibi else None,
                     dropout_p=dropout_p, seed=seed)


@pytest.mark.parametrize("dtype", [np.float16, np.float64])
def test_sinks_dtypes(dtype):
    q, k, v = rands((1, 4, 70, 16), (1, 2, 90, 16), (1, 2, 90, 16), dtype=dtype)
    sinks = np.array([1.0, -0.5, 2.5, -np.inf])
    out = cpuflash.attention(q, k, v, sinks=sinks, causal=True)
    ref = reference.attention(q, k, v, sinks=sinks, causal=True)
    assert out.dtype == dtype
    tol = 1e-12 if dtype == np.float64 else 2e-3  # float16: two roundings of the output
    np.testing.assert_allclose(out.astype(np.float64), ref, rtol=tol, atol=tol)
    if dtype == np.float64:
        check_with_sinks(q, k, v, rand(out.shape, dtype, 9), sinks, causal=True)


@pytest.mark.parametrize("n_q", [33, 3])  # the tiled kernel's finish_row; the decode merge
def test_a_sink_of_minus_inf_is_none_bit_for_bit(n_q):
    q, k, v, dout = rands((2, 4, n_q, 16), (2, 2, 50, 16), (2, 2, 50, 16), (2, 4, n_q, 16))
    none = np.full(4, -np.inf, np.float32)
    out, lse = cpuflash.attention(q, k, v, causal=True, return_lse=True)
    out_s, lse_s = cpuflash.attention(q, k, v, causal=True, return_lse=True, sinks=none)
    assert np.array_equal(out, out_s) and np.array_equal(lse, lse_s)
    *grads, dsinks = cpuflash.attention_backward(dout, q, k, v, out_s, lse_s, causal=True,
                                                 sinks=none)
    for g, want in zip(grads, cpuflash.attention_backward(dout, q, k, v, out, lse, causal=True)):
        assert np.array_equal(g, want)
    assert np.array_equal(dsinks, np.zeros(4, np.float32))


def test_a_sink_is_a_merged_part_with_output_zero():
    q, k, v = rands((1, 2, 40, 8), (1, 2, 64, 8), (1, 2, 64, 8), dtype=np.float64)
    sinks = np.array([0.5, 3.0])
    out, lse = cpuflash.attention(q, k, v, return_lse=True)
    merged, merged_lse = cpuflash.merge(
        [out, np.zeros_like(out)], [lse, np.broadcast_to(sinks[:, None], lse.shape[1:])[None]
                                    .copy()])
    out_s, lse_s = cpuflash.attention(q, k, v, return_lse=True, sinks=sinks)
    np.testing.assert_allclose(out_s, merged, rtol=1e-13, atol=1e-14)
    np.testing.assert_allclose(lse_s, merged_lse, rtol=1e-13)


@pytest.mark.parametrize("n_q", [3, 12])  # the decode path; the tiled kernel (takes_decode)
def test_rows_that_see_no_key_give_the_sink_alone(n_q):
    q, k, v, dout = rands((2, 2, n_q, 8), (2, 2, 20, 8), (2, 2, 20, 8), (2, 2, n_q, 8))
    sinks = np.array([1.5, -np.inf], np.float32)
    opts = dict(causal=True, kv_lens=np.array([0, 6]))  # no key: batch 0; rows < Nq - 6 of 1
    out, lse, (dq, dk, dv, dsinks) = check_with_sinks(q, k, v, dout, sinks, **opts)
    assert np.all(out[0] == 0) and np.all(lse[0, 0] == np.float32(1.5))
    assert np.all(lse[0, 1] == -np.inf)  # no key and no sink
    assert np.all(dq[0] == 0)
    q1 = q[:, :, -1:]
    assert not np.isnan(cpuflash.attention(q1, k, v, sinks=sinks, **opts)).any()


@pytest.mark.parametrize("q_shape, k_shape", [((0, 4, 5, 8), (0, 2, 7, 8)),
                                              ((1, 4, 0, 8), (1, 2, 7, 8)),
                                              ((1, 0, 5, 8), (1, 0, 7, 8)),
                                              ((1, 4, 5, 8), (1, 2, 0, 8))])
def test_sinks_with_empty_sizes(q_shape, k_shape):
    """B, Nq, H or Nk of 0: empty or zero results, no error, no NaN; with no key at all the
    output is 0 and ``lse`` is the sink (or -inf without one)."""
    q, k = rands(q_shape, k_shape)
    sinks = np.linspace(-1.0, 1.0, q_shape[1])
    if sinks.size:
        sinks[-1] = -np.inf
    out, lse = cpuflash.attention(q, k, k, sinks=sinks, return_lse=True)
    assert out.shape == q_shape and lse.shape == q_shape[:3] and not np.isnan(out).any()
    assert np.all(out == 0) or k_shape[2] > 0
    if k_shape[2] == 0 and q.size:
        assert np.array_equal(lse, np.broadcast_to(sinks[:, None], lse.shape[1:])[None]
                              .astype(np.float32))
    if q_shape[1]:  # the reference's GQA group is Hq // Hkv: no heads, no reference
        ref, ref_lse = reference.attention(q, k, k, sinks=sinks, return_lse=True)
        assert np.array_equal(out, ref) and np.array_equal(lse, ref_lse.astype(np.float32))
    *grads, dsinks = cpuflash.attention_backward(out, q, k, k, out, lse, sinks=sinks)
    assert dsinks.shape == sinks.shape and not np.isnan(dsinks).any()
    assert all(g.shape == x.shape and not np.isnan(g).any() for g, x in zip(grads, (q, k, k)))


@pytest.mark.parametrize("cache", ["float32", "float16", "int8"])
def test_sinks_on_the_decode_path_and_kvcache(cache):
    q, k, v = rands((2, 8, 3, 64), (2, 2, 300, 64), (2, 2, 300, 64))
    sinks = np.linspace(-2, 2, 8).astype(np.float32)
    kv = cpuflash.KVCache(1, 2, 2, 512, 64, dtype=cache)
    kv.append(0, k, v)
    kc, vc, scales = kv.view(0)
    k_ref, v_ref = kc.astype(np.float64), vc.astype(np.float64)
    if scales:
        k_ref, v_ref = k_ref * scales["k_scale"][..., None], v_ref * scales["v_scale"][..., None]
    ref, ref_lse = reference.attention(q, k_ref, v_ref, causal=True, sinks=sinks,
                                       return_lse=True)
    out, lse = cpuflash.attention(q, kc, vc, causal=True, sinks=sinks, return_lse=True,
                                  **scales)
    np.testing.assert_allclose(out, ref, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(lse, ref_lse, rtol=2e-5, atol=2e-5)
    # KVCache reads its blocks in place: other sums than from arrays (not the same bits)
    plans = [kv.attention(0, q, causal=True, sinks=sinks, return_lse=True) for _ in range(2)]
    general = kv.attention(0, q, causal=True, sinks=sinks, return_lse=True,
                           scale=np.float64(0.125))  # not a float: no step plan
    for step, step_lse in plans + [general]:
        np.testing.assert_allclose(step, ref, rtol=2e-5, atol=2e-5)
        np.testing.assert_allclose(step_lse, ref_lse, rtol=2e-5, atol=2e-5)
        assert np.array_equal(step, plans[0][0]) and np.array_equal(step_lse, plans[0][1])
    assert np.array_equal(kv.attention(0, q, causal=True, sinks=sinks), plans[0][0])


def test_the_decode_path_merges_sinks_in_its_kernel(monkeypatch):
    """Decode calls (``Nq <= 16``) take the sinks into the merge of their splits: per batch and
    head, -inf among them, rows that see no key (output 0, ``lse`` the sink exactly), long keys
    in several splits; ``attention``, a KVCache step plan and its general path alike, against
    the reference."""
    from cpuflash._cpu import decode
    calls = []
    original = decode.decode.call_built
    monkeypatch.setattr(decode.decode, "call_built", lambda args: calls.append(1) or
                        original(args))
    q, k, v = rands((3, 4, 2, 64), (3, 2, 3000, 64), (3, 2, 3000, 64))
    sinks = np.array([[0.5, -np.inf, 2.0, -1.0], [3.0, 1.0, -np.inf, 0.0],
                      [-2.0, 4.0, 0.25, -np.inf]])
    kv_lens = np.array([0, 1, 2999])
    ref, ref_lse = reference.attention(q, k, v, sinks=sinks, kv_lens=kv_lens, causal=True,
                                       return_lse=True)
    out, lse = cpuflash.attention(q, k, v, sinks=sinks, kv_lens=kv_lens, causal=True,
                                  return_lse=True)
    np.testing.assert_allclose(out, ref, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(lse, ref_lse, rtol=2e-5, atol=2e-5)
    assert np.all(out[0] == 0) and np.array_equal(lse[0], np.repeat(
        sinks[0].astype(np.float32)[:, None], 2, axis=1))
    kv = cpuflash.KVCache(1, 3, 2, 3072, 64)
    kv.append(0, k, v)
    full = reference.attention(q, k, v, sinks=sinks, causal=True)
    steps = [kv.attention(0, q, causal=True, sinks=sinks),  # new plan
             kv.attention(0, q, causal=True, sinks=sinks),  # from it
             kv.attention(0, q, causal=True, sinks=sinks, scale=np.float64(0.125))]  # general
    for step in steps:
        np.testing.assert_allclose(step, full, rtol=2e-5, atol=2e-5)
        assert np.array_equal(step, steps[0])
    assert len(calls) == 4  # each call took the decode path


@pytest.mark.parametrize("n_q", [40, 2])  # the tiled kernel; the decode path
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_sinks_far_above_and_below_the_scores(n_q, dtype):
    """A sink 1000 above a row's scores takes all its weight (``e^1000`` overflows float64: the
    kernels keep the larger of the two out), one 1000 below none; and in between."""
    q, k, v = rands((1, 4, n_q, 16), (1, 4, 50, 16), (1, 4, 50, 16), dtype=dtype)
    sinks = np.array([1000.0, -1000.0, 30.0, -30.0])
    out, lse = cpuflash.attention(q, k, v, sinks=sinks, return_lse=True)
    ref, ref_lse = reference.attention(q, k, v, sinks=sinks, return_lse=True)
    tol = 1e-12 if dtype == np.float64 else 2e-5
    np.testing.assert_allclose(out, ref, rtol=tol, atol=tol)
    np.testing.assert_allclose(lse, ref_lse, rtol=tol, atol=tol)
    assert np.all(np.abs(out[0, 0]) <= 1e-30) and np.all(lse[0, 0] == 1000.0)
    plain = cpuflash.attention(q[:, 1:2], k[:, 1:2], v[:, 1:2])
    np.testing.assert_allclose(out[:, 1:2], plain, rtol=tol, atol=tol)


def test_kvcache_step_with_sinks_none_runs_from_its_plan(monkeypatch):
    """``sinks=None`` (a model passing its layer's sinks, which it lacks) is a plain step:
    from the step plan, not the general path's checks; so is a step with ``return_lse`` (the
    way steps with sinks get their lse), with the general path's results, and a non-bool
    ``return_lse`` meets the general path's check."""
    from cpuflash._cpu.decode import StepPlan
    q, k, v = rands((1, 4, 1, 64), (1, 2, 100, 64), (1, 2, 100, 64))
    kv = cpuflash.KVCache(1, 1, 2, 128, 64)
    kv.append(0, k, v)
    plain = kv.attention(0, q, causal=True)
    runs = []
    original = StepPlan.run
    monkeypatch.setattr(StepPlan, "run", lambda self, *a: runs.append(a) or original(self, *a))
    assert np.array_equal(kv.attention(0, q, causal=True, sinks=None), plain)
    assert len(runs) == 1
    out, lse = kv.attention(0, q, causal=True, return_lse=True)
    assert len(runs) == 2
    general = kv.attention(0, q, causal=True, return_lse=True, scale=np.float64(0.125))
    assert len(runs) == 2  # a numpy float scale: no plan
    assert np.array_equal(out, general[0]) and np.array_equal(lse, general[1])
    with pytest.raises(TypeError, match="return_lse"):
        kv.attention(0, q, causal=True, return_lse=1)


@pytest.mark.parametrize("per_sequence", [False, True])
def test_sinks_varlen(per_sequence):
    lens_q, lens_k = [5, 0, 17, 9], [7, 4, 17, 30]
    cu_q, cu_k = (np.concatenate([[0], np.cumsum(x)]) for x in (lens_q, lens_k))
    q, k, v, dout = rands((31, 4, 8), (58, 2, 8), (58, 2, 8), (31, 4, 8), seed=3)
    rng = np.random.default_rng(4)
    sinks = rng.uniform(-3, 3, (4, 4) if per_sequence else (4,))
    out, lse = cpuflash.attention_varlen(q, k, v, cu_q, cu_k, causal=True, sinks=sinks,
                                         return_lse=True)
    dq, dk, dv, dsinks = cpuflash.attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k,
                                                            causal=True, sinks=sinks)
    want_dsinks = np.zeros_like(sinks)
    for b in range(4):
        qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        s_b = sinks[b] if per_sequence else sinks
        heads = [x.transpose(1, 0, 2) for x in (q[qs], k[ks], v[ks], dout[qs])]
        ref, ref_lse = reference.attention(*heads[:3], causal=True, sinks=s_b, return_lse=True)
        *ref_grads, ref_ds = reference.attention_backward(heads[3], *heads[:3], causal=True,
                                                          sinks=s_b)
        np.testing.assert_allclose(out[qs].transpose(1, 0, 2), ref, rtol=2e-5, atol=2e-5)
        np.testing.assert_allclose(lse[:, qs], ref_lse, rtol=2e-5, atol=2e-5)
        for g, w, rows in zip((dq, dk, dv), ref_grads, (qs, ks, ks)):
            np.testing.assert_allclose(g[rows].transpose(1, 0, 2), w, rtol=2e-5, atol=2e-4)
        if per_sequence:
            want_dsinks[b] = ref_ds
        else:
            want_dsinks += ref_ds
    np.testing.assert_allclose(dsinks, want_dsinks, rtol=2e-5, atol=2e-5)


def test_sinks_with_out_vjp_and_threads():
    q, k, v, dout = rands((1, 4, 40, 16), (1, 4, 70, 16), (1, 4, 70, 16), (1, 4, 40, 16))
    sinks = np.array([0.0, 1.0, -1.0, 4.0], np.float32)
    buf = np.empty_like(q)
    assert cpuflash.attention(q, k, v, sinks=sinks, out=buf) is buf
    assert np.array_equal(buf, cpuflash.attention(q, k, v, sinks=sinks))
    strided = np.empty((1, 4, 40, 32), np.float32)[..., ::2]
    assert cpuflash.attention(q, k, v, sinks=sinks, out=strided) is strided
    assert np.array_equal(strided, buf)
    out, *grads = cpuflash.attention_vjp(q, k, v, dout, sinks=sinks)
    assert len(grads) == 4 and np.array_equal(out, buf)
    runs = on_threads(lambda: cpuflash.attention_vjp(q, k, v, dout, sinks=sinks), [1, 2])
    for a, b in zip(*runs):
        assert np.array_equal(a, b)


def test_bad_sinks_raise_before_any_kernel(monkeypatch):
    def no_kernel(*args, **kwargs):
        raise AssertionError("a kernel ran")
    monkeypatch.setattr(api, "run_forward", no_kernel)
    monkeypatch.setattr(api, "run_backward", no_kernel)
    q, k, v = rands((2, 4, 20, 8), (2, 2, 20, 8), (2, 2, 20, 8))
    cases = [([0.0] * 4, TypeError), (np.zeros(4, np.complex64), TypeError),
             (np.zeros(2), ValueError), (np.zeros((3, 4)), ValueError),
             (np.array([0.0, np.nan, 0, 0]), ValueError),
             (np.array([0.0, np.inf, 0, 0]), ValueError)]
    for sinks, error in cases:
        with pytest.raises(error, match="sinks"):
            cpuflash.attention(q, k, v, sinks=sinks)
        with pytest.raises(error, match="sinks"):
            cpuflash.attention_backward(q, q, k, v, q, q[..., 0], sinks=sinks)


def test_bad_sinks_raise_in_varlen_and_kvcache(monkeypatch):
    """The same checks where varlen (one row of sinks a sequence) and KVCache take them, before
    any kernel."""
    from cpuflash import varlen
    from cpuflash._cpu import decode

    def no_kernel(*args, **kwargs):
        raise AssertionError("a kernel ran")
    q, k, v = rands((9, 4, 8), (12, 2, 8), (12, 2, 8))
    cu_q, cu_k = np.array([0, 4, 9]), np.array([0, 5, 12])
    kv = cpuflash.KVCache(1, 1, 2, 64, 8)
    kv.append(0, k.transpose(1, 0, 2)[None], v.transpose(1, 0, 2)[None])
    monkeypatch.setattr(varlen, "run_varlen", no_kernel)
    monkeypatch.setattr(varlen, "attention_backward", no_kernel)
    monkeypatch.setattr(decode.decode, "call_built", no_kernel)
    monkeypatch.setattr(api, "run_forward", no_kernel)
    for sinks, error in [(np.zeros((3, 4)), ValueError), (np.zeros(5), ValueError),
                         ([0.0] * 4, TypeError), (np.array([np.nan, 0, 0, 0]), ValueError)]:
        with pytest.raises(error, match="sinks"):
            cpuflash.attention_varlen(q, k, v, cu_q, cu_k, sinks=sinks)
        with pytest.raises(error, match="sinks"):
            cpuflash.attention_varlen_backward(q, q, k, v, q, np.zeros((4, 9), np.float32),
                                               cu_q, cu_k, sinks=sinks)
        with pytest.raises(error, match="sinks"):
            kv.attention(0, q[:1].transpose(1, 0, 2)[None], causal=True, sinks=sinks)
