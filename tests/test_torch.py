"""``cpuflash.torch``: forward and gradients against torch's own SDPA, masks, GQA, causal
alignments, the options torch lacks against the float64 reference, dropout seeds, errors, and
no copies of the inputs."""
import subprocess
import sys

import numpy as np
import pytest

import cpuflash
from cpuflash import reference

torch = pytest.importorskip("torch")
ct = pytest.importorskip("cpuflash.torch")
F = torch.nn.functional
from torch.nn.attention.bias import causal_lower_right, causal_upper_left  # noqa: E402

TOL = {torch.float64: 1e-12, torch.float32: 2e-5}


def tensors(*shapes, dtype=torch.float64, seed=0, grad=True):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, dtype=dtype, generator=g).requires_grad_(grad) for s in shapes]


def run(fn, q, k, v, dout, **kw):
    out = fn(q, k, v, **kw)
    return (out, *torch.autograd.grad(out, (q, k, v), dout))


def assert_same(got, want, dtype):
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        torch.testing.assert_close(g, w, rtol=TOL[dtype], atol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n_q,n_k", [(1, 1), (37, 37), (65, 64), (17, 70), (70, 17), (1, 70)])
def test_matches_torch_sdpa(dtype, causal, n_q, n_k):
    q, k, v, dout = tensors((2, 4, n_q, 16), (2, 2, n_k, 16), (2, 2, n_k, 8), (2, 4, n_q, 8),
                            dtype=dtype)
    kw = {"is_causal": causal, "enable_gqa": True}
    assert_same(run(ct.scaled_dot_product_attention, q, k, v, dout, **kw),
                run(F.scaled_dot_product_attention, q, k, v, dout, **kw), dtype)


@pytest.mark.parametrize("kind", ["bool-keys", "bool-2d", "float-2d", "float-4d"])
def test_masks_match_torch(kind):
    q, k, v, dout = tensors((2, 3, 19, 8), (2, 3, 23, 8), (2, 3, 23, 8), (2, 3, 19, 8))
    g = torch.Generator().manual_seed(5)
    if kind == "bool-keys":  # key padding (B, 1, 1, Nk), every row keeps a key
        mask = torch.arange(23)[None, None, None, :] < torch.tensor([23, 9])[:, None, None, None]
    elif kind == "bool-2d":
        mask = torch.rand(19, 23, generator=g) > 0.3
        mask[:, 0] = True
    elif kind == "float-2d":
        mask = torch.randn(19, 23, dtype=torch.float64, generator=g)
    else:
        mask = torch.randn(2, 1, 19, 23, dtype=torch.float64, generator=g).expand(2, 3, 19, 23)
    assert_same(run(ct.scaled_dot_product_attention, q, k, v, dout, attn_mask=mask),
                run(F.scaled_dot_product_attention, q, k, v, dout, attn_mask=mask),
                torch.float64)


@pytest.mark.filterwarnings("ignore:Lower right causal bias")
@pytest.mark.parametrize("bias", [causal_lower_right, causal_upper_left])
@pytest.mark.parametrize("n_q,n_k", [(9, 30), (30, 9)])
def test_causal_bias_alignments(bias, n_q, n_k):
    q, k, v, dout = tensors((1, 2, n_q, 8), (1, 2, n_k, 8), (1, 2, n_k, 8), (1, 2, n_q, 8))
    assert_same(run(ct.scaled_dot_product_attention, q, k, v, dout, attn_mask=bias(n_q, n_k)),
                run(F.scaled_dot_product_attention, q, k, v, dout, attn_mask=bias(n_q, n_k)),
                torch.float64)


def test_options_torch_lacks_match_reference():
    q, k, v, dout = tensors((2, 4, 33, 16), (2, 2, 40, 16), (2, 2, 40, 16), (2, 4, 33, 16))
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625], dtype=torch.float64)
    opts = {"window": (8, 2), "softcap": 5.0}
    got = run(ct.scaled_dot_product_attention, q, k, v, dout, attn_mask=causal_lower_right(33, 40),
              alibi_slopes=slopes, enable_gqa=True, **opts)
    arrays = [x.detach().numpy() for x in (q, k, v, dout)]
    ref_opts = {"causal": True, "alibi_slopes": slopes.numpy(), **opts}
    want = (reference.attention(*arrays[:3], **ref_opts),
            *reference.attention_backward(arrays[3], *arrays[:3], **ref_opts))
    for g, w in zip(got, want):
        np.testing.assert_allclose(g.detach().numpy(), w, rtol=0, atol=1e-7)  # vector tanh


