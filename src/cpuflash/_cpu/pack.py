"""Packing K and V into contiguous, zero-padded tiles, once per call, in parallel.

* ``kt[bh, kb]``: each key tile transposed to ``(D, block_k)``, so the score product reads
  unit-stride rows of keys, and stored as column panels (see ``tiles.tile_product``).
* ``vt[bh, kb]``: each value tile ``(block_k, Dv_pad)``, the value width padded to whole
  vectors, stored as column panels.

Panel layout of a ``(rows, cols)`` tile with panel width ``w``: element ``(r, c)`` sits at
``c0 * rows + r * width + (c - c0)``, where ``c0 = c - c % w`` and ``width = min(w, cols - c0)``.

Keys past ``Nk`` and columns past ``Dv`` are zero. Inputs may have any strides (transposed or
broadcast views) and are read once; the packed copies are O(N), like the inputs.
"""
import ctypes
import functools
import math
import mmap
import sys
import threading

import numpy as np
from numba import prange

from . import simd
from ._jit import helper, kernel
from .sequences import TILE0, TILES, owner
from .tasks import unravel


@kernel(strided=("k",))
def pack_keys_transposed(k, block_k, w, kt):
    """``k``: (B, H, Nk, D) any strides. ``kt``: (B*H, n_blocks, D * block_k) contiguous: each
    key tile transposed to (D, block_k), in column panels of width ``w``."""
    n_b, n_h, n_k, d = k.shape
    n_blocks = kt.shape[1]
    for task in prange(n_b * n_h * n_blocks):
        b, h, kb = unravel(task, n_h, n_blocks)
        bh = b * n_h + h
        j0 = kb * block_k
        n_valid = min(block_k, n_k - j0)
        # One panel (w keys x D) at a time: its w rows of K stay in L1 while each of its D
        # rows is written out contiguously.
        for p0 in range(0, block_k, w):
            width = min(w, block_k - p0)
            base = p0 * d
            for dd in range(d):
                row = base + dd * width
                for jj in range(width):
                    j = p0 + jj
                    kt[bh, kb, row + jj] = k[b, h, j0 + j, dd] if j < n_valid else 0.0


@helper
def key_tile(task, n_blocks, block_k, n_k, d):
    """A packing task's key tile for a C-contiguous (B, H, Nk, D) array: the flat index of its
    first key row and how many of the tile's keys come before ``Nk``."""
    bh, kb = task // n_blocks, task % n_blocks
    j0 = kb * block_k
    return (bh * n_k + j0) * d, min(block_k, n_k - j0)


