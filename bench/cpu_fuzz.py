"""``cpuflash.attention`` against the float64 reference on random shapes and options, for a while.

Each case is of one kind (``--kinds``, taken in turn):
- ``decode``: batch 1-2, kv heads 1/2/4, GQA groups 1-8, Nq 1-16 (the decode path, its chunks
  of up to 1024 keys and their splits), Nk up to ``--max-nk``, head dims 8/16/20/64;
- ``tiled``: Nq 17-300 (the tiled path, its query and key tiles and their edges), Nk up to
  700, head dims 1-130, a value head dim that differs from D at times, float16 inputs too;
- ``backward``: ``attention_backward``'s gradients (Nq and Nk up to 200);
- ``views``: a ``decode``, ``tiled`` or ``backward`` case whose q, k, v are laid out at random
  as views: heads and rows swapped in memory (a ``(B, N, H, D)`` buffer), reversed rows, every
  other column of a wider buffer, K/V broadcast over their heads (stride 0), the values
  unchanged;
- ``cache``: a ``KVCache`` (float32, float64, float16, bfloat16 or int8; one or two layers; a
  D and a Dv that its panels divide or not) filled by a prefill and a few appends, then
  ``KVCache.attention`` with 1-16 queries (the decode path on the blocks) or 17-40 (the tiled
  path), against the reference on the cache's dequantized K/V (``KVCache.view``); a plain
  step also checked and then from its step plan, both bitwise equal to the general path;
- ``varlen``: ``attention_varlen`` and its backward over 1-4 packed sequences (empty ones
  too), each against the reference on its own, dropout with each sequence's seed;
- ``torch`` (needs torch): ``cpuflash.torch.scaled_dot_product_attention`` against torch's own
  SDPA in float64, an oracle that is not ours: bool or float masks of every broadcast shape,
  torch's top-left ``is_causal`` with ``Nq != Nk``, ``scale``, ``enable_gqa``; the gradients
  too where every row sees a key (torch's rows that see none are NaN, ours 0: those rows must
  be 0 here);
- ``merge``: a ``decode`` or ``tiled`` case (masks and softcap only: a band, ALiBi and dropout
  depend on the key positions of a call) over 1-4 disjoint key ranges (empty ones too), its
  parts combined by ``cpuflash.merge``, against the reference on all the keys;
- ``formats``: a float32 ``decode`` or ``tiled`` case whose K/V are passed as a cache format
  (float16 arrays, or int8 with ``k_scale``/``v_scale``), laid out as ``views``, against the
  reference on the dequantized K/V.
float32 and float64 (float16 too for ``tiled``), and at random causal, a window, ``kv_lens``,
softcap, ALiBi, a bool or an additive float mask (with ``-inf`` entries), dropout and a
transposed K.
A case fails if an output (or gradient) or lse is further from the reference than
``--tol32`` (float32), ``--tol64`` (float64) or ``--tol16`` (float16, relative to the largest
reference value), or if its rows that see a key and those that see none differ from the
reference's. Prints the first failing case and exits 1, else the count of cases and the worst
error. Stop 38's run found softcap's float64 tanh (1e-8) and dropout's scale (1e-10) this way.
Not collected by pytest (tests/test_bench_scripts.py runs a few cases).

    python bench/cpu_fuzz.py [--seconds 120] [--seed 0] [--max-nk 6000]
                             [--kinds decode,tiled,backward,views,cache,varlen,merge,formats,torch]
"""
import argparse
import math
import sys
import time

import numpy as np

import cpuflash
from cpuflash import reference


KINDS = ("decode", "tiled", "backward", "views", "cache", "varlen", "merge", "formats",
         "torch")
CACHE_DTYPES = (np.float32, np.float64, np.float16, "bfloat16", np.int8)