def test_gradcheck():
    q, k, v = tensors((1, 2, 5, 4), (1, 2, 6, 4), (1, 2, 6, 3))
    assert torch.autograd.gradcheck(
        lambda *x: ct.scaled_dot_product_attention(*x, softcap=2.0, window=(3, 1)), (q, k, v))


def test_sinks_match_gpt_oss_eager_attention():
    """transformers' gpt-oss eager attention: the sink a column of the scores, softmaxed with
    them, then dropped; gradients of q, k, v and the sinks by torch's autograd."""
    q, k, v, dout = tensors((2, 4, 9, 8), (2, 2, 12, 8), (2, 2, 12, 8), (2, 4, 9, 8))
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0], dtype=torch.float64, requires_grad=True)
    got = ct.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(9, 12),
                                          enable_gqa=True, sinks=sinks)
    got_grads = torch.autograd.grad(got, (q, k, v, sinks), dout)
    kr, vr = (x.repeat_interleave(2, dim=1) for x in (k, v))
    s = q @ kr.transpose(-1, -2) / 8 ** 0.5
    s = s.masked_fill(~torch.ones(9, 12, dtype=torch.bool).tril(3), -torch.inf)
    s = torch.cat([s, sinks.reshape(1, -1, 1, 1).expand(2, -1, 9, 1)], dim=-1)
    want = torch.softmax(s - s.amax(-1, keepdim=True), dim=-1)[..., :-1] @ vr
    want_grads = torch.autograd.grad(want, (q, k, v, sinks), dout)
    for g, w in zip((got, *got_grads), (want, *want_grads)):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradcheck(
        lambda *x: ct.scaled_dot_product_attention(*x[:3], sinks=x[3], is_causal=True),
        (q[:1, :2, :5, :4], k[:1, :2, :5, :4], v[:1, :2, :5, :4], sinks[:2]))


def test_bad_sinks():
    q, k, v = tensors((1, 2, 5, 4), (1, 2, 6, 4), (1, 2, 6, 4), grad=False)
    with pytest.raises(TypeError, match="sinks: expected a torch.Tensor"):
        ct.scaled_dot_product_attention(q, k, v, sinks=[0.0, 0.0])
    with pytest.raises(ValueError, match="sinks: expected shape"):
        ct.scaled_dot_product_attention(q, k, v, sinks=torch.zeros(3, dtype=torch.float64))
    with pytest.raises(ValueError, match="sinks: expected finite"):
        ct.scaled_dot_product_attention(q, k, v, sinks=torch.tensor([0.0, float("nan")]))


def test_dropout_follows_seeds():
    q, k, v, dout = tensors((1, 2, 24, 8), (1, 2, 24, 8), (1, 2, 24, 8), (1, 2, 24, 8))
    sdpa = ct.scaled_dot_product_attention
    a, b = sdpa(q, k, v, dropout_p=0.3, seed=7), sdpa(q, k, v, dropout_p=0.3, seed=7)
    assert torch.equal(a, b) and not torch.equal(a, sdpa(q, k, v, dropout_p=0.3, seed=8))
    torch.manual_seed(3)
    c = sdpa(q, k, v, dropout_p=0.3)
    torch.manual_seed(3)
    assert torch.equal(c, sdpa(q, k, v, dropout_p=0.3))
    # gradients regenerate the forward's mask
    got = run(sdpa, q, k, v, dout, dropout_p=0.3, seed=7)
    arrays = [x.detach().numpy() for x in (q, k, v, dout)]
    want = cpuflash.attention_vjp(*arrays[:3], arrays[3], dropout_p=0.3, seed=7)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g.detach().numpy(), w, rtol=1e-12, atol=1e-12)


