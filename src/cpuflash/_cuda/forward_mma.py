"""Forward pass on the tensor cores: the same algorithm as ``forward.py``, with both products
(``S = Q K^T`` and ``P V``) as warp-wide ``mma.sync`` in 3xTF32 (``mma.py``: float32-class
accuracy from three TF32 MMAs per product), as torch's own float32 kernel does.

One block of 4 warps per (query block of 64 rows, batch * head); warp ``w`` owns rows
``16 w .. 16 w + 15`` of the block, and a thread holds, in the MMA's accumulator layout, two
rows (``g`` and ``g + 8``, ``g = lane // 4``) of S and of the output:

    Q block -> shared memory, scaled by scale * log2(e)
    K tile 0 -> shared memory (cp.async: no registers hold it on the way)
    for each key tile the block can see (32 keys):
        start V tile -> shared memory
        S   = Q K^T                     # per warp 4 n-tiles x D/8 k-steps x 3 MMAs
        start the next K tile -> shared memory
        softcap / ALiBi / band mask; online softmax per row (4 lanes share a row: 2 shuffles)
        acc = alpha * acc + P V         # P straight from S's registers (see below)
    out = acc / l;  lse = ln(2) * (m + log2(l))

Operands are split into TF32 parts in registers, as each fragment is loaded from shared
memory. The k index of an MMA is a summation index, so any order of it serves if A and B
agree: the kernel maps the MMA's ``k = t`` to element ``2t`` and ``k = t + 4`` to ``2t + 1`` of
each group of 8 (dims in ``Q K^T``, keys in ``P V``). Then a thread's two neighbouring S values
(``c0, c1`` of the accumulator) are exactly its A operands ``a0, a2`` of ``P V``, so P needs
no shuffle and no shared memory, and the B operands of ``Q K^T`` (and the A operands) are
neighbouring floats: one 8-byte load. Shared rows are padded (``make_forward``) so that the
loads of a warp hit every bank once.

Keys no row of the block sees are zero-filled (``copy_async16``), as ``forward.py`` loads
them as zeros. Used for float32 with head dims up to 64 on a GPU of compute capability 8.0 or
newer (``usable``); everything else, and the simulator, runs ``forward.py``.
"""
import functools
import math

import numpy as np
from numba import float32, int64

from .codegen import build, expand, join, rep
from .launch import compiled
from .mma import copy_async16, copy_commit, copy_wait, copy_wait_all, mma_tf32, tf32
from .runtime import load
from .tiles import (
    FORWARD_ARGS,
    FORWARD_BLOCK,
    FULL_MASK,
    LN2,
    NEG_INF,
    ONE,
    ZERO,
    band_lines,
    index_mask,
    option_args,
    q_block_lines,
    score_lines,
    shared_size,
    shfl_xor_sync,
    signature,
)

cuda = load()

BM, BN, NT = 64, 32, 128  # query rows, keys per tile, threads (4 warps of 16 rows)
# Wider heads take forward.py: at D = 128 this design (O in 64 registers a thread, 69 KiB of
# dynamic shared memory) measured 0.48-0.52x torch on the H200, below the SIMT kernel's 0.6x.
MAX_HEAD_DIM = 64


# The first lines of both tensor-core kernels: the shapes, and a thread's place in its warp in
# the MMA fragments' terms (``g``: its row of 8, ``t``: its pair of columns).
MMA_PREAMBLE = """
n_hq, n_q, d = q.shape[1], q.shape[2], q.shape[3]
n_hkv, dv = k.shape[1], v.shape[3]
tid = int64(cuda.threadIdx.x)
lane = tid % 32
g = lane // 4
t = lane % 4
""".strip().splitlines()


