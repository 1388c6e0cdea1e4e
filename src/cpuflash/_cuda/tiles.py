"""Tile shapes and the device helpers shared by the forward and backward kernels.

Thread layout of every kernel: ``8 * TY`` threads; thread ``t`` has ``tx = t % 8`` and
``ty = t // 8``. A tile of scores (``TY * TM`` "own" rows by ``8 * TN`` columns) is held in
registers, ``TM x TN`` per thread: rows ``ty * TM + i`` and columns ``tx + 8 * c`` (strided,
so the 8 threads of a row read 8 consecutive shared-memory words; the forward kernel holds
them in groups of ``width`` side by side instead, ``column``, read as one vector). The 8
threads of a row group sit in one warp, so row max and row sum are three ``shfl_xor`` steps,
and a product ``P @ V`` gets each ``P[i, j]`` from the thread that holds it by ``shfl_sync``
(no P tile in shared memory).

Shared memory holds tiles transposed (``[dim][row]``) so that the inner product loops read
one word per row across the threads; a row is stored rotated by its column,
``[c * ld + ((r + c) % ld)]`` (the forward kernel: by ``4 * (c // 4)``, so that vectors of 4
and the four dims of an unrolled step stay affine), so that the transposing stores spread
over the banks without padding (the static 48 KiB of shared memory is the limit: at D = 128
the tiles fill it exactly). Every shared index is ANDed with a mask (``index_mask``).
"""
import math

import numpy as np
from numba import float32

from .arrays import uploaded
from .dropout import SOURCE_STAMP, keep_scale, row_mix, seed_mix
from .runtime import load, simulated

cuda = load()

LOG2_E = np.float32(1.0 / math.log(2.0))
LN2 = np.float32(math.log(2.0))
NEG_INF = np.float32(-np.inf)  # a float32 constant: a bare -math.inf makes float64 code
POS_INF = np.float32(np.inf)
ZERO = np.float32(0.0)
ONE = np.float32(1.0)
FULL_MASK = 0xFFFFFFFF
UNBOUNDED = 1 << 40  # as _cpu.masking.UNBOUNDED: a window side with no limit

SHARED_FLOATS = 12288  # 48 KiB of float32: the most a kernel may hold statically


