"""Forward pass: one block of threads per (query block, batch * head); K/V tiles through shared
memory, online softmax per row in registers.

For the block's ``BM`` query rows, with Q pre-multiplied by ``scale * log2(e)`` on its way into
shared memory, so that scores are in base-2 units:

    m = -inf, l = 0, acc = 0                        # per row: running max, sum, output
    for each key tile the block can see:            # tiles outside the band: never loaded
        S   = Q @ K_tile^T                          # TM x TN per thread, in registers
        S   = softcap / ALiBi / -inf outside the band (only on tiles that cross its edge)
        m'  = max(m, rowmax(S));  P = 2^(S - m');  alpha = 2^(m - m')
        l   = alpha * l + rowsum(P);  acc = alpha * acc + P @ V_tile
    out = acc / l;  lse = ln(2) * (m + log2(l))

Never built: the (Nq, Nk) score matrix, or even a P tile in shared memory (P travels between
threads by warp shuffles). Keys that no row of the block sees are loaded as zeros, so a NaN
in them reaches nothing. Float32 arithmetic throughout, for float16 inputs too.
"""
import functools
import math

import numpy as np
from numba import float32, int64

from .codegen import build, expand, join, rep
from .runtime import load
from .tiles import (
    FORWARD_ARGS,
    FULL_MASK,
    LN2,
    LOG2_E,
    NEG_INF,
    ONE,
    SHARED_FLOATS,
    ZERO,
    first_key,
    forward_shape,
    last_key,
    pad8,
    score_lines,
    shared_size,
    shfl_sync,
    shfl_xor_sync,
    signature,
)

cuda = load()


TEMPLATE = """
def forward(q, k, v, scale2, left, right, kv_lens, softcap2, slopes2, out, lse):
    n_hq, n_q, d = q.shape[1], q.shape[2], q.shape[3]
    n_hkv, dv = k.shape[1], v.shape[3]
    qs = cuda.shared.array(Q_SIZE, float32)    # Q^T: [c * BM + r] (stored once: plain)
    kvs = cuda.shared.array(KV_SIZE, float32)  # K^T [c * LDK + j] for S, then V for P @ V
    tid = int64(cuda.threadIdx.x)  # special registers are unsigned: mixed with int64
    #  they would promote to float64
    tx = tid % 8
    ty = tid // 8
    base = (tid % 32) - tx  # the lane of this row group's tx = 0
    bh = int64(cuda.blockIdx.x)
    b = bh // n_hq
    h = bh % n_hq
    hk = h // (n_hq // n_hkv)  # GQA: query head h reads kv head h // group
    qb = int64(cuda.gridDim.y) - 1 - int64(cuda.blockIdx.y)  # dearest causal blocks start first
    q0 = qb * BM
    rows = min(BM, n_q - q0)
    kv_len = kv_lens[b]
    off = kv_len - n_q
    cap_inv = ONE / softcap2 if softcap2 != ZERO else ZERO
    slope2 = slopes2[b, h]

    for e in range(tid, BM * DK, NT):
        r = e // DK
        c = e % DK
        x = ZERO
        if r < rows and c < d:
            x = float32(q[b, h, q0 + r, c]) * scale2
        qs[c * BM + r] = x

    # keys that some row of the block sees: [lo, hi] (the band is monotonic in the row)
    @band
    kb_lo = lo // BN
    kb_hi = hi // BN + 1 if hi >= lo else kb_lo
    @init

    for kb in range(kb_lo, kb_hi):
        k0 = kb * BN
        cuda.syncthreads()  # Q stored / the last tile's V reads done
        for e in range(tid, BN * DK, NT):
            j = e // DK
            c = e % DK
            x = ZERO
            if lo <= k0 + j and k0 + j <= hi and c < d:  # unseen keys: 0, so NaN stays out
                x = float32(k[b, hk, k0 + j, c])
            kvs[@kt_store] = x
        cuda.syncthreads()

        @zero_s
        for kk in range(DK):  # S = Q K^T: TM x TN outer products per step
            @s_step

        edge = k0 < first_hi or k0 + BN - 1 > last_lo  # the tile crosses the band's edge
        @scores

        @softmax

        cuda.syncthreads()  # K^T reads done: the buffer takes V
        for e in range(tid, BN * DV, NT):
            j = e // DV
            c = e % DV
            x = ZERO
            if lo <= k0 + j and k0 + j <= hi and c < dv:
                x = float32(v[b, hk, k0 + j, c])
            kvs[j * DV + c] = x
        cuda.syncthreads()

        for t in range(8):  # P @ V: key t + 8c of the tile is held by lane base + t
            @pv

    @store
"""


