"""Forward pass for float16 on the tensor cores: ``mma.sync`` m16n8k16 with float16 operands and
float32 accumulation, as FlashAttention-2 does it.

The layout is ``forward_mma``'s (one block of warps per query block, each warp owning whole
m-tiles of 16 rows, K/V tiles through shared memory by ``cp.async``, the next K tile in
flight during the softmax and ``P V``), with float16 where that kernel splits float32 into
TF32 parts; block and tile sizes by head dim in ``SHAPES``:

    Q block -> shared memory or registers, as it is (float16, unscaled: exact)
    for each key tile the block can see (BN keys):
        S = Q K^T                            # float16 products, exact; float32 sums
        S = S * scale * log2(e); softcap / ALiBi / band mask; online softmax per row
        acc = alpha * acc;  acc += P V       # P rounded to float16, V as it is
    out = acc / l;  lse = ln(2) * (m + log2(l))     # with a sink c: l + 2^(c log2(e) - m)

Numerics. Q, K and V are used as the caller gave them: a product of two halves is exact in
float32, so ``S`` is as accurate as float32 accumulation makes it (the scale is applied to S
in float32, not folded into Q, which would round Q again). ``P`` enters ``P V`` rounded to
float16 (relative error 2^-11, below the float16 output's own rounding); ``l`` sums the
unrounded P. The output accumulates in the MMAs across tiles, as FlashAttention and torch's
flash kernel do: the drift of the tensor cores' truncating accumulation (measured with
float32 outputs at N=16384: 1.6e-5 against torch) stays far below float16's resolution
(4.9e-4 at 1; ``forward_mma`` stages each tile's sum, for float32 output).

Fragments. The accumulators of ``S`` for keys ``16 kk .. 16 kk + 15`` (n-tiles ``2 kk``, ``2 kk
+ 1``) are, packed in pairs, exactly the A operands of ``P V``'s k-step ``kk``: no shuffle. K's
B operands are pairs of neighbouring dims, one 32-bit shared load; V's are pairs of
neighbouring keys, which ``ldmatrix .trans`` gathers (four 8 x 8 blocks per instruction); Q's
A operands, when Q is in shared memory, come by ``ldmatrix``. A warp with two m-tiles reads
each K and V fragment once for both. Rows of the shared tiles are padded by 16 bytes so that
every kind of load hits every bank once.

Used for float16 with head dims up to 128 (multiples of 8), K/V rows unit-stride and 16-byte
aligned, on compute capability 8.0 or newer (``usable``); otherwise ``forward.py`` runs.
"""
import functools
import math

import numpy as np
from numba import float32, int32, int64

from .codegen import build
from .forward_mma import (
    copy_tile,
    kernel_source,
    mtile_rows,
    mtile_softmax,
    mtile_state,
    mtile_tags,
    pad16,
    takes,
)
from .launch import compiled
from .mma import (
    copy_async16,
    copy_commit,
    copy_wait,
    copy_wait_all,
    ldmatrix_x4,
    ldmatrix_x4_trans,
    mma_f16,
    pack_f16,
)
from .runtime import load
from .tiles import (
    FORWARD_ARGS,
    FULL_MASK,
    LN2,
    NEG_INF,
    NO_EXTRAS,
    ONE,
    ZERO,
    extra_names,
    grid,
    index_mask,
    mask_prologue,
    shared_size,
    shfl_xor_sync,
    signature,
)

cuda = load()