def random_case(rng, max_nk, kind="decode"):
    """``(q, k, v, options)`` of one random case of ``kind`` (``KINDS``)."""
    b, hkv = int(rng.integers(1, 3)), int(rng.choice([1, 2, 4]))
    if kind == "decode":
        hq, nq = hkv * int(rng.choice([1, 2, 4, 8])), int(rng.integers(1, 17))
        nk, d = int(rng.integers(1, max_nk + 1)), int(rng.choice([8, 16, 20, 64]))
        dv = d
    else:
        hq = hkv * int(rng.choice([1, 2]))
        top = 300 if kind == "tiled" else 200
        nq = int(rng.integers(17 if kind == "tiled" else 1, top + 1))
        nk = int(rng.integers(1, min(max_nk, 700 if kind == "tiled" else 200) + 1))
        d = int(rng.choice([1, 7, 16, 33, 64, 130]))
        dv = d if rng.random() < 0.7 else int(rng.choice([5, 16, 64]))
    if kind == "tiled":
        dtype = (np.float16, np.float32, np.float64)[int(rng.integers(3))]
    else:
        dtype = np.float32 if rng.random() < 0.5 else np.float64
    q, k, v = (rng.standard_normal(shape).astype(dtype)
               for shape in ((b, hq, nq, d), (b, hkv, nk, d), (b, hkv, nk, dv)))
    opts = random_options(rng, b, hq, nq, nk)
    if "mask" not in opts and kind != "decode" and rng.random() < 0.3:
        # additive, broadcast over heads at times
        shape = (b, hq, nq, nk) if rng.random() < 0.5 else (nq, nk)
        adds = rng.standard_normal(shape)
        adds[rng.random(shape) < 0.1] = -np.inf
        opts["mask"] = adds.astype(dtype if dtype != np.float16 else np.float32)
    if rng.random() < 0.2:
        opts.update(dropout_p=0.3, seed=int(rng.integers(0, 100)))
    if rng.random() < 0.3:  # K transposed in memory: keys along the unit stride
        k = np.ascontiguousarray(k.transpose(0, 1, 3, 2)).transpose(0, 1, 3, 2)
    return q, k, v, opts


def random_options(rng, b, hq, nq, nk):
    """At random: causal, a window, ``kv_lens``, softcap, ALiBi slopes, a bool mask and sinks
    (some heads without: -inf), for ``b`` batches, ``hq`` query heads, ``nq`` queries and
    ``nk`` keys."""
    opts = {}
    if rng.random() < 0.5:
        opts["causal"] = True
    if rng.random() < 0.4:
        opts["window"] = (int(rng.integers(0, nk + 5)), int(rng.integers(0, 50)))
    if rng.random() < 0.4:
        opts["kv_lens"] = rng.integers(0, nk + 1, size=b)
    if rng.random() < 0.3:
        opts["softcap"] = float(rng.uniform(1, 30))
    if rng.random() < 0.3:
        opts["alibi_slopes"] = rng.uniform(0, 0.1, size=hq)
    if rng.random() < 0.3:
        opts["mask"] = rng.random((b, hq, nq, nk)) < 0.8
    if rng.random() < 0.2:
        opts["sinks"] = random_sinks(rng, (hq,) if rng.random() < 0.5 else (b, hq))
    return opts


def random_sinks(rng, shape):
    """Sink logits of ``shape``, about the scores' size; a tenth of them -inf (no sink)."""
    sinks = rng.uniform(-3, 5, shape)
    sinks[rng.random(shape) < 0.1] = -np.inf
    return sinks


def laid_out(rng, x, broadcast_heads=False):
    """``x`` (B, H, N, D) with the same values in a random layout: heads and rows swapped in
    memory, rows reversed, every other column of a buffer twice as wide, and (where
    ``broadcast_heads``) one head broadcast over all with stride 0 (the values then those of
    head 0)."""
    n_b, n_h, n, d = x.shape
    if broadcast_heads and n_h > 1 and rng.random() < 0.3:
        x = x[:, :1]
    h = x.shape[1]
    if rng.random() < 0.5:  # (B, N, H, D) in memory, seen as (B, H, N, D)
        wide = 2 if rng.random() < 0.3 else 1
        view = np.empty((n_b, n, h, wide * d), x.dtype).transpose(0, 2, 1, 3)[..., ::wide]
    elif rng.random() < 0.5:  # every other column
        view = np.empty((n_b, h, n, 2 * d), x.dtype)[..., ::2]
    else:
        view = np.empty((n_b, h, n, d), x.dtype)
    if rng.random() < 0.3:  # rows reversed in memory
        view = view[:, :, ::-1]
    view[...] = x
    return np.broadcast_to(view, (n_b, n_h, n, d))


