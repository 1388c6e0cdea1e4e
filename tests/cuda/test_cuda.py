"""The CUDA path against the float64 reference: the features of the CPU path, float32 and
float16, GPU arrays in and out. Tiny shapes in the simulator (its tiles are 4 x 8, so these
still cross tile edges); larger ones on a GPU with CPUFLASH_CUDA_BIG=1."""
import numpy as np
import pytest
from cuda_env import BIG, SIMULATED, cuda

import cpuflash
from cpuflash import reference

# (B, Hq, Hkv, Nq, Nk, D, Dv)
SHAPES = [(1, 2, 1, 5, 7, 8, 8), (2, 2, 2, 9, 3, 5, 6)]
if BIG:
    SHAPES += [(1, 1, 1, 1, 11, 8, 8)]
    SHAPES += [(2, 4, 2, 130, 257, 64, 64), (1, 2, 2, 200, 100, 128, 128),
               (1, 2, 1, 67, 67, 256, 256), (1, 2, 2, 97, 131, 40, 72)]


def rands(*shapes, dtype=np.float32, seed=1):
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal(s).astype(dtype) for s in shapes)


def qkv(shape, dtype=np.float32, seed=1):
    n_b, n_hq, n_hkv, n_q, n_k, d, dv = shape
    return rands((n_b, n_hq, n_q, d), (n_b, n_hkv, n_k, d), (n_b, n_hkv, n_k, dv),
                 dtype=dtype, seed=seed)


def on_gpu(*xs):
    return tuple(cuda.to_device(np.ascontiguousarray(x)) for x in xs)


def tol(dtype, ref):
    scale = max(1.0, float(np.max(np.abs(ref)))) if ref.size else 1.0
    return (2e-5 if dtype == np.float32 else 4e-3) * scale


OPTIONS = [{}, {"causal": True}, {"window": (3, 1)}, {"causal": True, "window": (2, None)},
           {"softcap": 2.0}, {"alibi": True}, {"kv_lens": True, "causal": True},
           {"scale": 0.3}]


def _opts(opt, shape):
    opt = dict(opt)
    if opt.pop("alibi", False):
        opt["alibi_slopes"] = np.linspace(0.1, 0.7, shape[1])
    if opt.pop("kv_lens", False):
        opt["kv_lens"] = np.arange(shape[0], dtype=np.int64) % (shape[4] + 1)
    return opt


# Every option on every shape, in the simulator too (0.4-2 s a case there since
# tests/cuda/conftest.py's switch interval; 9-14 s before, when the second shape took only the
# options that move the band).
FORWARD_CASES = [(shape, opt) for shape in SHAPES for opt in OPTIONS]