MAX_HEAD_DIM = 128  # the output of 16 rows x 128 dims is 64 registers a thread
# By the widest padded head dim: (warps per block, m-tiles of 16 query rows per warp, keys per
# tile, Q in shared memory rather than in registers). Two m-tiles per warp read each K and V
# fragment once for both (FlashAttention-2 gives a warp 32 rows too); Q in shared memory frees
# the registers that takes. Measured on the H200 against torch's flash kernel (B=4, H=16,
# N=4096-16384; logs bench/results/h200_forward_f16_shapes*.txt; ptxas registers): at D=64,
# (4, 2, 64, Q shared) 213-237 TFLOP/s, 0.71-0.77x (255 registers, no spills); (4, 1, 64, Q
# shared) 0.58-0.62x; (4, 1, 64) 0.54-0.56x; (4, 2, 32, Q shared) 0.62-0.69x; (8, 1, 64)
# 0.58-0.62x. At D=128, (8, 1, 64) 214-225 TFLOP/s, 0.60-0.67x; (8, 1, 32) 0.53-0.60x; (4, 1,
# 32, Q shared) 0.50-0.52x (Q of 128 rows in shared memory would pass the static 48 KiB).
SHAPES = {16: (4, 2, 64, True), 32: (4, 2, 64, True), 48: (4, 2, 64, True),
          64: (4, 2, 64, True), 80: (8, 1, 64, False), 96: (8, 1, 64, False),
          112: (8, 1, 64, False), 128: (8, 1, 64, False)}


def usable(q, k, v, device_cc):
    """Whether this kernel takes the call (``forward_mma.takes``): float16, head dims up to
    ``MAX_HEAD_DIM`` in multiples of 8."""
    return takes(q, k, v, device_cc, np.float16, MAX_HEAD_DIM, 8)


def _load_q(nks, tag):
    """Lines: this thread's A fragments of Q for each k-step ``ks`` (dims ``16 ks ..``) of the
    m-tile ``tag``, ``qa{tag}{ks}_{i}``, from global memory as they are; dims past ``d`` as 0
    (rows past ``n_q`` read row ``n_q - 1``: never stored)."""
    lines = [f"qr_lo = min(r{tag}_lo, n_q - 1)", f"qr_hi = min(r{tag}_hi, n_q - 1)"]
    for ks in range(nks):
        for i, (row, dim) in enumerate((("lo", 0), ("hi", 0), ("lo", 8), ("hi", 8))):
            pair = []
            for e in range(2):
                col = f"{16 * ks + dim + e} + 2 * t"
                pair.append(f"cuda.selp({col} < d, float32(q[b, h, qr_{row}, "
                            f"min({col}, d - 1)]), ZERO)")
            lines.append(f"qa{tag}{ks}_{i} = pack_f16({pair[0]}, {pair[1]})")
    return lines


def _store_q(bm, dk, threads):
    """Lines: the block's Q rows into shared memory as they are, two halves a word (row
    ``LDQ`` words); rows past ``n_q`` and dims past ``d`` as 0."""
    half = dk // 2
    return [f"for e in range(tid, {bm * half}, {threads}):",
            f"    r = q0 + e // {half}",
            f"    c = 2 * (e % {half})",
            "    x0 = ZERO",
            "    x1 = ZERO",
            "    if r < n_q and c < d:",
            "        x0 = float32(q[b, h, r, c])",
            "        if c + 1 < d:",
            "            x1 = float32(q[b, h, r, c + 1])",
            f"    sm[(Q_AT + (e // {half}) * LDQ + e % {half}) & ANY] = pack_f16(x0, x1)"]


