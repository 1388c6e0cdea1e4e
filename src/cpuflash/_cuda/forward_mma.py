"""Forward pass on the tensor cores: the same algorithm as ``forward.py``, with both products
(``S = Q K^T`` and ``P V``) as warp-wide ``mma.sync`` in 3xTF32 (``mma.py``: float32-class
accuracy from three TF32 MMAs per product), as torch's own float32 kernel does.

One block of warps per (query block, batch * head); each warp owns two m-tiles of 16 rows
(up to D = 64; above, a pair of warps shares them, each taking half the dims: ``SHAPES``), and
a thread holds, in the MMA's accumulator layout, two rows (``g`` and ``g + 8``, ``g = lane //
4``) of each m-tile's S and output:

    Q block -> shared memory, scaled by scale * log2(e)
    K tile 0 -> shared memory (cp.async: no registers hold it on the way)
    for each key tile the block can see (16 keys):
        start V tile -> shared memory
        S   = Q K^T                     # per m-tile 2 n-tiles x D/8 k-steps x 3 MMAs
                                        # (a pair of warps: D/16 each, halves exchanged)
        start the next K tile -> shared memory
        softcap / ALiBi / the caller's mask / band mask; online softmax per row (4 lanes
        share a row: 2 shuffles); dropout on P after the row sums
        acc = alpha * acc + P V         # P straight from S's registers (see below)
    out = acc / l;  lse = ln(2) * (m + log2(l))     # with a sink c: l + 2^(c log2(e) - m)

Q is split into its TF32 parts once, as it is stored to shared memory (both parts kept, in
the MMA's fragment order: one 16-byte load per A operand, ``load_q_lines``); K, V
and P are split in registers, as each fragment is loaded. The k index of an MMA is a summation
index, so any order of it serves if A and B agree: the kernel maps the MMA's ``k = t`` to
element ``2t`` and ``k = t + 4`` to ``2t + 1`` of each group of 8 (dims in ``Q K^T``, keys in
``P V``). Then a thread's two neighbouring S values (``c0, c1`` of the accumulator) are exactly
its A operands ``a0, a2`` of ``P V``, so P needs no shuffle and no shared memory, and the B
operands of ``Q K^T`` are neighbouring floats: one 8-byte load. K and V rows in shared memory
are padded (``make_forward``) so that the loads of a warp hit every bank once.

Keys no row of the block sees are zero-filled (``copy_async16``), as ``forward.py`` loads them
as zeros. At head dims past 32 the tiles (with Q's two parts) pass the static 48 KiB of shared
memory and are sized at launch (73 KiB at 64, 89 KiB at 128; every GPU of compute capability
8.0 or newer takes 99 KiB or more a block; two blocks a multiprocessor, as their registers
allow, need the H100/H200's 228 KiB). Used for float32 with head dims up to 128 on such a GPU
(``usable``); everything else, and the simulator, runs ``forward.py``.
"""
import functools
import math

import numpy as np
from numba import float32, int64

from .codegen import build, expand, join, rep
from .launch import compiled
from .mma import (
    copy_async16,
    copy_commit,
    copy_wait,
    copy_wait_all,
    mma_tf32,
    tf32,
    tf32_near,
    tf32_trunc,
)
from .runtime import load
from .tiles import (
    FORWARD_ARGS,
    FORWARD_BLOCK,
    FULL_MASK,
    LN2,
    NEG_INF,
    NO_EXTRAS,
    ONE,
    SHARED_FLOATS,
    SINK_LINES,
    ZERO,
    band_lines,
    dropout_lines,
    extra_names,
    finish_lines,
    grid,
    index_mask,
    mask_prologue,
    score_lines,
    shfl_xor_sync,
    signature,
)

cuda = load()