def views_case(rng, max_nk):
    """A decode, tiled or backward case with its q, k, v laid out at random (``laid_out``),
    and that kind."""
    kind = ("decode", "tiled", "backward")[int(rng.integers(3))]
    q, k, v, opts = random_case(rng, max_nk, kind)
    return laid_out(rng, q), laid_out(rng, k, True), laid_out(rng, v, True), opts, kind


def formats_case(rng, max_nk):
    """``(q, k, v, opts, k64, v64)``: a float32 decode or tiled case with K/V as float16, or
    int8 with their scales in ``opts``, laid out at random; ``k64``, ``v64`` the values the
    library should see (dequantized, float64)."""
    while True:  # the tiled kind draws float16 and float64 too: float32 only here
        q, k, v, opts = random_case(rng, max_nk, "decode" if rng.random() < 0.6 else "tiled")
        if q.dtype == np.float32:
            break
    if rng.random() < 0.5:
        k, v = k.astype(np.float16), v.astype(np.float16)
        k64, v64 = k.astype(np.float64), v.astype(np.float64)
    else:
        (k, k_scale), (v, v_scale) = cpuflash.quantize_int8(k), cpuflash.quantize_int8(v)
        k64, v64 = (x * s[..., None].astype(np.float64) for x, s in
                    ((k, k_scale), (v, v_scale)))
        opts.update(k_scale=k_scale, v_scale=v_scale)
    # not broadcast over heads: the values (and an int8 cache's scales) would change
    return laid_out(rng, q), laid_out(rng, k), laid_out(rng, v), opts, k64, v64


def torch_case(rng, max_nk):
    """``(q, k, v, options)`` as numpy arrays for ``check_torch``: torch's SDPA options
    (``attn_mask``, ``is_causal``, ``scale``, ``enable_gqa``)."""
    b, hkv = int(rng.integers(1, 3)), int(rng.choice([1, 2]))
    hq = hkv * int(rng.choice([1, 2, 4]))
    nq, nk = int(rng.integers(1, 80)), int(rng.integers(1, min(max_nk, 300) + 1))
    d = int(rng.choice([8, 16, 33, 64]))
    dv = d if rng.random() < 0.7 else 24
    dtype = np.float32 if rng.random() < 0.5 else np.float64
    q, k, v = (rng.standard_normal(shape).astype(dtype)
               for shape in ((b, hq, nq, d), (b, hkv, nk, d), (b, hkv, nk, dv)))
    opts = {"enable_gqa": hq != hkv}
    if rng.random() < 0.3:
        opts["scale"] = float(rng.uniform(0.05, 1.0))
    roll = rng.random()
    if roll < 0.3:
        opts["is_causal"] = True  # torch allows no mask beside it
    elif roll < 0.7:
        shapes = [(b, hq, nq, nk), (nq, nk), (b, 1, nq, nk), (1, hq, 1, nk), (1, nk)]
        shape = shapes[int(rng.integers(len(shapes)))]
        if rng.random() < 0.5:
            opts["attn_mask"] = rng.random(shape) < 0.85
        else:
            adds = rng.standard_normal(shape)
            adds[rng.random(shape) < 0.1] = -np.inf
            opts["attn_mask"] = adds.astype(dtype)
    return q, k, v, opts