@functools.cache
def make_forward(d_pad, dv_pad, mods, mask=None, dropout=False):
    """The float16 tensor-core forward kernel for head dims up to ``d_pad``/``dv_pad``
    (multiples of 16, at most ``MAX_HEAD_DIM``), ``mods`` (softcap or ALiBi on), the caller's
    ``mask`` and ``dropout`` (as ``forward.make_forward``)."""
    DK, DV = d_pad, dv_pad
    assert DK % 16 == 0 and DV % 16 == 0 and max(DK, DV) <= MAX_HEAD_DIM, (DK, DV)
    warps, MT, BN, Q_SHARED = SHAPES[max(DK, DV)]
    BM, NT = 16 * MT * warps, 32 * warps  # query rows, threads
    tags = mtile_tags(MT)
    NKS, NJ, NKV, NVD = DK // 16, BN // 8, BN // 16, DV // 8
    # Row strides in words: rows 16-byte aligned (for cp.async and ldmatrix), and a multiple
    # of 4 words plus 4 (mod 32), so that 8 rows of a quad's 32-bit K loads, or of an
    # ldmatrix's 16-byte rows, fall on 8 distinct groups of 4 banks
    LDK, LDV = DK // 2 + 4, DV // 2 + 4
    V_AT = BN * LDK
    Q_AT, LDQ = V_AT + BN * LDV, DK // 2 + 4  # Q block [row][LDQ words], when in shared memory
    SIZE = shared_size(Q_AT + (BM * LDQ if Q_SHARED else 0))
    # S = Q K^T: per k-step ks, per n-tile j (keys 8j..8j+7) B = K[8j + g][16ks + 2t:+2] and
    # K[8j + g][16ks + 8 + 2t:+2]: words 8ks + t and 8ks + 4 + t of row 8j + g, loaded once for
    # all the warp's m-tiles. k-steps outermost: the MMAs in a row do not wait for each other.
    s_mma = []
    for ks in range(NKS):
        for j in range(NJ):
            at = f"k_frag + {8 * j * LDK + 8 * ks}"
            s_mma += [f"kf{j}_0 = sm[{at}]", f"kf{j}_1 = sm[{at} + 4]"]
        for tag in tags:
            qa = ", ".join(f"qa{tag}{ks}_{i}" for i in range(4))
            if Q_SHARED:
                s_mma += [f"{qa} = ldmatrix_x4(sm, q_frag{tag} + {8 * ks})"]
            for j in range(NJ):
                acc = ", ".join(f"s{tag}{j}_{c}" for c in range(4))
                s_mma += [f"{acc} = mma_f16({qa}, kf{j}_0, kf{j}_1, {acc})"]
    scores, softmax = mtile_softmax(tags, NJ, mods, mask, dropout)
    # P V: k-step kk (keys 16kk..16kk+15) takes A = P of S's n-tiles 2kk, 2kk + 1 packed in
    # pairs; each ldmatrix gives the B operands of two n-tiles of the output (dims 16np..+15),
    # for all the warp's m-tiles
    pv = []
    for tag in tags:
        for kk in range(NKV):
            lo, hi = f"s{tag}{2 * kk}", f"s{tag}{2 * kk + 1}"
            pv += [f"pa{tag}{kk}_0 = pack_f16({lo}_0, {lo}_1)",
                   f"pa{tag}{kk}_1 = pack_f16({lo}_2, {lo}_3)",
                   f"pa{tag}{kk}_2 = pack_f16({hi}_0, {hi}_1)",
                   f"pa{tag}{kk}_3 = pack_f16({hi}_2, {hi}_3)"]
    for kk in range(NKV):
        for np_ in range(DV // 16):
            pv += [f"vf0, vf1, vf2, vf3 = ldmatrix_x4_trans(sm, v_frag + "
                   f"{16 * kk} * LDV + {8 * np_})"]
            for tag in tags:
                pa = ", ".join(f"pa{tag}{kk}_{i}" for i in range(4))
                for nd, (b0, b1) in ((2 * np_, ("vf0", "vf1")), (2 * np_ + 1, ("vf2", "vf3"))):
                    acc = ", ".join(f"o{tag}{nd}_{c}" for c in range(4))
                    pv += [f"{acc} = mma_f16({pa}, {b0}, {b1}, {acc})"]
    init, store = mtile_state(tags, NVD)
    init += mask_prologue(mask)
    rescale, load_q = [], []
    for tag in tags:
        rescale += [f"o{tag}{nd}_{c} *= alpha{tag}_{'lo' if c < 2 else 'hi'}"
                    for nd in range(NVD) for c in range(4)]
        if not Q_SHARED:
            load_q += _load_q(NKS, tag)
    if Q_SHARED:
        load_q = _store_q(BM, DK, NT)
        for i, tag in enumerate(tags):  # ldmatrix: lane l gives row l % 8 of block l // 8
            load_q += [f"q_frag{tag} = (Q_AT + (((tid // 32) * {MT} + {i}) * 16 + (lane // 8) % 2 "
                       f"* 8 + lane % 8) * LDQ + (lane // 16) * 4) & ALIGN4"]
    source = kernel_source(
        "forward_f16",
        shared=["# K tile [key][LDK words] at 0, V tile [key][LDV words] at V_AT, Q block [row]"
                "[LDQ words]", "# at Q_AT (when in shared memory); a word holds two halves",
                "sm = cuda.shared.array(SIZE, int32, alignment=16)"],
        fragments=["k_frag = (g * LDK + t) & ANY  # K[g][2t:2t+2] of a k-step, n-tile 0",
                   "# ldmatrix: lane l gives row l % 8 of 8 x 8 block l // 8 (keys +0/+8, dims "
                   "+0/+8)", "v_frag = (V_AT + ((lane // 8) % 2 * 8 + lane % 8) * LDV + "
                   "(lane // 16) * 4) & ALIGN4"],
        rows=mtile_rows(tags), load_q=load_q, init=init,
        copy_first_k=copy_tile("0", "kh", "d", DK, "LDK", "kb_lo * BN", 8, BN, NT, True),
        copy_next_k=copy_tile("0", "kh", "d", DK, "LDK", "k0 + BN", 8, BN, NT, True),
        copy_v=copy_tile("V_AT", "vh", "dv", DV, "LDV", "k0", 8, BN, NT, True),
        zero_s=[f"s{tag}{j}_{c} = ZERO" for tag in tags for j in range(NJ) for c in range(4)],
        s_mma=s_mma,
        to_base2=[f"s{tag}{j}_{c} *= scale2" for tag in tags for j in range(NJ)
                  for c in range(4)],
        scores=scores, softmax=softmax, rescale=rescale,
        pv=pv, store=store)
    names = {"cuda": cuda, "math": math, "shfl_xor_sync": shfl_xor_sync, "float32": float32,
             "int32": int32, "int64": int64, "mma_f16": mma_f16, "pack_f16": pack_f16,
             "ldmatrix_x4": ldmatrix_x4, "ldmatrix_x4_trans": ldmatrix_x4_trans,
             "copy_async16": copy_async16,
             "copy_commit": copy_commit, "copy_wait": copy_wait, "copy_wait_all": copy_wait_all,
             "FULL_MASK": FULL_MASK, "LN2": LN2, "NEG_INF": NEG_INF, "ONE": ONE,
             "ZERO": ZERO, **extra_names(),
             "BM": BM, "BN": BN, "NT": NT, "LDK": LDK, "LDV": LDV, "V_AT": V_AT, "SIZE": SIZE,
             "Q_AT": Q_AT, "LDQ": LDQ,
             "MODS": mods, "ANY": index_mask(1), "ALIGN4": index_mask(4)}
    return build(source, "forward_f16", names), NT, BM


@functools.cache
def kernel(d_pad, dv_pad, mods, extras=NO_EXTRAS):
    """The compiled kernel; ``extras``: ``tiles.extra_args``'s kinds."""
    mask, mask_dtype, dropout = extras
    fn, threads, rows = make_forward(d_pad, dv_pad, mods, mask, dropout)
    return compiled(fn, signature(np.float16, FORWARD_ARGS, mask_dtype)), threads, rows


def run_forward(q, k, v, options, has_mods, kinds, extras, out, lse, stream=None):
    """Launch for ``forward.run_forward`` (which calls it for a non-empty ``out``, with the
    kernels' option and extra arguments, the sinks' among the extras, and their kinds);
    ``usable`` must hold."""
    n_b, n_hq, n_q, d = q.shape
    fn, threads, rows = kernel(pad16(d), pad16(v.shape[3]), has_mods, kinds)
    fn(grid(n_b * n_hq, n_q, rows), threads, stream, q, k, v, *options, *extras, out, lse)
