"""The backward pass against the float64 reference backward and against finite differences."""
import numpy as np
import pytest

import cpuflash
from cpuflash import config, reference
from conftest import on_threads, rand, rands

BQ, BK = config.BLOCK_Q, config.BACKWARD_BLOCK_K


def grads(q, k, v, dout, causal=False, scale=None):
    out, lse = cpuflash.attention(q, k, v, causal=causal, scale=scale, return_lse=True)
    return cpuflash.attention_backward(dout, q, k, v, out, lse, causal=causal, scale=scale)


def rounding_budget(q, k, want):
    """A float32 rounding budget per gradient: eps * max|g| * sqrt(Nq + Nk), the growth of
    rounding error in sums of that many terms (float16 inputs compute in float32 too).
    test_against_torch_when_installed checks the errors against torch's on the same inputs."""
    if q.dtype == np.float64:
        return [0.0, 0.0, 0.0]
    eps = np.finfo(np.float32).eps
    return [eps * float(np.max(np.abs(w))) * np.sqrt(q.shape[-2] + k.shape[-2]) for w in want]


def check(q, k, v, dout, causal=False, scale=None):
    got = grads(q, k, v, dout, causal, scale)
    want = reference.attention_backward(dout, q, k, v, causal=causal, scale=scale)
    base = rounding_budget(q, k, want)
    for name, g, w, x, b in zip("qkv", got, want, (q, k, v), base):
        assert g.shape == x.shape and g.dtype == x.dtype, name
        if g.size == 0:
            continue
        err = float(np.max(np.abs(g.astype(np.float64) - w)))
        scale_w = max(1.0, float(np.max(np.abs(w))))
        if x.dtype == np.float64:
            tol = 1e-12 * scale_w
        elif x.dtype == np.float32:
            tol = 4 * b + 1e-6 * scale_w
        else:
            tol = 4 * b + 2 * np.finfo(np.float16).eps * scale_w
        assert err <= tol, f"d{name}: error {err:.3g} > {tol:.3g}"
    return got


@pytest.mark.parametrize("n_q,n_k", [(1, 1), (BQ - 1, BK + 1), (BQ + 1, BK - 1), (37, 200),
                                     (200, 37), (13, 13)])
@pytest.mark.parametrize("causal", [False, True])
def test_sequence_lengths(kernels, n_q, n_k, causal):
    check(rand((1, 2, n_q, 16), seed=1), rand((1, 2, n_k, 16), seed=2),
          rand((1, 2, n_k, 16), seed=3), rand((1, 2, n_q, 16), seed=4), causal)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_dtypes(kernels, dtype):
    check(rand((2, 2, 67, 24), dtype, 1), rand((2, 2, 131, 24), dtype, 2),
          rand((2, 2, 131, 24), dtype, 3), rand((2, 2, 67, 24), dtype, 4), causal=True)


@pytest.mark.parametrize("h_kv", [1, 2, 6])
def test_gqa_sums_over_the_group(kernels, h_kv):
    check(rand((1, 6, 33, 16), seed=1), rand((1, h_kv, 70, 16), seed=2),
          rand((1, h_kv, 70, 8), seed=3), rand((1, 6, 33, 8), seed=4), causal=True)


@pytest.mark.parametrize("d,dv", [(1, 1), (5, 3), (97, 33), (256, 128)])
def test_head_dims(kernels, d, dv):
    check(rand((1, 1, 19, d), seed=1), rand((1, 1, 150, d), seed=2),
          rand((1, 1, 150, dv), seed=3), rand((1, 1, 19, dv), seed=4), scale=0.3)


def test_strided_views_and_ranks():
    q = rand((40, 3, 16), seed=1).transpose(1, 0, 2)
    k = rand((3, 50, 16), seed=2)[:, ::-1]
    v = np.broadcast_to(rand((1, 50, 8), seed=3), (3, 50, 8))
    dout = rand((3, 40, 8), seed=4)
    got = check(q, k, v, dout, causal=True)
    dense = grads(*(np.ascontiguousarray(x) for x in (q, k, v, dout)), causal=True)
    for g, h in zip(got, dense):
        assert np.array_equal(g, h)
    check(q[0], k[0], v[0], dout[0])  # 2-D


def test_rows_without_keys_have_zero_gradient(kernels):
    q, k, v, do = rands((1, 1, 90, 8), (1, 1, 20, 8), (1, 1, 20, 8), (1, 1, 90, 8))
    dq, dk, dv = check(q, k, v, do, causal=True)
    assert np.all(dq[0, 0, :70] == 0) and np.all(np.isfinite(dq)) and np.all(np.isfinite(dk))


