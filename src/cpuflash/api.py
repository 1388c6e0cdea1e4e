"""The public calls: validate, apply defaults, dispatch to the kernels."""
import functools

import numpy as np
import numba

from . import _checks, config, masks
from . import sinks as _sinks
from ._cpu import bfloat16
from ._cpu.backward import run_backward
from ._cpu.decode import ARG, StepPlan, arrays_of_blocks, decode, decode_args, takes_decode
from ._cpu.forward import run_forward

__all__ = ["attention", "attention_backward", "attention_vjp", "merge", "set_num_threads",
           "get_num_threads"]


def attention(q, k, v, *, causal=False, scale=None, mask=None, window=None, kv_lens=None,
              alibi_slopes=None, softcap=None, dropout_p=0.0, seed=None, sinks=None,
              return_lse=False, out=None, k_scale=None, v_scale=None, device=None):
    """Exact softmax attention, ``softmax(scale * q @ k^T) @ v``, computed tile by tile.

    Parameters
    ----------
    q : ndarray (B, Hq, Nq, D), (H, Nq, D) or (Nq, D); float16, float32 or float64.
    k : ndarray (B, Hkv, Nk, D) of the same rank and dtype; ``Hq % Hkv == 0`` (GQA/MQA: query
        head ``h`` reads key/value head ``h // (Hq // Hkv)``).
    v : ndarray (B, Hkv, Nk, Dv).
    causal : bool. Bottom-right aligned: query ``i`` sees key ``j`` iff ``j <= i + Nk - Nq``.
    scale : float, default ``1 / sqrt(D)``.
    mask : bool (True = may attend, as torch) or float (added to the scores) array,
        broadcastable to (B, Hq, Nq, Nk). Read through stride-0 views, never expanded; tiles it
        hides entirely are skipped, tiles it leaves untouched cost nothing.
    window : ``(left, right)``: query ``i`` sees keys ``i + off - left <= j <= i + off + right``
        (``off = Nk - Nq``); ``None`` or ``-1`` for an unbounded side. Tiles outside the band
        are skipped: cost grows as N * window.
    kv_lens : int array (B,): keys ``j >= kv_lens[b]`` are ignored (padding, a partly filled
        KV cache) and never read; ``causal`` and ``window`` then align to ``kv_lens[b]`` in
        place of ``Nk``, as FlashAttention's kv-cache call.
    alibi_slopes : float array (Hq,) or (B, Hq): ``s -= slope_h * |i + off - j|``.
    softcap : float > 0: ``s = softcap * tanh(s / softcap)``, applied before ALiBi and masks.
    dropout_p, seed : dropout on the probabilities, survivors scaled by ``1 / (1 - p)``; the
        mask is a pure function of ``(seed, b, h, i, j)`` (a seed is required), so the backward
        pass, reruns and any thread count see the same mask. ``lse`` is without dropout.
    sinks : float array (Hq,) or (B, Hq): attention sinks (gpt-oss), one logit a query head
        that joins each row's softmax with no value: ``p_j = e^(s_j) / (e^c + sum e^(s_k))``.
        Not scaled, capped, biased or masked; ``-inf`` for a head without one. ``lse`` then
        includes it. The kernels add them to each row's sum (``cpuflash/sinks.py``).
    return_lse : bool. Also return ``lse`` (B, Hq, Nq): natural-log log-sum-exp of each row's
        scores, float32 (float64 for float64 input); ``-inf`` for a row that sees no key.
    out : ndarray of the output's shape and dtype, written in place and returned.
    k_scale, v_scale : float32 arrays of shape ``k.shape[:-1]``, ``v.shape[:-1]``, for an int8
        K/V cache: ``K = k * k_scale[..., None]`` (see ``quantize_int8``).

    K/V caches: besides q, k, v of one dtype, ``k`` and ``v`` may be float16 with a float32
    ``q`` (a half-size cache), or int8 with their scales (a quarter-size cache). The decode
    path (``Nq <= 16``) reads them in place and computes in float32.

    device : None (from the arrays), "cpu" or "cuda". GPU arrays (anything with
        ``__cuda_array_interface__``: numba device arrays, CuPy arrays, torch CUDA tensors) run
        on the GPU through numba-cuda and return GPU arrays (see ``_cuda/dispatch.py``);
        numpy arrays with ``device="cuda"`` are copied over and back.

    Any strides are accepted (transposed or broadcast views); float16 computes in float32.
    A row that sees no key gets output 0 (and ``lse = -inf``).
    """
    if (sinks is None and out is None and mask is None and window is None and kv_lens is None
            and alibi_slopes is None and softcap is None and k_scale is None
            and v_scale is None and device is None and type(dropout_p) in (float, int)
            and dropout_p == 0 and (return_lse is False or return_lse is True)):
        shapes = _plain_shapes(q, k, v, causal, scale)  # once for both plain paths
        result = _plain_decode(q, k, v, causal, scale, shapes) if return_lse is False else None
        if result is None:
            result = _plain_forward(q, k, v, causal, scale, return_lse, shapes)
        if result is not None:
            return result
    return _attention(q, k, v, None, causal=causal, scale=scale, mask=mask, window=window,
                      kv_lens=kv_lens, alibi_slopes=alibi_slopes, softcap=softcap,
                      dropout_p=dropout_p, seed=seed, sinks=sinks, return_lse=return_lse,
                      out=out, k_scale=k_scale, v_scale=v_scale, device=device)