def check_torch(case, tol):
    """``check`` for a ``torch_case``: the drop-in's output and gradients against torch's SDPA
    on float64 copies. Rows where torch's output is NaN (they see no key) must be 0 in ours;
    the gradients are compared only where no row is such."""
    import torch
    import torch.nn.functional as F
    from cpuflash.torch import scaled_dot_product_attention

    q, k, v, opts = case
    ours = [torch.from_numpy(x).requires_grad_() for x in (q, k, v)]
    theirs = [torch.from_numpy(x.astype(np.float64)).requires_grad_() for x in (q, k, v)]
    mask = opts.get("attn_mask")
    kw = {n: x for n, x in opts.items() if n != "attn_mask"}
    out = scaled_dot_product_attention(
        *ours, attn_mask=None if mask is None else torch.from_numpy(mask), **kw)
    ref = F.scaled_dot_product_attention(
        *theirs, attn_mask=None if mask is None else torch.from_numpy(
            mask if mask.dtype == bool else mask.astype(np.float64)), **kw)
    out_np, ref_np = out.detach().numpy(), ref.detach().numpy()
    unseen = np.isnan(ref_np).all(axis=-1)  # torch's math path: NaN rows
    if np.any(out_np[unseen] != 0.0):
        return None
    err, bad = _far(out_np[~unseen], ref_np[~unseen], tol, False)
    if bad:
        return None
    if unseen.any():
        return err
    dout = np.random.default_rng(out_np.size).standard_normal(out_np.shape)
    out.backward(torch.from_numpy(dout.astype(out_np.dtype)))
    ref.backward(torch.from_numpy(dout))
    for mine, want in zip(ours, theirs):
        g_err, g_bad = _far(mine.grad.numpy(), want.grad.numpy(), tol, True)
        if g_bad:
            return None
        err = max(err, g_err)
    return err


def run_merge(rng, max_nk, tols):
    """A ``merge`` case, drawn and checked (see ``RUNS``)."""
    q, k, v, opts = random_case(rng, max_nk, "decode" if rng.random() < 0.5 else "tiled")
    opts = {n: x for n, x in opts.items() if n in ("softcap", "mask")}
    n_k = k.shape[2]
    cuts = np.sort(rng.integers(0, n_k + 1, size=int(rng.integers(0, 4))))
    spans = list(zip(np.r_[0, cuts], np.r_[cuts, n_k]))
    outs, lses = [], []
    for lo, hi in spans:
        part = dict(opts)
        if "mask" in opts:
            part["mask"] = opts["mask"][..., lo:hi]
        out, lse = cpuflash.attention(q, k[:, :, lo:hi], v[:, :, lo:hi], return_lse=True, **part)
        outs.append(out)
        lses.append(lse)
    out, lse = cpuflash.merge(outs, lses)
    ref, ref_lse = reference.attention(q, k, v, return_lse=True, **opts)
    what = describe(q, k, v, opts) + ({"key ranges": [(int(a), int(b)) for a, b in spans]},)
    relative = q.dtype == np.float16
    return _verdict(out, lse, ref, ref_lse, tols[q.dtype.name], relative), q.dtype.name, what


def cache_case(rng, max_nk):
    """``(cache, layer, q, opts, k, v)``: a filled KVCache, queries, options, and the cache's
    K/V dequantized (float64) for the reference."""
    from cpuflash._cpu import decode

    dtype = CACHE_DTYPES[int(rng.integers(len(CACHE_DTYPES)))]
    b, hkv = int(rng.integers(1, 3)), int(rng.choice([1, 2, 4]))
    hq = hkv * int(rng.choice([1, 2, 4]))
    d = int(rng.choice([8, 20, 64, 96]))
    dv = d if rng.random() < 0.7 else int(rng.choice([16, 48, 64]))
    nk = int(rng.integers(1, max_nk + 1))
    layers, layer = (2, 1) if rng.random() < 0.3 else (1, 0)
    cache = cpuflash.KVCache(layers, b, hkv, nk + int(rng.integers(0, 100)), d, v_head_dim=dv,
                             dtype=dtype)
    compute = np.float64 if dtype == np.float64 else np.float32
    cuts = np.sort(rng.integers(0, nk + 1, size=int(rng.integers(0, 4))))
    for lo, hi in zip(np.r_[0, cuts], np.r_[cuts, nk]):  # a prefill, then a few appends
        n = int(hi - lo)
        cache.append(layer, rng.standard_normal((b, hkv, n, d)).astype(compute),
                     rng.standard_normal((b, hkv, n, dv)).astype(compute))
    nq = int(rng.integers(1, 17)) if rng.random() < 0.8 else int(rng.integers(17, 41))
    q = rng.standard_normal((b, hq, nq, d)).astype(compute)
    opts = random_options(rng, b, hq, nq, nk)
    if rng.random() < 0.1:
        opts.update(dropout_p=0.3, seed=int(rng.integers(0, 100)))
    k, v, scales = cache.view(layer)
    if scales:
        k, v = (x * s[..., None].astype(np.float64) for x, s in
                zip((k, v), (scales["k_scale"], scales["v_scale"])))
    assert cache.k_blocks.shape[3] * decode.KEY_BLOCK >= nk
    return cache, layer, q, opts, k.astype(np.float64), v.astype(np.float64)


