"""Forward pass: one block of threads per (query block, batch * head); K/V tiles through shared
memory, online softmax per row in registers.

For the block's ``BM`` query rows, with Q pre-multiplied by ``scale * log2(e)`` on its way into
shared memory, so that scores are in base-2 units:

    m = -inf, l = 0, acc = 0                        # per row: running max, sum, output
    for each key tile the block can see:            # tiles outside the band: never loaded
        S   = Q @ K_tile^T                          # TM x TN per thread, in registers
        S   = softcap / ALiBi, the caller's mask (bool: -inf; float: added), -inf outside
              the band (only on tiles that cross its edge)
        m'  = max(m, rowmax(S));  P = 2^(S - m');  alpha = 2^(m - m')
        l   = alpha * l + rowsum(P);  P *= dropout's keep / (1 - p)  (dropout.py)
        acc = alpha * acc + P @ V_tile
    out = acc / l;  lse = ln(2) * (m + log2(l))     # with a sink c: l + 2^(c log2(e) - m)

Never built: the (Nq, Nk) score matrix, or even a P tile in shared memory (P travels between
threads by warp shuffles). Keys that no row of the block sees are loaded as zeros, so a NaN
in them reaches nothing. Float32 arithmetic throughout, for float16 inputs too, and for a K/V
cache in float16 or int8 (times its per-token scales as each tile is loaded).

What made it fast (H200, float32, D = 64: 6.4 -> 31 TFLOP/s), each seen in the PTX first:
- shared indices ANDed with a mask (``tiles.index_mask``): Numba's negative-index fix-up
  had cost five 64-bit instructions per shared load;
- a thread's Q rows, K^T keys and V columns side by side, read as ``ld.shared.v4``; the S
  loop unrolled by four dims with one rotation for the four;
- K and V fetched from global memory into registers a stage ahead (V during S = Q K^T, the
  next tile's K during P V), all loads of a tile in flight at once (``tiles.tile_fetch``).
It uses all 255 registers (ptxas), so two blocks of 128 threads per multiprocessor.
"""
import functools
import math
import os

import numpy as np
from numba import float32, int64

from .. import masks
from .codegen import build, expand, join, rep
from .launch import compiled
from .runtime import device_capability, load, simulated
from .tiles import (
    FORWARD_BLOCK,
    FULL_MASK,
    LN2,
    NEG_INF,
    NO_EXTRAS,
    ONE,
    SIMT_FORWARD_ARGS,
    SINK_LINES,
    ZERO,
    aligned,
    band_lines,
    column,
    column_offset,
    dropout_lines,
    extra_args,
    extra_names,
    finish_lines,
    forward_shape,
    grid,
    group_width,
    index_mask,
    mask_prologue,
    option_args,
    pad8,
    q_block_lines,
    scale_args,
    score_lines,
    shared_size,
    shfl_sync,
    shfl_xor_sync,
    signature,
    sink_args,
    tile_elements,
    tile_fetch,
    tile_store,
)

cuda = load()


TEMPLATE = """
def forward(q, k, v, scale2, left, right, kv_lens, softcap2, slopes2, mask, seed_mix,
            drop_below, inv_keep, k_scale, v_scale, sinks, out, lse):
    n_hq, n_q, d = q.shape[1], q.shape[2], q.shape[3]
    n_hkv, dv = k.shape[1], v.shape[3]
    qs = cuda.shared.array(Q_SIZE, float32@aligned)    # Q^T: [c * BM + r]
    kvs = cuda.shared.array(KV_SIZE, float32@aligned)  # K^T (rotated), then V [j * DV + c]
    tid = int64(cuda.threadIdx.x)  # special registers are unsigned: mixed with int64
    #  they would promote to float64
    tx = tid % 8
    ty = tid // 8
    base = (tid % 32) - tx  # the lane of this row group's tx = 0
    @block

    @load_q
    @band
    @init

    # Each tile's K is fetched into registers during the step before (its V during S = Q K^T):
    # step kb_lo - 1 only fetches the first tile's K. One fetch of K in the code: Numba's
    # compile time grows with every copy (see tiles.tile_fetch).
    first_step = kb_lo - 1 if kb_lo < kb_hi else kb_hi  # no tiles: no steps
    @zero_kx
    for kb in range(first_step, kb_hi):
        k0 = kb * BN
        if kb >= kb_lo:
            cuda.syncthreads()  # Q stored / the last tile's V reads done
            @store_k
            cuda.syncthreads()
            @fetch_v

            @zero_s
            for kq in range(0, DK, 4):  # S = Q K^T: TM x TN outer products per dim
                @s_step

            edge = k0 < first_hi or k0 + BN - 1 > last_lo  # the tile crosses the band's edge
            @scores

            @softmax

            cuda.syncthreads()  # K^T reads done: the buffer takes V
            @store_v
            cuda.syncthreads()

        @fetch_k

        if kb >= kb_lo:
            for t in range(8):  # P @ V: the keys of lane base + t, P from it by shuffles
                @pv

    @store
"""