def _sink_logits(q, sinks):
    """``sinks`` checked against the numpy ``q`` (``sinks.check``): float64 ``(B or 1, Hq)``."""
    return _sinks.check_for_queries(sinks, _checks.array("q", q).shape)


def attention_on_blocks(q, kv_blocks, n_k, options):
    """``attention(q, k, v, **options)`` for ``KVCache``, whose K and V are held in blocks of
    ``decode.KEY_BLOCK`` keys (``kv_blocks``: a layer's ``decode.Blocks``), their first ``n_k``
    keys. The decode path reads the blocks in place; any other gets K and V as arrays. The
    checks are ``attention``'s, on stand-ins for K and V of their shapes and dtype that hold no
    memory."""
    if kv_blocks.k.dtype == bfloat16.BITS and isinstance(q, np.ndarray) and q.dtype != np.float32:
        raise TypeError(f"q: expected float32 with a bfloat16 K/V cache, got {q.dtype}")
    k, v = _block_stand_ins(kv_blocks, n_k)
    if options.keys() <= _PLAIN_ON_BLOCKS:
        kv_scales = (None if "k_scale" not in options and "v_scale" not in options
                     else (options.get("k_scale"), options.get("v_scale")))
        causal, scale = options.get("causal", False), options.get("scale")
        result = _plain_decode(q, k, v, causal, scale, _plain_shapes(q, k, v, causal, scale),
                               kv_blocks, kv_scales)
        if result is not None:
            return result
    return _attention(q, k, v, kv_blocks, **options)


# The options ``attention_on_blocks`` takes straight to ``_plain_decode``: an int8 cache's
# scales come with every step (``KVCache.attention``).
_PLAIN_ON_BLOCKS = frozenset(("causal", "scale", "k_scale", "v_scale"))


def _block_stand_ins(kv_blocks, n_k):
    """Stand-ins for K and V of a layer's ``Blocks`` over its first ``n_k`` keys. A bfloat16
    cache's (int16 bits, which numpy cannot call a float) stand in as float16: the checks then
    ask of it what they ask of a float16 cache, float32 queries, and the decode path reads it
    as it reads those, in place as a 2-byte storage type (``decode_args``); its kernel reads
    the blocks themselves, and every other path gets them as float32 (``arrays_of_blocks``)."""
    n_b, n_hkv, _, _, d, _ = kv_blocks.k.shape
    dv = kv_blocks.v.shape[3] * kv_blocks.v.shape[5]
    dtype = np.float16 if kv_blocks.k.dtype == bfloat16.BITS else kv_blocks.k.dtype
    return _stand_in((n_b, n_hkv, n_k, d), dtype), _stand_in((n_b, n_hkv, n_k, dv), dtype)


@functools.lru_cache(maxsize=16)
def _stand_in(shape, dtype):
    """A read-only array of ``shape`` and ``dtype`` that holds one element: the layers of a
    model's step share one (their caches hold as many tokens)."""
    x = np.ndarray(shape, dtype, buffer=np.zeros(1, dtype), strides=(0,) * len(shape))
    x.flags.writeable = False
    return x