@functools.cache
def make_forward(d_pad, dv_pad, mods):
    """The forward kernel for head dims up to ``d_pad``/``dv_pad`` (multiples of 8) and
    ``mods`` (softcap or ALiBi on). Returns ``(python_function, threads, rows_per_block)``;
    ``kernel`` compiles it, the tests also through ``cuda.compile_ptx``."""
    TY, TM, TN = forward_shape(d_pad, dv_pad)
    NT, BM, BN = 8 * TY, TY * TM, 8 * TN
    DK, DV, CV = d_pad, dv_pad, dv_pad // 8
    # K^T rows padded by one word when that fits (affine reads, conflict-free stores), else
    # rotated by their column: [c * BN + ((j + c) & (BN - 1))]
    LDK = BN + 1 if DK * BM + max(DK * (BN + 1), BN * DV) <= SHARED_FLOATS else BN
    Q_SIZE, KV_SIZE = DK * BM, max(DK * LDK, BN * DV)
    shared_size(Q_SIZE, KV_SIZE)

    def kt_read(c):
        if LDK > BN:
            return f"kk * LDK + tx + {8 * c}"
        return f"kk * BN + ((tx + {8 * c} + kk) & (BN - 1))"
    kt_store = "c * LDK + j" if LDK > BN else "c * BN + ((j + c) & (BN - 1))"
    rows = rep("r{i} = q0 + ty * TM + {i}", i=TM)
    softmax = []
    for i in range(TM):
        m = f"m{i}"
        softmax += [f"mx = s{i}_0"] + [f"mx = max(mx, s{i}_{c})" for c in range(1, TN)]
        softmax += [f"mx = max(mx, shfl_xor_sync(FULL_MASK, mx, {x}))" for x in (1, 2, 4)]
        softmax += [f"m_new = max({m}, mx)",
                    "m_use = m_new if m_new != NEG_INF else ZERO  # all masked so far: P = 0",
                    f"alpha = math.exp2({m} - m_use)  # max rose: rescale earlier terms",
                    "row_sum = ZERO"]
        softmax += join(*([f"s{i}_{c} = math.exp2(s{i}_{c} - m_use)",
                           f"row_sum += s{i}_{c}"] for c in range(TN)))
        softmax += [f"row_sum += shfl_xor_sync(FULL_MASK, row_sum, {x})" for x in (1, 2, 4)]
        softmax += [f"l{i} = alpha * l{i} + row_sum", f"{m} = m_new"]
        softmax += rep(f"a{i}_{{cc}} *= alpha", cc=CV)
    scores = rows + join(*([f"first{i} = {first_key(f'r{i}')}", f"last{i} = {last_key(f'r{i}')}"]
                           for i in range(TM)))
    for i in range(TM):
        for c in range(TN):
            scores += score_lines(f"s{i}_{c}", f"r{i}", f"k0 + tx + {8 * c}", f"first{i}",
                                  f"last{i}", mods)
    band = [f"lo = {first_key('q0')}", f"hi = {last_key('q0 + rows - 1')}",
            f"last_lo = {last_key('q0')}  # the smallest last key",
            f"first_hi = {first_key('q0 + rows - 1')}  # the largest first key"]
    store = rows
    for i in range(TM):
        store += [f"if r{i} < n_q:",
                  f"    seen = l{i} != ZERO  # a row that sees no key: output 0, lse -inf",
                  f"    inv_l = ONE / l{i} if seen else ZERO"]
        store += rep(f"    if tx + {{cc8}} < dv: out[b, h, r{i}, tx + {{cc8}}] = a{i}_{{cc}} "
                     "* inv_l", cc=CV)
        store += [(f"    if tx == 0: lse[b, h, r{i}] = (m{i} + math.log2(l{i})) * LN2 "
                  "if seen else NEG_INF")]
    source = expand(
        TEMPLATE,
        init=rep("m{i} = NEG_INF", i=TM) + rep("l{i} = ZERO", i=TM)
        + rep("a{i}_{cc} = ZERO", i=TM, cc=CV),
        zero_s=rep("s{i}_{c} = ZERO", i=TM, c=TN),
        s_step=rep("qr{i} = qs[kk * BM + ty * TM + {i}]", i=TM)
        + [f"kr{c} = kvs[{kt_read(c)}]" for c in range(TN)]
        + rep("s{i}_{c} += qr{i} * kr{c}", i=TM, c=TN),
        scores=scores, softmax=softmax, band=band,
        pv=join(*(rep(f"p{{i}} = shfl_sync(FULL_MASK, s{{i}}_{c}, base + t)", i=TM)
                  + join(*(rep(f"v{cc} = kvs[(t + {8 * c}) * DV + tx + {8 * cc}]")
                           + rep(f"a{{i}}_{cc} += p{{i}} * v{cc}", i=TM) for cc in range(CV)))
                  for c in range(TN))),
        store=store).replace("@kt_store", kt_store)
    names = {"cuda": cuda, "math": math, "shfl_sync": shfl_sync,
             "shfl_xor_sync": shfl_xor_sync, "float32": float32, "int64": int64,
             "FULL_MASK": FULL_MASK, "LN2": LN2, "NEG_INF": NEG_INF, "ONE": ONE, "ZERO": ZERO,
             "TM": TM, "BM": BM, "BN": BN, "NT": NT, "DK": DK, "DV": DV, "Q_SIZE": Q_SIZE,
             "KV_SIZE": KV_SIZE, "MODS": mods, "LDK": LDK}
    return build(source, "forward", names), NT, BM


@functools.cache
def kernel(d_pad, dv_pad, mods, dtype):
    fn, threads, rows = make_forward(d_pad, dv_pad, mods)
    return cuda.jit(signature(dtype, FORWARD_ARGS))(fn), threads, rows


def run_forward(q, k, v, scale, band, mods, out, lse):
    """Launch on 4-D device arrays (any strides; float16 or float32). ``band``, ``mods``: as
    ``masks.band``/``masks.modifiers`` give them (numpy). Writes ``out`` (B, Hq, Nq, Dv) of q's
    dtype and ``lse`` (B, Hq, Nq) float32, natural log."""
    n_b, n_hq, n_q, d = q.shape
    if out.size == 0:
        return
    left, right, kv_lens = band
    softcap, slopes = mods
    has_mods = softcap != 0.0 or bool(np.any(slopes != 0.0))
    fn, threads, rows = kernel(pad8(d), pad8(v.shape[3]), has_mods, np.dtype(q.dtype).str)
    grid = (n_b * n_hq, -(-n_q // rows))
    fn[grid, threads](q, k, v, np.float32(scale * LOG2_E), left, right,
                      cuda.to_device(kv_lens.astype(np.int64)), np.float32(softcap * LOG2_E),
                      cuda.to_device((slopes * LOG2_E).astype(np.float32)), out, lse)