MAX_HEAD_DIM = 128  # the output of 16 rows x 128 dims is 64 registers a thread
# By the widest padded head dim: (warps per block, m-tiles of 16 query rows per warp, keys per
# tile, warps that share each m-tile). Two m-tiles per warp split each K and V fragment into
# TF32 parts once for both, and 16-key tiles keep the two m-tiles' S, P and output in 254
# registers without spills (ptxas, sm_90). Past D = 64 the output of two m-tiles would not fit:
# there a pair of warps shares its two m-tiles, each warp summing half the dims of Q K^T (the
# halves exchanged through shared memory) and holding half the dims of the output, so that a
# warp's work per tile is the D = 64 kernel's. Measured on the H200 against torch's efficient
# kernel, float32, not causal, B=4, H=16, N=4096 / 16384 (log
# bench/results/h200_forward_mma_shapes.txt): at D=64, (4, 2, 16, 1) 1.10 / 1.24x; (4, 1, 32,
# 1), stop 16's shape, 0.98 / 1.16x; (4, 1, 16, 1) 0.87 / 1.02x (166 registers, 3 blocks a
# multiprocessor); (8, 1, 16, 1) 0.79 / 0.85x. At D=128, (4, 2, 16, 2) 0.78 / 0.81x and (8, 2,
# 16, 2) 0.78 / 0.84x; one m-tile a warp, (4, 1, 16, 1) and (8, 1, 16, 1), 0.68-0.74x; (4, 1,
# 32, 1) 0.60-0.65x (188 bytes spilled); the SIMT kernel 0.62-0.65x. Capping registers for
# more blocks a multiprocessor (launch bounds: 168 or 128 registers) spilled and lost 5-25 %
# at both widths; so did keeping Q, K and V in shared memory already split (fewer
# conversions, twice the loads: 0.63-0.72x at D=64).
# P V's n-tiles (8 dims each) taken together: their MMA chains interleaved, so that more of
# them are in flight (the same sums, so the same bits). Measured on the H200 with ten calls
# between the events, N = 4096 / 16384, not causal (log bench/results/h200_q_presplit_stop22.txt):
# 1, 2, 4 n-tiles at D=128 14.38 / 14.35 / 14.11 ms and 223 / 222 / 220 ms, at D=64 6.51 /
# 6.48 / 6.43 ms and 97.5 / 97.7 / 96.9 ms. No spills with 4 (ptxas, sm_90).
PV_GROUP = 4
SHAPES = {16: (4, 2, 16, 1), 32: (4, 2, 16, 1), 48: (4, 2, 16, 1), 64: (4, 2, 16, 1),
          80: (4, 2, 16, 2), 96: (4, 2, 16, 2), 112: (4, 2, 16, 2), 128: (4, 2, 16, 2)}


def mtile_tags(mt):
    """Name tags of a warp's ``mt`` m-tiles (16 rows each): "" for one, else "a", "b", ..."""
    return [""] if mt == 1 else [chr(ord("a") + i) for i in range(mt)]


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
    ``MAX_HEAD_DIM`` (128) in multiples of 4."""
    return takes(q, k, v, device_cc, np.float32, MAX_HEAD_DIM, 4)


# Both tensor-core kernels: ``kernel_source`` fills in the blocks (``@name``) of the kernel
# ``KERNEL``. The pipeline: K tile 0 in flight before the loop; per key tile, V in flight
# during S = Q K^T and the next K during the softmax and P V.
TEMPLATE = """
def KERNEL(q, k, v, scale2, left, right, kv_lens, softcap2, slopes2, mask, seed_mix,
           drop_below, inv_keep, sinks, out, lse):
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