def test_float16_and_strided_inputs():
    base = torch.randn(2, 50, 4, 3, 16, generator=torch.Generator().manual_seed(1))
    q, k, v = (base[..., i, :].transpose(1, 2) for i in range(3))  # (B, H, N, D) views
    assert not q.is_contiguous()
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(ct.scaled_dot_product_attention(q, k, v, is_causal=True), want,
                               rtol=2e-5, atol=2e-5)
    h = [x.half() for x in (q, k, v)]
    out = ct.scaled_dot_product_attention(*h, is_causal=True)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.float(), want, rtol=0, atol=2e-3)


def test_bfloat16_is_computed_in_float32_and_rounded_once():
    """bfloat16 q, k, v (and mask, sinks): the float32 call's results on the same values,
    rounded to bfloat16, bit for bit, gradients included; errors against the float64
    reference no larger than torch's own bfloat16 SDPA's."""
    q, k, v, dout = (x.detach().bfloat16() for x in tensors(
        (2, 4, 37, 16), (2, 2, 45, 16), (2, 2, 45, 8), (2, 4, 37, 8), seed=4))
    mask = torch.randn(2, 1, 37, 45, generator=torch.Generator().manual_seed(6))
    mask = mask.bfloat16().expand(2, 4, 37, 45)  # a broadcast view
    assert ct._mask_view(mask).strides[1] == 0  # widened without writing out its copies
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0]).bfloat16()
    kw = {"attn_mask": mask, "enable_gqa": True}
    wide = [x.float().requires_grad_() for x in (q, k, v)]
    want = run(ct.scaled_dot_product_attention, *wide, dout.float(), sinks=sinks.float(), **kw)
    got = run(ct.scaled_dot_product_attention, *(x.clone().requires_grad_() for x in (q, k, v)),
              dout, sinks=sinks, **kw)
    for g, w in zip(got, want):
        assert g.dtype == torch.bfloat16 and torch.equal(g, w.to(torch.bfloat16))
    # against the float64 reference (no sinks: torch has none)
    kw["attn_mask"] = mask[:, :1]
    out = ct.scaled_dot_product_attention(q, k, v, **kw)
    ref = reference.attention(*(x.double().numpy() for x in (q, k, v)),
                              mask=mask[:, :1].double().numpy())
    ours = np.abs(out.double().numpy() - ref).max()
    theirs = np.abs(F.scaled_dot_product_attention(q, k, v, **kw).double().numpy() - ref).max()
    assert ours <= theirs and ours <= 2.0**-8 * np.abs(ref).max()


def test_bfloat16_buffers_live_only_within_a_call():
    """Widened q, k, v (and dout) go to buffers that the next call reuses: two layers' forward
    calls before either backward pass, each with a bfloat16 mask kept for its backward, give
    each layer's gradients as a call of its own does."""
    def layer_inputs(seed):
        q, k, v = (x.detach().bfloat16() for x in tensors((1, 2, 20, 8), (1, 2, 20, 8),
                                                          (1, 2, 20, 8), seed=seed))
        mask = torch.randn(20, 20, generator=torch.Generator().manual_seed(seed)).bfloat16()
        return [x.requires_grad_() for x in (q, k, v)], mask

    def grads_alone(seed, weight):
        (q, k, v), mask = layer_inputs(seed)
        out = ct.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        (weight * out.float()).sum().backward()
        return [x.grad for x in (q, k, v)]

    (a, mask_a), (b, mask_b) = layer_inputs(1), layer_inputs(2)
    out_a = ct.scaled_dot_product_attention(*a, attn_mask=mask_a)
    out_b = ct.scaled_dot_product_attention(*b, attn_mask=mask_b)
    (out_a.float().sum() + 2 * out_b.float().sum()).backward()
    for got, want in zip([x.grad for x in a + b], grads_alone(1, 1) + grads_alone(2, 2)):
        assert torch.equal(got, want)


