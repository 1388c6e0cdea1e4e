"""cpuflash for torch tensors: ``scaled_dot_product_attention`` with torch's signature and
semantics, and the autograd Function behind it (forward and backward by cpuflash). CPU
tensors run the CPU kernels; CUDA tensors (since stop 21) the GPU path (``_cuda/``), with the
same options and results.

    from cpuflash.torch import scaled_dot_product_attention as sdpa
    out = sdpa(q, k, v, is_causal=True)                     # as torch's, gradients included
    out = sdpa(q, k, v, attn_mask=causal_lower_right(Nq, Nk), window=(256, 0), softcap=30.0)

No copies: CPU tensors enter as ``tensor.detach().numpy()`` views (any strides, as cpuflash
takes them) and the result leaves as ``torch.from_numpy(out)``; CUDA tensors are read in place
and the results are torch tensors on their device, on torch's current stream. ``import
cpuflash`` never imports this module or torch.

Where torch defines a behaviour this follows it:

* ``attn_mask``: bool (True = take part) or float (added), broadcastable to (B, Hq, Nq, Nk).
  A ``torch.nn.attention.bias.CausalBias`` (``causal_upper_left`` / ``causal_lower_right``)
  selects the causal alignment; lower-right is cpuflash's own ``causal`` (FlashAttention >= 2.1,
  decoding). No gradient flows to ``attn_mask``.
* ``is_causal=True`` is torch's top-left alignment (query ``i`` sees key ``j <= i``); for
  ``Nq == Nk`` both alignments agree. For ``Nq < Nk`` no query sees a key past ``Nq - 1``, so the
  keys are cut to the first ``Nq`` (their gradients are 0); for ``Nq > Nk`` it is
  ``window=(None, Nq - Nk)``. Combining top-left causal of ``Nq != Nk`` with ``window`` or
  ``alibi_slopes`` (both bottom-right aligned in cpuflash) raises ValueError.
* ``dropout_p`` is applied whenever > 0, as torch's functional SDPA (pass 0 in eval mode). The
  mask is cpuflash's (a pure function of the seed and position, not torch's RNG stream):
  ``seed=None`` draws one from torch's default generator, so ``torch.manual_seed`` makes runs
  repeat; the backward pass regenerates the same mask.
* ``enable_gqa``: ``Hq`` a multiple of ``Hkv`` (key/value heads are shared, never repeated).
* Shapes: 2-D, 3-D or 4-D (cpuflash's ranks); q/k/v of one dtype.

Beyond torch (keyword-only, cpuflash's semantics, see ``cpuflash.attention``): ``window``,
``alibi_slopes`` (a tensor or array (Hq,) or (B, Hq)), ``softcap``, ``seed``, and ``sinks``
(attention sinks, a float tensor (Hq,) or (B, Hq) as gpt-oss's, differentiable).

dtypes: float32, float64 (on the CPU only), float16 and bfloat16, the last two computed in
float32. bfloat16 has no numpy dtype: such a tensor is widened to float32 (exactly: every
bfloat16 is a float32; a copy, O(N)) and the results are rounded back to bfloat16 once, to
nearest even, bit for bit as torch's ``.to(torch.bfloat16)``; on the CPU both by the kernels'
threads (``_cpu/bfloat16.py``), on the GPU by torch. q, k and v must be all bfloat16 or none
(a mix raises TypeError, as any mix of dtypes); a bfloat16 ``attn_mask``, ``alibi_slopes`` or
``sinks`` is widened the same way. The backward pass keeps the float32 output and lse, not the
rounded output.

Differences: a row that sees no key gives 0 (torch's math path gives NaN); tensors on another
kind of device (neither CPU nor CUDA) raise ValueError, and a mask must be on the device of
the query.

Threads: torch and Numba each load their own OpenMP runtime, and by default each one's idle
threads spin after a parallel region, stealing the cores of whatever runs next. In a process
that alternates torch ops and cpuflash calls, start Python with ``OMP_WAIT_POLICY=PASSIVE``
(torch's runtime reads it when ``import torch`` loads it, so setting it later is too late).
Measured on 2 busy cores, cpuflash's forward at N=512 interleaved with torch's SDPA: 3-4x
slower without it; with it, as fast as torch or up to 1.3x faster.
"""