@pytest.mark.parametrize("shape, opt", FORWARD_CASES, ids=str)
def test_forward(shape, opt):
    opts = _opts(opt, shape)
    q, k, v = qkv(shape)
    out, lse = cpuflash.attention(*on_gpu(q, k, v), return_lse=True, **opts)
    ref, ref_lse = reference.attention(q, k, v, return_lse=True, **opts)
    out, lse = out.copy_to_host(), lse.copy_to_host()
    assert out.dtype == np.float32 and lse.dtype == np.float32
    np.testing.assert_allclose(out, ref, atol=tol(np.float32, ref), rtol=0)
    finite = np.isfinite(ref_lse)
    np.testing.assert_array_equal(np.isfinite(lse), finite)
    np.testing.assert_allclose(lse[finite], ref_lse[finite], atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("shape", SHAPES[:1] + SHAPES[3:], ids=str)
@pytest.mark.parametrize("opt", [{}, {"causal": True, "softcap": 1.5, "alibi": True}], ids=str)
def test_float16(shape, opt):
    opts = _opts(opt, shape)
    q, k, v = qkv(shape, np.float16)
    out = cpuflash.attention(*on_gpu(q, k, v), **opts).copy_to_host()
    ref = reference.attention(q, k, v, **opts)
    assert out.dtype == np.float16
    np.testing.assert_allclose(out, ref, atol=tol(np.float16, ref), rtol=0)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("opt", [{"causal": True}, {"window": (2, 1), "kv_lens": True},
                                 {"softcap": 1.5, "alibi": True, "causal": True}], ids=str)
def test_backward(shape, opt):
    opts = _opts(opt, shape)
    q, k, v = qkv(shape)
    (dout,) = rands(q.shape[:-1] + (v.shape[-1],), seed=7)
    gq, gk, gv, gdo = on_gpu(q, k, v, dout)
    out, lse = cpuflash.attention(gq, gk, gv, return_lse=True, **opts)
    grads = cpuflash.attention_backward(gdo, gq, gk, gv, out, lse, **opts)
    refs = reference.attention_backward(dout, q, k, v, **opts)
    for name, g, r in zip(("dq", "dk", "dv"), grads, refs):
        g = g.copy_to_host()
        assert g.shape == r.shape and g.dtype == np.float32, name
        np.testing.assert_allclose(g, r, atol=5 * tol(np.float32, r), rtol=0, err_msg=name)


def test_backward_float16():
    shape = SHAPES[-1] if BIG else SHAPES[0]
    q, k, v = qkv(shape, np.float16)
    (dout,) = rands(q.shape[:-1] + (v.shape[-1],), dtype=np.float16, seed=7)
    out, lse = cpuflash.attention(q, k, v, return_lse=True, causal=True, device="cuda")
    grads = cpuflash.attention_backward(dout, q, k, v, out, lse, causal=True, device="cuda")
    refs = reference.attention_backward(dout, q, k, v, causal=True)
    for g, r in zip(grads, refs):
        assert isinstance(g, np.ndarray) and g.dtype == np.float16
        np.testing.assert_allclose(g, r, atol=1e-2 * max(1.0, np.abs(r).max()), rtol=0)


@pytest.mark.parametrize("per_batch", [False, True])
def test_sinks(per_batch):
    """Attention sinks, forward (each forward kernel adds the sinks to its rows' sums,
    ``tiles.finish_lines``) and backward with ``dsinks`` (``_cuda/sinks.py``), against the
    reference; a row that sees no key gives output 0 and ``lse = c``, a sink of -inf none at
    all."""
    shape = SHAPES[-1] if BIG else SHAPES[0]
    q, k, v = qkv(shape)
    (dout,) = rands(q.shape[:-1] + (v.shape[-1],), seed=7)
    n_b, n_hq = shape[:2]
    sinks = np.linspace(-1.0, 2.0, n_b * n_hq).reshape(n_b, n_hq).astype(np.float32)
    sinks = sinks if per_batch else sinks[0]
    sinks[..., -1] = -np.inf
    opts = {"causal": True, "kv_lens": np.arange(n_b, dtype=np.int64) * 0 + 2}
    opts["kv_lens"][0] = 0  # batch 0: no key at all
    gq, gk, gv, gdo = on_gpu(q, k, v, dout)
    out, lse = cpuflash.attention(gq, gk, gv, return_lse=True, sinks=sinks, **opts)
    ref, ref_lse = reference.attention(q, k, v, return_lse=True, sinks=sinks, **opts)
    out, lse = out.copy_to_host(), lse.copy_to_host()
    np.testing.assert_allclose(out, ref, atol=tol(np.float32, ref), rtol=0)
    assert np.array_equal(np.isfinite(lse), np.isfinite(ref_lse))
    seen = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse[seen], ref_lse[seen], atol=2e-5, rtol=2e-5)
    assert np.all(out[0] == 0)
    grads = cpuflash.attention_backward(gdo, gq, gk, gv, *on_gpu(out, lse), sinks=sinks, **opts)
    refs = reference.attention_backward(dout, q, k, v, sinks=sinks, **opts)
    assert len(grads) == 4
    for name, g, r in zip(("dq", "dk", "dv", "dsinks"), grads, refs):
        g = g.copy_to_host()
        assert g.shape == r.shape and g.dtype == np.float32, name
        np.testing.assert_allclose(g, r, atol=5 * tol(np.float32, r), rtol=0, err_msg=name)
    # numpy in and out (device="cuda"): the same numbers
    out_np = cpuflash.attention(q, k, v, sinks=sinks, device="cuda", **opts)
    assert isinstance(out_np, np.ndarray) and np.array_equal(out_np, out)
    with pytest.raises(ValueError, match="sinks"):
        cpuflash.attention(gq, gk, gv, sinks=np.zeros(n_hq + 1))


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("tensor_cores", [True, False], ids=["mma", "simt"])
def test_sinks_in_every_forward_kernel(dtype, tensor_cores, monkeypatch):
    """Each forward kernel (the tensor-core kernels of float32 and float16 on a GPU, the SIMT
    kernel with ``CPUFLASH_CUDA_MMA=0`` and in the simulator) with a sink per head: near the
    scores, 1000 above them (``2^(c - m)`` would overflow float32 without the shift by the
    larger: output 0, ``lse = c``), 1000 below, -inf (none); rows that see no key (batch 0)
    give output 0 and ``lse`` exactly the sink's float32 value."""
    if not tensor_cores:
        monkeypatch.setenv("CPUFLASH_CUDA_MMA", "0")
    elif SIMULATED:
        pytest.skip("the simulator runs the SIMT kernel only")
    shape = (2, 4, 2, 130, 257, 64, 64) if BIG else (2, 4, 2, 5, 9, 8, 8)
    q, k, v = qkv(shape, dtype)
    sinks = np.array([0.25, 1000.0, -1000.0, -np.inf], dtype=np.float32)
    opts = {"causal": True, "kv_lens": np.array([0, shape[4] - 2])}
    out, lse = cpuflash.attention(*on_gpu(q, k, v), return_lse=True, sinks=sinks, **opts)
    ref, ref_lse = reference.attention(q, k, v, return_lse=True, sinks=sinks, **opts)
    out, lse = out.copy_to_host(), lse.copy_to_host()
    assert out.dtype == dtype and lse.dtype == np.float32
    np.testing.assert_allclose(out, ref, atol=tol(dtype, ref), rtol=0)
    np.testing.assert_allclose(lse[1], ref_lse[1], atol=1e-4, rtol=1e-5)
    assert np.all(out[0] == 0) and np.array_equal(lse[0], np.broadcast_to(sinks[:, None],
                                                                          lse[0].shape))
    assert np.all(out[1, 1] == 0)  # the sink 1000 above every score takes all the weight
    plain = cpuflash.attention(*on_gpu(q, k, v), sinks=np.full(4, -np.inf), **opts)
    assert np.array_equal(plain.copy_to_host(),
                          cpuflash.attention(*on_gpu(q, k, v), **opts).copy_to_host())


def test_ranks_and_strides():
    """2-D and 3-D inputs, and transposed views of a (B, N, H, D) buffer, read in place."""
    (x,) = rands((2, 9, 3, 8))
    q4 = x.transpose(0, 2, 1, 3)
    ref = reference.attention(q4, q4, q4, causal=True)
    if not SIMULATED:  # a transposed view of a (B, N, H, D) buffer, through torch
        torch = pytest.importorskip("torch")
        view = torch.from_numpy(x).cuda().transpose(1, 2)
        out = cpuflash.attention(view, view, view, causal=True).cpu().numpy()
        np.testing.assert_allclose(out, ref, atol=2e-5)
    for sub in (q4[0], q4[0, 1]):
        ref = reference.attention(sub, sub, sub)
        out = cpuflash.attention(*on_gpu(sub, sub, sub))
        assert out.shape == ref.shape
        np.testing.assert_allclose(out.copy_to_host(), ref, atol=2e-5)
        out_np, lse = cpuflash.attention(sub, sub, sub, device="cuda", return_lse=True)
        assert isinstance(out_np, np.ndarray) and lse.shape == sub.shape[:-1]