def _attention(q, k, v, kv_blocks, *, causal=False, scale=None, mask=None, window=None,
               kv_lens=None, alibi_slopes=None, softcap=None, dropout_p=0.0, seed=None,
               sinks=None, return_lse=False, out=None, k_scale=None, v_scale=None,
               device=None):
    """``attention`` after the plain decode path; ``kv_blocks``: as ``attention_on_blocks``
    (``k`` and ``v`` then their stand-ins), or None."""
    return_lse = _checks.flag("return_lse", return_lse)
    if _on_cuda(q, device):
        if kv_blocks is not None:
            k, v = arrays_of_blocks(kv_blocks, k.shape[2])
        return _cuda_dispatch().attention(
            q, k, v, causal=causal, scale=scale, mask=mask, window=window, kv_lens=kv_lens,
            alibi_slopes=alibi_slopes, softcap=softcap, dropout_p=dropout_p, seed=seed,
            return_lse=return_lse, out=out, device=device, k_scale=k_scale, v_scale=v_scale,
            sinks=sinks)
    logits = None if sinks is None else _sink_logits(q, sinks)
    call = _prepare(q, k, v, causal, scale, mask, window, kv_lens, alibi_slopes, softcap,
                    dropout_p, seed, k_scale, v_scale)
    out_shape = q.shape[:-1] + (call.dv,)
    out = _checks.out_array(out, out_shape, q.dtype)
    q4 = call.in_compute(q)
    k4, v4 = (call.in_storage(x) for x in (k, v))  # a float16/int8 cache stays as it is
    direct = (out is not None and out.dtype == call.compute and out.flags.c_contiguous
              and not any(np.may_share_memory(out, x)
                          for x in ((q4, k4, v4) if kv_blocks is None
                                    else (q4, kv_blocks.k, kv_blocks.v))))
    o4, lse = run_forward(q4, k4, v4, call.scale, call.band, call.mods, call.mask, call.drop,
                          config.PORTABLE, out=_checks.as_4d(out) if direct else None,
                          kv_scales=call.kv_scales, kv_blocks=kv_blocks, sinks=logits)

    result = o4.reshape(out_shape)
    if out is not None and not direct:
        out[...] = result
        result = out
    elif out is not None:
        result = out
    elif result.dtype != q.dtype:
        result = result.astype(q.dtype)
    if return_lse:
        return result, lse.reshape(q.shape[:-1])
    return result


def _plain_decode(q, k, v, causal, scale, shapes, kv_blocks=None, kv_scales=None):
    """A decode step with no option but ``causal`` and ``scale`` (and an int8 cache's scales),
    straight to the decode path, or None for anything else (the general path then checks it,
    and raises what it must).

    A decode step runs right after its kernel has streamed K/V through every cache, where the
    general path's Python (about 30 checks, objects and small arrays) took 160-250 us a call, not
    its 25 us with warm caches: 10-15 % of a step from DRAM (Hkv=2, Nk=32768, 1.5-1.6 ms;
    ``bench/cpu_profile.py decode --layers 19``). This path takes only what the general checks
    accept as they stand: 4-D numpy q, k, v with q float32 or float64, k and v of q's dtype (or
    a float16 cache with float32 q, or an int8 one with float32 q and ``kv_scales = (k_scale,
    v_scale)``, float32 numpy arrays of shape (B, Hkv, Nk)), matching shapes with ``Hq % Hkv ==
    0``, the queries and keys ``decode.takes_decode`` gives this path (1 to ``MAX_NQ``
    queries, not ``TILED_FROM_NQ`` or more in q's dtype with at most ``TILED_KEYS_PER_ROW``
    keys a query row of a GQA group, nor ``TILED_FROM_NQ_MHA`` or more with at most
    ``TILED_KEYS_PER_QUERY_MHA`` keys a query without GQA),
    ``causal`` a bool, ``scale`` None or a float. It runs the same kernel on the same arguments
    as the general path (the same bits). ``kv_blocks``: as ``attention_on_blocks``. (int8
    steps took the general path until stop 40: 95 us a call against float16's 40, Nk=64.)
    ``shapes``: ``_plain_shapes``' answer for the call (its callers ask it once for both plain
    paths)."""
    args = _plain_decode_args(q, k, v, causal, scale, shapes, kv_blocks, kv_scales)
    if args is None:
        return None
    decode(*args)
    return args[ARG["out"]]