def _pieces(keys, per_row, threads, affine):
    """This thread's 16-byte pieces of a tile of ``keys`` rows of ``per_row`` pieces (threads
    take them in turn): ``(guard, row, piece)`` source texts, ``guard`` a condition or None.
    ``affine``: as ``copy_tile``."""
    for u in range(-(-keys * per_row // threads)):
        e = f"(tid + {u * threads})"
        j, p = f"({e} // {per_row})", f"({e} % {per_row})"
        if affine and threads % per_row == 0:  # the same piece of a row u * rows further on
            j, p = f"(tid // {per_row} + {u * threads // per_row})", f"(tid % {per_row})"
        guard = None if keys * per_row % threads == 0 else f"{e} < {keys * per_row}"
        yield guard, j, p


def copy_tile(at, src, width, pad, ld, first, per_piece, keys, threads, affine=False,
              inside=False):
    """Lines: this thread's 16-byte pieces of the ``keys x pad`` tile of rows ``first ..`` of
    ``src`` into shared ``sm`` from word ``at`` (row stride ``ld`` 4-byte words), by
    ``copy_async16``; a piece is ``per_piece`` elements of ``src`` (4 float32, 8 float16) and 4
    words of ``sm``. Rows outside the block's keys ``[lo, hi]`` and pieces past ``width`` (a
    multiple of ``per_piece``) are zero-filled. ``affine``: a thread's pieces written as one
    row and column plus constant row offsets (when the threads cover whole rows), so that its
    addresses differ by constants and need no register each.

    ``inside``: a tile inside ``[lo, hi]`` (every tile but the edges of the band) takes its
    rows as they are, on a branch of its own: the clamp and test of each row against ``lo``
    and ``hi`` are 64-bit compares and selects, about 20 instructions a piece (SASS, sm_90: 90
    of a key tile's 1252 at D=128 went to K's four pieces a thread). (The float16 kernel with
    a mask and dropout spills 24 bytes more with it: not taken there.)"""
    fast, edge = [], []
    for guard, j, p in _pieces(keys, pad // per_piece, threads, affine):
        c = f"{per_piece} * {p}"
        to = f"({at} + {j} * {ld} + 4 * {p}) & ALIGN4"
        col = f"min({c}, {width} - {per_piece}) & ANY"
        ok = f"(lo <= {first} + {j}) & ({first} + {j} <= hi) & ({c} < {width})"
        plain = (f"copy_async16(sm, {to}, {src}, ({first} + {j}) & ANY, {col}, "
                 f"16 if {c} < {width} else 0)")
        body = (f"copy_async16(sm, {to}, {src}, min(max({first} + {j}, lo), hi) & ANY, {col}, "
                f"16 if {ok} else 0)")
        for lines, line in ((fast, plain), (edge, body)):
            lines += [f"if {guard}:", "    " + line] if guard else [line]
    if not inside:
        return edge
    return ([f"if lo <= {first} and {first} + {keys - 1} <= hi:"] + ["    " + x for x in fast]
            + ["else:"] + ["    " + x for x in edge])


def _split(value, big, small, once=False):
    """Lines: ``value`` (float32) as the TF32 parts ``big + small`` (3xTF32, ``mma.py``).

    In the loop (K, V and P, split in every tile), CUTLASS's split: ``big`` truncated (one
    logic instruction), ``small = value - big`` (exact) rounded by adding half an ulp to its
    bits: four instructions. ``cvt.rna`` (``tf32``) compiles to more, with a NaN test each
    (FSETP and SEL in the SASS); measured on the H200 with ten calls, the fast split is 8-9 %
    faster at D=128 and 13-14 % at D=64 (log bench/results/h200_tf32_split_stop22.txt). A
    NaN stays NaN in ``big``: masking off low mantissa bits keeps a quiet NaN's quiet bit
    (only a signalling NaN with nothing but its low 13 bits set would read as an infinity).
    ``small`` then carries up to a whole TF32 ulp, not half, and the product left out is up
    to 4x larger, so ``once`` (Q, split once per block) keeps the rounded split. Max errors
    against the float64 reference (B=1, H=16, N=4096): within 15 % of ``cvt.rna``
    everywhere's, 1.2-1.6x smaller than the fast split everywhere's; with q = k = v scaled
    up (N=1024), 3.8e-6 as torch's (``cvt.rna`` everywhere: 1.9e-6)."""
    if once:
        return [f"{big} = tf32({value})", f"{small} = tf32({value} - {big})"]
    return [f"{big} = tf32_trunc({value})", f"{small} = tf32_near({value} - {big})"]


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


def store_lines(nvd, mt="", dim0="", writes_lse="t == 0"):
    """Lines: the output ``o{mt}{nd}_{c}`` (``nvd`` n-tiles of 8 dims, accumulator layout,
    from dim ``dim0``: "" or " + <expression>") divided by ``l`` into ``oh``, and ``lse`` into
    ``lse_h`` (by the lanes where ``writes_lse``), the head's rows of ``out`` and ``lse``
    (``mtile_state``); rows past ``n_q`` and dims past ``dv`` are not stored. ``mt`` as in
    ``softmax_lines``."""
    store = []
    for w, cs in (("lo", (0, 1)), ("hi", (2, 3))):
        r, m, total = f"r{mt}_{w}", f"m{mt}_{w}", f"l{mt}_{w}"
        store += [f"if {r} < n_q:"] + ["    " + x for x in finish_lines(m, total)]
        for nd in range(nvd):
            for c in cs:
                col = f"{8 * nd + (c & 1)} + 2 * t{dim0}"
                store += [f"    if {col} < dv: oh[{r} & ANY, ({col}) & ANY] = "
                          f"o{mt}{nd}_{c} * inv_l"]
        store += [f"    if {writes_lse}: lse_h[{r} & ANY] = lse_row"]
    return store


def mtile_rows(tags, split=1):
    """Lines: this thread's two rows of each of its warp's m-tiles (``tags``, ``mtile_tags``):
    warp w owns m-tiles w * MT .. w * MT + MT - 1 of 16 rows (with ``split`` warps to a group
    of rows, group w // split); a thread rows g and g + 8 of each."""
    warp = "(tid // 32)" if split == 1 else f"(tid // {32 * split})"
    lines = []
    for i, tag in enumerate(tags):
        lines += [f"r{tag}_lo = q0 + ({warp} * {len(tags)} + {i}) * 16 + g",
                  f"r{tag}_hi = r{tag}_lo + 8"]
    return lines


def mtile_softmax(tags, nj, mods, mask=None, dropout=False):
    """Lines: score modifiers, the caller's mask and band masks (``score_lines``), and the
    online softmax (``softmax_lines``) with dropout after the sums, of a tile of scores
    ``s{tag}{j}_{c}`` (``nj`` n-tiles of 8 keys per m-tile, accumulator layout: the key of
    ``s{tag}{j}_{c}`` is k0 + 8j + 2t + (c & 1), its row ``r{tag}_lo`` for c < 2, else
    ``r{tag}_hi``)."""
    elements, row_tags, softmax = [], [], []
    for i, tag in enumerate(tags):
        mine = [(f"s{tag}{j}_{c}", f"r{tag}_lo" if c < 2 else f"r{tag}_hi",
                 f"k0 + {8 * j + (c & 1)} + 2 * t", 2 * i + (c >= 2))
                for j in range(nj) for c in range(4)]
        elements += mine
        row_tags += [(2 * i, f"r{tag}_lo"), (2 * i + 1, f"r{tag}_hi")]
        softmax += softmax_lines(nj, tag)
        if dropout:  # the rows' hash inputs made here, not kept: registers are short
            softmax += [f"mix_r{tag}_{w} = row_mix(seed_mix, bh * n_q + r{tag}_{w})"
                        for w in ("lo", "hi")]
            softmax += dropout_lines(mine, lambda row: f"mix_{row}")
    return score_lines(elements, row_tags, mods, mask), softmax


def mtile_state(tags, nvd, dim0="", writes_lse="t == 0"):
    """Lines: each m-tile's running max, sum and output set up (``init``), and stored
    (``store``, ``store_lines``)."""
    # The rows of this head (indices masked non-negative, so without the wraparound test)
    init, store = [], ["oh = out[b, h]", "lse_h = lse[b, h]"] + SINK_LINES
    for tag in tags:
        init += [f"m{tag}_lo = NEG_INF", f"m{tag}_hi = NEG_INF", f"l{tag}_lo = ZERO",
                 f"l{tag}_hi = ZERO"] + rep(f"o{tag}{{nd}}_{{c}} = ZERO", nd=nvd, c=4)
        store += store_lines(nvd, tag, dim0, writes_lse)
    return init, store


def load_q_lines(ks):
    """Lines: the block's Q rows scaled to base 2 (``scale2``), split into TF32 parts (big at
    0, small at ``QL_AT``), rows past ``n_q`` and dims past ``d`` as 0, each part in the
    fragment order of ``S = Q K^T``'s A operands, ``ks`` k-steps of 8 dims to a 16-row m-tile:
    quad ``e = (m-tile * ks + k-step) * 32 + lane`` at words ``4e .. 4e + 3`` holds lane ``4g +
    t``'s ``a0 .. a3`` = Q[g, 2t], Q[g + 8, 2t], Q[g, 2t + 1], Q[g + 8, 2t + 1] (rows of the
    m-tile, dims of the k-step), so that one 16-byte load fills the four registers an MMA
    takes its A operand from, and a warp's loads cover 512 bytes in a row (no bank conflict).
    Q stored as rows, a quad came as two 8-byte loads of pairs (a0, a2) and (a1, a3), and the
    compiler moved them into place: 4 moves a quad, 294 moves in a key tile's 1585
    instructions at D=128 (SASS, sm_90).

    A thread takes whole quads, their elements found by shifts and masks of ``e``: element by
    element, the divisions and 64-bit index arithmetic of a row-major loop
    (``tiles.q_block_lines``) cost 138 instructions an element at D=128, a tenth of a block's
    work at N=1024."""
    if ks & (ks - 1) == 0:  # a power of two: shifts and masks
        mtile, kstep = f"(e >> {4 + ks.bit_length()})", f"((e >> 5) & {ks - 1})"
    else:
        mtile, kstep = f"((e >> 5) // {ks})", f"((e >> 5) % {ks})"
    lines = ["qh = q[b, h]", f"for e in range(tid, BM * {2 * ks}, NT):",  # BM * DK / 4 quads
             f"    r = {mtile} * 16 + ((e >> 2) & 7)", f"    c = {kstep} * 8 + 2 * (e & 3)",
             "    at = (4 * e) & ALIGN4"]
    for i, (dr, dc) in enumerate(((0, 0), (8, 0), (0, 1), (8, 1))):  # a0 .. a3
        lines += ["    x = ZERO", f"    if r + {dr} < rows and c + {dc} < d:",
                  f"        x = float32(qh[(q0 + r + {dr}) & ANY, (c + {dc}) & ANY]) * scale2"]
        lines += ["    " + x for x in _split("x", "xb", "xl", once=True)]
        lines += [f"    sm[at + {i}] = xb", f"    sm[QL_AT + at + {i}] = xl"]
    return lines


@functools.cache
def make_forward(d_pad, dv_pad, mods, mask=None, dropout=False):
    """The tensor-core forward kernel for float32 head dims up to ``d_pad``/``dv_pad``
    (multiples of 16, at most ``MAX_HEAD_DIM``), ``mods`` (softcap or ALiBi on), the caller's
    ``mask`` and ``dropout`` (as ``forward.make_forward``): the kernel, its threads, its query
    rows and its bytes of dynamic shared memory."""
    DK, DV = d_pad, dv_pad
    assert DK % 16 == 0 and DV % 16 == 0 and max(DK, DV) <= MAX_HEAD_DIM, (DK, DV)
    warps, MT, BN, SPLIT = SHAPES[max(DK, DV)]
    BM, NT = 16 * MT * warps // SPLIT, 32 * warps  # query rows, threads
    DKW, DVW = DK // SPLIT, DV // SPLIT  # a warp's share of the dims (multiples of 8)
    tags = mtile_tags(MT)
    NKS, NJ, NVD = DKW // 8, BN // 8, DVW // 8  # a warp's k-steps of S, n-tiles of S and out
    # Row strides (floats), for conflict-free fragment loads: a half warp's 8-byte K loads
    # (rows g, dims 2t) need LDK = 8 (mod 32) words; a warp's V loads (rows 2t, dims g),
    # LDV = 4 (mod 16). Q is stored in the MMA's fragment order (``load_q_lines``).
    LDK, LDV = DK + 8, DV + 4
    KS = DK // 8  # k-steps over all of Q's dims
    # Q's TF32 parts, split once for all key tiles: big at 0, small at QL_AT, each as quads
    # (``load_q_lines``). (Split in every
    # tile as K and V are, stop 21: 2-3 % slower at D = 64 and 128, log
    # bench/results/h200_q_presplit_stop22.txt. Both parts of a pair of dims side by side, one
    # 16-byte load where two blocks take two 8-byte loads, stop 24: the same speed within 0.5 %,
    # bench/results/h200_q_pairs_stop24.txt; two stages of K/V buffers with one barrier a tile,
    # 12-17 % slower, bench/results/h200_two_stages_stop24.txt.)
    QL_AT = BM * DK
    K_AT, V_AT = 2 * QL_AT, 2 * QL_AT + BN * LDK  # multiples of 4: 16-byte aligned
    X_AT = V_AT + BN * LDV  # with SPLIT = 2: the warps' partial scores, [score][thread]
    NX = MT * NJ * 4 if SPLIT > 1 else 0  # a thread's scores
    SIZE = X_AT + NX * NT
    dynamic = SIZE > SHARED_FLOATS  # past the static 48 KiB: sized at launch
    # S = Q K^T, per k-step ks (dims 8ks..8ks+7): A = Q[g, 8ks + 2t], Q[g + 8, 8ks + 2t], Q[g,
    # 8ks + 2t + 1], Q[g + 8, 8ks + 2t + 1] (the MMA's k = t is dim 2t, k = t + 4 is dim 2t +
    # 1), one 16-byte load of each TF32 part (split once, above); per n-tile j (keys 8j..8j+7)
    # B = K[8j + g, 8ks + 2t] and K[8j + g, 8ks + 2t + 1], one, split into TF32 parts in
    # registers once for all the warp's m-tiles. Each accumulator takes its three MMAs in the
    # order small terms first; between them the MMAs of the other n-tiles and m-tiles, which do
    # not wait.
    s_mma = []
    for ks in range(NKS):
        for i, tag in enumerate(tags):
            at = f"q_frag + {128 * (i * KS + ks)}"
            for part, base in (("qb", at), ("ql", f"{at} + QL_AT")):
                s_mma += [f"{part}{tag}_{c} = sm[{base} + {c}]" for c in range(4)]
        for j in range(NJ):
            at = f"k_frag + {8 * j * LDK + 8 * ks}"
            s_mma += [f"y0 = sm[{at}]", f"y1 = sm[{at} + 1]"]
            s_mma += _split("y0", f"kb{j}_0", f"kl{j}_0") + _split("y1", f"kb{j}_1", f"kl{j}_1")
        for a, bb in (("ql", "b"), ("qb", "l"), ("qb", "b")):
            for tag in tags:
                qa = ", ".join(f"{a}{tag}_{c}" for c in range(4))
                for j in range(NJ):
                    acc = ", ".join(f"s{tag}{j}_{c}" for c in range(4))
                    s_mma += [f"{acc} = mma_tf32({qa}, k{bb}{j}_0, k{bb}{j}_1, {acc})"]
    # With SPLIT = 2 the two warps of a pair (warps 2p, 2p + 1: lanes ``tid`` and ``tid ^ 32``
    # hold the same scores) each sum half of the dims; each adds the other's half after the
    # barrier that follows S (a + b = b + a: both get the same bits, and so the same softmax),
    # and a tile's writes come after the barrier before P V, which follows the last reads.
    exchange_out, exchange_in = [], []
    if SPLIT > 1:
        names_s = [f"s{tag}{j}_{c}" for tag in tags for j in range(NJ) for c in range(4)]
        for e, x in enumerate(names_s):
            exchange_out += [f"sm[X_AT + {e * NT} + tid] = {x}"]
            exchange_in += [f"{x} += sm[X_AT + {e * NT} + (tid ^ 32)]"]
    s_mma += exchange_out
    scores, softmax = mtile_softmax(tags, NJ, mods, mask, dropout)
    # P V: per k-step kk (keys 8kk..8kk+7 = S's n-tile kk) A = (s0, s2, s1, s3) of that
    # n-tile; per n-tile nd (dims 8nd..8nd+7) B = V[8kk + 2t, 8nd + g], V[8kk + 2t + 1, 8nd + g],
    # split once for all the warp's m-tiles.
    # Each n-tile's P V of the tile is summed in the MMAs from zero and joins the output by a
    # float32 FMA: the tensor cores' own accumulation truncates, and summed across thousands of
    # tiles in them the output drifted (measured at N=16384: 1.6e-5 against torch, whose
    # 3xTF32 kernel stages its sums too; 3e-7 so). n-tiles outermost: 4 staging registers an
    # m-tile.
    if SPLIT == 1:
        fragments = [f"q_frag = ((tid // 32) * {128 * MT * KS} + 4 * lane) & ALIGN4  # A "
                     "operands of S = Q K^T", "k_frag = (K_AT + g * LDK + 2 * t) & ALIGN2  # B "
                     "operands", "v_frag = V_AT + 2 * t * LDV + g             # and of P V"]
    else:
        fragments = [f"half = (tid // 32) % {SPLIT}  # this warp's share of the dims",
                     f"q_frag = ((tid // {32 * SPLIT}) * {128 * MT * KS} + 4 * lane "
                     f"+ {128 * (DKW // 8)} * half) & ALIGN4",
                     f"k_frag = (K_AT + g * LDK + 2 * t + {DKW} * half) & ALIGN2",
                     f"v_frag = V_AT + 2 * t * LDV + g + {DVW} * half"]
    pv = []
    for tag in tags:
        for kk in range(NJ):
            for i, c in enumerate((0, 2, 1, 3)):
                pv += _split(f"s{tag}{kk}_{c}", f"pb{tag}{kk}_{i}", f"pl{tag}{kk}_{i}")
    for nd0 in range(0, NVD, PV_GROUP):
        nds = range(nd0, min(nd0 + PV_GROUP, NVD))
        pv += [f"t{tag}{x}_{c} = ZERO" for tag in tags for x in range(len(nds)) for c in range(4)]
        for kk in range(NJ):
            for x, nd in enumerate(nds):
                at = f"v_frag + {8 * kk * LDV + 8 * nd}"
                pv += [f"y0 = sm[{at}]", f"y1 = sm[{at} + LDV]"]
                pv += _split("y0", f"vb{x}0", f"vl{x}0") + _split("y1", f"vb{x}1", f"vl{x}1")
            for a, bb in (("pl", "b"), ("pb", "l"), ("pb", "b")):
                for tag in tags:
                    pa = ", ".join(f"{a}{tag}{kk}_{i}" for i in range(4))
                    for x in range(len(nds)):
                        acc = ", ".join(f"t{tag}{x}_{c}" for c in range(4))
                        pv += [f"{acc} = mma_tf32({pa}, v{bb}{x}0, v{bb}{x}1, {acc})"]
        pv += [f"o{tag}{nd}_{c} = o{tag}{nd}_{c} * alpha{tag}_{'lo' if c < 2 else 'hi'} "
               f"+ t{tag}{x}_{c}" for tag in tags for x, nd in enumerate(nds) for c in range(4)]
    if SPLIT > 1:  # each warp of a pair stores its half of the dims; the first, lse
        init, store = mtile_state(tags, NVD, f" + {DVW} * half", "t == 0 and half == 0")
    else:
        init, store = mtile_state(tags, NVD)
    init += mask_prologue(mask)
    source = kernel_source(
        "forward_mma",
        shared=["# Q block [row][dim] (row LDQ): TF32 big parts at 0, small at QL_AT; K tile",
                "# [key][dim] (row LDK) at K_AT, V tile (row LDV) at V_AT",
                "sm = cuda.shared.array(%s, float32, alignment=16)"
                % ("0" if dynamic else "SIZE")],
        rows=mtile_rows(tags, SPLIT),
        fragments=fragments,
        load_q=load_q_lines(KS),
        init=init,
        copy_first_k=copy_tile("K_AT", "kh", "d", DK, "LDK", "kb_lo * BN", 4, BN, NT, True, True),
        copy_next_k=copy_tile("K_AT", "kh", "d", DK, "LDK", "k0 + BN", 4, BN, NT, True, True),
        copy_v=copy_tile("V_AT", "vh", "dv", DV, "LDV", "k0", 4, BN, NT, True, True),
        zero_s=[f"s{tag}{j}_{c} = ZERO" for tag in tags for j in range(NJ) for c in range(4)],
        s_mma=s_mma, scores=scores, softmax=softmax, pv=pv,
        to_base2=exchange_in, store=store)
    names = {"cuda": cuda, "math": math, "shfl_xor_sync": shfl_xor_sync, "float32": float32,
             "int64": int64, "tf32": tf32, "tf32_trunc": tf32_trunc, "tf32_near": tf32_near,
             "mma_tf32": mma_tf32, "copy_async16": copy_async16,
             "copy_commit": copy_commit, "copy_wait": copy_wait, "copy_wait_all": copy_wait_all,
             "FULL_MASK": FULL_MASK, "LN2": LN2, "NEG_INF": NEG_INF, "ONE": ONE,
             "ZERO": ZERO, **extra_names(),
             "BM": BM, "BN": BN, "NT": NT, "DK": DK, "LDK": LDK, "LDV": LDV,
             "K_AT": K_AT, "V_AT": V_AT, "QL_AT": QL_AT, "X_AT": X_AT, "SIZE": SIZE,
             "MODS": mods, "ANY": index_mask(1), "ALIGN2": index_mask(2),
             "ALIGN4": index_mask(4)}
    return build(source, "forward_mma", names), NT, BM, 4 * SIZE if dynamic else 0


@functools.cache
def kernel(d_pad, dv_pad, mods, extras=NO_EXTRAS):
    """The compiled kernel; ``extras``: ``tiles.extra_args``'s kinds."""
    mask, mask_dtype, dropout = extras
    fn, threads, rows, dynamic_bytes = make_forward(d_pad, dv_pad, mods, mask, dropout)
    return (compiled(fn, signature(np.float32, FORWARD_ARGS, mask_dtype), dynamic_bytes),
            threads, rows, dynamic_bytes)


def run_forward(q, k, v, options, has_mods, kinds, extras, out, lse, stream=None):
    """Launch for ``forward.run_forward`` (which calls it for a non-empty ``out``, with the
    kernels' option and extra arguments, the sinks' among the extras, and their kinds);
    ``usable`` must hold."""
    n_b, n_hq, n_q, d = q.shape
    fn, threads, rows, _ = kernel(pad16(d), pad16(v.shape[3]), has_mods, kinds)
    fn(grid(n_b * n_hq, n_q, rows), threads, stream, q, k, v, *options, *extras, out, lse)
