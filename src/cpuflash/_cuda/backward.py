"""Backward pass by recomputation, deterministic (no atomics): three kernels.

Saved from the forward pass: ``out`` and ``lse`` only. With scores in base-2 units (Q times
``scale * log2(e)``) and ``lse2 = lse * log2(e)`` (``+inf`` for rows that see no key, so
their P is 0):

    prep:  delta_i = rowsum(dO_i * O_i);  lse2_i
    dK/dV: one block per (key block, batch * kv head), looping over the query heads of its GQA
           group and the query tiles that see the block:
             S^T = K Q^T;  P^T = 2^(S^T - lse2);  dP^T = V dO^T;  dS^T = P^T * (dP^T - delta)
             dV += P^T dO;  dK += dS^T Q          (written once, at the end: no atomics)
    dQ:    one block per (query block, batch * query head), looping over its key tiles:
             S = Q K^T;  P = 2^(S - lse2);  dP = dO V^T;  dS = P * (dP - delta);  dQ += dS K

Softcap goes through ``dS *= 1 - tanh^2``. The caller's mask enters P as in the forward pass
(bool: P = 0 there; float: added to S), and dropout, its keep factor ``z`` regenerated from the
same hash (``dropout.py``), as ``dS = P * (dP * z - delta)`` and ``dV += (P * z)^T dO``.
``dS`` is the gradient of the natural-unit score
``scale * q.k``: dQ is ``scale * dS K``, dK is ``scale * dS^T Q = ln 2 * dS^T (Q * scale *
log2 e)``. Tiles live in registers (``tiles.py`` gives the thread layout); Q, dO, K, V tiles
in shared memory, transposed and rotated. Never built: any (Nq, Nk) matrix.
"""
import functools
import math

import numpy as np
from numba import float32, int64

from .. import masks
from .arrays import view
from .codegen import build, expand, rep
from .launch import compiled
from .runtime import load
from .tiles import (
    DKDV_ARGS,
    DQ_ARGS,
    FULL_MASK,
    LN2,
    LOG2_E,
    NEG_INF,
    NO_EXTRAS,
    ONE,
    POS_INF,
    PREP_ARGS,
    ZERO,
    backward_shape,
    block_lines,
    extra_args,
    extra_names,
    first_key,
    grad_lines,
    grid,
    index_mask,
    last_key,
    mask_prologue,
    option_args,
    pad8,
    shared_size,
    shfl_sync,
    signature,
)

cuda = load()