def pad8(n):
    return max(8, -(-n // 8) * 8)


def forward_shape(d_pad, dv_pad):
    """``(TY, TM, TN)`` for the forward kernel: rows ``16 * TM`` per block, keys ``8 * TN``."""
    width = max(d_pad, dv_pad)
    if simulated():
        return 4, 1, 1    # 4 x 8: one warp, so the simulator's threads stay few
    if width <= 64:
        return 16, 4, 8   # 64 query rows x 64 keys
    if width <= 128:
        return 16, 4, 4   # 64 x 32
    return 16, 2, 2       # 32 x 16 (D up to 256)


def backward_shape(d_pad, dv_pad):
    """``(TY, TM, TN)`` for the backward kernels: ``16 * TM`` owned rows (keys in the dK/dV
    kernel, queries in the dQ kernel) by ``8 * TN`` of the other side."""
    width = max(d_pad, dv_pad)
    if simulated():
        return 4, 1, 1
    if width <= 64:
        return 16, 4, 4   # 64 x 32
    if width <= 128:
        return 16, 2, 2   # 32 x 16
    return 16, 1, 1       # 16 x 8


MAX_HEAD_DIM = 256


# Shared-memory indices. Numba indexes arrays with signed int64 and, unless it can prove an
# index is >= 0, adds "if i < 0: i += n" to every access (five 64-bit instructions per load,
# measured in the PTX of the first version: the hot loops ran at a tenth of the FMA rate).
# An index ANDed with a positive mask is provably >= 0: one instruction, and the offsets of
# the loads that share a base fold into the address. Masks that also clear the low bits
# (on indices that are multiples of 2 or 4 anyway) let NVVM prove 8- or 16-byte alignment
# and merge neighbouring loads into ld.shared.v2/v4 (the arrays are 16-byte aligned).
def index_mask(multiple):
    """The mask for a shared-memory index that is always a multiple of ``multiple`` (1, 2, 4)
    and below 2**31: it changes no such index."""
    return 0x7FFFFFFF & ~(multiple - 1)


def aligned():
    """Source text: the alignment argument of ``cuda.shared.array`` (16 bytes: vector loads;
    the simulator takes none)."""
    return "" if simulated() else ", alignment=16"


def group_width(n):
    """Columns a thread holds side by side (so it reads them as one vector): 4, 2 or 1."""
    return 4 if n % 4 == 0 else 2 if n % 2 == 0 else 1


def column(c, width):
    """Source text: the tile column of a thread's ``c``-th value when each thread of a row
    group holds ``width`` neighbouring columns per group of ``8 * width``:
    ``8 * width * (c // width) + width * tx + c % width``."""
    return f"{width} * tx + {column_offset(c, width)}"


def column_offset(c, width):
    """The constant part of ``column``."""
    return 8 * width * (c // width) + c % width


def first_key(i):
    """Source text: the first key row ``i`` sees (bottom-right aligned band, as
    ``_cpu.masking.row_band``); the kernels define ``off = kv_len - n_q``, ``left``, ``right``."""
    return f"max(0, {i} + off - left)"


def last_key(i):
    """Source text: the last key row ``i`` sees; below ``first_key`` when it sees none."""
    return f"min(kv_len - 1, {i} + off + right)"


def grid(heads, n, rows):
    """The 1-D grid of the kernels: a block per (head, block of ``rows`` of ``n``), in the
    order of ``block_lines``."""
    return heads * -(-n // rows)


# The bytes of the heads whose blocks run together (``block_lines``): a third of an H100's or
# H200's 50 MiB L2 cache (an A100 has 40), so that what they share stays there.
L2_SHARE = 16 << 20


def block_lines(n, rows, heads, head_bytes, head, first, latest_first=False):
    """Kernel lines: this block's ``head`` (of ``heads``, batch * head indices) and ``first``
    (its first row of ``n``, in blocks of ``rows``), in the 1-D grid of ``grid``; ``head_bytes``
    is what a head's blocks all read (a query head's K and V: its share of them under GQA).

    The order: heads in groups of as many as fit ``L2_SHARE`` bytes (at least one); group by
    group, and within a group row block by row block (``latest_first``: from the last, which
    under causal masking has the most tiles), head by head. So the blocks that run at once
    read the same few heads' K and V through the L2 cache; and where every head fits (short
    sequences), all heads form one group and the blocks go longest first, which balances a
    causal launch of few waves. Measured on the H200, float32, B=4, H=16 (log
    bench/results/h200_block_order_stop23.txt): one row block after another for all heads
    (stop 22's order) let N = 16384, D = 128 read its K/V from DRAM, 2-5 % slower than head
    by head; head by head alone cost causal N = 1024 10-20 %, whose blocks then ran in two
    waves without the longest first."""
    within = "rank" if not latest_first else "(n_blocks - 1 - rank)"
    return [f"n_blocks = ({n} + {rows} - 1) // {rows}",
            f"together = min({heads}, max(1, L2_SHARE // max(1, {head_bytes})))",
            "blk = int64(cuda.blockIdx.x)",
            "first_head = blk // (together * n_blocks) * together",
            f"in_group = min(together, {heads} - first_head)",
            "rank = blk % (together * n_blocks) // in_group",
            f"{head} = first_head + blk % (together * n_blocks) % in_group",
            f"{first} = {within} * {rows}"]


# The forward kernels' block coordinates: one block per (query block of BM rows, batch * head).
FORWARD_BLOCK = block_lines(
    "n_q", "BM", "q.shape[0] * n_hq", "k.shape[2] * (d + dv) * k.itemsize * n_hkv // n_hq",
    "bh", "q0", latest_first=True) + """
b = bh // n_hq
h = bh % n_hq
hk = h // (n_hq // n_hkv)  # GQA: query head h reads kv head h // group
rows = min(BM, n_q - q0)
kv_len = kv_lens[b]
off = kv_len - n_q
cap_inv = ONE / softcap2 if softcap2 != ZERO else ZERO
slope2 = slopes2[b, h]
kh = k[b, hk]
vh = v[b, hk]
""".strip().splitlines()


def q_block_lines(store):
    """Source lines: the block's Q rows scaled to base 2 (``scale2``) into shared memory,
    padding rows and dims as 0; ``store``: the statement, a format string in ``{r}``, ``{c}``
    (row, dim) and ``{x}`` (the value)."""
    return ["for e in range(tid, BM * DK, NT):", "    r = e // DK", "    c = e % DK",
            "    x = ZERO", "    if r < rows and c < d:",
            "        x = float32(q[b, h, q0 + r, c]) * scale2",
            "    " + store.format(r="r", c="c", x="x")]


def band_lines():
    """Source lines: the keys that some row of the block sees, ``[lo, hi]`` (the band is
    monotonic in the row), the smallest last and largest first key of its rows, and the key
    tiles of ``BN`` keys that hold ``[lo, hi]``, ``kb_lo .. kb_hi - 1``."""
    return [f"lo = {first_key('q0')}", f"hi = {last_key('q0 + rows - 1')}",
            f"last_lo = {last_key('q0')}  # the smallest last key",
            f"first_hi = {first_key('q0 + rows - 1')}  # the largest first key",
            "kb_lo = lo // BN", "kb_hi = hi // BN + 1 if hi >= lo else kb_lo"]


def score_lines(elements, rows, mods, mask=None):
    """Source lines: softcap and ALiBi on every score of a tile (each test once for the whole
    tile), the caller's ``mask`` (``mask_kind``: None, "bool" or "float") on every score, then
    the band's edges, only on tiles that cross one (``edge``), as ``-inf``.
    ``elements``: ``(score variable, row, key, row tag)``; ``rows``: ``(row tag, row)``, whose
    first and last keys go to ``first{tag}`` and ``last{tag}``. As few Python branches as
    possible: see ``tile_fetch``."""
    lines = []
    if mods:
        lines += ["if softcap2 != ZERO:"]
        lines += [f"    {s} = softcap2 * math.tanh({s} * cap_inv)" for s, _, _, _ in elements]
        lines += ["if slope2 != ZERO:"]
        lines += [f"    {s} -= slope2 * float32(abs({r} + off - ({key})))"
                  for s, r, key, _ in elements]
    lines += [mask_line(s, r, key, mask) for s, r, key, _ in elements if mask]
    lines += ["if edge:"]
    lines += [f"    first{tag} = {first_key(row)}" for tag, row in rows]
    lines += [f"    last{tag} = {last_key(row)}" for tag, row in rows]
    lines += [f"    {s} = cuda.selp(({key} < first{tag}) | ({key} > last{tag}), NEG_INF, {s})"
              for s, _, key, tag in elements]
    return lines


# The caller's mask (``attention(mask=...)``), a 4-D array of its own shape, each axis 1
# (broadcast) or full: ``min(index, length - 1)`` reads both kinds, and clamps the padding rows
# and keys of a tile into the array (their scores are discarded or masked by the band anyway).
# A bool mask hides a key as the band does (``-inf``); a float one is added, in base-2 units.
def mask_prologue(mask, head="h"):
    """Source lines: the mask's batch and head indices and last row and key, for a kernel
    with ``b`` and ``head`` defined; none without a mask."""
    if not mask:
        return []
    return ["mb = min(b, mask.shape[0] - 1)", f"mh = min({head}, mask.shape[1] - 1)",
            "mq = mask.shape[2] - 1", "mk = mask.shape[3] - 1"]


def dropout_lines(elements, mix):
    """Source lines: dropout on the probabilities of ``elements`` (``(variable, row, key,
    tag)``; ``mix(row)``: the name of the row's ``row_mix``), after their sums."""
    return [f"{s} *= keep_scale({mix(r)}, {key}, drop_below, inv_keep)"
            for s, r, key, _ in elements]


def mask_value(row, key):
    return f"mask[mb, mh, min({row}, mq), min({key}, mk)]"


def mask_line(var, row, key, mask):
    """Source line: the caller's mask on the base-2 score ``var`` of (row, key)."""
    if mask == "bool":
        return f"{var} = cuda.selp({mask_value(row, key)}, {var}, NEG_INF)"
    return f"{var} += LOG2_E * float32({mask_value(row, key)})"


def modify_lines(var, row, key, mods, tanh_var=None):
    """Source lines: softcap then ALiBi on the base-2 score ``var`` of (row, key); with
    ``tanh_var``, also keep ``tanh`` there for the backward pass."""
    if not mods:
        return []
    lines = []
    if tanh_var:
        lines += [f"{tanh_var} = ZERO"]
    lines += ["if softcap2 != ZERO:"]
    if tanh_var:
        lines += [f"    {tanh_var} = math.tanh({var} * cap_inv)",
                  f"    {var} = softcap2 * {tanh_var}"]
    else:
        lines += [f"    {var} = softcap2 * math.tanh({var} * cap_inv)"]
    lines += ["if slope2 != ZERO:", f"    {var} -= slope2 * float32(abs({row} + off - ({key})))"]
    return lines


def grad_lines(s, dp, row, key, lse2, delta, mods, mask=None, mix=None):
    """Source lines: ``s`` becomes P (regenerated from ``lse2``) and ``dp`` becomes dS, the
    gradient of the natural-unit score, of (row, key); both 0 outside the row's band and
    where a bool ``mask`` hides the key. With dropout (``mix``: the row's ``row_mix``), dS
    takes the dropped ``dP * keep / (1 - p)`` and ``s`` ends as the dropped P that ``dV``
    sums (``delta = rowsum(dO * O)`` is already of the dropped output)."""
    lines = modify_lines(s, row, key, mods, tanh_var="tt")
    hidden = f"{key} < {first_key(row)} or {key} > {last_key(row)}"
    if mask == "bool":
        hidden += f" or not {mask_value(row, key)}"
    elif mask:
        lines += [mask_line(s, row, key, mask)]
    lines += [f"if {hidden}:",
              f"    {s} = ZERO", f"    {dp} = ZERO",
              "else:",
              f"    {s} = math.exp2({s} - {lse2})"]
    if mix:
        lines += [f"    z = keep_scale({mix}, {key}, drop_below, inv_keep)",
                  f"    {dp} = {s} * ({dp} * z - {delta})",
                  f"    {s} *= z"]
    else:
        lines += [f"    {dp} = {s} * ({dp} - {delta})"]
    if mods:
        lines += ["    if softcap2 != ZERO:",
                  f"        {dp} *= ONE - tt * tt  # through c * tanh(s / c)"]
    return lines


def tile_elements(pad, threads, keys):
    """Source text ``(j, c)`` of each element a thread moves of a ``keys x pad`` tile (element
    ``e = tid + u * threads``, row-major), one per ``u``, and whether ``e`` needs a bound
    check. When the threads cover whole rows, a thread keeps one column."""
    count = -(-keys * pad // threads)
    if threads % pad == 0 and keys % (threads // pad) == 0:
        step = threads // pad
        return [(f"tid // {pad} + {u * step}", f"tid % {pad}") for u in range(count)], False
    if pad % threads == 0:
        per_row = pad // threads
        return [(f"{u // per_row}", f"tid + {(u % per_row) * threads}")
                for u in range(count)], False
    return [(f"(tid + {u * threads}) // {pad}", f"(tid + {u * threads}) % {pad}")
            for u in range(count)], keys * pad % threads != 0


def tile_fetch(reg, src, width, pad, threads, keys, first, scale=None):
    """Source lines: a thread's elements (``tile_elements``) of rows ``first .. first + keys -
    1`` of the 2-D view ``src`` (columns below ``width``) into registers ``{reg}0, {reg}1,
    ...`` as float32; keys outside ``[lo, hi]`` and columns past ``width`` as 0, so a NaN
    there reaches nothing. Needs ``lo <= hi``.

    Written out in full so that all the loads are in flight at once: fetched a stage ahead of
    their use, their latency hides behind the arithmetic (a loop that stored each load to
    shared memory before the next one waited a round trip per element). One test per tile:
    a tile inside the band with no padded columns takes plain loads; any other is read
    branch-free, every load of a valid element (row clamped into ``[lo, hi]``, column below
    ``width``) and ``selp`` zeroing the ones outside. ``scale``: a 1-D view of per-row
    factors (an int8 cache's ``k_scale[b, h]``) that each row is multiplied by. Numba's own
    passes (liveness, SSA) take time in blocks times variables times assignments, and each
    ``and`` or ``if`` of Python is a block: with one per element, the forward kernel took 45 s
    to compile."""
    elements, check = tile_elements(pad, threads, keys)

    def scaled(row):
        return f" * {scale}[{row}]" if scale else ""

    edge = []
    for u, (j, c) in enumerate(elements):
        key = f"{first} + {j}"
        cond = f"(lo <= {key}) & ({key} <= hi) & ({c} < {width})"
        if check:
            cond += f" & (tid + {u * threads} < {keys * pad})"
        row = f"min(max({key}, lo), hi) & ANY"
        edge += [f"{reg}{u} = cuda.selp({cond}, float32({src}[{row}, "
                 f"min({c}, {width} - 1) & ANY]){scaled(row)}, ZERO)"]
    if check:
        return edge
    # tiles inside the band with no padded columns (most of them): plain loads
    inner = [f"{reg}{u} = float32({src}[({first} + {j}) & ANY, {c}])"
             f"{scaled(f'({first} + {j}) & ANY')}" for u, (j, c) in enumerate(elements)]
    return ([f"if (lo <= {first}) & ({first} + {keys - 1} <= hi) & ({width} == {pad}):"]
            + ["    " + line for line in inner] + ["else:"] + ["    " + line for line in edge])


def tile_store(reg, pad, threads, keys, index):
    """Source lines: the registers of ``tile_fetch`` into shared ``kvs`` at ``index`` (a format
    string in ``{j}``, ``{c}``)."""
    elements, check = tile_elements(pad, threads, keys)
    lines = []
    for u, (j, c) in enumerate(elements):
        at = index.format(j=f"({j})", c=f"({c})")
        store = f"kvs[({at}) & ANY] = {reg}{u}"
        lines += [f"if tid + {u * threads} < {keys * pad}:", "    " + store] if check else [store]
    return lines


def shared_size(*sizes):
    """The floats of shared memory a kernel holds, checked against the static limit."""
    total = sum(sizes)
    assert total <= SHARED_FLOATS, sizes
    return total


def signature(dtype, pattern, mask_dtype=np.uint8, kv_dtype=None):
    """Numba argument types from a pattern string, one letter per argument: ``X`` a 4-D array
    of ``dtype``, ``M`` a 4-D array of ``mask_dtype``, ``K`` a 4-D array of ``kv_dtype``
    (default ``dtype``), ``L`` a 3-D float32 array, ``S`` a 2-D
    float32 array, ``I`` a 1-D int64 array, ``f`` float32, ``i`` int64. Arrays are typed
    layout ``A``: one compiled kernel takes contiguous and strided views alike (each layout
    would otherwise compile anew)."""
    from numba.core import types
    from numba.np import numpy_support
    dt = numpy_support.from_dtype(np.dtype(dtype))
    table = {"X": types.Array(dt, 4, "A"), "L": types.Array(float32, 3, "A"),
             "M": types.Array(numpy_support.from_dtype(np.dtype(mask_dtype)), 4, "A"),
             "K": types.Array(numpy_support.from_dtype(np.dtype(kv_dtype or dtype)), 4, "A"),
             "S": types.Array(float32, 2, "A"), "I": types.Array(types.int64, 1, "A"),
             "f": float32, "i": types.int64}
    return tuple(table[c] for c in pattern)


def option_args(scale, band, mods):
    """The option arguments every kernel takes after its arrays, ``(scale2, left, right,
    kv_lens, softcap2, slopes2)`` (the ``fiiIfS`` of the patterns below; base-2 units, the
    small arrays on the device, uploaded once per content), and whether softcap or ALiBi is on
    (which kernel variant runs). ``band``, ``mods``: as ``masks.band``/``masks.modifiers``."""
    left, right, kv_lens = band
    softcap, slopes = mods
    has_mods = softcap != 0.0 or bool(np.any(slopes != 0.0))
    return (scale * LOG2_E, left, right, uploaded(kv_lens.astype(np.int64, copy=False)),
            softcap * LOG2_E, uploaded((slopes * LOG2_E).astype(np.float32))), has_mods


def extra_args(mask, drop):
    """The caller's mask and dropout as the forward and backward kernels take them:
    ``(kinds, args)``.
    ``kinds = (mask kind, mask dtype, dropout on)`` picks the kernel variant (None, "bool" or
    "float"; a bool mask is read as bool, a float one as float16 or float32);
    ``args = (mask, seed_mix, drop_below, inv_keep)``, the ``Miif`` of the patterns below:
    without a mask, a 1-element uint8 array that no line reads. ``mask``: a 4-D ``GpuArray``
    (each axis 1 or full) or None; ``drop``: ``masks.dropout``'s ``(drop_below, seed,
    inv_keep)``."""
    if mask is None:
        kind, mask = None, uploaded(_NO_MASK)
    else:
        kind = "bool" if mask.dtype == np.bool_ else "float"
    drop_below, seed, inv_keep = drop
    inv_keep = np.float32(inv_keep)  # 1 / (1 - p), as the CPU's
    kinds = (kind, np.dtype(mask.dtype).str, drop_below > 0)
    return kinds, (mask, seed_mix(seed), drop_below, inv_keep)


# ``extra_args``'s kinds for a call with neither mask nor dropout.
NO_EXTRAS = (None, np.dtype(np.uint8).str, False)


def extra_names():
    """The globals that the lines of the mask and dropout (``score_lines``, ``dropout_lines``,
    ``grad_lines``) and of the block order (``block_lines``) read in a generated kernel;
    ``DROPOUT_STAMP`` puts the hash's source among the kernel's constants
    (``dropout.SOURCE_STAMP``)."""
    return {"LOG2_E": LOG2_E, "NEG_INF": NEG_INF, "row_mix": row_mix,
            "keep_scale": keep_scale, "DROPOUT_STAMP": SOURCE_STAMP, "L2_SHARE": L2_SHARE}


_NO_MASK = np.ones((1, 1, 1, 1), dtype=np.uint8)
_NO_SCALES = np.ones((1, 1, 1), dtype=np.float32)


def scale_args(kv_scales):
    """``(k_scale, v_scale)`` for the SIMT forward kernel: an int8 cache's (B, Hkv, Nk)
    scales as given, else 1-element stand-ins that no line reads."""
    return tuple(kv_scales) if kv_scales is not None else (uploaded(_NO_SCALES),) * 2

_NO_SINKS = np.full((1, 1), -np.inf, dtype=np.float32)


def sink_args(sinks):
    """``(sinks,)`` for the forward kernels: the attention sinks' logits, natural units, a
    float32 (B or 1, Hq) ``GpuArray`` (``sinks.logits_on_device``), or for None a (1, 1) -inf
    that adds nothing (``finish_lines``)."""
    return (uploaded(_NO_SINKS) if sinks is None else sinks,)


# The forward kernels' store: the head's sink (``sinks[b or 0, h or 0]``), read once the key
# tiles are done (not held in a register through them), and in base 2 as the scores are.
SINK_LINES = ["c_sink = sinks[b if sinks.shape[0] > 1 else 0, h if sinks.shape[1] > 1 else 0]",
              "c2_sink = c_sink * LOG2_E"]


def finish_lines(m, total):
    """Lines: a row's ``inv_l``, the factor of its output, and ``lse_row`` (natural log) from
    its running max ``m`` and sum ``total`` (base 2) and the head's sink (``SINK_LINES``). The
    sink adds ``2^(c2 - m)`` to the sum: with ``top = max(m, c2)``, ``l' = total 2^(m - top) +
    2^(c2 - top)``, ``out = acc 2^(m - top) / l'`` and ``lse = (top + log2(l')) ln 2``, which
    cannot overflow (a sink far above the scores: ``l' = 1``, output 0, ``lse = c``). The
    names end in ``_sink``: a kernel's own (``t``, a lane's quad) must not be taken. A row that
    sees no key: output 0, ``lse`` the sink's logit (-inf without one). Without a sink (a
    uniform branch: one head a block) the lines of a plain row, the same bits as before."""
    return [f"seen = {total} != ZERO  # a row that sees no key: output 0, lse the sink's",
            f"inv_l = ONE / {total} if seen else ZERO",
            f"lse_row = ({m} + math.log2({total})) * LN2 if seen else c_sink",
            "if seen and c2_sink != NEG_INF:",
            f"    top_sink = max({m}, c2_sink)",
            f"    em_sink = math.exp2({m} - top_sink)",
            f"    l_sink = {total} * em_sink + math.exp2(c2_sink - top_sink)",
            "    inv_l = em_sink / l_sink",
            "    lse_row = (top_sink + math.log2(l_sink)) * LN2"]


# Every kernel takes ``extra_args``'s four after the options. The SIMT forward kernel also
# reads K/V caches (``K``: float16 with float32 q, or int8 times ``k_scale``/``v_scale``, the
# two ``L`` after the extras). The forward kernels take the sinks (``S``, ``sink_args``) before
# ``out`` and ``lse``.
FORWARD_ARGS = "XXXfiiIfSMiifSXL"
SIMT_FORWARD_ARGS = "XKKfiiIfSMiifLLSXL"
DKDV_ARGS = "XXXXLLfiiIfSMiifXX"
DQ_ARGS = "XXXXLLfiiIfSMiiffX"
PREP_ARGS = "XXLLL"


if simulated():
    # The simulator has no warp shuffles: exchange through a block-wide buffer between two
    # barriers. Every thread of the block calls the shuffles in the same order (the kernels'
    # control flow around them is uniform), which is what this needs.
    @cuda.jit(device=True)
    def _exchange(value, src_lane):
        buf = cuda.shared.array(1024, float32)
        tid = cuda.threadIdx.x
        cuda.syncthreads()
        buf[tid] = value
        cuda.syncthreads()
        return buf[tid - tid % 32 + src_lane]

    @cuda.jit(device=True)
    def shfl_sync(mask, value, src_lane):
        return _exchange(value, src_lane)

    @cuda.jit(device=True)
    def shfl_xor_sync(mask, value, lane_mask):
        return _exchange(value, (cuda.threadIdx.x % 32) ^ lane_mask)
else:
    shfl_sync = cuda.shfl_sync
    shfl_xor_sync = cuda.shfl_xor_sync