def test_finite_differences_float64():
    rng = np.random.default_rng(7)
    q, k, v = (rng.standard_normal(s) for s in ((1, 2, 5, 3), (1, 1, 7, 3), (1, 1, 7, 2)))
    dout = rng.standard_normal((1, 2, 5, 2))
    dq, dk, dv = grads(q, k, v, dout, causal=True)
    eps = 1e-6
    for x, g in ((q, dq), (k, dk), (v, dv)):
        for idx in np.ndindex(x.shape):
            old = x[idx]
            x[idx] = old + eps
            plus = np.sum(dout * cpuflash.attention(q, k, v, causal=True))
            x[idx] = old - eps
            minus = np.sum(dout * cpuflash.attention(q, k, v, causal=True))
            x[idx] = old
            assert abs((plus - minus) / (2 * eps) - g[idx]) < 1e-7


def test_vjp_matches_forward_and_backward():
    q, k, v, do = rands((1, 2, 30, 8), (1, 2, 30, 8), (1, 2, 30, 8), (1, 2, 30, 8))
    out, dq, dk, dv = cpuflash.attention_vjp(q, k, v, do, causal=True)
    assert np.array_equal(out, cpuflash.attention(q, k, v, causal=True))
    for a, b in zip((dq, dk, dv), grads(q, k, v, do, causal=True)):
        assert np.array_equal(a, b)


def test_reused_gradient_buffers_are_rewritten_and_never_taken_while_held():
    """The gradients come from a per-thread pool (pack.reusable): a dropped result's memory is
    handed out again, and must then be written in full (zeros for the keys past kv_lens, which
    no tile product touches); a result the caller still holds is never handed out."""
    q, k, v, do = rands((2, 2, 40, 16), (2, 2, 150, 16), (2, 2, 150, 16), (2, 2, 40, 16))
    kv_lens = np.array([150, 70])
    opts = dict(kv_lens=kv_lens, causal=True)
    out, lse = cpuflash.attention(q, k, v, return_lse=True, **opts)
    want = reference.attention_backward(do, q, k, v, **opts)
    first = cpuflash.attention_backward(do, q, k, v, out, lse, **opts)
    held = [g.copy() for g in first]
    for g in first:
        g.fill(np.nan)
    second = cpuflash.attention_backward(do, q, k, v, out, lse, **opts)
    assert not any(np.shares_memory(a, b) for a, b in zip(first, second))  # held: not reused
    assert all(np.isnan(g).all() for g in first)  # and not written
    addresses = [g.ctypes.data for g in second]  # the pool keeps these alive: no new array there
    for g in second:
        g.fill(np.nan)  # what a reuse must overwrite everywhere
    del second, g
    third = cpuflash.attention_backward(do, q, k, v, out, lse, **opts)
    assert [g.ctypes.data for g in third] == addresses  # dropped: reused
    for name, got, again, ref in zip("qkv", third, held, want):
        assert np.array_equal(got, again), name
        assert np.max(np.abs(got - ref)) < 1e-5, name
    assert not np.any(third[1][1, :, 70:]) and not np.any(third[2][1, :, 70:])


def test_plain_page_arrays(monkeypatch):
    """Arrays from ``pack.PLAIN_PAGES_FROM_BYTES`` on come from their own mapping of plain
    pages (``pack.empty``). With the threshold at 1 byte every output, gradient, packed K/V
    and scratch array of a forward and backward pass does, and the results are the same bits
    as with numpy's arrays."""
    import threading
    from cpuflash._cpu import pack
    q, k, v, do = rands((1, 2, 70, 16), (1, 1, 90, 16), (1, 1, 90, 24), (1, 2, 70, 24))
    out, lse = cpuflash.attention(q, k, v, causal=True, return_lse=True)
    want = (out, lse) + tuple(grads(q, k, v, do, causal=True))
    monkeypatch.setattr(pack, "PLAIN_PAGES_FROM_BYTES", 1)
    monkeypatch.setattr(pack, "_workspace", threading.local())  # no buffer kept from before
    out, lse = cpuflash.attention(q, k, v, causal=True, return_lse=True)
    got = (out, lse) + tuple(grads(q, k, v, do, causal=True))
    assert out.base is not None and got[2].base is not None  # over a mapping, not numpy's
    for a, b in zip(got, want):
        assert a.flags.c_contiguous and a.flags.writeable and a.dtype == b.dtype
        assert np.array_equal(a, b)
    x = pack.empty((3, 5), np.float32)
    assert x.shape == (3, 5) and x.ctypes.data % 4096 == 0 and x.flags.writeable
    assert pack.empty((0, 5), np.float32).shape == (0, 5)


