"""The CUDA path of ``attention`` and ``attention_backward``: checks, defaults, launches.

Inputs: GPU arrays (``__cuda_array_interface__``), read in place with any strides; or numpy
arrays with ``device="cuda"``, copied over and back. Results: device arrays of the caller's
kind (torch tensors for torch, CuPy arrays for CuPy, numba device arrays otherwise), or numpy
for numpy inputs. The scalar options go through the same checks as the CPU path
(``masks.band``, ``masks.modifiers``, ``_checks.scale``).
"""
import numpy as np

from .. import _checks, masks
from .. import sinks as _sinks
from . import arrays
from .backward import run_backward
from .forward import run_forward
from .runtime import load, require_device
from .sinks import logits_on_device, run_dsinks
from .tiles import MAX_HEAD_DIM

GPU_DTYPES = (np.dtype(np.float16), np.dtype(np.float32))


def _array(name, x, int8=False):
    dtype = np.dtype(x.dtype)
    if dtype == np.float64:
        raise NotImplementedError(f"{name}: float64 is not yet on the CUDA path (float16 and "
                                  "float32 are; or use the CPU path with numpy arrays)")
    if dtype not in GPU_DTYPES and not (int8 and dtype == np.int8):
        allowed = "float16, float32 or int8 (with a scale)" if int8 else "float16 or float32"
        raise TypeError(f"{name}: expected dtype {allowed}, got {dtype}")
    if x.ndim not in (2, 3, 4):
        raise ValueError(f"{name}: expected 2-D (N, D), 3-D (H, N, D) or 4-D (B, H, N, D), "
                         f"got {x.ndim}-D with shape {tuple(x.shape)}")


def _host(name, x):
    """Small option arrays (kv_lens, alibi_slopes) given on the GPU: read back (B or H values)."""
    if x is not None and not isinstance(x, np.ndarray) and arrays.is_gpu_array(x):
        return load().as_cuda_array(x).copy_to_host()
    return x


def _inputs(named, device):
    """Device views of the arrays in ``named`` (name -> array) and the result kind."""
    first = next(iter(named.values()))
    on_gpu = arrays.is_gpu_array(first)
    if not on_gpu and device != "cuda":
        raise TypeError("device: the CUDA path takes GPU arrays, or numpy arrays with "
                        "device='cuda'")
    views = {}
    for name, x in named.items():
        if arrays.is_gpu_array(x) != on_gpu:
            where = "a GPU array" if on_gpu else "a numpy array"
            raise TypeError(f"{name}: expected {where} like {next(iter(named))}, got "
                            f"{type(x).__name__}")
        if on_gpu:
            views[name] = arrays.view(x)
        else:
            if not isinstance(x, np.ndarray):
                raise TypeError(f"{name}: expected a numpy.ndarray, got {type(x).__name__}")
            views[name] = x
    kind = arrays.kind_of(first)
    return views, kind


def _upload(views):
    """Numpy inputs (``device="cuda"``) copied to the GPU, as ``GpuArray``s."""
    if not any(isinstance(x, np.ndarray) for x in views.values()):
        return views  # GPU inputs: a GPU is there (numba's check costs microseconds a call)
    cuda = require_device()
    return {n: x if not isinstance(x, np.ndarray)
            else arrays.view(cuda.to_device(np.ascontiguousarray(x))) for n, x in views.items()}