def test_rows_that_see_nothing():
    q, k, v = qkv((2, 1, 1, 6, 5, 8, 8))
    kv_lens = np.array([0, 3])
    out, lse = cpuflash.attention(*on_gpu(q, k, v), kv_lens=kv_lens, window=(0, 0),
                                  return_lse=True)
    ref, ref_lse = reference.attention(q, k, v, kv_lens=kv_lens, window=(0, 0), return_lse=True)
    out = out.copy_to_host()
    assert not np.isnan(out).any()
    np.testing.assert_allclose(out, ref, atol=2e-5)
    np.testing.assert_array_equal(lse.copy_to_host() == -np.inf, ref_lse == -np.inf)


def test_out_and_empty():
    q, k, v = qkv((1, 2, 1, 5, 7, 8, 8))
    out = cuda.device_array(q.shape, dtype=np.float32)
    got = cpuflash.attention(*on_gpu(q, k, v), out=out)
    assert got is out
    np.testing.assert_allclose(out.copy_to_host(), reference.attention(q, k, v), atol=2e-5)
    empty = cpuflash.attention(*on_gpu(q[:, :, :0], k, v))
    assert empty.shape == (1, 2, 0, 8)
    none = cpuflash.attention(*on_gpu(q, k[:, :, :0], v[:, :, :0])).copy_to_host()
    assert (none == 0).all()
    with pytest.raises(TypeError, match="out: expected a GPU array"):
        cpuflash.attention(*on_gpu(q, k, v), out=np.empty(q.shape, np.float32))
    with pytest.raises(ValueError, match="out: expected shape"):
        cpuflash.attention(*on_gpu(q, k, v), out=cuda.device_array((1, 2, 5, 7), np.float32))
    host_out = np.empty(q.shape, np.float32)  # numpy inputs on the GPU: out is numpy
    assert cpuflash.attention(q, k, v, device="cuda", out=host_out) is host_out
    np.testing.assert_allclose(host_out, reference.attention(q, k, v), atol=2e-5)