def check_cache(case, tol):
    """``check`` for a ``cache_case``: ``KVCache.attention`` against the reference on the
    dequantized cache. A plain step (no option but ``causal``) also runs twice without the
    lse: checked, then from its step plan (``decode.StepPlan``); both must give the general
    path's bits."""
    cache, layer, q, opts, k, v = case
    out, lse = cache.attention(layer, q, return_lse=True, **opts)
    ref, ref_lse = reference.attention(q, k, v, return_lse=True, **opts)
    if opts.keys() <= {"causal"} and not all(
            np.array_equal(cache.attention(layer, q, **opts), out, equal_nan=True)
            for _ in range(2)):
        return None
    return _verdict(out, lse, ref, ref_lse, tol, False)


def varlen_case(rng):
    """``(q, k, v, cu_q, cu_k, opts)``: 1-4 packed sequences (some empty) of one dtype."""
    n_seq, hkv = int(rng.integers(1, 5)), int(rng.choice([1, 2]))
    hq, d = hkv * int(rng.choice([1, 2])), int(rng.choice([1, 16, 33, 64]))
    dv = d if rng.random() < 0.7 else 24
    q_lens = rng.integers(0, 100, size=n_seq)
    k_lens = q_lens.copy() if rng.random() < 0.5 else rng.integers(0, 150, size=n_seq)
    cu_q, cu_k = (np.r_[0, np.cumsum(n)].astype(np.int64) for n in (q_lens, k_lens))
    dtype = np.float32 if rng.random() < 0.6 else np.float64
    q, k, v = (rng.standard_normal(shape).astype(dtype) for shape in
               ((cu_q[-1], hq, d), (cu_k[-1], hkv, d), (cu_k[-1], hkv, dv)))
    opts = {}
    if rng.random() < 0.5:
        opts["causal"] = True
    if rng.random() < 0.3:
        opts["window"] = (int(rng.integers(0, 60)), int(rng.integers(0, 20)))
    if rng.random() < 0.3:
        opts["softcap"] = float(rng.uniform(1, 30))
    if rng.random() < 0.3:  # per head, or per sequence and head
        opts["alibi_slopes"] = rng.uniform(0, 0.1, size=(hq,) if rng.random() < 0.5
                                           else (n_seq, hq))
    if rng.random() < 0.2:
        opts.update(dropout_p=0.3, seed=int(rng.integers(0, 100)))
    if rng.random() < 0.2:  # per head, or per sequence and head
        opts["sinks"] = random_sinks(rng, (hq,) if rng.random() < 0.5 else (n_seq, hq))
    return q, k, v, cu_q, cu_k, opts


def check_varlen(case, tol):
    """``check`` for a ``varlen_case``: each sequence against the reference on its own (its
    slopes, its dropout seed: ``varlen._sequence_seed``)."""
    from cpuflash.varlen import _sequence_seed

    q, k, v, cu_q, cu_k, opts = case
    out, lse = cpuflash.attention_varlen(q, k, v, cu_q, cu_k, return_lse=True, **opts)
    dout = np.random.default_rng(out.size).standard_normal(out.shape).astype(q.dtype)
    grads = cpuflash.attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, **opts)
    ref = np.zeros(out.shape)
    ref_lse = np.full(lse.shape, -np.inf)
    ref_grads = [np.zeros(x.shape) for x in (q, k, v)]
    if opts.get("sinks") is not None:
        ref_grads.append(np.zeros(opts["sinks"].shape))
    for b in range(len(cu_q) - 1):
        (q0, q1), (k0, k1) = cu_q[b:b + 2], cu_k[b:b + 2]
        seq_opts = dict(opts)
        for name in ("alibi_slopes", "sinks"):  # per sequence
            if opts.get(name) is not None and opts[name].ndim == 2:
                seq_opts[name] = opts[name][b]
        if "seed" in opts:
            seq_opts["seed"] = _sequence_seed(opts["seed"], b)
        spans = ((q0, q1), (k0, k1), (k0, k1))
        heads = [x[a:z].transpose(1, 0, 2) for x, (a, z) in zip((q, k, v), spans)]
        o, l_b = reference.attention(*heads, return_lse=True, **seq_opts)
        ref[q0:q1] = o.transpose(1, 0, 2)
        ref_lse[:, q0:q1] = l_b
        if q1 > q0 and k1 > k0:
            seq_grads = reference.attention_backward(dout[q0:q1].transpose(1, 0, 2), *heads,
                                                     **seq_opts)
            for full, g, (a, z) in zip(ref_grads, seq_grads, spans):
                full[a:z] = g.transpose(1, 0, 2)
            if len(seq_grads) == 4:  # dsinks: per sequence, or summed over them
                if ref_grads[3].ndim == 2:
                    ref_grads[3][b] = seq_grads[3]
                else:
                    ref_grads[3] += seq_grads[3]
    err = _verdict(out, lse, ref, ref_lse, tol, False)
    for g, r in zip(grads, ref_grads):
        if err is None:
            break
        g_err, g_bad = _far(g, r, tol, True)  # gradients grow with the scores' spread
        err = None if g_bad else max(err, g_err)
    return err