def _plain_forward(q, k, v, causal, scale, return_lse, shapes):
    """A forward call with no option but ``causal``, ``scale`` and ``return_lse`` (a bool),
    straight to ``run_forward`` with the arguments the general path would build (the same
    kernel on the same arguments: the same bits), or None for anything else (the general path
    then checks it, and raises what it must). It takes what ``_plain_shapes`` takes (any
    strides) with K and V of q's dtype: more than ``MAX_NQ`` queries, and fewer where
    ``_plain_decode`` does not take them (the tiled path's short calls, ``decode.takes_decode``,
    and calls that ask for the lse, which ``run_forward`` hands to the decode path).

    The general path's checks and objects cost a call about 18 us more (B=1, H=1, N=64, D=64:
    83 against 65 us, side by side), what a small model's short sequences pay on every layer
    (1.06-1.12x at 12-16 heads of 64-128 tokens). ``shapes``: as ``_plain_decode``'s."""
    if shapes is None:
        return None
    n_b, n_hq, n_q, n_k, d, q_type, k_type = shapes
    if k_type is not q_type:
        return None
    out, lse = run_forward(q, k, v, _checks.scale(scale, d),
                           *_no_options(causal, n_b, n_hq, n_q, n_k, q.dtype), config.PORTABLE)
    return (out, lse) if return_lse else out


@functools.lru_cache(maxsize=64)
def _no_options(causal, n_b, n_hq, n_q, n_k, dtype):
    """``run_forward``'s and ``decode_args``' ``band, mods, user_mask, drop`` for a call with
    no option but ``causal``, as the general path builds them; kept per shape (about 1 us of a
    16-token prompt's 38 us call). Their arrays are the ones ``masks`` already shares between
    calls, which the kernels only read."""
    return (masks.band(causal, None, None, n_b, n_k), masks.modifiers(None, None, n_b, n_hq),
            masks.UserMask(None, n_b, n_hq, n_q, n_k, dtype), masks.NO_DROPOUT)