@pytest.mark.parametrize("causal", [False, True])
def test_bitwise_identical_across_threads_and_runs(causal):
    q, k, v, do = rands((1, 1, 150, 16), (1, 1, 600, 16), (1, 1, 600, 16), (1, 1, 150, 16))
    results = on_threads(lambda: grads(q, k, v, do, causal), (1, None, None))
    for r in results[1:]:
        for a, b in zip(r, results[0]):
            assert np.array_equal(a, b)


def test_against_torch_when_installed():
    torch = pytest.importorskip("torch")
    q, k, v, do = rands((1, 4, 100, 32), (1, 2, 100, 32), (1, 2, 100, 32), (1, 4, 100, 32))
    want = reference.attention_backward(do, q, k, v, causal=True)
    tq, tk, tv = (torch.from_numpy(x).clone().requires_grad_() for x in (q, k, v))
    torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=True, enable_gqa=True
                                                     ).backward(torch.from_numpy(do))
    ours = grads(q, k, v, do, causal=True)
    for o, t, w in zip(ours, (tq.grad.numpy(), tk.grad.numpy(), tv.grad.numpy()), want):
        assert np.abs(o - w).max() <= 2 * np.abs(t - w).max() + 1e-6


Q, K, V = rand((1, 2, 8, 4)), rand((1, 2, 9, 4)), rand((1, 2, 9, 4))
# From the reference, not a kernel: at import, a kernel's compilation would hold up the
# collection of the session, and with it the start of the background runs (conftest.py).
OUT, LSE = (x.astype(np.float32) for x in reference.attention(Q, K, V, return_lse=True))


@pytest.mark.parametrize("args,exc,words", [
    ((rand((1, 2, 8, 3)), Q, K, V, OUT, LSE), ValueError, "dout: expected shape"),
    ((OUT.astype(np.float64), Q, K, V, OUT, LSE), TypeError, "dout: expected dtype"),
    ((OUT, Q, K, V, OUT[:, :1], LSE), ValueError, "out: expected shape"),
    ((OUT, Q, K, V, OUT, LSE[..., :3]), ValueError, "lse: expected shape"),
    ((OUT, Q, K, V, OUT, LSE.astype(np.float64)), TypeError, "lse: expected dtype"),
    ((OUT, Q, K, V, OUT, LSE.tolist()), TypeError, "lse: expected a numpy.ndarray"),
    ((OUT, Q, K, V.astype(np.float64), OUT, LSE), TypeError, "v=float64"),
])
def test_bad_input(args, exc, words):
    with pytest.raises(exc, match=words):
        cpuflash.attention_backward(*args)


@pytest.mark.parametrize("d", [40, 64])
def test_one_hot_rows_give_their_value_and_dout_exactly(d, kernels):
    # Each query sees its own key with score 9 * scale = 90 and every other key with 0: one-hot
    # rows (the others' e^-90 is far below float32's resolution). Scores in natural units make
    # the row's lse exactly its largest score, so the backward pass's P = exp(S - lse) is
    # exactly 1 and dV = dO, bit for bit. With scores in base 2 (Q carrying scale * log2(e),
    # until stop 30) the lse, stored in natural units, was the base-2 maximum times ln 2,
    # rounded: P came out as 1 +- a few 1e-6.
    n = 40
    q = np.zeros((1, 2, n, d), dtype=np.float32)
    for i in range(n):
        q[:, :, i, i % d] = 3.0
    v, dout = rands((1, 2, n, d), (1, 2, n, d))
    out, lse = cpuflash.attention(q, q, v, scale=10.0, return_lse=True)
    assert np.array_equal(out, v) and np.all(lse == np.float32(90.0))
    dq, dk, dv = cpuflash.attention_backward(dout, q, q, v, out, lse, scale=10.0)
    assert np.array_equal(dv, dout)


@pytest.mark.parametrize("n_q", [65, 100, 200])
def test_dq_rows_give_the_same_bits_in_a_short_last_query_block(n_q):
    """The backward pass computes a short last query block's own rows, not its padding (stop
    62): dQ's rows are those the same rows get among 256 query rows, bit for bit. dK and dV
    sum over every query row, so they are checked against the reference (``check``)."""
    q, dout = rands((1, 2, 256, 64), (1, 2, 256, 64), seed=n_q)
    k, v = rands((1, 2, 200, 64), (1, 2, 200, 64), seed=n_q + 10)
    full = grads(q, k, v, dout)
    part = check(q[:, :, :n_q], k, v, dout[:, :, :n_q])
    assert np.array_equal(part[0], full[0][:, :, :n_q])