def _far(x, ref, tol, relative):
    """Max abs difference of ``x`` from ``ref``, and whether it is beyond ``tol`` (times the
    largest reference value if ``relative``) or NaN where the reference is not."""
    if not x.size:
        return 0.0, False
    diff = np.abs(x.astype(np.float64) - ref)
    err = float(np.max(np.where(np.isnan(ref), 0.0, diff)))
    bound = tol * max(1.0, float(np.max(np.abs(ref)))) if relative else tol
    return err, not err <= bound or bool(np.any(np.isnan(x) & ~np.isnan(ref)))


def check(q, k, v, opts, tol, kind="decode"):
    """The case's max error, or None if it fails (``tol``, or which rows see a key)."""
    out, lse = cpuflash.attention(q, k, v, return_lse=True, **opts)
    ref, ref_lse = reference.attention(q, k, v, return_lse=True, **opts)
    err = _verdict(out, lse, ref, ref_lse, tol, q.dtype == np.float16)
    if err is not None and kind == "backward":
        dout = np.random.default_rng(out.size).standard_normal(out.shape).astype(q.dtype)
        grads = cpuflash.attention_backward(dout, q, k, v, out, lse, **opts)
        refs = reference.attention_backward(dout, q, k, v, **opts)
        for g, r in zip(grads, refs):
            g_err, g_bad = _far(g, r, tol, True)  # gradients grow with the scores' spread
            if g_bad:
                return None
            err = max(err, g_err)
    return err


def _verdict(out, lse, ref, ref_lse, tol, relative):
    """The output's max error, or None if it or the lse is beyond ``tol`` (see ``_far``), or
    the rows that see a key differ from the reference's."""
    err, bad = _far(out, ref, tol, relative)
    seen = np.isfinite(ref_lse)
    lse_err = float(np.max(np.abs(lse[seen] - ref_lse[seen]))) if seen.any() else 0.0
    if (bad or not lse_err <= tol * (max(1.0, float(np.max(np.abs(ref_lse[seen]))))
                                     if seen.any() else 1.0)
            or (np.isfinite(lse) != seen).any()):
        return None
    return err


def describe(q, k, v, opts):
    shapes = {"q": q.shape, "k": k.shape, "dtype": q.dtype.name,
              "k transposed": k.strides[3] != k.itemsize}
    return shapes, options(opts)


def options(opts):
    """The options for printing: arrays by their shape."""
    return {n: (x if np.isscalar(x) or isinstance(x, tuple) else f"array{np.shape(x)}")
            for n, x in opts.items()}


def run_cache(rng, max_nk, tols):
    case = cache_case(rng, max_nk)
    cache, _, q, opts, k, v = case
    what = ({"cache": str(cache.dtype), "q": q.shape, "k": k.shape, "v head dim": v.shape[3]},
            options(opts))
    return check_cache(case, tols[q.dtype.name]), str(cache.dtype), what