import torch
from torch.autograd.function import once_differentiable

from . import _checks, api
from ._cpu import bfloat16

__all__ = ["FlashAttentionFunction", "scaled_dot_product_attention"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _checked(name, t):
    """``t`` detached, where it is a float tensor that cpuflash reads; else the error naming
    ``name``."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.device.type not in ("cpu", "cuda"):
        raise ValueError(f"{name}: expected a CPU or CUDA tensor, got device {t.device}")
    if t.dtype not in _DTYPES:
        raise TypeError(f"{name}: expected float16, bfloat16, float32 or float64, got {t.dtype}")
    return t.detach()


def _numpy_view(name, t, passing=False):
    """What cpuflash reads of a float tensor, checked (``_checked``) and read (``_readable``)."""
    return _readable(name, _checked(name, t), passing)


def _readable(name, t, passing=False):
    """What cpuflash reads of the checked tensor ``t`` (``_checked``), with no copy for any
    strides: a numpy view of a CPU tensor's memory, or the CUDA tensor itself. bfloat16, which
    numpy lacks, is read as a float32 copy (``_widened``); ``passing``: one that no one keeps
    past the call it is made for (q, k, v, dout), in a buffer the next call reuses."""
    t = _widened(t, f"bfloat16 {name}" if passing else None)
    return t if t.is_cuda else t.numpy()


def _widened(t, workspace=None):
    """A bfloat16 tensor as float32, exactly (a bfloat16 is a float32's upper 16 bits; on the
    CPU by the kernels' threads, ``_cpu/bfloat16.py``, into the ``workspace`` of that name if
    given: a fresh array's pages are faulted in on each call; at B=1 H=8 N=512 D=64 a bfloat16
    call took 4.04 ms against float32's 2.68 with fresh arrays, 2.79 against 2.32 with the
    buffers); any other tensor as it is. A broadcast
    view (stride 0, as ``expand`` makes) stays one: its one copy is widened and expanded again,
    where ``t.float()`` would write out every copy (a mask expanded to (B, H, Nq, Nk):
    O(N^2))."""
    if t.dtype != torch.bfloat16:
        return t
    one_copy = t[tuple(slice(0, 1) if step == 0 else slice(None) for step in t.stride())]
    if one_copy.is_cuda or one_copy.ndim > 4:
        wide = one_copy.float()
    else:
        wide = torch.from_numpy(bfloat16.to_float32(one_copy.view(torch.int16).numpy(),
                                                    workspace))
    return wide.expand(t.shape)


def _result_dtype(query, key, value):
    """The dtype cpuflash's results are given back in: bfloat16 where q, k and v are (they are
    computed in float32 and rounded once), else None (the results' own dtype, q's). A mix of
    bfloat16 with another dtype raises TypeError, as ``cpuflash.attention`` does for any mix."""
    if torch.bfloat16 not in (query.dtype, key.dtype, value.dtype):
        return None
    dtypes = {"query": query.dtype, "key": key.dtype, "value": value.dtype}
    if len(set(dtypes.values())) > 1:
        given = ", ".join(f"{n}={d}" for n, d in dtypes.items())
        raise TypeError(f"query, key, value: expected one dtype, got {given} (cast "
                        "explicitly; cpuflash does not cast silently)")
    return torch.bfloat16


def _rounded(t, dtype):
    """A float32 result rounded to ``dtype`` (bfloat16, to nearest even; on the CPU by the
    kernels' threads), or ``t`` itself for None."""
    if dtype is None:
        return t
    if t.is_cuda:
        return t.to(dtype)
    return torch.from_numpy(bfloat16.from_float32(t.numpy())).view(torch.bfloat16)


def _tensor(x):
    """A cpuflash result as a tensor: numpy arrays as ``torch.from_numpy`` views, the GPU
    path's torch tensors as they are."""
    return x if isinstance(x, torch.Tensor) else torch.from_numpy(x)


def _mask_view(attn_mask):
    if attn_mask.dtype != torch.bool and attn_mask.dtype not in _DTYPES:
        raise TypeError(f"attn_mask: expected a bool or float tensor, got {attn_mask.dtype}")
    if attn_mask.requires_grad and torch.is_grad_enabled():
        raise ValueError("attn_mask: gradients with respect to a float mask are not supported; "
                         "pass attn_mask.detach()")
    if attn_mask.device.type not in ("cpu", "cuda"):
        raise ValueError(f"attn_mask: expected a CPU or CUDA tensor, got device "
                         f"{attn_mask.device}")
    mask = _widened(attn_mask.detach())
    return mask if mask.is_cuda else mask.numpy()


def _causal_bias(attn_mask):
    """``(is_causal, lower_right)`` for a CausalBias, else None."""
    try:
        from torch.nn.attention.bias import CausalBias, CausalVariant
    except ImportError:  # older torch: no CausalBias to recognise
        return None
    if not isinstance(attn_mask, CausalBias):
        return None
    return attn_mask.variant == CausalVariant.LOWER_RIGHT


class _Plan:
    """One call's cpuflash options, how the keys are cut (top-left causal, Nq < Nk) and the
    dtype the results are rounded to."""

    def __init__(self, q, k, attn_mask, is_causal, scale, enable_gqa, dropout_p, window,
                 alibi_slopes, softcap, seed, sinks=None, result_dtype=None):
        n_q, n_k = q.shape[-2], k.shape[-2]
        self.result_dtype = result_dtype  # bfloat16, or None: the results' own (_result_dtype)
        h_q = q.shape[-3] if q.ndim > 2 else 1
        h_kv = k.shape[-3] if k.ndim > 2 else 1
        if h_q != h_kv and not enable_gqa:
            raise ValueError(f"key: {h_kv} heads for {h_q} query heads needs enable_gqa=True")
        lower_right = _causal_bias(attn_mask) if attn_mask is not None else None
        if lower_right is not None:
            if (attn_mask.seq_len_q, attn_mask.seq_len_kv) != (n_q, n_k):
                raise ValueError(f"attn_mask: a CausalBias for ({attn_mask.seq_len_q}, "
                                 f"{attn_mask.seq_len_kv}) queries and keys, got ({n_q}, {n_k})")
            if is_causal:
                raise ValueError("is_causal: expected False with a CausalBias attn_mask")
            attn_mask, is_causal = None, True
        elif is_causal and attn_mask is not None:
            raise ValueError("attn_mask: expected None with is_causal=True (as torch)")
        mask = _mask_view(attn_mask) if attn_mask is not None else None
        self.key_stop = n_k
        causal = bool(is_causal)
        if is_causal and not lower_right and n_q != n_k:  # torch's top-left alignment
            if window is not None or alibi_slopes is not None:
                raise ValueError("is_causal: top-left causal with Nq != Nk and window or "
                                 "alibi_slopes (bottom-right aligned) is ambiguous; pass "
                                 "attn_mask=causal_lower_right(Nq, Nk) instead")
            if n_q < n_k:  # keys past Nq - 1 are seen by no query; on the first Nq keys
                self.key_stop = n_q  # the two alignments agree
                if mask is not None and mask.shape[-1] != 1:
                    mask = mask[..., :n_q]
            else:  # j <= i  <=>  j <= i + (Nk - Nq) + right with right = Nq - Nk
                causal, window = False, (None, n_q - n_k)
        if isinstance(alibi_slopes, torch.Tensor):
            alibi_slopes = _numpy_view("alibi_slopes", alibi_slopes)
        if dropout_p and seed is None:
            # from torch's default generator: torch.manual_seed makes the mask repeat
            seed = int(torch.randint(0, 2**62, (), dtype=torch.int64).item())
        if _checks.is_real(dropout_p):
            dropout_p = float(dropout_p)
        self.opts = {"causal": causal, "scale": scale, "mask": mask, "window": window,
                     "alibi_slopes": alibi_slopes, "softcap": softcap,
                     "dropout_p": dropout_p, "seed": seed}
        if sinks is not None:
            self.opts["sinks"] = _numpy_view("sinks", sinks)

    def keys(self, x):
        return x if self.key_stop == x.shape[-2] else x[..., :self.key_stop, :]


class FlashAttentionFunction(torch.autograd.Function):
    """``out = attention(q, k, v)`` by cpuflash, gradients by ``cpuflash.attention_backward``.
    Saves q, k, v, out and lse (O(N)); the probabilities are recomputed in the backward pass.
    ``plan`` is a ``_Plan`` (the options); it gets no gradient. ``sinks``: the tensor behind
    ``plan``'s sinks, if any, which gets its gradient."""

    @staticmethod
    def forward(ctx, q, k, v, plan, sinks=None):
        qn, kn, vn = (_numpy_view(name, x, passing=True)
                      for name, x in (("query", q), ("key", k), ("value", v)))
        out, lse = api.attention(qn, plan.keys(kn), plan.keys(vn), return_lse=True, **plan.opts)
        out_t, lse_t = _tensor(out), _tensor(lse)
        ctx.save_for_backward(q, k, v, out_t, lse_t)  # out: as computed, before any rounding
        ctx.plan = plan
        ctx.sinks_dtype = None if sinks is None else sinks.dtype
        return _rounded(out_t, plan.result_dtype)

    @staticmethod
    @once_differentiable  # the backward pass is cpuflash's: no double backward
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        plan = ctx.plan
        kn, vn = _numpy_view("key", k, passing=True), _numpy_view("value", v, passing=True)
        # any strides (an expand of sum()); bfloat16 is widened by _numpy_view, not by torch
        dout_n = _numpy_view("dout", dout if plan.result_dtype else dout.to(out.dtype),
                             passing=True)
        dq, dk, dv, *dsinks = api.attention_backward(
            dout_n, _numpy_view("query", q, passing=True), plan.keys(kn), plan.keys(vn),
            _numpy_view("out", out), _numpy_view("lse", lse), **plan.opts)
        dq, dk, dv = (_rounded(_tensor(g), plan.result_dtype) for g in (dq, dk, dv))
        if plan.key_stop != k.shape[-2]:  # keys no query saw: gradient 0
            dk, dv = (_pad_keys(g, x.shape) for g, x in ((dk, k), (dv, v)))
        dsinks = _tensor(dsinks[0]).to(ctx.sinks_dtype) if ctx.sinks_dtype is not None else None
        return dq, dk, dv, None, dsinks


def _pad_keys(g, shape):
    full = g.new_zeros(shape)
    full[..., :g.shape[-2], :] = g
    return full


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0,
                                 is_causal=False, scale=None, enable_gqa=False, *, window=None,
                                 alibi_slopes=None, softcap=None, seed=None, sinks=None):
    """``torch.nn.functional.scaled_dot_product_attention`` computed by cpuflash, for CPU or
    CUDA tensors; differentiable in ``query``, ``key``, ``value`` (and ``sinks``). See the module
    docstring for the semantics, the causal alignment and the extra keyword options."""
    # checked once here, read (views; bfloat16 widened) once, by the path that computes: the
    # plan takes only their shapes
    names = ("query", "key", "value")
    checked = [_checked(name, x) for name, x in zip(names, (query, key, value))]
    plan = _Plan(checked[0], checked[1], attn_mask, is_causal, scale, enable_gqa, dropout_p,
                 window, alibi_slopes, softcap, seed, sinks, _result_dtype(query, key, value))
    inputs = (query, key, value) if sinks is None else (query, key, value, sinks)
    if torch.is_grad_enabled() and any(t.requires_grad for t in inputs):
        return FlashAttentionFunction.apply(query, key, value, plan, sinks)
    qn, kn, vn = (_readable(name, x, passing=True) for name, x in zip(names, checked))
    out = api.attention(qn, plan.keys(kn), plan.keys(vn), **plan.opts)
    return _rounded(_tensor(out), plan.result_dtype)