def _mask(kind, shape):
    """A mask of ``kind`` for ``shape``, on the host: "bool" (B, 1, Nq, Nk) with one query row
    of batch 0 that sees no key, "float" (Hq, 1, Nk) with a key at -inf, "float16" (Nq, Nk)."""
    n_b, n_hq, _, n_q, n_k = shape[:5]
    rng = np.random.default_rng(3)
    if kind == "bool":
        m = rng.random((n_b, 1, n_q, n_k)) > 0.3
        m[0, 0, min(1, n_q - 1)] = False
        return m
    if kind == "float":
        m = rng.standard_normal((n_hq, 1, n_k)).astype(np.float32)
        m[..., n_k // 2] = -np.inf
        return m
    return rng.standard_normal((n_q, n_k)).astype(np.float16)


MASK_OPTIONS = [{"mask": "bool"}, {"mask": "float", "causal": True},
                {"mask": "float16", "window": (3, 1)}, {"dropout_p": 0.3, "seed": 11},
                {"mask": "bool", "dropout_p": 0.25, "seed": 2**40 + 5, "softcap": 2.0,
                 "alibi": True, "kv_lens": True}]
# each option once in the simulator (a forward and backward there takes 10-30 s), the last
# with two batches and GQA; every option on the larger shapes on a GPU
MASK_CASES = [(SHAPES[0], opt) for opt in MASK_OPTIONS[:-1]]
MASK_CASES += [((2, 2, 1, 5, 6, 8, 8), MASK_OPTIONS[-1])]
if BIG:
    MASK_CASES += [(shape, opt) for shape in SHAPES[3:] for opt in MASK_OPTIONS]


def _mask_opts(opt, shape):
    """``(options for the reference, the same with the mask on the GPU)``; ``kv_lens``: all
    keys but one in batch 0, half of them in the others."""
    opts = _opts(opt, shape)
    if "kv_lens" in opts:
        opts["kv_lens"] = np.full(shape[0], shape[4] // 2, dtype=np.int64)
        opts["kv_lens"][0] = shape[4] - 1
    if "mask" not in opts:
        return opts, opts
    opts["mask"] = _mask(opts["mask"], shape)
    return opts, dict(opts, mask=cuda.to_device(opts["mask"]))


@pytest.mark.parametrize("shape, opt", MASK_CASES, ids=str)
def test_mask_and_dropout(shape, opt):
    """The caller's bool/float masks (broadcast, float16, -inf, rows that see nothing) and
    dropout (the CPU path's hash, so the reference's keep mask) through the SIMT kernels,
    forward and backward, against the float64 reference."""
    ref_opts, opts = _mask_opts(opt, shape)
    q, k, v = qkv(shape)
    (dout,) = rands(q.shape[:-1] + (v.shape[-1],), seed=7)
    gq, gk, gv, gdo = on_gpu(q, k, v, dout)
    out, lse = cpuflash.attention(gq, gk, gv, return_lse=True, **opts)
    ref, ref_lse = reference.attention(q, k, v, return_lse=True, **ref_opts)
    host_out, host_lse = out.copy_to_host(), lse.copy_to_host()
    np.testing.assert_allclose(host_out, ref, atol=tol(np.float32, ref), rtol=0)
    finite = np.isfinite(ref_lse)
    np.testing.assert_array_equal(np.isfinite(host_lse), finite)
    np.testing.assert_allclose(host_lse[finite], ref_lse[finite], atol=1e-4, rtol=1e-5)
    grads = cpuflash.attention_backward(gdo, gq, gk, gv, out, lse, **opts)
    refs = reference.attention_backward(dout, q, k, v, **ref_opts)
    for name, g, r in zip(("dq", "dk", "dv"), grads, refs):
        g = g.copy_to_host()
        assert np.all(np.isfinite(g)), name
        np.testing.assert_allclose(g, r, atol=5 * tol(np.float32, r), rtol=0, err_msg=name)


@pytest.mark.parametrize("cache", ["float16", "int8", "int8 under float16 q"])
def test_kv_cache_formats(cache):
    """K/V caches as the CPU path takes them, read in place by the SIMT kernel: float16 K/V
    under a float32 q, int8 K/V with a scale per token and head (q float32 or float16), against
    the reference on the K/V they stand for; numpy inputs with device="cuda" too."""
    shape = (1, 4, 2, 3, 9, 8, 8)  # GQA, a few queries against the cache (decoding)
    q, k, v = qkv(shape)
    if cache == "float16":
        k_c, v_c, scales = k.astype(np.float16), v.astype(np.float16), {}
        k_ref, v_ref = k_c.astype(np.float32), v_c.astype(np.float32)
    else:
        (k_c, k_s), (v_c, v_s) = cpuflash.quantize_int8(k), cpuflash.quantize_int8(v)
        scales = {"k_scale": k_s, "v_scale": v_s}
        k_ref, v_ref = k_c * k_s[..., None], v_c * v_s[..., None]
        if cache.endswith("float16 q"):
            q = q.astype(np.float16)
    ref = reference.attention(q, k_ref, v_ref, causal=True)
    on_device = dict(zip(scales, on_gpu(*scales.values())))
    out = cpuflash.attention(*on_gpu(q, k_c, v_c), causal=True, **on_device).copy_to_host()
    assert out.dtype == q.dtype
    np.testing.assert_allclose(out, ref, atol=tol(q.dtype, ref), rtol=0)
    out = cpuflash.attention(q, k_c, v_c, causal=True, device="cuda", **scales)
    np.testing.assert_allclose(out, ref, atol=tol(q.dtype, ref), rtol=0)
    # a KVCache in that format (K copied out of its blocks of keys for the GPU)
    kv_cache = cpuflash.KVCache(1, 1, 2, 9, 8, dtype=cache.split()[0])
    kv_cache.append(0, k, v)
    out = kv_cache.attention(0, q, causal=True, device="cuda")
    np.testing.assert_allclose(out, ref, atol=tol(q.dtype, ref), rtol=0)


def test_kv_cache_format_errors():
    q, k, v = qkv((1, 2, 1, 3, 7, 8, 8))
    (k8, k_s), (v8, v_s) = cpuflash.quantize_int8(k), cpuflash.quantize_int8(v)
    gq, gk, gv, gk8, gv8, gks, gvs = on_gpu(q, k, v, k8, v8, k_s, v_s)
    with pytest.raises(TypeError, match="k_scale: required"):
        cpuflash.attention(gq, gk8, gv8)
    with pytest.raises(TypeError, match="k_scale, v_scale: only for int8"):
        cpuflash.attention(gq, gk, gv, k_scale=gks, v_scale=gvs)
    with pytest.raises(TypeError, match="k_scale: expected a GPU array"):
        cpuflash.attention(gq, gk8, gv8, k_scale=k_s, v_scale=gvs)
    with pytest.raises(ValueError, match="v_scale: expected shape"):
        cpuflash.attention(gq, gk8, gv8, k_scale=gks, v_scale=on_gpu(v_s[..., :3])[0])
    g16 = on_gpu(k.astype(np.float16))[0]
    with pytest.raises(TypeError, match="one dtype"):  # the backward takes one dtype
        cpuflash.attention_backward(gq, gq, g16, g16, gq, on_gpu(q[..., 0])[0])


def test_mask_from_numpy_and_float16_inputs():
    """numpy inputs (device="cuda") with a float64 numpy mask (converted on the host), and
    float16 inputs with a bool mask; a numpy mask beside GPU inputs is refused."""
    shape = SHAPES[0]
    q, k, v = qkv(shape)
    mask = _mask("float", shape).astype(np.float64)
    out = cpuflash.attention(q, k, v, mask=mask, device="cuda")
    ref = reference.attention(q, k, v, mask=mask)
    np.testing.assert_allclose(out, ref, atol=tol(np.float32, ref), rtol=0)
    h16 = [x.astype(np.float16) for x in (q, k, v)]
    bool_mask = _mask("bool", shape)
    out = cpuflash.attention(*on_gpu(*h16), mask=cuda.to_device(bool_mask), dropout_p=0.2,
                             seed=3).copy_to_host()
    ref = reference.attention(*h16, mask=bool_mask, dropout_p=0.2, seed=3)
    assert out.dtype == np.float16
    np.testing.assert_allclose(out, ref, atol=tol(np.float16, ref), rtol=0)
    with pytest.raises(TypeError, match="mask: expected a GPU array"):
        cpuflash.attention(*on_gpu(q, k, v), mask=bool_mask)


@pytest.mark.parametrize("kwargs, error, match", [
    ({"mask": np.ones((5, 7), np.int32)}, TypeError, "mask: expected a bool or float"),
    ({"mask": np.ones((3, 7), bool)}, ValueError, "mask: shape"),
    ({"mask": np.ones((1, 1, 1, 5, 7), bool)}, ValueError, "mask: expected at most 4"),
    ({"mask": np.ones((5, 7), np.float64)}, NotImplementedError, "mask: a float64"),
    ({"dropout_p": 0.1}, ValueError, "seed: required"),
    ({"dropout_p": 1.0, "seed": 1}, ValueError, "dropout_p"),
    ({"window": (-2, 0)}, ValueError, "window"),
    ({"scale": float("nan")}, ValueError, "scale"),
    ({"device": "tpu"}, ValueError, "device"),
])
def test_errors(kwargs, error, match):
    q, k, v = qkv((1, 2, 1, 5, 7, 8, 8))
    if "mask" in kwargs:
        kwargs = dict(kwargs, mask=cuda.to_device(kwargs["mask"]))
    with pytest.raises(error, match=match):
        cpuflash.attention(*on_gpu(q, k, v), **kwargs)


def test_dtype_errors():
    q, k, v = qkv((1, 1, 1, 4, 4, 8, 8), np.float64)
    with pytest.raises(NotImplementedError, match="float64"):
        cpuflash.attention(*on_gpu(q, k, v))
    q, k, v = qkv((1, 1, 1, 4, 4, 8, 8))
    with pytest.raises(TypeError, match="one dtype"):
        cpuflash.attention(*on_gpu(q, k, v.astype(np.float16)))
    with pytest.raises(TypeError, match="GPU array"):
        cpuflash.attention(cuda.to_device(q), k, v)
    (big,) = rands((1, 1, 2, 264))
    with pytest.raises(NotImplementedError, match="256"):
        cpuflash.attention(*on_gpu(big, big, big))

    class Masked:  # a producer that exports a validity mask: refused, never read
        __cuda_array_interface__ = {"shape": (2, 8), "typestr": "<f4", "data": (0, False),
                                    "version": 3, "mask": object()}

    with pytest.raises(NotImplementedError, match="masked"):
        cpuflash.attention(Masked(), Masked(), Masked())


@pytest.mark.skipif(SIMULATED, reason="torch CUDA tensors need a GPU")
@pytest.mark.parametrize("opt", [{"is_causal": True}, {"mask": True, "dropout_p": 0.2, "seed": 5},
                                 {"softcap": 5.0, "window": (8, 0), "dropout_p": 0.1, "seed": 6},
                                 {"is_causal": True, "sinks": True}],
                         ids=str)
def test_torch_dropin_on_cuda_tensors(opt):
    """``cpuflash.torch``'s SDPA on CUDA tensors: output and gradients as the same call on CPU
    tensors (dropout included: both paths drop by the same hash), top-left causal with
    Nq < Nk (keys cut, their gradients padded with zeros on the GPU)."""
    torch = pytest.importorskip("torch")
    from cpuflash.torch import scaled_dot_product_attention as sdpa
    shape = (2, 4, 2, 37, 53, 64, 64)
    q, k, v = qkv(shape)
    (dout,) = rands(q.shape, seed=7)
    opts = dict(opt, enable_gqa=True)
    mask = torch.from_numpy(_mask("bool", shape)) if opts.pop("mask", False) else None
    sinks = np.linspace(-1.0, 3.0, 4).astype(np.float32) if opts.pop("sinks", False) else None
    results = {}
    for device in ("cpu", "cuda"):
        ts = [torch.from_numpy(x).to(device).requires_grad_() for x in (q, k, v)]
        if sinks is not None:  # differentiable, on the device of q
            ts.append(torch.from_numpy(sinks).to(device).requires_grad_())
            opts["sinks"] = ts[-1]
        out = sdpa(*ts[:3], attn_mask=None if mask is None else mask.to(device), **opts)
        assert out.device.type == device
        out.backward(torch.from_numpy(dout).to(device))
        results[device] = [out.detach().cpu().numpy()] + [t.grad.cpu().numpy() for t in ts]
    for name, cpu, gpu in zip(("out", "dq", "dk", "dv", "dsinks"), results["cpu"],
                              results["cuda"]):
        np.testing.assert_allclose(gpu, cpu, atol=5 * tol(np.float32, cpu), rtol=0, err_msg=name)
    cuda_qkv = [torch.from_numpy(x).cuda() for x in (q, k, v)]
    if mask is not None:  # a mask on the CPU beside CUDA tensors: refused, naming it
        with pytest.raises(TypeError, match="mask: expected a GPU array"):
            sdpa(*cuda_qkv, attn_mask=mask, **opts)
    # bfloat16: the float32 call on the same values, its output rounded once (as on the CPU)
    halves = [x.bfloat16() for x in cuda_qkv]
    got, want = sdpa(*halves, **opts), sdpa(*(x.float() for x in halves), **opts)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want.to(torch.bfloat16))


@pytest.mark.skipif(SIMULATED, reason="torch/CuPy interop needs a real GPU")
def test_torch_and_cupy_in_and_out():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    q, k, v = qkv((1, 2, 1, 33, 40, 64, 64))
    tq, tk, tv = (torch.from_numpy(x).cuda() for x in (q, k, v))
    out = cpuflash.attention(tq, tk, tv, causal=True)
    assert isinstance(out, torch.Tensor) and out.is_cuda
    np.testing.assert_allclose(out.cpu().numpy(), reference.attention(q, k, v, causal=True),
                               atol=2e-5)
    try:
        import cupy
    except ImportError:
        return
    out = cpuflash.attention(*(cupy.asarray(x) for x in (q, k, v)))
    assert isinstance(out, cupy.ndarray)
    np.testing.assert_allclose(cupy.asnumpy(out), reference.attention(q, k, v), atol=2e-5)


@pytest.mark.skipif(SIMULATED, reason="torch streams need a real GPU")
def test_torch_side_stream_forward_and_backward():
    """Inputs made on a torch side stream: the kernels run on that stream (no host wait), so
    the results, lse and gradients (torch tensors from torch's allocator) are the reference's
    when read on that stream, also with work queued before and after the calls."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    q, k, v, dout = rands((2, 4, 300, 64), (2, 2, 700, 64), (2, 2, 700, 64), (2, 4, 300, 64),
                          seed=7)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        big = torch.randn(4096, 4096, device="cuda")
        busy = big @ big  # queued ahead: the inputs' copies wait behind it on this stream
        tq, tk, tv, tdo = (torch.from_numpy(x).cuda(non_blocking=False) for x in (q, k, v, dout))
        out, lse = cpuflash.attention(tq, tk, tv, causal=True, return_lse=True)
        grads = cpuflash.attention_backward(tdo, tq, tk, tv, out, lse, causal=True)
        sums = [x.double().sum() for x in (out, *grads)]  # read on the same stream
        del busy
    side.synchronize()
    assert all(isinstance(x, torch.Tensor) and x.is_cuda for x in (out, lse, *grads))
    ref_out, ref_lse = reference.attention(q, k, v, causal=True, return_lse=True)
    ref_grads = reference.attention_backward(dout, q, k, v, causal=True)
    np.testing.assert_allclose(out.cpu().numpy(), ref_out, atol=2e-5)
    np.testing.assert_allclose(lse.cpu().numpy(), ref_lse, atol=2e-5)
    for got, ref in zip(grads, ref_grads):
        np.testing.assert_allclose(got.cpu().numpy(), ref, atol=1e-4 * max(1, np.abs(ref).max()))
    for got, ref in zip(sums, (ref_out, *ref_grads)):
        assert abs(float(got) - ref.sum()) <= 1e-3 * max(1.0, np.abs(ref).sum() / 1e3)


def test_generated_sources_are_content_addressed_files(tmp_path, monkeypatch):
    """codegen.build writes each kernel's text once, to a file named by the text and the
    constants it reads (numba-cuda's disk cache keys on the file, not on global values), and
    compiles from it; with CPUFLASH_CUDA_CACHE_DIR=0 nothing is written and nothing cached."""
    from cpuflash._cuda import codegen
    monkeypatch.setenv("CPUFLASH_CUDA_CACHE_DIR", str(tmp_path))
    source = "def kern(x):\n    return x * TM\n"
    first = codegen.build(source, "kern", {"TM": 4})
    again = codegen.build(source, "kern", {"TM": 4})
    other = codegen.build(source, "kern", {"TM": 2})
    files = sorted(tmp_path.glob("kern_*.py"))
    assert len(files) == 2 and all(f.read_text() == source for f in files)
    assert first.__code__.co_filename == again.__code__.co_filename
    assert first.__code__.co_filename != other.__code__.co_filename
    assert first(3) == 12 and other(3) == 6 and first.cacheable and other.cacheable
    monkeypatch.setenv("CPUFLASH_CUDA_CACHE_DIR", "0")
    uncached = codegen.build(source, "kern", {"TM": 3})
    assert not uncached.cacheable and uncached(3) == 9
    assert len(list(tmp_path.glob("kern_*.py"))) == 2
    blocked = tmp_path / "a_file"
    blocked.write_text("")  # a directory cannot be made here: compile without a cache
    monkeypatch.setenv("CPUFLASH_CUDA_CACHE_DIR", str(blocked / "sub"))
    unwritable = codegen.build(source, "kern", {"TM": 5})
    assert not unwritable.cacheable and unwritable(3) == 15


@pytest.mark.skipif(SIMULATED, reason="the tensor-core kernel runs on a real GPU only")
@pytest.mark.parametrize("shape", [(1, 2, 1, 77, 130, 64, 64), (2, 4, 2, 130, 257, 64, 64),
                                   (1, 2, 2, 100, 90, 40, 40), (1, 1, 1, 3, 5, 8, 16),
                                   (1, 2, 1, 150, 260, 128, 128), (1, 2, 2, 70, 90, 100, 124)],
                         ids=str)
@pytest.mark.parametrize("opt", [{}, {"causal": True}, {"window": (20, 5)},
                                 {"kv_lens": True, "causal": True},
                                 {"causal": True, "softcap": 1.5, "alibi": True},
                                 {"mask": "bool", "dropout_p": 0.2, "seed": 9},
                                 {"mask": "float", "causal": True}], ids=str)
def test_tensor_core_kernel(shape, opt, monkeypatch):
    """The 3xTF32 kernel (``forward_mma``) takes float32 calls with head dims up to 128, masks
    and dropout included, and is as close to the float64 reference as the SIMT kernel it
    replaces there."""
    from cpuflash._cuda import arrays, forward
    ref_opts, opts = _mask_opts(opt, shape)
    q, k, v = qkv(shape)
    qd, kd, vd = on_gpu(q, k, v)
    assert forward.tensor_cores(*(arrays.as_4d(arrays.view(x)) for x in (qd, kd, vd))) is not None
    ref, ref_lse = reference.attention(q, k, v, return_lse=True, **ref_opts)
    finite = np.isfinite(ref_lse)
    for mma in ("1", "0"):
        monkeypatch.setenv("CPUFLASH_CUDA_MMA", mma)
        out, lse = cpuflash.attention(qd, kd, vd, return_lse=True, **opts)
        out, lse = out.copy_to_host(), lse.copy_to_host()
        np.testing.assert_allclose(out, ref, atol=tol(np.float32, ref), rtol=0)
        np.testing.assert_array_equal(np.isfinite(lse), finite)
        np.testing.assert_allclose(lse[finite], ref_lse[finite], atol=1e-4, rtol=1e-5)


@pytest.mark.skipif(SIMULATED, reason="the tensor-core kernel runs on a real GPU only")
def test_tensor_core_kernel_peaked_scores():
    """q = k = v scaled up: scores near 2^9, where the TF32 split must keep float32 accuracy
    (one TF32 product alone would be off by 2^-11 of a score, about 0.25)."""
    (x,) = rands((1, 2, 256, 64))
    x = x * 8
    out, lse = cpuflash.attention(*on_gpu(x, x, x), return_lse=True)
    ref, ref_lse = reference.attention(x, x, x, return_lse=True)
    np.testing.assert_allclose(out.copy_to_host(), ref, atol=1e-4 * np.abs(ref).max(), rtol=0)
    np.testing.assert_allclose(lse.copy_to_host(), ref_lse, atol=2e-3, rtol=1e-5)


@pytest.mark.skipif(SIMULATED, reason="the tensor-core kernel runs on a real GPU only")
@pytest.mark.parametrize("shape", [(1, 2, 1, 77, 130, 64, 64), (2, 4, 2, 130, 257, 128, 128),
                                   (1, 2, 2, 100, 90, 40, 72), (1, 1, 1, 3, 5, 8, 16)], ids=str)
@pytest.mark.parametrize("opt", [{}, {"causal": True}, {"window": (20, 5)},
                                 {"kv_lens": True, "causal": True},
                                 {"causal": True, "softcap": 1.5, "alibi": True},
                                 {"mask": "bool", "dropout_p": 0.2, "seed": 9},
                                 {"mask": "float16", "causal": True}], ids=str)
def test_tensor_core_kernel_float16(shape, opt, monkeypatch):
    """The float16 kernel (``forward_f16``) takes float16 calls with head dims up to 128, masks
    and dropout included, and is as close to the float64 reference as the SIMT kernel it
    replaces there (P rounded to float16 costs less than the float16 output's own rounding)."""
    from cpuflash._cuda import arrays, forward, forward_f16
    ref_opts, opts = _mask_opts(opt, shape)
    q, k, v = qkv(shape, np.float16)
    qd, kd, vd = on_gpu(q, k, v)
    views = (arrays.as_4d(arrays.view(x)) for x in (qd, kd, vd))
    assert forward.tensor_cores(*views) is forward_f16
    ref, ref_lse = reference.attention(q, k, v, return_lse=True, **ref_opts)
    finite = np.isfinite(ref_lse)
    errors = []
    for mma in ("1", "0"):
        monkeypatch.setenv("CPUFLASH_CUDA_MMA", mma)
        out, lse = cpuflash.attention(qd, kd, vd, return_lse=True, **opts)
        out, lse = out.copy_to_host(), lse.copy_to_host()
        assert out.dtype == np.float16
        np.testing.assert_allclose(out, ref, atol=tol(np.float16, ref), rtol=0)
        np.testing.assert_array_equal(np.isfinite(lse), finite)
        np.testing.assert_allclose(lse[finite], ref_lse[finite], atol=1e-4, rtol=1e-5)
        errors.append(np.abs(out - ref).max() if out.size else 0.0)
    assert errors[0] <= 2 * errors[1] + 1e-3 * max(1.0, np.abs(ref).max())


@pytest.mark.skipif(SIMULATED, reason="the tensor-core kernel runs on a real GPU only")
def test_tensor_core_kernel_float16_peaked_scores():
    """q = k = v scaled up (scores near 600): products of halves are exact in float32, so the
    scores, and lse, keep float32 accuracy; only P meets float16 rounding."""
    (x,) = rands((1, 2, 256, 64), dtype=np.float16)
    x = (x * 3).astype(np.float16)
    out, lse = cpuflash.attention(*on_gpu(x, x, x), return_lse=True)
    ref, ref_lse = reference.attention(x, x, x, return_lse=True)
    np.testing.assert_allclose(out.copy_to_host(), ref, atol=4e-3 * np.abs(ref).max(), rtol=0)
    np.testing.assert_allclose(lse.copy_to_host(), ref_lse, atol=2e-3, rtol=1e-5)


@pytest.mark.skipif(SIMULATED, reason="torch CUDA tensors need a GPU")
def test_torch_tensors_read_as_their_interface_says():
    """``arrays.view`` reads a torch tensor's pointer, shape, strides and dtype from the tensor
    itself (fast); it must say what ``__cuda_array_interface__`` says, and name torch's
    current stream (a side stream inside ``torch.cuda.stream``)."""
    torch = pytest.importorskip("torch")
    from cpuflash._cuda import arrays
    base = torch.randn(3, 4, 5, 8, device="cuda")
    cases = [base, base.transpose(1, 2), base[:, :, 1:3], base.half(), base[:0],
             torch.randn(1, 4, 1, 8, device="cuda").expand(2, 4, 3, 8),
             torch.randn(2, 3, device="cuda", requires_grad=True)]
    side = torch.cuda.Stream()
    for x in cases:
        fast = arrays.view(x)
        desc = x.detach().__cuda_array_interface__
        shape = tuple(desc["shape"])
        strides = desc["strides"] or arrays._c_strides(shape, fast.dtype.itemsize)
        assert (fast.ptr, fast.shape, fast.strides, fast.dtype.str) == (
            desc["data"][0], shape, tuple(strides), desc["typestr"])
        assert arrays.is_gpu_array(x) and fast.owner is x
        # torch's interface names no stream: the kernels go on torch's current stream
        assert fast.stream == torch.cuda.current_stream().cuda_stream
        with torch.cuda.stream(side):
            assert arrays.view(x).stream == side.cuda_stream != fast.stream
    assert not arrays.is_gpu_array(torch.ones(2))
    assert not arrays.is_gpu_array(torch.eye(3, device="cuda").to_sparse())  # as the interface


@pytest.mark.skipif(SIMULATED, reason="torch CUDA tensors need a GPU")
def test_torch_results_described_as_view_reads_them(monkeypatch):
    """``arrays.empty`` describes a new torch tensor itself (no read back): the same record as
    ``arrays.view`` of it; ``torch_stream`` names torch's current stream with torch's raw
    accessor and without it (the public API, for a torch that lacks the accessor)."""
    torch = pytest.importorskip("torch")
    from cpuflash._cuda import arrays
    like = torch.zeros(1, device="cuda")
    side = torch.cuda.Stream()
    for shape, dtype in [((2, 3, 4, 8), np.float32), ((5, 8), np.float16), ((0, 4), np.float32),
                         ((3, 7), np.float32)]:
        made, desc = arrays.empty(shape, dtype, like)
        read = arrays.view(made)
        assert desc.owner is made and made.dtype == getattr(torch, np.dtype(dtype).name)
        assert (desc.ptr, desc.shape, desc.strides, desc.dtype, desc.stream) == (
            read.ptr, read.shape, read.strides, read.dtype, read.stream)
    index = like.get_device()
    for raw in (True, False):
        if not raw:
            monkeypatch.delattr(torch._C, "_cuda_getCurrentRawStream", raising=False)
        assert arrays.torch_stream(index) == torch.cuda.current_stream().cuda_stream
        with torch.cuda.stream(side):
            assert arrays.torch_stream(index) == side.cuda_stream


@pytest.mark.skipif(SIMULATED, reason="the tensor-core kernel runs on a real GPU only")
@pytest.mark.parametrize("d", [64, 128])
def test_tensor_core_kernel_nan_propagates(d):
    """A NaN in q, k or v shows in every output it enters, never vanishes: the fast TF32
    split (``forward_mma._split``) truncates the big part, which keeps a quiet NaN a NaN; the
    NaN here is the one the GPU's own arithmetic makes (0/0: all mantissa bits set), and a
    plain quiet NaN."""
    import torch
    q, k, v = (torch.as_tensor(x, device="cuda") for x in qkv((1, 2, 2, 40, 50, d, d)))
    gpu_nan = torch.zeros((), device="cuda") / 0
    q[0, 0, 5, 3] = gpu_nan
    k[0, 1, 7, 2] = float("nan")
    v[0, 0, 9, 4] = gpu_nan
    out = torch.as_tensor(cpuflash.attention(q, k, v), device="cuda").cpu().numpy()
    nan = np.isnan(out)
    assert nan[0, 0, 5].all()             # the row of the NaN query
    assert nan[0, 1].all()                # every row of head 1 sees key 7
    assert nan[0, 0, :, 4].all()          # every row of head 0 averages v's NaN into dim 4
    expected = np.zeros_like(nan)
    expected[0, 0, 5], expected[0, 1], expected[0, 0, :, 4] = True, True, True
    np.testing.assert_array_equal(nan, expected)


@pytest.mark.parametrize("latest_first", [False, True])
def test_block_order_covers_every_block_once(latest_first):
    """``tiles.block_lines`` maps the 1-D grid onto (head, row block) one to one, whatever the
    number of heads, rows and the heads that fit the L2 share together (one, some with a
    smaller last group, all)."""
    import itertools
    from types import SimpleNamespace
    from cpuflash._cuda.tiles import L2_SHARE, block_lines, grid
    lines = "\n".join(block_lines("n", "rows", "heads", "head_bytes", "head", "first",
                                  latest_first))
    for heads, n, rows, head_bytes in itertools.product(
            [1, 3, 7, 64], [1, 5, 64, 200], [16, 64], [0, L2_SHARE // 5, L2_SHARE, 3 * L2_SHARE]):
        seen = []
        for blk in range(grid(heads, n, rows)):
            at = {"n": n, "rows": rows, "heads": heads, "head_bytes": head_bytes,
                  "L2_SHARE": L2_SHARE, "int64": int,
                  "cuda": SimpleNamespace(blockIdx=SimpleNamespace(x=blk))}
            exec(lines, at)  # noqa: S102 - the generated lines, as the kernels run them
            seen.append((at["head"], at["first"]))
        assert sorted(seen) == [(h, r) for h in range(heads) for r in range(0, n, rows)]
        if head_bytes >= L2_SHARE:  # one head at a time: all of a head's blocks in a row
            assert [h for h, _ in seen] == sorted(h for h, _ in seen)
        if latest_first and head_bytes == 0:  # all heads together: longest first
            assert [r for _, r in seen] == sorted((r for _, r in seen), reverse=True)


@pytest.fixture
def fresh_kernels():
    """Kernels compiled anew before and after the test (their block order reads
    ``tiles.L2_SHARE`` when they are generated)."""
    from cpuflash._cuda import backward, forward, forward_f16, forward_mma

    def clear():
        for fn in (forward.make_forward, forward.kernel, forward_mma.make_forward,
                   forward_mma.kernel, forward_f16.make_forward, forward_f16.kernel,
                   backward.make_dkdv, backward.make_dq, backward.kernels):
            fn.cache_clear()
    clear()
    yield
    clear()


@pytest.mark.parametrize("shape", SHAPES[:1] if SIMULATED else SHAPES, ids=str)
def test_one_head_at_a_time(shape, fresh_kernels, monkeypatch):
    """With an L2 share too small for one head, the blocks go head by head (several groups,
    the last one short); forward and backward still match the reference (causal, GQA). One
    shape in the simulator (26 s a shape there)."""
    from cpuflash._cuda import tiles
    monkeypatch.setattr(tiles, "L2_SHARE", 1)
    q, k, v = qkv(shape)
    (dout,) = rands(q.shape[:-1] + (v.shape[-1],), seed=7)
    gq, gk, gv, gdo = on_gpu(q, k, v, dout)
    out, lse = cpuflash.attention(gq, gk, gv, return_lse=True, causal=True)
    ref = reference.attention(q, k, v, causal=True)
    np.testing.assert_allclose(out.copy_to_host(), ref, atol=tol(np.float32, ref), rtol=0)
    grads = cpuflash.attention_backward(gdo, gq, gk, gv, out, lse, causal=True)
    refs = reference.attention_backward(dout, q, k, v, causal=True)
    for name, g, r in zip(("dq", "dk", "dv"), grads, refs):
        np.testing.assert_allclose(g.copy_to_host(), r, atol=5 * tol(np.float32, r), rtol=0,
                                   err_msg=name)