def _plain_decode_args(q, k, v, causal, scale, shapes, kv_blocks, kv_scales):
    """``_plain_decode``'s kernel arguments (``decode.decode_args``), or None where it does not
    take the call. ``shapes``: as ``_plain_decode``'s."""
    if shapes is None or config.PORTABLE:
        return None
    n_b, n_hq, n_q, n_k, d, q_type, k_type = shapes
    n_hkv = v.shape[1]
    cache = kv_blocks is not None or k_type is not q_type  # read in place by the decode path
    if not (takes_decode(n_q, n_k, n_hq // n_hkv, cache)
            and (k_type is q_type or (k_type is np.float16 and q_type is np.float32)
                 or (k_type is np.int8 and q_type is np.float32))):
        return None
    if (k_type is np.int8) != (kv_scales is not None):
        return None
    if kv_scales is not None and not all(
            type(x) is np.ndarray and x.dtype.type is np.float32 and x.dtype.isnative
            and x.shape == (n_b, n_hkv, n_k) for x in kv_scales):
        return None
    # Everything else is valid here, so a NaN or zero scale raises what the general path would.
    return decode_args(q, k, v, _checks.scale(scale, d),
                       *_no_options(causal, n_b, n_hq, n_q, n_k, q.dtype),
                       kv_scales=kv_scales, kv_blocks=kv_blocks)


def _plain_shapes(q, k, v, causal, scale):
    """What both plain paths (``_plain_forward``, ``_plain_decode_args``) take of a call, as the
    general checks would accept it as it stands, or None: 4-D numpy q, k, v with matching
    shapes (``Hq % Hkv == 0``, at least one query, key, batch and head, D and Dv at least 1),
    q float32 or float64, k and v of one dtype, all in native byte order; ``causal`` a bool,
    ``scale`` None or a float. Returns ``(B, Hq, Nq, Nk, D, q_type, k_type)``, the dtypes by
    their scalar types (``dtype == np.float32`` converts the type to a dtype first, about
    0.3 us a comparison; a non-native dtype gives None)."""
    if not (type(q) is np.ndarray and type(k) is np.ndarray and type(v) is np.ndarray
            and q.ndim == 4 and k.ndim == 4 and v.ndim == 4
            and (causal is True or causal is False) and (scale is None or type(scale) is float)):
        return None
    n_b, n_hq, n_q, d = q.shape
    _, n_hkv, n_k, dv = v.shape
    q_type = q.dtype.type if q.dtype.isnative else None
    k_type = k.dtype.type if k.dtype.isnative else None
    if not (n_q > 0 and n_k > 0 and d > 0 and dv > 0 and n_b > 0 and n_hkv > 0
            and n_hq % n_hkv == 0 and k.shape == (n_b, n_hkv, n_k, d) and v.shape[0] == n_b
            and (q_type is np.float32 or q_type is np.float64) and k.dtype == v.dtype):
        return None
    return n_b, n_hq, n_q, n_k, d, q_type, k_type


def step_plan(q, kv_blocks, n_k, causal, scale, scales=None):
    """A ``decode.StepPlan`` for ``KVCache.attention``'s steps like this one (a layer's
    ``Blocks``, its first ``n_k >= 1`` keys, no option but ``causal`` and ``scale``): the
    arguments ``_plain_decode`` would run its kernel on, built by its checks (a NaN or zero
    ``scale`` raises here), or None where it would not take the call. ``scales``: an int8
    cache's ``(k_scale, v_scale)`` of the layer, (B, Hkv, max_len) each."""
    k, v = _block_stand_ins(kv_blocks, n_k)
    kv_scales = None if scales is None else tuple(x[:, :, :n_k] for x in scales)
    args = _plain_decode_args(q, k, v, causal, scale, _plain_shapes(q, k, v, causal, scale),
                              kv_blocks, kv_scales)
    return None if args is None else StepPlan(args, scales)


@functools.cache
def _cuda_dispatch():
    """The CUDA path's module, imported on the first GPU call (it imports numba-cuda, which a
    CPU-only install lacks: ImportError with the install hint, raised again on each try), then
    kept (an import statement per call costs microseconds)."""
    from ._cuda import dispatch
    return dispatch


def _on_cuda(q, device):
    """Whether the call runs on the GPU: ``device="cuda"``, or ``q`` is a GPU array."""
    if device not in (None, "cpu", "cuda"):
        raise ValueError(f"device: expected None, 'cpu' or 'cuda', got {device!r}")
    if device == "cuda":
        return True
    if isinstance(q, np.ndarray):
        return False
    # attribute checks only: no numba.cuda import
    from ._cuda.arrays import is_gpu_array

    on_gpu = is_gpu_array(q)
    if on_gpu and device == "cpu":
        raise TypeError("q: a GPU array with device='cpu'; copy it to numpy first, or leave "
                        "device=None")
    return on_gpu


def compute_dtype(dtype):
    """What arrays (or a K/V cache) of ``dtype`` are computed in: float64 for float64, float32 for
    every other type (float16, bfloat16's int16 bits, int8)."""
    return np.dtype(np.float64 if dtype == np.float64 else np.float32)


class _Call:
    """One call's checked arguments: what the kernels take, in the compute dtype."""

    def __init__(self, **fields):
        self.__dict__.update(fields)

    def in_compute(self, x):
        """``x`` as a 4-D array of the compute dtype (a view unless a cast is needed)."""
        x = _checks.as_4d(x)
        return x if x.dtype == self.compute else x.astype(self.compute)

    def in_storage(self, x):
        """K or V as 4-D: float16 and int8 caches as they are (read in place by the decode
        path), anything else in the compute dtype."""
        x = _checks.as_4d(x)
        return x if x.dtype in (np.float16, np.int8) else self.in_compute(x)


def _prepare(q, k, v, causal, scale, mask, window, kv_lens, alibi_slopes, softcap, dropout_p,
             seed, k_scale=None, v_scale=None, cache_formats=True):
    """The checks and defaults shared by the forward and backward calls. ``cache_formats``:
    whether K/V may be a float16/int8 cache (forward only)."""
    _checks.array("q", q)
    _checks.array("k", k, int8=cache_formats)
    _checks.array("v", v, int8=cache_formats)
    _checks.same_rank(q=q, k=k, v=v)
    if cache_formats:
        kv_scales = _checks.kv_cache_format(q, k, v, k_scale, v_scale)
    else:
        _checks.same_dtype(q=q, k=k, v=v)
        kv_scales = None
    causal = _checks.flag("causal", causal)
    q4, k4, v4 = _checks.as_4d(q), _checks.as_4d(k), _checks.as_4d(v)
    n_b, n_hq, _, n_q, n_k, d, dv = _checks.qkv_shapes(q4, k4, v4)
    compute = compute_dtype(q.dtype)
    return _Call(
        dv=dv, compute=compute, scale=_checks.scale(scale, d),
        band=masks.band(causal, window, kv_lens, n_b, n_k),
        mods=masks.modifiers(softcap, alibi_slopes, n_b, n_hq),
        mask=masks.UserMask(mask, n_b, n_hq, n_q, n_k, compute),
        drop=masks.dropout(dropout_p, seed), kv_scales=kv_scales)


def attention_backward(dout, q, k, v, out, lse, *, causal=False, scale=None, mask=None,
                       window=None, kv_lens=None, alibi_slopes=None, softcap=None,
                       dropout_p=0.0, seed=None, sinks=None, device=None):
    """Gradients ``(dq, dk, dv)`` of attention, from the forward pass's ``out`` and ``lse``.

    ``dout`` is the gradient of the loss with respect to ``out``; ``out, lse`` are what
    ``attention(q, k, v, return_lse=True, ...)`` returned; ``causal``, ``scale``, ``mask``,
    ``window``, ``kv_lens``, ``alibi_slopes``, ``softcap``, ``dropout_p`` and ``seed`` must be
    the forward call's.
    Probabilities are recomputed tile by tile from ``lse`` (memory O(N)).
    Returns arrays shaped and typed like ``q``, ``k``, ``v`` (C-contiguous). For GQA, dk/dv
    sum over the query heads of each group. Bitwise the same for any thread count.
    GPU arrays (or ``device="cuda"``) run on the GPU, as in ``attention``.

    With ``sinks`` (and the ``out``, ``lse`` that the call with them returned), returns
    ``(dq, dk, dv, dsinks)``: ``dsinks`` shaped like ``sinks``, in ``lse``'s dtype.
    """
    if sinks is not None and not _on_cuda(q, device):
        logits = _sink_logits(q, sinks)
        grads = attention_backward(
            dout, q, k, v, out, lse, causal=causal, scale=scale, mask=mask, window=window,
            kv_lens=kv_lens, alibi_slopes=alibi_slopes, softcap=softcap, dropout_p=dropout_p,
            seed=seed, device=device)  # out, lse with the sinks in: the same kernel is right
        rows = _sinks.row_gradients(*(_checks.as_4d(x) for x in (dout, out)),
                                    lse.reshape(_checks.as_4d(out).shape[:3]),
                                    logits[:, :, None])
        dsinks = rows.sum(axis=2).sum(axis=0) if sinks.ndim == 1 else rows.sum(axis=2)
        return (*grads, dsinks.astype(lse.dtype))
    if _on_cuda(q, device):
        return _cuda_dispatch().attention_backward(
            dout, q, k, v, out, lse, causal=causal, scale=scale, mask=mask, window=window,
            kv_lens=kv_lens, alibi_slopes=alibi_slopes, softcap=softcap, dropout_p=dropout_p,
            seed=seed, device=device, sinks=sinks)
    call = _prepare(q, k, v, causal, scale, mask, window, kv_lens, alibi_slopes, softcap,
                    dropout_p, seed, cache_formats=False)
    out_shape = q.shape[:-1] + (call.dv,)
    _checks.matches("dout", dout, out_shape, q.dtype)
    _checks.matches("out", out, out_shape, q.dtype)
    _checks.matches("lse", lse, q.shape[:-1], call.compute)
    dq, dk, dv = run_backward(*(call.in_compute(x) for x in (dout, q, k, v, out)),
                              lse.reshape(call.in_compute(q).shape[:3]), call.scale, call.band,
                              call.mods, call.mask, call.drop, config.PORTABLE)
    return tuple(g.reshape(x.shape).astype(x.dtype, copy=False)
                 for g, x in ((dq, q), (dk, k), (dv, v)))


def attention_vjp(q, k, v, dout, *, causal=False, scale=None, mask=None, window=None,
                  kv_lens=None, alibi_slopes=None, softcap=None, dropout_p=0.0, seed=None,
                  sinks=None, device=None):
    """Forward and backward in one call: returns ``(out, dq, dk, dv)``, the output and the
    vector-Jacobian product of attention with the cotangent ``dout``; with ``sinks``,
    ``(out, dq, dk, dv, dsinks)``."""
    opts = dict(causal=causal, scale=scale, mask=mask, window=window, kv_lens=kv_lens,
                alibi_slopes=alibi_slopes, softcap=softcap, dropout_p=dropout_p, seed=seed,
                sinks=sinks, device=device)
    out, lse = attention(q, k, v, return_lse=True, **opts)
    return (out, *attention_backward(dout, q, k, v, out, lse, **opts))


def merge(outs, lses):
    """Combine partial attentions over disjoint key sets into the exact result.

    ``outs[i]`` (..., Nq, Dv) and ``lses[i]`` (..., Nq) are what ``attention(...,
    return_lse=True)`` returned for the i-th key set. Returns ``(out, lse)`` with
    ``lse = logsumexp_i lse_i`` and ``out = sum_i out_i * exp(lse_i - lse)``, summed in list
    order. Rows that no part saw stay 0 with ``lse = -inf``; a part whose row saw no key
    (``lse_i = -inf``) contributes nothing. Accumulates in float32 (float64 for float64).
    """
    if not isinstance(outs, (list, tuple)) or not isinstance(lses, (list, tuple)):
        raise TypeError("outs, lses: expected lists of arrays")
    if len(outs) == 0 or len(outs) != len(lses):
        raise ValueError(f"outs, lses: expected equally long, non-empty lists, got "
                         f"{len(outs)} and {len(lses)}")
    if not isinstance(outs[0], np.ndarray) or outs[0].dtype not in _checks.FLOAT_DTYPES:
        raise TypeError(f"outs[0]: expected a float numpy array, got {type(outs[0]).__name__}")
    for i, (o, part_lse) in enumerate(zip(outs, lses)):
        _checks.matches(f"outs[{i}]", o, outs[0].shape, outs[0].dtype)
        _checks.matches(f"lses[{i}]", part_lse, o.shape[:-1], compute_dtype(o.dtype))
    compute = compute_dtype(outs[0].dtype)
    lse_all = np.stack(lses).astype(compute, copy=False)
    m = lse_all.max(axis=0)
    m_safe = np.where(np.isfinite(m), m, 0.0).astype(compute)
    weights = [np.exp(part - m_safe) for part in lses]  # exp(-inf) = 0: parts that saw nothing
    total = sum(weights[1:], weights[0])
    acc = sum((w[..., None] * o for w, o in zip(weights[1:], outs[1:])),
              weights[0][..., None] * outs[0].astype(compute))
    with np.errstate(divide="ignore", invalid="ignore"):
        out = np.where(total[..., None] > 0, acc / total[..., None], 0.0)
        lse = np.where(total > 0, m_safe + np.log(total), -np.inf)
    return out.astype(outs[0].dtype), lse.astype(compute)


def set_num_threads(n):
    """Threads used by the kernels (Numba's thread pool; at most ``NUMBA_NUM_THREADS``)."""
    if isinstance(n, (bool, np.bool_)) or not isinstance(n, (int, np.integer)):
        raise TypeError(f"n: expected an int, got {type(n).__name__}")
    if not 1 <= n <= numba.config.NUMBA_NUM_THREADS:
        raise ValueError(f"n: expected 1..{numba.config.NUMBA_NUM_THREADS} "
                         f"(NUMBA_NUM_THREADS), got {n}")
    numba.set_num_threads(int(n))


def get_num_threads():
    """Threads the kernels use now."""
    return numba.get_num_threads()