def test_inputs_are_not_copied():
    base = torch.randn(1, 40, 2, 3, 8)
    q = base[..., 0, :].transpose(1, 2)  # strided view
    view = ct._numpy_view("query", q)
    assert view.__array_interface__["data"][0] == q.data_ptr()
    assert np.shares_memory(view, base.numpy()) and view.strides == tuple(
        s * 4 for s in q.stride())
    out = ct.scaled_dot_product_attention(q, q, q)
    assert out.numpy().base is not None or out.is_contiguous()  # torch.from_numpy: shared


def test_requires_grad_paths():
    q, k, v = tensors((1, 1, 6, 4), (1, 1, 6, 4), (1, 1, 6, 4), grad=False)
    k.requires_grad_()
    out = ct.scaled_dot_product_attention(q, k, v)
    out.sum().backward()
    assert q.grad is None and k.grad is not None and v.grad is None
    with torch.no_grad():
        assert ct.scaled_dot_product_attention(q, k, v).grad_fn is None


def test_gradients_held_by_torch_are_never_reused():
    """cpuflash's gradient buffers are reused once nothing refers to them (pack.reusable): the
    tensors that torch.from_numpy made of one backward pass keep theirs."""
    q, k, v = tensors((1, 2, 20, 8), (1, 2, 20, 8), (1, 2, 20, 8))
    ct.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
    first = [x.grad for x in (q, k, v)]
    kept = [g.clone() for g in first]
    for x in (q, k, v):
        x.grad = None
    (2 * ct.scaled_dot_product_attention(q, k, v, is_causal=True)).sum().backward()
    for g, was, x in zip(first, kept, (q, k, v)):
        assert torch.equal(g, was)
        assert torch.allclose(x.grad, 2 * was, rtol=1e-5, atol=1e-6)


def test_errors():
    q, k, v = tensors((1, 4, 6, 8), (1, 2, 6, 8), (1, 2, 6, 8), grad=False)
    sdpa = ct.scaled_dot_product_attention
    with pytest.raises(ValueError, match="enable_gqa"):
        sdpa(q, k, v)
    with pytest.raises(TypeError, match="one dtype"):
        sdpa(q.bfloat16(), k.float(), v.float(), enable_gqa=True)
    with pytest.raises(TypeError, match="one dtype"):
        sdpa(q.float(), k.bfloat16(), v.float(), enable_gqa=True)
    with pytest.raises(TypeError, match="int32"):
        sdpa(q.int(), k, v, enable_gqa=True)
    with pytest.raises(TypeError, match="query"):
        sdpa(q.numpy(), k, v, enable_gqa=True)
    with pytest.raises(ValueError, match="CPU"):
        sdpa(torch.empty(1, 4, 6, 8, dtype=torch.float64, device="meta"), k, v)
    with pytest.raises(TypeError, match="dtype|one dtype"):
        sdpa(q.float(), k, v, enable_gqa=True)
    with pytest.raises(ValueError, match="attn_mask"):
        sdpa(q, k, v, attn_mask=torch.ones(6, 6, dtype=torch.bool), is_causal=True,
             enable_gqa=True)
    with pytest.raises(ValueError, match="attn_mask"):
        sdpa(q, k, v, attn_mask=torch.zeros(6, 6, dtype=torch.float64, requires_grad=True),
             enable_gqa=True)
    with pytest.raises(ValueError, match="ambiguous"):
        sdpa(q[:, :, :3], k, v, is_causal=True, window=(2, 0), enable_gqa=True)
    with pytest.raises(ValueError, match="seed|dropout"):
        sdpa(q, k, v, dropout_p=1.5, enable_gqa=True)


def test_import_cpuflash_does_not_import_torch():
    code = "import sys, cpuflash; assert 'torch' not in sys.modules"
    assert subprocess.run([sys.executable, "-c", code], check=False, timeout=300).returncode == 0