def _options(q, k, v, causal, scale, mask, window, kv_lens, alibi_slopes, softcap, dropout_p,
             seed, cache=None):
    """Checked shapes and options: ``(dv, scale, band, mods, drop, kv_scales)``; what the
    CUDA path lacks raises NotImplementedError. ``cache``: the forward pass's ``(k_scale,
    v_scale)``, where K/V may be a cache format (``_checks.kv_cache_format``: float16 K/V
    with float32 q, or int8 with scales); None: q, k, v of one dtype."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        _array(name, x, int8=cache is not None and name != "q")
    _checks.same_rank(q=q, k=k, v=v)
    kv_scales = None
    if cache is None:
        _checks.same_dtype(q=q, k=k, v=v)
    else:
        kv_scales = _checks.kv_cache_format(q, k, v, *cache,
                                            array_type=(np.ndarray, arrays.GpuArray))
    causal = _checks.flag("causal", causal)
    shape4 = [(1,) * (4 - x.ndim) + tuple(x.shape) for x in (q, k, v)]
    n_b, n_hq, _, _n_q, n_k, d, dv = _checks.qkv_shapes(*(_Shape(s) for s in shape4))
    if max(d, dv) > MAX_HEAD_DIM:
        raise NotImplementedError(f"q, v: head dims up to {MAX_HEAD_DIM} on the CUDA path, got "
                                  f"D={d}, Dv={dv} (the CPU path takes any)")
    band = masks.band(causal, window, _host("kv_lens", kv_lens), n_b, n_k)
    mods = masks.modifiers(softcap, _host("alibi_slopes", alibi_slopes), n_b, n_hq)
    drop = masks.dropout(dropout_p, seed)
    if mask is not None:
        _mask(mask, (n_b, n_hq, _n_q, n_k))
    return dv, _checks.scale(scale, d), band, mods, drop, kv_scales


def _mask(mask, shape):
    """The caller's mask (a ``GpuArray``, or numpy for numpy inputs): bool, float16 or float32
    (float64 only from numpy, converted there), broadcastable to ``shape``."""
    dtype = np.dtype(mask.dtype)
    if dtype != np.bool_ and dtype.kind != "f":
        raise TypeError(f"mask: expected a bool or float array, got {dtype}")
    if dtype == np.float64 and not isinstance(mask, np.ndarray):
        raise NotImplementedError("mask: a float64 mask is not on the CUDA path; pass it as "
                                  "float32 (or bool)")
    masks.broadcast_shape(tuple(mask.shape), shape)


def _mask_4d(views):
    """The mask of ``views`` (uploaded, a ``GpuArray``) as 4-D, or None."""
    mask = views.get("mask")
    return None if mask is None else arrays.as_4d(mask)


def _with_mask(named, mask):
    """``named`` with the mask joined (numpy: float64 as float32, uploaded with the rest)."""
    if mask is None:
        return named
    if isinstance(mask, np.ndarray) and mask.dtype == np.float64:
        mask = mask.astype(np.float32)
    return dict(named, mask=mask)


class _Shape:
    def __init__(self, shape):
        self.shape = shape


def _sink_logits(sinks, q):
    """The checked sinks (``sinks.check``; a GPU array is read back, as the other small
    option arrays), on the device; None without sinks."""
    if sinks is None:
        return None
    return logits_on_device(_sinks.check_for_queries(_host("sinks", sinks), q.shape))


def attention(q, k, v, *, causal, scale, mask, window, kv_lens, alibi_slopes, softcap,
              dropout_p, seed, return_lse, out, device, k_scale=None, v_scale=None,
              sinks=None):
    named = {"q": q, "k": k, "v": v}
    named.update({n: x for n, x in (("k_scale", k_scale), ("v_scale", v_scale))
                  if x is not None})
    views, kind = _inputs(_with_mask(named, mask), device)
    dv, scale, band, mods, drop, kv_scales = _options(
        views["q"], views["k"], views["v"], causal, scale, views.get("mask"), window, kv_lens,
        alibi_slopes, softcap, dropout_p, seed,
        cache=(views.get("k_scale"), views.get("v_scale")))
    sinks_dev = _sink_logits(sinks, views["q"])
    views = _upload(views)
    if kv_scales is not None:  # the uploaded ones, (B, Hkv, Nk)
        kv_scales = tuple(arrays.as_nd(views[n], 3) for n in ("k_scale", "v_scale"))
    qd = views["q"]
    out_shape = tuple(q.shape[:-1]) + (dv,)
    like = q if kind != "numpy" else qd.owner  # results from the caller's allocator
    if out is not None and kind != "numpy":
        if not arrays.is_gpu_array(out):
            raise TypeError(f"out: expected a GPU array like q, got {type(out).__name__}")
        out_dev = arrays.view(out)
        _matches("out", out_dev, out_shape, np.dtype(qd.dtype))
        result = out
    else:
        if out is not None:
            _checks.out_array(out, out_shape, np.dtype(qd.dtype))
        result, out_dev = arrays.empty(out_shape, qd.dtype, like)
    lse_result, lse_dev = arrays.empty(tuple(q.shape[:-1]), np.float32, like)
    run_forward(*(arrays.as_4d(views[n]) for n in "qkv"), scale, band, mods,
                arrays.as_4d(out_dev), arrays.as_nd(lse_dev, 3), qd.stream,
                mask=_mask_4d(views), drop=drop, kv_scales=kv_scales, sinks=sinks_dev)
    if kind == "numpy":
        result = out_dev.copy_to_host()
        lse_result = lse_dev.copy_to_host() if return_lse else None
        if out is not None:
            out[...] = result
            result = out
    if return_lse:
        return result, lse_result
    return result


def _matches(name, x, shape, dtype):
    """A companion array (out, dout, lse) must have exactly this shape and dtype."""
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(x.shape)}")
    if np.dtype(x.dtype) != dtype:
        raise TypeError(f"{name}: expected dtype {np.dtype(dtype)}, got {np.dtype(x.dtype)}")


def attention_backward(dout, q, k, v, out, lse, *, causal, scale, mask, window, kv_lens,
                       alibi_slopes, softcap, dropout_p, seed, device, sinks=None):
    views, kind = _inputs(_with_mask({"q": q, "k": k, "v": v, "dout": dout, "out": out,
                                      "lse": lse}, mask), device)
    dv, scale, band, mods, drop, _ = _options(views["q"], views["k"], views["v"], causal,
                                              scale, views.get("mask"), window, kv_lens,
                                              alibi_slopes, softcap, dropout_p, seed)
    qd = views["q"]
    out_shape = tuple(q.shape[:-1]) + (dv,)
    for name in ("dout", "out"):
        _matches(name, views[name], out_shape, np.dtype(qd.dtype))
    _matches("lse", views["lse"], tuple(q.shape[:-1]), np.dtype(np.float32))
    sinks_dev = _sink_logits(sinks, qd)
    views = _upload(views)
    like = q if kind != "numpy" else views["q"].owner
    grads = [arrays.empty(tuple(x.shape), x.dtype, like)
             for x in (views["q"], views["k"], views["v"])]
    delta = run_backward(*(arrays.as_4d(views[n]) for n in ("dout", "q", "k", "v", "out")),
                 arrays.as_nd(views["lse"], 3), scale, band, mods,
                 *(arrays.as_4d(g[1]) for g in grads), stream=views["q"].stream,
                 scratch=lambda shape: arrays.empty(shape, np.float32, like)[1],
                 mask=_mask_4d(views), drop=drop)
    if sinks_dev is not None:  # out, lse with the sinks in: the kernels gave dq, dk, dv
        grads.append(arrays.empty(tuple(sinks.shape), np.float32, like))
        run_dsinks(delta, arrays.as_nd(views["lse"], 3), sinks_dev, grads[-1][1],
                   views["q"].stream)
    if kind == "numpy":
        return tuple(g[1].copy_to_host() for g in grads)
    return tuple(g[0] for g in grads)