def pad16(n):
    return max(16, -(-n // 16) * 16)


def takes(q, k, v, device_cc, dtype, max_head_dim, multiple):
    """Whether a tensor-core kernel takes the call: sm_80+, q, k and v all of ``dtype``, head
    dims up to ``max_head_dim`` and multiples of ``multiple`` (whole 16-byte pieces), K and V
    rows unit-stride and 16-byte aligned (``copy_async16`` moves 16-byte pieces of them)."""
    if device_cc < (8, 0) or not q.dtype == k.dtype == v.dtype == dtype:
        return False
    d, dv = q.shape[3], v.shape[3]
    if max(d, dv) > max_head_dim or d % multiple or dv % multiple:
        return False
    itemsize = np.dtype(dtype).itemsize
    for x in (k, v):
        if x.strides[3] != itemsize or x.ptr % 16 or any(s % 16 for s in x.strides[:3]):
            return False
    return True


def usable(q, k, v, device_cc):
    """Whether this kernel takes the call (``takes``): float32, head dims up to
    ``MAX_HEAD_DIM`` in multiples of 4."""
    return takes(q, k, v, device_cc, np.float32, MAX_HEAD_DIM, 4)


# Both tensor-core kernels: ``kernel_source`` fills in the blocks (``@name``) of the kernel
# ``KERNEL``. The pipeline: K tile 0 in flight before the loop; per key tile, V in flight
# during S = Q K^T and the next K during the softmax and P V.
TEMPLATE = """
def KERNEL(q, k, v, scale2, left, right, kv_lens, softcap2, slopes2, out, lse):
    @preamble
    @shared
    @block
    @rows
    @load_q
    @band
    @init
    @fragments
    if kb_lo < kb_hi:
        @copy_first_k
    copy_commit()
    for kb in range(kb_lo, kb_hi):
        k0 = kb * BN
        @copy_v
        copy_commit()
        copy_wait()  # this tile's K is in (its V may still be on its way)
        cuda.syncthreads()
        @zero_s
        @s_mma
        cuda.syncthreads()  # K reads done: the next tile's K may land
        if kb + 1 < kb_hi:
            @copy_next_k
        copy_commit()
        @to_base2
        edge = k0 < first_hi or k0 + BN - 1 > last_lo  # the tile crosses the band's edge
        @scores
        @softmax
        @rescale
        copy_wait()  # this tile's V is in
        cuda.syncthreads()
        @pv
        cuda.syncthreads()  # V reads done: the next tile's V may land
    copy_wait_all()
    @store
"""


def kernel_source(name, **blocks):
    """The source of the tensor-core kernel ``name``: ``TEMPLATE`` with the shared blocks
    (shapes and lanes, block coordinates, band) and ``blocks``; ``to_base2`` and ``rescale``
    may be left out."""
    blocks = dict({"to_base2": [], "rescale": []}, **blocks)
    return expand(TEMPLATE.replace("KERNEL", name), preamble=MMA_PREAMBLE, block=FORWARD_BLOCK,
                  band=band_lines(), **blocks)


def copy_tile(at, src, width, pad, ld, first, per_piece=4, keys=BN, threads=NT,
              affine=False):
    """Lines: this thread's 16-byte pieces of the ``keys x pad`` tile of rows ``first ..`` of
    ``src`` into shared ``sm`` from word ``at`` (row stride ``ld`` 4-byte words), by
    ``copy_async16``; a piece is ``per_piece`` elements of ``src`` (4 float32, 8 float16) and 4
    words of ``sm``. Rows outside the block's keys ``[lo, hi]`` and pieces past ``width`` (a
    multiple of ``per_piece``) are zero-filled. ``affine``: a thread's pieces written as one
    row and column plus constant row offsets (when the threads cover whole rows), so that its
    addresses differ by constants and need no register each."""
    per_row = pad // per_piece
    lines = []
    for u in range(-(-keys * per_row // threads)):
        e = f"(tid + {u * threads})"
        j, p = f"({e} // {per_row})", f"({e} % {per_row})"
        if affine and threads % per_row == 0:  # the same piece of a row u * rows further on
            j, p = f"(tid // {per_row} + {u * threads // per_row})", f"(tid % {per_row})"
        c = f"{per_piece} * {p}"
        ok = f"(lo <= {first} + {j}) & ({first} + {j} <= hi) & ({c} < {width})"
        guard = [] if keys * per_row % threads == 0 else [f"if {e} < {keys * per_row}:"]
        body = (f"copy_async16(sm, ({at} + {j} * {ld} + 4 * {p}) & ALIGN4, {src}, "
                f"min(max({first} + {j}, lo), hi) & ANY, min({c}, {width} - {per_piece}) & ANY, "
                f"16 if {ok} else 0)")
        lines += guard + [("    " if guard else "") + body]
    return lines


def _split(value, big, small):
    """Lines: ``value`` (float32) as the TF32 parts ``big + small`` (3xTF32, ``mma.py``)."""
    return [f"{big} = tf32({value})", f"{small} = tf32({value} - {big})"]


def softmax_lines(nj, mt=""):
    """Lines: the online softmax of a tile of scores ``s{mt}{j}_{c}`` (``nj`` n-tiles in the
    MMA's accumulator layout: ``c`` 0, 1 of row ``r{mt}_lo``, 2, 3 of ``r{mt}_hi``; a row spread
    over the 4 lanes of a quad), base 2: new running max ``m{mt}_lo``/``m{mt}_hi``, the rescale
    ``alpha{mt}_lo``/``alpha{mt}_hi`` of what came before, the scores replaced by ``P``, and
    ``l{mt}_lo``/``l{mt}_hi`` updated. ``mt``: a tag for a warp's m-tile ("" for one)."""
    softmax = []
    for w, cs in (("lo", (0, 1)), ("hi", (2, 3))):
        m, total, alpha = f"m{mt}_{w}", f"l{mt}_{w}", f"alpha{mt}_{w}"
        vals = [f"s{mt}{j}_{c}" for j in range(nj) for c in cs]
        softmax += [f"mx = {vals[0]}"] + [f"mx = max(mx, {x})" for x in vals[1:]]
        softmax += [f"mx = max(mx, shfl_xor_sync(FULL_MASK, mx, {x}))" for x in (1, 2)]
        softmax += [f"m_new = max({m}, mx)",
                    "m_use = cuda.selp(m_new != NEG_INF, m_new, ZERO)  # all masked so far: P = 0",
                    f"{alpha} = math.exp2({m} - m_use)  # max rose: rescale earlier terms",
                    "row_sum = ZERO"]
        softmax += join(*([f"{x} = math.exp2({x} - m_use)", f"row_sum += {x}"] for x in vals))
        softmax += [f"row_sum += shfl_xor_sync(FULL_MASK, row_sum, {x})" for x in (1, 2)]
        softmax += [f"{total} = {alpha} * {total} + row_sum", f"{m} = m_new"]
    return softmax


def store_lines(nvd, mt=""):
    """Lines: the output ``o{mt}{nd}_{c}`` (``nvd`` n-tiles of 8 dims, accumulator layout)
    divided by ``l`` into ``out``, and ``lse``; rows past ``n_q`` and dims past ``dv`` are not
    stored. ``mt`` as in ``softmax_lines``."""
    store = []
    for w, cs in (("lo", (0, 1)), ("hi", (2, 3))):
        r, m, total = f"r{mt}_{w}", f"m{mt}_{w}", f"l{mt}_{w}"
        store += [f"if {r} < n_q:",
                  f"    seen = {total} != ZERO  # a row that sees no key: output 0, lse -inf",
                  f"    inv_l = ONE / {total} if seen else ZERO"]
        for nd in range(nvd):
            for c in cs:
                col = f"{8 * nd + (c & 1)} + 2 * t"
                store += [f"    if {col} < dv: out[b, h, {r}, {col}] = o{mt}{nd}_{c} * inv_l"]
        store += [f"    if t == 0: lse[b, h, {r}] = ({m} + math.log2({total})) * LN2 "
                  "if seen else NEG_INF"]
    return store


@functools.cache
def make_forward(d_pad, dv_pad, mods):
    """The tensor-core forward kernel for float32 head dims up to ``d_pad``/``dv_pad``
    (multiples of 16, at most ``MAX_HEAD_DIM``) and ``mods`` (softcap or ALiBi on)."""
    DK, DV = d_pad, dv_pad
    assert DK % 16 == 0 and DV % 16 == 0 and max(DK, DV) <= MAX_HEAD_DIM, (DK, DV)
    NKS, NJ, NVD = DK // 8, BN // 8, DV // 8  # k-steps of S, n-tiles of S, n-tiles of out
    # Row strides (floats), for conflict-free fragment loads: a half warp's 8-byte K loads
    # (rows g, dims 2t) need LDK = 8 (mod 32) words; a warp's V loads (rows 2t, dims g),
    # LDV = 4 (mod 16)
    LDQ, LDK, LDV = DK + 8, DK + 8, DV + 4
    K_AT, V_AT = BM * LDQ, BM * LDQ + BN * LDK  # multiples of 4: 16-byte aligned
    SIZE = shared_size(V_AT + BN * LDV)
    # S = Q K^T, per k-step ks (dims 8ks..8ks+7): A = Q[g, 8ks + 2t], Q[g + 8, 8ks + 2t],
    # Q[g, 8ks + 2t + 1], Q[g + 8, 8ks + 2t + 1] (the MMA's k = t is dim 2t, k = t + 4 is dim
    # 2t + 1), two 8-byte loads; per n-tile j (keys 8j..8j+7) B = K[8j + g, 8ks + 2t] and
    # K[8j + g, 8ks + 2t + 1], one. Each split into TF32 parts in registers.
    s_mma = []
    for ks in range(NKS):
        at = f"q_frag + {8 * ks}"
        s_mma += [f"x0 = sm[{at}]", f"x2 = sm[{at} + 1]",
                  f"x1 = sm[{at} + {8 * LDQ}]", f"x3 = sm[{at} + {8 * LDQ + 1}]"]
        s_mma += join(*(_split(f"x{i}", f"qb_{i}", f"ql_{i}") for i in range(4)))
        for j in range(NJ):
            at = f"k_frag + {8 * j * LDK + 8 * ks}"
            s_mma += [f"y0 = sm[{at}]", f"y1 = sm[{at} + 1]"]
            s_mma += _split("y0", "kb0", "kl0") + _split("y1", "kb1", "kl1")
            acc = f"s{j}_0, s{j}_1, s{j}_2, s{j}_3"
            for a, bb in (("ql", "b"), ("qb", "l"), ("qb", "b")):
                s_mma += [f"{acc} = mma_tf32({a}_0, {a}_1, {a}_2, {a}_3, k{bb}0, k{bb}1, {acc})"]
    # scores: the key of s{j}_{c} is k0 + 8j + 2t + (c & 1), its row r_lo (c < 2) or r_hi
    elements = [(f"s{j}_{c}", "r_lo" if c < 2 else "r_hi", f"k0 + {8 * j + (c & 1)} + 2 * t",
                 0 if c < 2 else 1) for j in range(NJ) for c in range(4)]
    scores = score_lines(elements, [(0, "r_lo"), (1, "r_hi")], mods)  # first0, last0, ...
    softmax = softmax_lines(NJ)
    # P V: per k-step kk (keys 8kk..8kk+7 = S's n-tile kk) A = (s0, s2, s1, s3) of that
    # n-tile; per n-tile nd (dims 8nd..8nd+7) B = V[8kk + 2t, 8nd + g], V[8kk + 2t + 1, 8nd + g].
    # Each n-tile's P V of the tile is summed in the MMAs from zero and joins the output by a
    # float32 FMA: the tensor cores' own accumulation truncates, and summed across thousands of
    # tiles in them the output drifted (measured at N=16384: 1.6e-5 against torch, whose
    # 3xTF32 kernel stages its sums too; 3e-7 so). n-tiles outermost: 4 staging registers.
    pv = []
    for kk in range(NJ):
        for i, c in enumerate((0, 2, 1, 3)):
            pv += _split(f"s{kk}_{c}", f"pb{kk}_{i}", f"pl{kk}_{i}")
    for nd in range(NVD):
        pv += rep("t{c} = ZERO", c=4)
        for kk in range(NJ):
            at = f"v_frag + {8 * kk * LDV + 8 * nd}"
            pv += [f"y0 = sm[{at}]", f"y1 = sm[{at} + LDV]"]
            pv += _split("y0", "vb0", "vl0") + _split("y1", "vb1", "vl1")
            for a, bb in ((f"pl{kk}", "b"), (f"pb{kk}", "l"), (f"pb{kk}", "b")):
                pv += [f"t0, t1, t2, t3 = mma_tf32({a}_0, {a}_1, {a}_2, {a}_3, "
                       f"v{bb}0, v{bb}1, t0, t1, t2, t3)"]
        pv += [f"o{nd}_{c} = o{nd}_{c} * alpha_{'lo' if c < 2 else 'hi'} + t{c}"
               for c in range(4)]
    store = store_lines(NVD)
    source = kernel_source(
        "forward_mma",
        shared=["# Q block [row][dim] (row LDQ) at 0, K tile [key][dim] (row LDK) at K_AT, V tile "
                "(row LDV)", "# at V_AT", "sm = cuda.shared.array(SIZE, float32, alignment=16)"],
        rows=["r_lo = q0 + (tid // 32) * 16 + g  # this thread's two rows", "r_hi = r_lo + 8"],
        fragments=["q_frag = ((tid // 32) * 16 * LDQ + g * LDQ + 2 * t) & ALIGN2  # A operands "
                   "of S = Q K^T", "k_frag = (K_AT + g * LDK + 2 * t) & ALIGN2  # B operands",
                   "v_frag = V_AT + 2 * t * LDV + g             # and of P V"],
        load_q=q_block_lines("sm[({r} * LDQ + {c}) & ANY] = {x}"),
        init=["m_lo = NEG_INF", "m_hi = NEG_INF", "l_lo = ZERO", "l_hi = ZERO"]
        + rep("o{nd}_{c} = ZERO", nd=NVD, c=4),
        copy_first_k=copy_tile("K_AT", "kh", "d", DK, "LDK", "kb_lo * BN"),
        copy_next_k=copy_tile("K_AT", "kh", "d", DK, "LDK", "k0 + BN"),
        copy_v=copy_tile("V_AT", "vh", "dv", DV, "LDV", "k0"),
        zero_s=rep("s{j}_{c} = ZERO", j=NJ, c=4), s_mma=s_mma, scores=scores,
        softmax=softmax, pv=pv, store=store)
    names = {"cuda": cuda, "math": math, "shfl_xor_sync": shfl_xor_sync, "float32": float32,
             "int64": int64, "tf32": tf32, "mma_tf32": mma_tf32, "copy_async16": copy_async16,
             "copy_commit": copy_commit, "copy_wait": copy_wait, "copy_wait_all": copy_wait_all,
             "FULL_MASK": FULL_MASK, "LN2": LN2, "NEG_INF": NEG_INF, "ONE": ONE, "ZERO": ZERO,
             "BM": BM, "BN": BN, "NT": NT, "DK": DK, "LDQ": LDQ, "LDK": LDK, "LDV": LDV,
             "K_AT": K_AT, "V_AT": V_AT, "SIZE": SIZE,
             "MODS": mods, "ANY": index_mask(1), "ALIGN2": index_mask(2),
             "ALIGN4": index_mask(4)}
    return build(source, "forward_mma", names), NT, BM


@functools.cache
def kernel(d_pad, dv_pad, mods, dtype):
    fn, threads, rows = make_forward(d_pad, dv_pad, mods)
    return compiled(fn, signature(dtype, FORWARD_ARGS)), threads, rows


def run_forward(q, k, v, scale, band, mods, out, lse, stream=None):
    """As ``forward.run_forward`` (which calls it for a non-empty ``out``), on the tensor
    cores; ``usable`` must hold."""
    n_b, n_hq, n_q, d = q.shape
    options, has_mods = option_args(scale, band, mods)
    fn, threads, rows = kernel(pad16(d), pad16(v.shape[3]), has_mods, np.dtype(q.dtype).str)
    fn((n_b * n_hq, -(-n_q // rows)), threads, stream, q, k, v, *options, out, lse)