@helper
def keys_transposed_task(kf, src, row_stride, n_valid, d, block_k, w, ktf, tile, padded):
    """One key tile in ``pack_keys_transposed``'s layout at ``ktf[tile:]``: its keys are the
    ``n_valid`` rows of ``d`` elements at ``kf[src + j * row_stride:]`` (the rest zero;
    ``padded``: the whole vectors of zeros past them are there already, from a tile of as many
    keys packed before at ``tile``, and are not written again). Flat
    indices, no test per element and, where whole vectors of keys and D allow,
    ``lanes x lanes`` blocks transposed in registers (measured at B=1, H=8, N=512, D=128: 0.47
    -> 0.09 ms; N=2048: 0.81 -> 0.45 ms). A panel that ends past ``Nk`` (the last tile of
    any N that is not a whole number of panels, the one tile of a short sequence) takes its
    whole vectors of keys that way too (stop 62: H=12, N=32 took 39 us to pack, twice N=64's
    19, its 32 keys a head all element by element), and since stop 63 its last few keys
    with the zeros after them in one block of ``simd.transpose_rows`` (they went element by
    element: N=37 and 47 took 24-29 us, N=32 and 48 16-19)."""
    lanes = simd.lanes_of(ktf)
    zero = simd.vsplat(ktf, 0.0)
    for p0 in range(0, block_k, w):
        width = min(w, block_k - p0)
        inside = max(0, min(width, n_valid - p0))  # keys of this panel before Nk
        first = src + p0 * row_stride
        panel = tile + p0 * d
        done = 0  # keys of the panel written in registers, zeros past Nk included
        if width % lanes == 0 and d % lanes == 0:
            for jj in range(0, inside, lanes):  # lanes x lanes blocks
                keys = min(lanes, inside - jj)
                for dd in range(0, d, lanes):
                    if keys == lanes:
                        simd.transpose_block(kf, first + jj * row_stride + dd, row_stride, ktf,
                                             panel + dd * width + jj, width)
                    else:  # the last few keys, the rest of their vector zero
                        simd.transpose_rows(kf, first + jj * row_stride + dd, row_stride, keys,
                                            ktf, panel + dd * width + jj, width)
            done = -(-inside // lanes) * lanes
        # The keys not transposed (D not of whole vectors) element by element, and the zeros
        # past Nk up to a whole vector of keys; then zero vectors where the panel has them.
        zeros_from = -(-inside // lanes) * lanes if width % lanes == 0 else width
        zeros_to = zeros_from if padded else width
        if done >= zeros_to:
            continue
        for dd in range(d):
            row = panel + dd * width
            for jj in range(done, inside):
                ktf[row + jj] = kf[first + jj * row_stride + dd]
            for jj in range(max(done, inside), zeros_from):
                ktf[row + jj] = 0.0
            for jj in range(zeros_from, zeros_to, lanes):
                simd.vstore(ktf, row + jj, zero)


@helper
def values_task(vf, src, row_stride, n_valid, dv, dv_pad, block_k, w, zero_nonfinite, vtf,
                tile, padded):
    """One value tile in ``pack_values``' layout at ``vtf[tile:]``, rows of ``dv`` elements at
    ``vf[src + j * row_stride:]`` as ``keys_transposed_task`` takes them, padded with zeros
    to ``dv_pad`` columns: each panel row a few vector copies (measured at B=1, H=8, N=512,
    D=128: 0.31 -> 0.07 ms), a row's last part past whole vectors one by one. The zero rows
    past ``n_valid`` are written unless ``padded`` (there already, as in
    ``keys_transposed_task``)."""
    lanes = simd.lanes_of(vtf)
    zero = simd.vsplat(vtf, 0.0)
    for c0 in range(0, dv_pad, w):
        width = min(w, dv_pad - c0)
        for j in range(n_valid if padded else block_k):
            dst = tile + c0 * block_k + j * width
            at = src + j * row_stride + c0
            for cc in range(0, width, lanes):
                if j < n_valid and c0 + cc + lanes <= dv:
                    x = simd.vload(vf, at + cc)
                    if zero_nonfinite:  # x - x is 0 for a finite x, NaN for NaN and Inf
                        x = simd.vselect_nonzero(simd.vsub(x, x), zero, x)
                    simd.vstore(vtf, dst + cc, x)
                elif j < n_valid:
                    for c in range(cc, cc + lanes):
                        x = vf[at + c] if c0 + c < dv else 0.0
                        vtf[dst + c] = 0.0 if zero_nonfinite and not np.isfinite(x) else x
                else:
                    simd.vstore(vtf, dst + cc, zero)


@kernel(read_only=("k", "v"))
def pack_tiles(k, v, block_k, w, kt, vtt, kn, vn):
    """The packed copies of C-contiguous K and V that a call needs, in one parallel region
    (each region costs the threads a wake-up and a join: 25-70 us with
    ``OMP_WAIT_POLICY=PASSIVE``, 1.5 us without): ``kt``, ``vtt``, K and V tiles transposed
    (``keys_transposed_task``); ``kn``, K tiles as rows with NaN/Inf as 0, and ``vn``, V tiles
    as rows (``values_task``; their rows whole vectors). The forward pass takes ``kt`` and
    ``vn``, the backward pass ``kt``, ``vtt``, ``kn``; ``packed_transposed``/``packed_rows``
    one of them (``k`` and ``v`` the same array then).

    A copy not wanted is None, and Numba compiles one specialization per combination: an
    ``is None`` test of an argument is decided before typing, so each holds only the copies it
    makes (the forward pass's first call compiled the four in 8.3 s). ``vn`` may also be
    empty: not wanted either, in the specialization that packs it (``packed_kv``)."""
    n_k, d, dv = k.shape[2], k.shape[3], v.shape[3]
    kf, vf = k.reshape(-1), v.reshape(-1)
    n_blocks = max(1, (n_k + block_k - 1) // block_k)
    n_tiles = k.shape[0] * k.shape[1] * n_blocks  # of each copy
    n_copies = (kt is not None) + (vtt is not None) + (kn is not None)
    if vn is not None:
        n_copies += vn.size > 0  # an empty ``vn``: V read in place, K alone (``packed_kv``)
    for task in prange(n_tiles * n_copies):
        tile, which = task // n_copies, task % n_copies  # a tile's copies side by side
        if kt is not None:
            if which == 0:
                src, n_valid = key_tile(tile, n_blocks, block_k, n_k, d)
                keys_transposed_task(kf, src, d, n_valid, d, block_k, w, kt.reshape(-1),
                                     tile * (d * block_k), False)
            which -= 1
        if vtt is not None:
            if which == 0:
                src, n_valid = key_tile(tile, n_blocks, block_k, n_k, dv)
                keys_transposed_task(vf, src, dv, n_valid, dv, block_k, w, vtt.reshape(-1),
                                     tile * (dv * block_k), False)
            which -= 1
        if kn is not None:
            if which == 0:
                src, n_valid = key_tile(tile, n_blocks, block_k, n_k, d)
                values_task(kf, src, d, n_valid, d, d, block_k, w, True, kn.reshape(-1),
                            tile * (block_k * d), False)
            which -= 1
        if vn is not None:
            if which == 0:
                src, n_valid = key_tile(tile, n_blocks, block_k, n_k, dv)
                values_task(vf, src, dv, n_valid, dv, dv, block_k, w, False, vn.reshape(-1),
                            tile * (block_k * dv), False)


@kernel(read_only=("kf", "vf", "cu_k", "seqs"))
def pack_varlen(kf, k_steps, vf, v_steps, cu_k, seqs, d, dv, block_k, w, kt, vt):
    """K and V of packed sequences as the forward kernel's tile lists: sequence ``s``'s tiles
    for key head ``h`` at ``seqs[s, TILE0] + h * seqs[s, TILES]``, keys transposed in ``kt``
    (tiles, D * block_k), values as rows, padded to whole vectors, in ``vt`` (tiles,
    block_k * Dv_pad). ``kf``, ``k_steps``: K as a flat span and its (token, head) strides in
    elements, element ``(j, h, c)`` at ``kf[j * k_steps[0] + h * k_steps[1] + c]``
    (``flat_rows``); ``vf``, ``v_steps`` the same for V. One task per tile and tensor."""
    dv_pad = vt.shape[1] // block_k
    n_tiles = kt.shape[0]
    ktf, vtf = kt.reshape(-1), vt.reshape(-1)
    for task in prange(2 * n_tiles):
        tile = np.int64(task % n_tiles)
        s = owner(seqs, TILE0, tile)  # the sequence whose tiles these are
        h, kb = divmod(tile - seqs[s, TILE0], seqs[s, TILES])
        j0 = cu_k[s] + kb * block_k
        n_valid = min(block_k, cu_k[s + 1] - j0)
        if task < n_tiles:
            keys_transposed_task(kf, j0 * k_steps[0] + h * k_steps[1], k_steps[0], n_valid, d,
                                 block_k, w, ktf, tile * (d * block_k), False)
        else:
            values_task(vf, j0 * v_steps[0] + h * v_steps[1], v_steps[0], n_valid, dv, dv_pad,
                        block_k, w, False, vtf, tile * (block_k * dv_pad), False)


def flat_rows(x):
    """``(flat, (row step, head step))`` for a (rows, H, D) array whose last axis is unit-stride
    and whose other strides are non-negative: a 1-D view from its first to its last element
    and the steps in elements (a slice of a fused QKV projection, ``qkv[:, 1]``, read in place);
    a C-contiguous copy's for any other array."""
    item = x.itemsize
    if not (x.size and x.strides[2] == item and min(x.strides) >= 0
            and x.strides[0] % item == 0 and x.strides[1] % item == 0):
        x = np.ascontiguousarray(x)
    steps = (x.strides[0] // item, x.strides[1] // item)
    span = (x.shape[0] - 1) * steps[0] + (x.shape[1] - 1) * steps[1] + x.shape[2] if x.size else 0
    flat = np.lib.stride_tricks.as_strided(x, shape=(span,), strides=(item,), writeable=False)
    return flat, steps


@kernel(strided=("v",))
def pack_values(v, block_k, dv_pad, w, zero_nonfinite, vt):
    """``v``: (B, H, Nk, Dv) any strides. ``vt``: (B*H, n_blocks, block_k * dv_pad) contiguous:
    each value tile (block_k, dv_pad), zero-padded, in column panels of width ``w``.
    ``zero_nonfinite``: store NaN/Inf as 0 (see ``packed_rows``)."""
    n_b, n_h, n_k, dv = v.shape
    n_blocks = vt.shape[1]
    for task in prange(n_b * n_h * n_blocks):
        b, h, kb = unravel(task, n_h, n_blocks)
        bh = b * n_h + h
        j0 = kb * block_k
        for c0 in range(0, dv_pad, w):
            width = min(w, dv_pad - c0)
            base = c0 * block_k
            for j in range(block_k):
                row = base + j * width
                inside = j0 + j < n_k
                for cc in range(width):
                    c = c0 + cc
                    x = v[b, h, j0 + j, c] if inside and c < dv else 0.0
                    if zero_nonfinite and not np.isfinite(x):
                        x = 0.0
                    vt[bh, kb, row + cc] = x


# Fresh arrays from this size on get their own anonymous mapping of plain 4-KiB pages
# (``empty``). numpy asks the kernel for huge pages on arrays of 4 MiB and more
# (madvise(MADV_HUGEPAGE)), and with the kernel's transparent huge pages set to "madvise" (as
# here) a fault in such memory may first compact physical memory for a 2-MiB page, in the
# faulting thread. Right after a torch forward + backward had freed its tensors, that took
# cpuflash's forward + backward at N=8192, D=128 (32-MiB arrays) from 3.55 to 4.04 s (0.6 s of
# kernel time against 0.06; bench/after_torch.py, log bench/results/cpu_after_torch.txt); on
# plain pages it ran in 3.45-3.67 s either way. Smaller arrays keep numpy's huge pages: from
# 4 MiB on, plain pages made forward + backward at N=2048, D=64 (4-MiB arrays) 5-12 % slower
# in page faults (same log), and no compaction stall showed there.
PLAIN_PAGES_FROM_BYTES = 32 << 20


# Where the tile products' B operands start (packed K and V): a whole cache line. numpy gives
# 16 bytes (large arrays come from mmap with malloc's 16-byte header: 16 mod 64), and then
# every 64-byte vector load of a B row spans two lines. Measured on stop 31's Xeon, the 4 x 64
# micro-kernel at k = 64 on one core: 192 GFLOP/s with B at 0 mod 64, 166-167 at 16 or 32.
ALIGN_BYTES = 64


def address(x):
    """Where ``x``'s first element is in memory. ``x.ctypes.data`` builds a ctypes object (1.1
    us); a ctypes view of a writeable C-contiguous buffer takes 0.37 us, what a small call pays
    for its output and its in-place V."""
    if x.flags.writeable and x.flags.c_contiguous and x.nbytes > 0:
        return ctypes.addressof(ctypes.c_char.from_buffer(x))
    return x.ctypes.data


def aligned(x):
    """Whether ``x`` starts on a cache line (``ALIGN_BYTES``)."""
    return address(x) % ALIGN_BYTES == 0


@helper
def scratch(n, like):
    """A kernel's scratch: ``n`` uninitialized elements of ``like``'s dtype starting on a cache
    line (``ALIGN_BYTES``; Numba's ``np.empty`` gives 32 bytes), for the tiles the products and
    the softmax read and write a vector at a time."""
    pad = ALIGN_BYTES // like.itemsize
    raw = np.empty(n + pad, dtype=like.dtype)
    start = (-raw.ctypes.data % ALIGN_BYTES) // like.itemsize
    return raw[start:start + n]


def on_line(shape, dtype, zeroed=False):
    """``np.empty`` (``zeroed``: ``np.zeros``) of ``shape`` and ``dtype``, C-contiguous and
    writeable, from numpy's allocator but starting on a cache line (``ALIGN_BYTES``): a view
    into a buffer one line longer."""
    dtype = np.dtype(dtype)
    n_bytes = (math.prod(shape) if isinstance(shape, tuple) else int(shape)) * dtype.itemsize
    raw = (np.zeros if zeroed else np.empty)(n_bytes + ALIGN_BYTES, dtype=np.uint8)
    start = -address(raw) % ALIGN_BYTES
    return raw[start:start + n_bytes].view(dtype).reshape(shape)


def empty(shape, dtype):
    """``np.empty(shape, dtype)``, C-contiguous, writeable and starting on a cache line
    (``on_line``); from ``PLAIN_PAGES_FROM_BYTES`` on, page-aligned over its own anonymous
    mapping (unmapped when the array goes), which the kernel backs with plain pages."""
    dtype = np.dtype(dtype)
    size = math.prod(shape) if isinstance(shape, tuple) else int(shape)  # not np.prod: 3 us
    if size * dtype.itemsize < PLAIN_PAGES_FROM_BYTES:
        return on_line(shape, dtype)
    mapping = mmap.mmap(-1, size * dtype.itemsize)
    return np.frombuffer(mapping, dtype=dtype, count=size).reshape(shape)


# Outputs below this size come straight from ``np.empty`` (``output``): a line-aligned one
# costs 3 us more here (a buffer one line longer, its address, a view), a twentieth of a
# 60-us call at H=1, N=17, while its rows' vector stores are a few hundred at most.
ALIGNED_OUTPUT_FROM_BYTES = 64 << 10


def output(shape, dtype):
    """A call's result array, C-contiguous and writeable: ``empty``'s from
    ``ALIGNED_OUTPUT_FROM_BYTES`` (or ``PLAIN_PAGES_FROM_BYTES``, where that is lower) on,
    ``np.empty``'s below (aligned to numpy's 16 bytes)."""
    dtype = np.dtype(dtype)
    n_bytes = math.prod(shape) * dtype.itemsize
    if n_bytes < ALIGNED_OUTPUT_FROM_BYTES and n_bytes < PLAIN_PAGES_FROM_BYTES:
        return np.empty(shape, dtype)
    return empty(shape, dtype)


# Packed buffers up to this size are kept per Python thread and reused by the next call: a
# fresh buffer is page-faulted in on every call (measured: 0.5 ms of a 6 ms call at N=512,
# D=128). Larger ones are allocated per call, where the faults are a small share of the work.
REUSE_MAX_BYTES = 16 << 20
_workspace = threading.local()


def workspace(name, shape, dtype):
    size = math.prod(shape)
    if size * np.dtype(dtype).itemsize > REUSE_MAX_BYTES:
        return empty(shape, dtype)
    buf = getattr(_workspace, name, None)
    if buf is None or buf.size < size or buf.dtype != dtype:
        buf = empty(max(size, 1), dtype)
        setattr(_workspace, name, buf)
    return buf[:size].reshape(shape)


# Results (the backward pass's gradients) up to REUSE_MAX_BYTES are also kept per Python thread,
# but handed out again only once nothing outside the pool refers to them: the caller dropped
# the previous call's result (a training step's gradients are summed into ``.grad`` and let
# go). Fresh memory of a few MiB is page-faulted in on every call, because glibc gives freed
# memory of that size back to the system (measured at N=512, D=128: the three gradients' first
# touch 0.8 ms of an 11 ms backward pass).
_results = threading.local()


def _refs_held_by_pool():
    """What ``sys.getrefcount`` reports in ``reusable`` for an array that only the pool holds
    (its slot, the local name, the call's argument: 3 on CPython 3.11), measured the same
    way here so that an interpreter that counts differently never reuses a held array."""
    pool = {"x": np.empty(1)}
    buf = pool.get("x")
    return sys.getrefcount(buf)


_POOL_ONLY = _refs_held_by_pool()


def reusable(name, shape, dtype):
    """``(array, fresh)``: an uninitialized C-contiguous array for a result, this thread's
    previous one of that name, shape and dtype if nothing outside the pool refers to it any
    more (a view, a torch tensor from ``torch.from_numpy`` and a memoryview all refer to it),
    else a new one (``fresh`` True: its pages are not yet faulted in)."""
    dtype = np.dtype(dtype)
    shape = tuple(int(n) for n in shape)
    if math.prod(shape) * dtype.itemsize > REUSE_MAX_BYTES:
        return empty(shape, dtype), True
    pool = _results.__dict__
    buf = pool.get(name)
    if (buf is not None and buf.shape == shape and buf.dtype == dtype
            and sys.getrefcount(buf) == _POOL_ONLY):
        return buf, False
    buf = pool[name] = np.empty(shape, dtype=dtype)
    return buf, True


def packed_transposed(x, block_k, panel_width, name):
    """(B, H, N, D) -> (B*H, n_blocks, D * block_k): tiles transposed to (D, block_k), panels."""
    n_b, n_h, n, d = x.shape
    n_blocks = max(1, -(-n // block_k))
    xt = workspace(name, (n_b * n_h, n_blocks, d * block_k), x.dtype)
    if xt.size and x.flags.c_contiguous:
        pack_tiles(x, x, block_k, panel_width, xt, None, None, None)
    elif xt.size:
        pack_keys_transposed(x, block_k, panel_width, xt)
    return xt


def packed_rows(x, block_k, lanes, panel_width, name, zero_nonfinite=False, pack=True):
    """(B, H, N, D) -> (B*H, n_blocks, block_k * D_pad): tiles (block_k, D_pad), panels; a view
    of ``x`` itself where that is already its layout (never with ``zero_nonfinite``).
    ``pack=False``: that view, or None where a copy would be needed.

    ``zero_nonfinite`` serves the backward pass's ``dQ = dS @ K``: a masked key has dS = 0, and
    0 * NaN would carry a NaN in K into every row's dQ. A NaN in a key that a row does see
    reaches that row's dQ anyway, through its score and so its dS."""
    n_b, n_h, n, d = x.shape
    n_blocks = max(1, -(-n // block_k))
    d_pad = -(-d // lanes) * lanes
    if (not zero_nonfinite and d == d_pad <= panel_width and n > 0 and n % block_k == 0
            and x.flags.c_contiguous and x.flags.writeable and aligned(x)):
        # Rows of whole vectors in one panel, no padding keys, on a cache line: the packed
        # layout is the array's own (D=64 float32 on AVX-512, say), so it is read in place
        # (measured at N=512, D=64: the copy was 3 % of the call). An array off the line is
        # copied: its rows would cost two lines per vector load (``ALIGN_BYTES``).
        return x.reshape(n_b * n_h, n_blocks, block_k * d)
    if not pack:
        return None
    xr = workspace(name, (n_b * n_h, n_blocks, block_k * d_pad), x.dtype)
    if xr.size and d == d_pad and x.flags.c_contiguous:
        rows_as = (xr, None) if zero_nonfinite else (None, xr)  # kn zeroes NaN/Inf, vn keeps
        pack_tiles(x, x, block_k, panel_width, None, None, *rows_as)
    elif xr.size:
        pack_values(x, block_k, d_pad, panel_width, zero_nonfinite, xr)
    return xr


@functools.lru_cache(maxsize=4)
def _no_copy(dtype):
    """``pack_tiles``' empty ``vn`` for ``dtype``: V read in place, no copy of it. Made once
    (size 0: nothing ever writes to it), not on each forward call."""
    return np.empty((0, 0, 0), dtype)


def packed_kv(k, v, block_k, lanes, panel_width):
    """Keys transposed and values as rows, packed for the forward pass: in one parallel region
    (``pack_tiles``) where both are C-contiguous.

    V is read in place where it already has the packed layout and starts on a cache line
    (``packed_rows``), which depends on where numpy put it. K alone is then packed by the same
    specialization of ``pack_tiles``, with an empty ``vn``: with a specialization for each
    case, a process whose V fell the other way than the cached first call's compiled the
    other at its first call (1.2-2.3 s, stop 53, against 0.2 s)."""
    n_b, n_h, n, d = k.shape
    dv = v.shape[3]
    vn = packed_rows(v, block_k, lanes, panel_width, "values", pack=False)
    if not (k.flags.c_contiguous and v.flags.c_contiguous and dv % lanes == 0 and n > 0):
        return (packed_transposed(k, block_k, panel_width, "keys"),
                vn if vn is not None else packed_rows(v, block_k, lanes, panel_width, "values"))
    n_blocks = -(-n // block_k)
    kt = workspace("keys", (n_b * n_h, n_blocks, d * block_k), k.dtype)
    in_place = vn is not None
    if not in_place:
        vn = workspace("values", (n_b * n_h, n_blocks, block_k * dv), k.dtype)
    if kt.size:
        pack_tiles(k, v, block_k, panel_width, kt, None, None,
                   _no_copy(k.dtype) if in_place else vn)
    return kt, vn


def packed_varlen(k, v, cu_k, seqs, block_k, lanes, panel_width, n_tiles):
    """``(kt, vt)``: the tile lists ``pack_varlen`` makes from (total_k, Hkv, D/Dv) ``k``, ``v``
    of any strides, in this thread's workspaces."""
    d, dv = k.shape[2], v.shape[2]
    dv_pad = -(-dv // lanes) * lanes
    kt = workspace("keys", (n_tiles, d * block_k), k.dtype)
    vt = workspace("values", (n_tiles, block_k * dv_pad), k.dtype)
    if n_tiles:
        pack_varlen(*flat_rows(k), *flat_rows(v), cu_k, seqs, d, dv, block_k, panel_width, kt,
                    vt)
    return kt, vt