def run_varlen(rng, max_nk, tols):
    case = varlen_case(rng)
    q, k, v, cu_q, cu_k, opts = case
    what = ({"q": q.shape, "k": k.shape, "v": v.shape, "cu_seqlens_q": cu_q.tolist(),
             "cu_seqlens_k": cu_k.tolist()}, options(opts))
    return check_varlen(case, tols[q.dtype.name]), q.dtype.name, what


def run_torch(rng, max_nk, tols):
    case = torch_case(rng, max_nk)
    q, k, v, opts = case
    what = ({"q": q.shape, "k": k.shape, "v": v.shape, "dtype": q.dtype.name}, options(opts))
    return check_torch(case, tols[q.dtype.name]), q.dtype.name, what


def run_formats(rng, max_nk, tols):
    q, k, v, opts, k64, v64 = formats_case(rng, max_nk)
    what = describe(q, k, v, opts) + ({"strides": [x.strides for x in (q, k, v)]},)
    out, lse = cpuflash.attention(q, k, v, return_lse=True, **opts)
    ref_opts = {n: x for n, x in opts.items() if n not in ("k_scale", "v_scale")}
    ref, ref_lse = reference.attention(q, k64, v64, return_lse=True, **ref_opts)
    return _verdict(out, lse, ref, ref_lse, tols["float32"], False), k.dtype.name, what


def run_views(rng, max_nk, tols):
    q, k, v, opts, base = views_case(rng, max_nk)
    what = describe(q, k, v, opts) + ({"kind": base,
                                       "strides": [x.strides for x in (q, k, v)]},)
    return check(q, k, v, opts, tols[q.dtype.name], base), q.dtype.name, what


def run_plain(kind):
    def run(rng, max_nk, tols):
        q, k, v, opts = random_case(rng, max_nk, kind)
        err = check(q, k, v, opts, tols[q.dtype.name], kind)
        return err, q.dtype.name, describe(q, k, v, opts)
    return run


# Each kind drawn and checked: ``run(rng, max_nk, tols) -> (max error or None if it fails, the
# dtype it is counted under, what to print of it)``, ``tols`` by the compute dtype's name.
RUNS = {"decode": run_plain("decode"), "tiled": run_plain("tiled"),
        "backward": run_plain("backward"), "views": run_views, "cache": run_cache,
        "varlen": run_varlen, "merge": run_merge, "formats": run_formats, "torch": run_torch}
assert tuple(RUNS) == KINDS


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=120.0)
    p.add_argument("--cases", type=int, default=0, help="stop after this many (0: no limit)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-nk", type=int, default=6000)
    p.add_argument("--tol32", type=float, default=3e-4)
    p.add_argument("--tol64", type=float, default=1e-12)
    p.add_argument("--tol16", type=float, default=4e-3)
    p.add_argument("--kinds", default=",".join(KINDS),
                   help=f"kinds of case, comma-separated, taken in turn: {', '.join(KINDS)}")
    a = p.parse_args(argv)
    if not (math.isfinite(a.seconds) and a.seconds > 0):
        p.error("--seconds must be positive")
    if a.cases < 0:
        p.error("--cases must be 0 (no limit) or positive")
    if a.max_nk < 1:
        p.error("--max-nk must be at least 1")
    if not all(math.isfinite(t) and t > 0 for t in (a.tol32, a.tol64, a.tol16)):
        p.error("--tol32, --tol64 and --tol16 must be positive")
    kinds = a.kinds.split(",")
    if not kinds or any(kind not in KINDS for kind in kinds):
        p.error(f"--kinds: expected some of {', '.join(KINDS)}, got {a.kinds!r}")
    rng = np.random.default_rng(a.seed)
    tols = {"float16": a.tol16, "float32": a.tol32, "float64": a.tol64}
    start, n, worst = time.perf_counter(), 0, {}
    while time.perf_counter() - start < a.seconds and (a.cases == 0 or n < a.cases):
        kind = kinds[n % len(kinds)]
        err, dtype, what = RUNS[kind](rng, a.max_nk, tols)
        if err is None:
            print("MISMATCH", kind, *what)
            return 1
        key = f"{kind} {dtype}"
        worst[key] = max(worst.get(key, 0.0), err)
        n += 1
    print(f"{n} cases, no mismatch; worst error: "
          + ", ".join(f"{key} {e:.2e}" for key, e in sorted(worst.items())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