@functools.cache
def make_forward(d_pad, dv_pad, mods, mask=None, dropout=False, quantized=False):
    """The forward kernel for head dims up to ``d_pad``/``dv_pad`` (multiples of 8), ``mods``
    (softcap or ALiBi on), the caller's ``mask`` (None, "bool" or "float") and ``dropout``
    (on or off; ``tiles.extra_args``), and K/V ``quantized`` (int8 times per-row scales).
    Returns ``(python_function, threads, rows_per_block)``;
    ``kernel`` compiles it, the tests also through ``cuda.compile_ptx``."""
    TY, TM, TN = forward_shape(d_pad, dv_pad)
    NT, BM, BN = 8 * TY, TY * TM, 8 * TN
    DK, DV, CV = d_pad, dv_pad, dv_pad // 8
    assert BN & (BN - 1) == 0, BN  # the K^T rotation and the S step wrap with & (BN - 1)
    WK, WV = group_width(TN), group_width(CV)  # columns side by side: vector reads
    Q_SIZE, KV_SIZE = DK * BM, max(DK * BN, BN * DV)
    shared_size(Q_SIZE, KV_SIZE)
    # K^T row c holds key j at (j + 4 * (c // 4)) mod BN: the transposing stores of a warp
    # (consecutive c) spread over 8 banks, a thread's WK neighbouring keys stay neighbours,
    # and the four rows of an S step share one rotation
    kt_index = "{c} * BN + (({j} + ({c} & -4)) & (BN - 1))"
    rows = rep("r{i} = q0 + ty * TM + {i}", i=TM)
    elements = [(f"s{i}_{c}", f"r{i}", f"k0 + {column(c, WK)}", i)
                for i in range(TM) for c in range(TN)]
    softmax = []
    for i in range(TM):
        m = f"m{i}"
        softmax += [f"mx = s{i}_0"] + [f"mx = max(mx, s{i}_{c})" for c in range(1, TN)]
        softmax += [f"mx = max(mx, shfl_xor_sync(FULL_MASK, mx, {x}))" for x in (1, 2, 4)]
        softmax += [f"m_new = max({m}, mx)",
                    "m_use = cuda.selp(m_new != NEG_INF, m_new, ZERO)  # all masked so far: P = 0",
                    f"alpha = math.exp2({m} - m_use)  # max rose: rescale earlier terms",
                    "row_sum = ZERO"]
        softmax += join(*([f"s{i}_{c} = math.exp2(s{i}_{c} - m_use)",
                           f"row_sum += s{i}_{c}"] for c in range(TN)))
        softmax += [f"row_sum += shfl_xor_sync(FULL_MASK, row_sum, {x})" for x in (1, 2, 4)]
        softmax += [f"l{i} = alpha * l{i} + row_sum", f"{m} = m_new"]
        if dropout:  # after the sums: l normalizes the probabilities before dropout
            softmax += dropout_lines(elements[i * TN:(i + 1) * TN], lambda _: f"mix{i}")
        softmax += rep(f"a{i}_{{cc}} *= alpha", cc=CV)
    scores = rows + score_lines(elements, [(i, f"r{i}") for i in range(TM)], mods, mask)
    store = list(rows) + SINK_LINES
    for i in range(TM):
        store += [f"if r{i} < n_q:"] + ["    " + x for x in finish_lines(f"m{i}", f"l{i}")]
        for cc in range(CV):
            col = column(cc, WV)
            store += [f"    if {col} < dv: out[b, h, r{i}, {col}] = a{i}_{cc} * inv_l"]
        store += [f"    if tx == 0: lse[b, h, r{i}] = lse_row"]
    # S step, four dims at a time: Q^T rows kq..kq+3 (this thread's TM rows side by side) and
    # K^T rows kq..kq+3 (its TN keys in groups of WK side by side, rotated as kt_index stores
    # them: the same rotation for the four rows, so each load is a base plus a constant)
    s_step = [f"qa = (kq * BM + ty * TM) & {index_mask(group_width(TM))}"]
    for g in range(TN // WK):
        s_step += [f"ka{g} = (kq * BN + ((WK * tx + {8 * WK * g} + kq) & (BN - 1))) "
                   f"& {index_mask(WK)}"]
    for u in range(4):
        s_step += rep(f"qr{u}_{{i}} = qs[qa + {u * BM} + {{i}}]", i=TM)
        s_step += [f"kr{u}_{c} = kvs[ka{c // WK} + {u * BN + c % WK}]" for c in range(TN)]
    # one assignment per step (each one costs Numba's SSA pass); the sum runs left to right,
    # dim by dim, as four separate += would, and compiles to a chain of FMAs
    s_step += rep("s{i}_{c} = s{i}_{c} + " + " + ".join(f"qr{u}_{{i}} * kr{u}_{{c}}"
                                                       for u in range(4)), i=TM, c=TN)
    # P @ V: key column(c) of lane t's P; V row of that key, this thread's CV columns
    pv = [f"vt = (WK * t * DV + WV * tx) & {index_mask(WV)}"]
    for c in range(TN):
        pv += rep(f"p{{i}} = shfl_sync(FULL_MASK, s{{i}}_{c}, base + t)", i=TM)
        row = column_offset(c, WK) * DV
        pv += [f"v{cc} = kvs[vt + {row + column_offset(cc, WV)}]" for cc in range(CV)]
        pv += rep("a{i}_{cc} += p{i} * v{cc}", i=TM, cc=CV)
    source = expand(
        TEMPLATE,
        init=rep("m{i} = NEG_INF", i=TM) + rep("l{i} = ZERO", i=TM)
        + rep("a{i}_{cc} = ZERO", i=TM, cc=CV) + mask_prologue(mask)
        + (["ksh = k_scale[b, hk]", "vsh = v_scale[b, hk]"] if quantized else [])
        + (rep("mix{i} = row_mix(seed_mix, bh * n_q + q0 + ty * TM + {i})", i=TM)
           if dropout else []),
        zero_s=rep("s{i}_{c} = ZERO", i=TM, c=TN),
        zero_kx=rep("kx{u} = ZERO", u=len(tile_elements(DK, NT, BN)[0])),
        s_step=s_step, scores=scores, softmax=softmax, band=band_lines(), pv=pv, store=store,
        block=FORWARD_BLOCK, load_q=q_block_lines("qs[({c} * BM + {r}) & ANY] = {x}"),
        fetch_k=tile_fetch("kx", "kh", "d", DK, NT, BN, "k0 + BN", "ksh" if quantized else None),
        store_k=tile_store("kx", DK, NT, BN, kt_index),
        fetch_v=tile_fetch("vx", "vh", "dv", DV, NT, BN, "k0", "vsh" if quantized else None),
        store_v=tile_store("vx", DV, NT, BN, "{j} * DV + {c}"),
    ).replace("@aligned", aligned())
    names = {"cuda": cuda, "math": math, "shfl_sync": shfl_sync,
             "shfl_xor_sync": shfl_xor_sync, "float32": float32, "int64": int64,
             "FULL_MASK": FULL_MASK, "LN2": LN2, "NEG_INF": NEG_INF, "ONE": ONE,
             "ZERO": ZERO, **extra_names(),
             "TM": TM, "BM": BM, "BN": BN, "NT": NT, "DK": DK, "DV": DV, "Q_SIZE": Q_SIZE,
             "KV_SIZE": KV_SIZE, "MODS": mods, "WK": WK, "WV": WV, "ANY": index_mask(1)}
    return build(source, "forward", names), NT, BM


def tensor_cores(q, k, v):
    """The tensor-core kernel's module that takes a call, or None: ``forward_mma`` (3xTF32)
    for float32, ``forward_f16`` for float16, as their ``usable`` decide; never in the
    simulator, nor with ``CPUFLASH_CUDA_MMA=0``."""
    if simulated() or os.environ.get("CPUFLASH_CUDA_MMA", "") == "0":
        return None
    cc = device_capability()
    for module in _tensor_core_modules():
        if module.usable(q, k, v, cc):
            return module
    return None


@functools.cache
def _tensor_core_modules():
    """``forward_mma``, ``forward_f16``: imported on a real GPU only (their intrinsics are PTX),
    once (an import statement per call costs microseconds)."""
    from . import forward_f16, forward_mma
    return forward_mma, forward_f16


@functools.cache
def kernel(d_pad, dv_pad, mods, dtype, extras=NO_EXTRAS, kv_dtype=None):
    """The compiled SIMT kernel; ``extras``: ``tiles.extra_args``'s kinds; ``kv_dtype``: K/V's
    dtype where it is not ``dtype`` (a cache format; int8: times the scales)."""
    mask, mask_dtype, dropout = extras
    quantized = kv_dtype is not None and np.dtype(kv_dtype) == np.int8
    fn, threads, rows = make_forward(d_pad, dv_pad, mods, mask, dropout, quantized)
    sig = signature(dtype, SIMT_FORWARD_ARGS, mask_dtype, kv_dtype)
    return compiled(fn, sig), threads, rows


def run_forward(q, k, v, scale, band, mods, out, lse, stream=None, mask=None,
                drop=masks.NO_DROPOUT, kv_scales=None, sinks=None):
    """Launch on 4-D ``GpuArray``s (any strides; float16 or float32), on the raw ``stream``.
    ``band``, ``mods``: as ``masks.band``/``masks.modifiers`` give them (numpy); ``mask``: the
    caller's mask as a 4-D ``GpuArray`` (each axis 1 or full) or None; ``drop``:
    ``masks.dropout``'s ``(drop_below, seed, inv_keep)``; ``kv_scales``: an int8 cache's
    ``(k_scale, v_scale)``, 3-D ``GpuArray``s (K/V may also be float16 under a float32 q);
    ``sinks``: the attention sinks' logits (``sinks.logits_on_device``) or None, one more term
    of each row's sum (``tiles.finish_lines``). Writes ``out`` (B, Hq, Nq, Dv) of q's dtype
    and ``lse`` (B, Hq, Nq) float32, natural log. The
    tensor-core kernels take the calls they can (``tensor_cores``), this module's SIMT
    kernel the rest."""
    n_b, n_hq, n_q, d = q.shape
    if out.size == 0:
        return
    options, has_mods = option_args(scale, band, mods)
    kinds, extras = extra_args(mask, drop)
    module = tensor_cores(q, k, v)
    if module is not None:
        return module.run_forward(q, k, v, options, has_mods, kinds, extras + sink_args(sinks),
                                  out, lse, stream)
    kv_dtype = None if k.dtype == q.dtype else np.dtype(k.dtype).str
    fn, threads, rows = kernel(pad8(d), pad8(v.shape[3]), has_mods, np.dtype(q.dtype).str,
                               kinds, kv_dtype)
    fn(grid(n_b * n_hq, n_q, rows), threads, stream, q, k, v, *options, *extras,
       *scale_args(kv_scales), *sink_args(sinks), out, lse)