def prep(dout, out, lse, delta, lse2):
    """delta = rowsum(dO * O) in float32; lse2 = lse * log2(e), +inf for empty rows."""
    n_hq, n_q, dv = out.shape[1], out.shape[2], out.shape[3]
    idx = int64(cuda.blockIdx.x) * int64(cuda.blockDim.x) + int64(cuda.threadIdx.x)
    if idx >= out.shape[0] * n_hq * n_q:
        return
    b = idx // (n_hq * n_q)
    h = (idx // n_q) % n_hq
    i = idx % n_q
    acc = ZERO
    for c in range(dv):
        acc += float32(dout[b, h, i, c]) * float32(out[b, h, i, c])
    delta[b, h, i] = acc
    x = lse[b, h, i]
    lse2[b, h, i] = x * LOG2_E if x != NEG_INF else POS_INF


COMMON = """
    tid = int64(cuda.threadIdx.x)  # special registers are unsigned: cast, or int64 mixes
    tx = tid % 8                   # with them into float64
    ty = tid // 8
    base = (tid % 32) - tx
    cap_inv = ONE / softcap2 if softcap2 != ZERO else ZERO
"""

DKDV = """
def dkdv(q, k, v, dout, lse2, delta, scale2, left, right, kv_lens, softcap2, slopes2, mask,
         seed_mix, drop_below, inv_keep, dk, dv):
    n_hq, n_q, d = q.shape[1], q.shape[2], q.shape[3]
    n_hkv, n_k, d_v = k.shape[1], k.shape[2], v.shape[3]
    group = n_hq // n_hkv
    ks = cuda.shared.array(SK_R, float32)   # K^T of the block's keys, rotated
    vs = cuda.shared.array(SV_R, float32)   # V^T
    qs = cuda.shared.array(SK_C, float32)   # Q^T of a query tile, times scale2
    dos = cuda.shared.array(SV_C, float32)  # dO^T
    @common
    @dkdv_block
    b = bhk // n_hkv
    hk = bhk % n_hkv
    kv_len = kv_lens[b]
    off = kv_len - n_q
    k1 = min(k0 + BR, kv_len)  # keys past kv_len: never read, gradient 0
    for e in range(tid, BR * DK, NT):
        j = e // DK
        c = e % DK
        x = ZERO
        if k0 + j < k1 and c < d:
            x = float32(k[b, hk, k0 + j, c])
        ks[(c * BR + ((j + c) & (BR - 1))) & ANY] = x
    for e in range(tid, BR * DV, NT):
        j = e // DV
        c = e % DV
        x = ZERO
        if k0 + j < k1 and c < d_v:
            x = float32(v[b, hk, k0 + j, c])
        vs[(c * BR + ((j + c) & (BR - 1))) & ANY] = x
    # queries that see some key of [k0, k1): i + off - left <= k1 - 1, i + off + right >= k0
    i_lo = max(0, k0 - off - right)
    i_hi = min(n_q - 1, k1 - 1 - off + left)
    if k1 <= k0:
        i_hi = i_lo - 1
    @init
    for h in range(hk * group, hk * group + group):
        slope2 = slopes2[b, h]
        @per_head
        for qt in range(i_lo // BC, (i_hi // BC + 1) if i_hi >= i_lo else 0):
            q0 = qt * BC
            cuda.syncthreads()  # the last tile's reads done
            for e in range(tid, BC * DK, NT):
                r = e // DK
                c = e % DK
                x = ZERO
                if i_lo <= q0 + r and q0 + r <= i_hi and c < d:
                    x = float32(q[b, h, q0 + r, c]) * scale2
                qs[(c * BC + ((r + c) & (BC - 1))) & ANY] = x
            for e in range(tid, BC * DV, NT):
                r = e // DV
                c = e % DV
                x = ZERO
                if i_lo <= q0 + r and q0 + r <= i_hi and c < d_v:
                    x = float32(dout[b, h, q0 + r, c])
                dos[(c * BC + ((r + c) & (BC - 1))) & ANY] = x
            cuda.syncthreads()
            @zero
            for kk in range(DK):  # S^T = K Q^T
                @s_step
            for kk in range(DV):  # dP^T = V dO^T
                @dp_step
            @grad
            for t in range(8):  # query t + 8c of the tile is held by lane base + t
                @acc
    @store
"""

DQ = """
def dq_kernel(q, k, v, dout, lse2, delta, scale2, left, right, kv_lens, softcap2, slopes2,
              mask, seed_mix, drop_below, inv_keep, scale, dq):
    n_hq, n_q, d = q.shape[1], q.shape[2], q.shape[3]
    n_hkv, d_v = k.shape[1], v.shape[3]
    qs = cuda.shared.array(SK_R, float32)   # Q^T of the block's queries, times scale2
    dos = cuda.shared.array(SV_R, float32)  # dO^T
    ks = cuda.shared.array(SK_C, float32)   # K^T of a key tile, rotated
    vs = cuda.shared.array(SV_C, float32)   # V^T
    @common
    @dq_block
    b = bh // n_hq
    h = bh % n_hq
    hk = h // (n_hq // n_hkv)
    rows = min(BR, n_q - q0)
    kv_len = kv_lens[b]
    off = kv_len - n_q
    slope2 = slopes2[b, h]
    for e in range(tid, BR * DK, NT):
        r = e // DK
        c = e % DK
        x = ZERO
        if r < rows and c < d:
            x = float32(q[b, h, q0 + r, c]) * scale2
        qs[(c * BR + ((r + c) & (BR - 1))) & ANY] = x
    for e in range(tid, BR * DV, NT):
        r = e // DV
        c = e % DV
        x = ZERO
        if r < rows and c < d_v:
            x = float32(dout[b, h, q0 + r, c])
        dos[(c * BR + ((r + c) & (BR - 1))) & ANY] = x
    @rows_stats
    @band
    @init
    for kt in range(lo // BC, (hi // BC + 1) if hi >= lo else 0):
        k0 = kt * BC
        cuda.syncthreads()
        for e in range(tid, BC * DK, NT):
            j = e // DK
            c = e % DK
            x = ZERO
            if lo <= k0 + j and k0 + j <= hi and c < d:
                x = float32(k[b, hk, k0 + j, c])
            ks[(c * BC + ((j + c) & (BC - 1))) & ANY] = x
        for e in range(tid, BC * DV, NT):
            j = e // DV
            c = e % DV
            x = ZERO
            if lo <= k0 + j and k0 + j <= hi and c < d_v:
                x = float32(v[b, hk, k0 + j, c])
            vs[(c * BC + ((j + c) & (BC - 1))) & ANY] = x
        cuda.syncthreads()
        @zero
        for kk in range(DK):  # S = Q K^T
            @s_step
        for kk in range(DV):  # dP = dO V^T
            @dp_step
        @grad
        for t in range(8):  # key t + 8c of the tile is held by lane base + t
            @acc
    @store
"""


def _blocks(own, other, TM, TN, CK, CV):
    """The register-tile blocks of both kernels. ``own``/``other``: which smem arrays hold the
    owned rows (TM per thread) and the other side (TN per thread, strided by 8)."""
    o_k, o_v, x_k, x_v = own + other  # e.g. ("ks", "vs", "qs", "dos")
    return {
        "zero": rep("s{i}_{c} = ZERO", i=TM, c=TN) + rep("dp{i}_{c} = ZERO", i=TM, c=TN),
        "s_step": rep(f"ar{{i}} = {o_k}[(kk * BR + ((ty * TM + {{i}} + kk) & (BR - 1))) & ANY]",
                      i=TM)
        + rep(f"br{{c}} = {x_k}[(kk * BC + ((tx + {{c8}} + kk) & (BC - 1))) & ANY]", c=TN)
        + rep("s{i}_{c} += ar{i} * br{c}", i=TM, c=TN),
        "dp_step": rep(f"ar{{i}} = {o_v}[(kk * BR + ((ty * TM + {{i}} + kk) & (BR - 1))) & ANY]",
                       i=TM)
        + rep(f"br{{c}} = {x_v}[(kk * BC + ((tx + {{c8}} + kk) & (BC - 1))) & ANY]", c=TN)
        + rep("dp{i}_{c} += ar{i} * br{c}", i=TM, c=TN),
    }


@functools.cache
def make_dkdv(d_pad, dv_pad, mods, mask=None, dropout=False):
    TY, TM, TN = backward_shape(d_pad, dv_pad)
    NT, BR, BC = 8 * TY, TY * TM, 8 * TN
    DK, DV, CK, CV = d_pad, dv_pad, d_pad // 8, dv_pad // 8
    shared_size(DK * BR, DV * BR, DK * BC, DV * BC)
    blocks = _blocks(("ks", "vs"), ("qs", "dos"), TM, TN, CK, CV)
    grad = []
    for c in range(TN):
        grad += [f"qi = q0 + tx + {8 * c}",
                 "lse2_c = lse2[b, h, qi] if qi < n_q else POS_INF",
                 "delta_c = delta[b, h, qi] if qi < n_q else ZERO"]
        if dropout:
            grad += ["mix_c = row_mix(seed_mix, (b * n_hq + h) * n_q + qi)"]
        for i in range(TM):
            grad += grad_lines(f"s{i}_{c}", f"dp{i}_{c}", "qi", f"k0 + ty * TM + {i}",
                               "lse2_c", "delta_c", mods, mask, "mix_c" if dropout else None)
    acc = []
    for c in range(TN):
        acc += rep(f"pr{{i}} = shfl_sync(FULL_MASK, s{{i}}_{c}, base + t)", i=TM)
        acc += rep(f"gr{{i}} = shfl_sync(FULL_MASK, dp{{i}}_{c}, base + t)", i=TM)
        for cc in range(CV):  # dV += P^T dO: dO[j, col] = dos[col * BC + ((j + col) & (BC - 1))]
            acc += [f"x = dos[((tx + {8 * cc}) * BC + ((t + {8 * c} + tx + {8 * cc}) & (BC - 1))) "
                    "& ANY]"]
            acc += rep(f"v{{i}}_{cc} += pr{{i}} * x", i=TM)
        for cc in range(CK):  # dK += dS^T Q
            acc += [f"x = qs[((tx + {8 * cc}) * BC + ((t + {8 * c} + tx + {8 * cc}) & (BC - 1))) "
                    "& ANY]"]
            acc += rep(f"g{{i}}_{cc} += gr{{i}} * x", i=TM)
    store = []
    for i in range(TM):
        store += [f"if k0 + ty * TM + {i} < n_k:"]
        store += rep(f"    if tx + {{cc8}} < d: dk[b, hk, k0 + ty * TM + {i}, tx + {{cc8}}] = "
                     f"g{i}_{{cc}} * LN2", cc=CK)
        store += rep(f"    if tx + {{cc8}} < d_v: dv[b, hk, k0 + ty * TM + {i}, tx + {{cc8}}] = "
                     f"v{i}_{{cc}}", cc=CV)
    source = expand(DKDV, grad=grad, acc=acc, store=store, per_head=mask_prologue(mask),
                    dkdv_block=block_lines(
                        "n_k", "BR", "q.shape[0] * n_hkv",
                        "n_q * (d + d_v) * q.itemsize * (n_hq // n_hkv)", "bhk", "k0"),
                    init=rep("g{i}_{cc} = ZERO", i=TM, cc=CK) + rep("v{i}_{cc} = ZERO", i=TM,
                                                                     cc=CV),
                    **blocks)
    source = expand(source, common=[line.strip() for line in COMMON.strip().splitlines()])
    names = _names(TM=TM, BR=BR, BC=BC, NT=NT, DK=DK, DV=DV, MODS=mods, SK_R=DK * BR,
                   SV_R=DV * BR, SK_C=DK * BC, SV_C=DV * BC)
    return build(source, "dkdv", names), NT, BR


@functools.cache
def make_dq(d_pad, dv_pad, mods, mask=None, dropout=False):
    TY, TM, TN = backward_shape(d_pad, dv_pad)
    NT, BR, BC = 8 * TY, TY * TM, 8 * TN
    DK, DV, CK, CV = d_pad, dv_pad, d_pad // 8, dv_pad // 8
    shared_size(DK * BR, DV * BR, DK * BC, DV * BC)
    blocks = _blocks(("qs", "dos"), ("ks", "vs"), TM, TN, CK, CV)
    stats = []
    for i in range(TM):
        stats += [f"r{i} = q0 + ty * TM + {i}",
                  f"lse2_{i} = lse2[b, h, r{i}] if r{i} < n_q else POS_INF",
                  f"delta_{i} = delta[b, h, r{i}] if r{i} < n_q else ZERO"]
        if dropout:
            stats += [f"mix_{i} = row_mix(seed_mix, (b * n_hq + h) * n_q + r{i})"]
    stats += mask_prologue(mask)
    grad = []
    for i in range(TM):
        for c in range(TN):
            grad += grad_lines(f"s{i}_{c}", f"dp{i}_{c}", f"r{i}", f"k0 + tx + {8 * c}",
                               f"lse2_{i}", f"delta_{i}", mods, mask,
                               f"mix_{i}" if dropout else None)
    acc = []
    for c in range(TN):
        acc += rep(f"gr{{i}} = shfl_sync(FULL_MASK, dp{{i}}_{c}, base + t)", i=TM)
        for cc in range(CK):  # dQ += dS K: K[j, col] = ks[col * BC + ((j + col) & (BC - 1))]
            acc += [f"x = ks[((tx + {8 * cc}) * BC + ((t + {8 * c} + tx + {8 * cc}) & (BC - 1))) "
                    "& ANY]"]
            acc += rep(f"g{{i}}_{cc} += gr{{i}} * x", i=TM)
    store = []
    for i in range(TM):
        store += [f"if r{i} < n_q:"]
        store += rep(f"    if tx + {{cc8}} < d: dq[b, h, r{i}, tx + {{cc8}}] = g{i}_{{cc}} * scale",
                     cc=CK)
    source = expand(DQ, band=[f"lo = {first_key('q0')}", f"hi = {last_key('q0 + rows - 1')}"],
                    grad=grad, acc=acc, store=store, rows_stats=stats,
                    dq_block=block_lines(
                        "n_q", "BR", "q.shape[0] * n_hq",
                        "k.shape[2] * (d + d_v) * k.itemsize * n_hkv // n_hq", "bh", "q0",
                        latest_first=True),
                    init=rep("g{i}_{cc} = ZERO", i=TM, cc=CK), **blocks)
    source = expand(source, common=[line.strip() for line in COMMON.strip().splitlines()])
    names = _names(TM=TM, BR=BR, BC=BC, NT=NT, DK=DK, DV=DV, MODS=mods, SK_R=DK * BR,
                   SV_R=DV * BR, SK_C=DK * BC, SV_C=DV * BC)
    return build(source, "dq_kernel", names), NT, BR


def _names(**consts):
    return {"cuda": cuda, "math": math, "shfl_sync": shfl_sync, "float32": float32,
            "int64": int64, "FULL_MASK": FULL_MASK, "LN2": LN2, "POS_INF": POS_INF,
            "ONE": ONE, "ZERO": ZERO, "ANY": index_mask(1), **extra_names(), **consts}


@functools.cache
def kernels(d_pad, dv_pad, mods, dtype, extras=NO_EXTRAS):
    """The compiled prep, dK/dV and dQ kernels; ``extras``: ``tiles.extra_args``'s kinds."""
    mask, mask_dtype, dropout = extras
    return (compiled(prep, signature(dtype, PREP_ARGS)),) + tuple(
        (compiled(fn, signature(dtype, args, mask_dtype)), threads, rows)
        for (fn, threads, rows), args in
        ((make_dkdv(d_pad, dv_pad, mods, mask, dropout), DKDV_ARGS),
         (make_dq(d_pad, dv_pad, mods, mask, dropout), DQ_ARGS)))


def run_backward(dout, q, k, v, out, lse, scale, band, mods, dq, dk, dv, stream=None,
                 scratch=None, mask=None, drop=masks.NO_DROPOUT):
    """Launch on 4-D ``GpuArray``s, on the raw ``stream``; writes ``dq, dk, dv`` (4-D, the
    dtypes of q, k, v). ``scratch(shape)``: a new float32 ``GpuArray`` (default: numba's).
    ``mask``, ``drop``: as ``forward.run_forward`` takes them. Returns ``delta``, each row's
    ``rowsum(dO * O)`` (B, Hq, Nq), for the sinks' gradient (``sinks.run_dsinks``)."""
    n_b, n_hq, n_q, d = q.shape
    n_hkv, n_k, d_v = k.shape[1], k.shape[2], v.shape[3]
    options, has_mods = option_args(scale, band, mods)
    kinds, extras = extra_args(mask, drop)
    prep_k, (dkdv_k, t1, r1), (dq_k, t2, r2) = kernels(pad8(d), pad8(d_v), has_mods,
                                                         np.dtype(q.dtype).str, kinds)
    if scratch is None:
        scratch = lambda shape: view(cuda.device_array(shape, dtype=np.float32))  # noqa: E731
    delta = scratch((n_b, n_hq, n_q))
    lse2 = scratch((n_b, n_hq, n_q))
    rows = n_b * n_hq * n_q
    if rows:
        prep_k(-(-rows // 128), 128, stream, dout, out, lse, delta, lse2)
    args = (q, k, v, dout, lse2, delta, *options, *extras)
    if n_b * n_hkv and n_k:
        dkdv_k(grid(n_b * n_hkv, n_k, r1), t1, stream, *args, dk, dv)
    if rows:
        dq_k(grid(n_b * n_hq, n_q, r2), t2, stream, *args, scale, dq)
    return delta
