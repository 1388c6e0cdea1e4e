"""Decoding: few queries against a long K/V, read in place. prange over (batch*kv-head, split).

With ``Nq`` small the forward pass is bound by reading K and V, and packing them (as the
tiled kernel does) would read them twice. Here every task takes one split of the key axis for
one kv head and all the query rows of its GQA group (``group * Nq`` rows), so each K/V byte is
read once per call, straight from the caller's array (rows must be unit-stride):

    for each chunk of ``chunk`` keys in the split (``chunk_keys``):
        s[r, :] = q_r . k_j                  # one vector dot product per (row, key)
        online softmax over the chunk        # as the tiled kernel, base 2
        acc[r] = alpha * acc[r] + sum_j p[r, j] * v_j

With K transposed, or in KVCache's blocks of KEY_BLOCK keys (each their K^T, contiguous), a
chunk's scores are a tile product over all D rows of K^T (``transposed_scores``). The
products hint the rows they will read ``AHEAD * CHUNK`` keys later into L2, so that K/V stream
in while the core computes on the current chunk, and (since stop 54) the rows 8 KiB on into L1
(``simd.NEAR_ROWS``): K and V where K is stored in float16 or int8
or transposed in whole rows (which is also hinted a block ahead a few rows at a time,
``HINT_BLOCK``); neither for K in the compute dtype, by rows or in KVCache's blocks (on
Intel's cores, both for every layout: ``hinted``).

Each split leaves ``m``, ``l`` and an unnormalized ``acc``; ``combine_row`` merges the splits
in split order (``out = sum_s acc_s 2^(m_s - M) / sum_s l_s 2^(m_s - M)``). The number of splits
is a function of the shapes only (``split_count``), so the result is the same for any thread
count.
"""
import functools
import inspect
import math
from typing import NamedTuple

import numpy as np
from numba import prange
from numpy.lib.stride_tricks import as_strided

from .. import config
from . import bfloat16, simd
from ._jit import helper, kernel
from .tasks import unravel
from .dropout import dropout_row
from .masking import apply_user_mask, row_band
from .scores import modifies, modify_row
from .pack import ALIGN_BYTES, scratch
from .tiles import online_softmax, rescale_add, tile_product, tile_product_ahead
from ..masks import key_lengths

LN2 = math.log(2.0)
LOG2_E = 1.0 / LN2
# Keys per online-softmax step (``chunk_keys``): a multiple of CHUNK, as many as keep a chunk's
# scores within CHUNK_SCORE_BYTES (16 KiB, half of L1: 4096 float32 scores, 2048 float64), at
# most MAX_CHUNK. The per-step work (row max, rescale of the accumulators, the P @ V call) is
# paid once per chunk (measured at Nk = 32768: 16 keys 51 ns/key, 128 keys 28 ns/key with the
# folded dot products). A chunk reads its keys' K, then their V: the longer the chunk, the longer
# each of the two streams runs before the other takes over, and from DRAM that is what counted.
# On the Zen 4 (stop 38, Hkv=2, Nk=32768, 4 rows, 19 layers from DRAM, one process, rounds side
# by side with a streaming read; GB/s): chunks of 128 keys with the hints 27.4, of 1024 without
# them 35.9 (the read at 51); in a slower spell 26.9 against 29.7, 1024 and 2048 keys alike
# (30.3). A model of the loop that read K and V with 4 FMAs a line and no softmax: phases of 128
# keys 31.6, of 1024 39.8, one stream 44.8 GB/s. CHUNK itself is the granule: splits are whole
# multiples of it, chunks start on them, and a multiple of every lane count.
CHUNK = 128
MAX_CHUNK = 1024
CHUNK_SCORE_BYTES = 16384
# Keys in a block of KVCache's K and V: each block is its keys' K^T in panels of ``w`` keys,
# (KEY_BLOCK // w, D, w), and their values in panels of ``u`` columns, (Dv // u, KEY_BLOCK, u),
# each in one piece (``key_panel_width``, ``value_panel_width``: the micro-kernel's width, 16
# float32 on AVX2, 64 on AVX-512, where a block is one panel); a chunk is CHUNK // KEY_BLOCK
# blocks in a row. Each micro-kernel call reads one panel from its first byte to its last, as
# the hardware prefetcher likes it. With blocks of one panel on AVX2 (stops 37-38), a 16-column
# call read one 64-byte line of each 256-byte row, four passes over each block of K^T and over
# each chunk of V. Measured on the Zen 3 (stop 39, Hkv=2, Nk=32768, from DRAM, side by side in
# one process, ``bench/cpu_kv_layout.py``), ms a step with panels against one panel a block:
# float32 1.41-1.53 against 1.61-1.75 (faster in 5 of 5 rounds; 73-78 % of the streaming read
# against 66-68 %), float16 0.90-0.93 against 0.97-1.05 (4 of 4), int8 the same (0.84-0.95
# against 0.83-1.00: bound by its arithmetic there). On the Zen 4, with blocks of one panel
# against a whole chunk's (stop 37, a model of the loop over K from DRAM, rounds side by side
# in one process): 27.8 against 23.4 GB/s, faster in 10 of 10 rounds; 28.5 against 27.1, 11
# of 12.
KEY_BLOCK = 64
# How far ahead (``AHEAD * CHUNK`` keys) K^T's and V's rows are hinted into L2, one line per line
# read, spread over the tile products (simd.PREFETCH_LOCALITY), where ``hinted`` says so. Since
# stop 39 KVCache's blocks in panels narrower than a block (AVX2) are not hinted at all: on the
# Zen 3, from DRAM, side by side in one process, steps without hints were faster in 5 of 5
# rounds in float16 (by 3-10 %) and 4 of 4 in int8 (8-27 %), and in float32 as fast (faster in
# 4 of 6 rounds, by up to 8 %). Since stop 38 neither is hinted for K in the compute dtype by
# rows, and from stop 38 to 42 only K for KVCache's blocks in the compute dtype (since stop 43
# not that either: ``HINT_VALUES``): with chunks of up to 1024 keys
# the hardware prefetcher streams them as well or better alone from DRAM (float32, the
# measurements of MAX_CHUNK: 1024 keys with both hinted 30.5 and 29.7 GB/s, with neither 35.9
# and 30.6, K alone 28.1; a row-major K through ``attention``: 23.3 against 25.7, chunks of 128
# with hints 19.0), and K's hints help a layer
# that sits half in the L3 (one layer of 33.5 MB again and again: 0.49-0.71 ms a step with them,
# 0.62-0.86 without, 6 of 6 rounds; 4 of 6 in a second run). float16 and int8 keep both (float16
# 1024 keys without 20.1 GB/s, with 32.0; 128 keys with 29.1), and so does a transposed K of
# whole rows (without 17.6, with 23.0). Before (chunks of 128 keys): a step from DRAM is bound by
# the memory, and the hardware prefetcher alone did not keep enough lines in flight while the
# core computed: the 64 rows of K^T are 64 streams, more than it follows, and sweeps of several
# thousand keys 8 rows at a time (stops 20-32) read each stream longer but summed the scores in 8
# passes through memory (10 ns a key against 5 in one pass, keys in L2). Measured (stop 33, Zen
# 4, Hkv=2, Nk=32768, the step's share of a streaming read of the same bytes timed in alternation
# with it (the slow read of stops up to 37), medians of 8 rounds; old kernel / this one, two
# processes each): float32 from DRAM 60-61 % / 71-78 %, hot 30-38 % / 53-56 %; float16 from DRAM
# 38-54 % / 67-72 %; int8 (a chunk at a time before too, hinted into L1) 24-31 % / 45 %. Hints
# two chunks ahead or one or three: the same within the noise. What is left, as we read it: the
# hints fill the core's few miss buffers (one core reaches about 12 GB/s this way, the hardware
# prefetcher on 8 long streams 19); the block hints below take back a little of it. With
# KVCache's blocks (stop 37, float32 from DRAM, one process, rounds side by side; GB/s against a
# 40-43 GB/s read): hints on K and V 27.7-29.8, on K only 26.5-30.8, on V only 24.9-28.4, none
# 21.9-32.9, both one chunk ahead 28.2-30.7 (with blocks of 128 keys: none 1.58-2.10 ms a step
# against 1.23-1.53; 1, 2, 4 and 8 chunks ahead 1.14-1.39, 1.13-1.37, 1.14-1.32, 1.21-1.47 ms).
AHEAD = 2
PREFETCH = True  # the hints (a switch for the tests: the same bits without)
# On Intel's cores V is hinted as well as K wherever anything is (``hinted``): on an Intel Xeon
# (stop 41, Hkv=2, Nk=32768, float32 from DRAM, the kinds of hints side by side in one process,
# 4 rounds), KVCache's blocks with K hinted 20.7-21.2 GB/s, K and V 24.2-24.3, V alone
# 20.9-21.3, neither 19.1-19.4, against a 31.1-31.6 GB/s streaming read; float32 arrays by rows
# through ``attention`` (where only V's hints apply) neither 19.9-20.2, both 22.8-23.3; one
# layer again and again (hot: 4096, 16384 or 32768 keys, in L2 or this machine's large L3)
# K alone, both and neither within 2 % of each other (42-44, 46-48 and 50-51 GB/s). float16
# and int8 keep both (float16 19.0-20.5 with any, int8 K and V 16.6, K 13.6, neither 9.9).
# ``cpuflash bench --section decode``, two rounds each: float32 from DRAM 67-69 % of the
# streaming read before, 75-76 % after (2.99-3.05x torch before, 3.46-3.59x after). The Zen 4's
# and Zen 3's measurements above chose otherwise, and AMD kept their choice until stop 43. Since
# then KVCache's blocks in the compute dtype are not hinted on AMD at all (K was, from stop 38's
# measurements): the hardware prefetcher alone streams them faster now (on stop 43's code, with
# the micro-kernels inlined; whether that moved the balance was not measured). Measured on the
# Zen 4 (Hkv=2, Nk=32768, float32, 19 layers from DRAM, one process, best of 5 steps a round, the
# variants in turn with a streaming read after each round; GB/s and share of that read): in a fast
# spell of the read (56-63 GB/s, 16 rounds) no hints 50.9-53.3 (81-93 %), K hinted 43.9-46.2
# (71-80 %), K and V 38.2-39.1 (61-68 %); in a slow spell (35-36 GB/s, 8 rounds) no hints
# 33.7-35.1 (94-97 %), K 32.5-33.5 (91-93 %); one layer again and again (hot, 6 rounds of 40
# steps) no hints 86.7-88.2 GB/s, K 86.0-86.6, K and V 83.9-86.2. float16 keeps its hints:
# 38.3-39.0 GB/s with them, 35.2-36.0 without (fast spell, 8 rounds).
HINT_VALUES = config.HOST_VENDOR == "GenuineIntel"
HINT_K, HINT_V = 1, 2  # the kernel's ``prefetch`` bits (``hinted``)
# A transposed K of whole rows (not KVCache's blocks, which are one stream a chunk already) is
# also hinted a block of HINT_BLOCK keys ahead in the order the hardware prefetcher
# follows (a few long streams, not 64 short ones): with the chunk that is the i-th of its
# block, rows [i g, (i + 1) g) of K^T over the next block's keys, g = D / (chunks a block);
# at D=64 8 rows of 4 KiB of float32 a chunk (``hint_rows``). Measured as above, float32 from
# DRAM: 2-12 % faster than with the products' hints alone in each of four processes (medians
# 1.35-1.54 ms a step against 1.38-1.68; blocks of 512 or 2048 keys alike); float16 and hot
# steps within the noise.
HINT_BLOCK = 1024
# How the key axis is split (``split_count``): into at least enough splits for ``TASKS``
# tasks over (batch, kv head, split), but no split shorter than ``MIN_SPLIT_KEYS`` keys nor
# longer than ``MAX_SPLIT_KEYS``. Every split pays fixed costs (its buffers, its Q, its partial
# output and its share of the merge). Measured with 2 threads, one process, best of 450
# interleaved, ms per step at 1/2/4/8/16/32 splits: Hkv=2, Nk=32768: 0.713 0.710 0.710 0.717
# 0.727 0.741 (it was 32 splits of 1024 keys); Hkv=8, Nk=32768: 4.05 3.15 2.88 2.79 2.81 2.79;
# Hkv=2, Nk=4096: 0.134 0.123 0.117 0.122 0.133 0.142.
MIN_SPLIT_KEYS = 1024
MAX_SPLIT_KEYS = 4096
TASKS = 16  # keeps up to 16 threads busy where the keys allow it
MAX_SPLITS = 64  # caps the partial results at 64 * (B, Hq, Nq, Dv), whatever Nk
MAX_NQ = 16            # attention() takes this path for Nq up to this (but see below)
SERIAL_COMBINE = 1 << 18  # partial-output elements up to which the merge runs on one thread
# From TILED_FROM_NQ queries on, a call with K and V in q's own dtype and at most
# TILED_KEYS_PER_ROW keys for each query row of a GQA group (Nk <= 32 * Nq * Hq / Hkv), without
# GQA TILED_KEYS_PER_QUERY_MHA keys a query (Nk <= 16 * Nq), takes the tiled forward pass instead
# (``takes_decode``): there the work is the products, not the read of K and V, and the tiled
# kernel's register-blocked products over a query block do it faster than this path's rows of
# dot products, packing K and V included. Measured (stop 63, float32, D=64, B=1, causal; one
# process, calls of the two paths in alternating order, medians; decode / tiled time, at the
# Nk given; * marks the largest Nk the rule gives the tiled path). 2 threads:
#   Hq=Hkv=12, Nq=16: 1.53 1.45 1.40 1.17* 1.01 0.87 at Nk = 16 64 128 256 512 1024;
#                Nq=8: 1.05 1.12 1.28* 1.01 0.77 0.59;  Nq=6: 0.90 1.00 0.93 0.85 0.64 0.52;
#   Hq=8, Hkv=2, Nq=16: 1.32 1.37 1.45 1.42 1.26 1.20 at Nk = 16 ... 1024, 1.31* at 2048, 1.18
#                at 4096;  Nq=12: 1.19 1.26* 1.22 0.94 at 512 1024 2048 4096;  Nq=8: 0.97-1.10
#                up to 1024* (1.31 at 512 in a second run);  Nq=4: 0.84-0.93;
#   Hq=32, Hkv=4, Nq=16: 1.60 1.50 1.23* 1.23 at 512 1024 2048 4096;  Nq=8: 1.31 1.18 0.97*
#                0.88;  Hq=16, Hkv=2, Nq=8: 1.25 1.19 1.28* 0.94.
# One thread (NUMBA_NUM_THREADS=1): Hq=Hkv=12, Nq=16 1.36 at 128, 1.15* at 256, 0.79 at 512;
# Nq=8 1.07* at 128, 0.68 at 256; Hq=8 Hkv=2, Nq=16 1.35 at 1024, 1.20* at 2048; Nq=12 1.20* at
# 1536; Hq=32 Hkv=4, Nq=8 1.12* at 2048. (32 keys a query without GQA too, the rule's first
# form, tied on 2 threads at 256-512 keys but lost 0.68-0.79x on one.)
# Since stop 64 a one-tile call's tasks pack their own K/V (``forward.packs_own_tiles``), and
# without GQA the tiled path takes calls from TILED_FROM_NQ_MHA queries on. Measured as above
# (stop 64): Hq=Hkv=12, Nq=4: 1.23* 1.16 0.64 at Nk = 64 128 256 (one thread 1.07* 0.97 0.40);
# Nq=6: 1.32 1.08* 1.21 0.90 at 64 96 128 256 (one thread 1.17 0.97* 1.24 0.88); Nq=7: 1.37
# 1.59 1.56 at 16 64 128; Nq=1: 0.73-0.87 at 16-128. With GQA below 8 queries the tiled
# kernel led only at 128 keys or fewer (Hq=8 Hkv=2, Nq=4: 1.03-1.10 at 16-128; Nq=7: 1.12-1.33)
# and not over the rest of the rule's range: Hq=8 Hkv=2, Nq=4: 0.94-0.97 at 256-1024 (one
# thread 1.02-1.15); Nq=6: 0.98-1.05 at 256-1024; Hq=32 Hkv=4 Nq=4: 1.20 0.94 0.76 at 512 1024
# 2048; Hq=16 Hkv=2 Nq=5: 0.83-0.95 at 512-2048. So GQA keeps TILED_FROM_NQ.
# A KVCache's blocks and float16/int8 caches stay on this path: it reads them in place.
TILED_FROM_NQ = 8
TILED_FROM_NQ_MHA = 4
TILED_KEYS_PER_ROW = 32
TILED_KEYS_PER_QUERY_MHA = 16


def takes_decode(n_q, n_k, group, cache):
    """Whether ``attention`` takes the decode path for ``n_q`` queries of ``group`` query heads
    a key head and ``n_k`` keys (with the portable kernels it never does). ``cache``: K and V
    are a KVCache's blocks or in a storage type (float16, int8), which this path reads in
    place: up to ``MAX_NQ`` queries it always takes those."""
    if n_q > MAX_NQ:
        return False
    if group > 1:
        from_nq, keys_a_query = TILED_FROM_NQ, TILED_KEYS_PER_ROW * group
    else:
        from_nq, keys_a_query = TILED_FROM_NQ_MHA, TILED_KEYS_PER_QUERY_MHA
    return cache or n_q < from_nq or n_k > keys_a_query * n_q


def chunk_keys(rows, itemsize):
    """Keys per online-softmax step for ``rows`` query rows whose scores have ``itemsize``
    bytes: a multiple of CHUNK, the most whose scores fit in ``CHUNK_SCORE_BYTES``, at most
    ``MAX_CHUNK``."""
    return max(CHUNK, min(MAX_CHUNK, CHUNK_SCORE_BYTES // itemsize // rows // CHUNK * CHUNK))


def hinted(k_storage, keys_unit, blocked, panels=False):
    """What the kernel hints ahead (``AHEAD``), as ``HINT_K | HINT_V`` bits: neither for
    KVCache's blocks in ``panels`` narrower than a block (AVX2's; see ``KEY_BLOCK``); else both
    for K in a storage type (float16, int8) or transposed in whole rows, and on Intel's cores
    (``HINT_VALUES``) for every layout; elsewhere neither: K in the compute dtype, by rows or
    in KVCache's blocks (see ``HINT_VALUES``)."""
    if not PREFETCH or panels:
        return 0
    if k_storage or (keys_unit and not blocked) or HINT_VALUES:
        return HINT_K | HINT_V
    return 0


def split_count(n_b, n_hkv, n_k):
    """Splits of the key axis: a function of the shapes only, so that the merge, and with it
    the result, is the same for any thread count."""
    for_threads = min(-(-n_k // MIN_SPLIT_KEYS), -(-TASKS // max(1, n_b * n_hkv)))
    return max(1, min(MAX_SPLITS, max(for_threads, -(-n_k // MAX_SPLIT_KEYS))))


@helper
def span_of(x):
    """A 1-D view from the first element of the 4-D ``x`` over all of it (its strides
    non-negative whole elements: checked by the caller, ``element_strides``); empty if ``x``
    is."""
    item = x.itemsize
    if x.size == 0:  # the int8 scales' stand-in for a float cache
        return as_strided(x, shape=(0,), strides=(item,))
    last = 0  # the offset of the last element
    for axis in range(4):
        last += (x.shape[axis] - 1) * (x.strides[axis] // item)
    return as_strided(x, shape=(last + 1,), strides=(item,))


@helper
def dot_rows(q_s, q_off, kf, k_off, d, d_vec):
    """``q_s[q_off:q_off+d] . kf[k_off:k_off+d]``: vectors up to ``d_vec``, then scalars."""
    acc = simd.vsplat(q_s, 0.0)
    for dd in range(0, d_vec, simd.lanes_of(q_s)):
        acc = simd.vfma(simd.vload(q_s, q_off + dd), simd.vload_as(q_s, kf, k_off + dd), acc)
    total = simd.vhsum(acc)
    for dd in range(d_vec, d):
        total += q_s[q_off + dd] * simd.load_as(q_s, kf, k_off + dd)
    return total


@helper
def dot_strided(q_s, q_off, kf, k_off, k_step, d):
    """``q_s[q_off:q_off+d] . kf[k_off::k_step][:d]`` (a key of a transposed K)."""
    total = 0.0
    for dd in range(d):
        total += q_s[q_off + dd] * simd.load_as(q_s, kf, k_off + dd * k_step)
    return total


@helper
def axpy_row(acc, acc_off, p, vf, v_off, dv, dv_vec):
    """``acc[acc_off:acc_off+dv] += p * vf[v_off:v_off+dv]``."""
    p_v = simd.vsplat(acc, p)
    for c in range(0, dv_vec, simd.lanes_of(acc)):
        simd.vstore(acc, acc_off + c, simd.vfma(p_v, simd.vload_as(acc, vf, v_off + c),
                                                 simd.vload(acc, acc_off + c)))
    for c in range(dv_vec, dv):
        acc[acc_off + c] += p * simd.load_as(acc, vf, v_off + c)


@helper
def convert_rows(dst, src, src_off, src_step, n, d, d_vec):
    """``dst[j*d:(j+1)*d] = src[src_off + j*src_step:][:d]`` in the compute dtype, j < n."""
    lanes = simd.lanes_of(dst)
    for j in range(n):
        for dd in range(0, d_vec, lanes):
            simd.vstore(dst, j * d + dd, simd.vload_as(dst, src, src_off + j * src_step + dd))
        for dd in range(d_vec, d):
            dst[j * d + dd] = simd.load_as(dst, src, src_off + j * src_step + dd)


@helper
def chunk_scores(s, ld, q_s, rows, d, d_vec, kf, k_off, k_step, n_c, k_buf):
    """``s[r, jj] = q_r . k_(jj)`` for ``jj < n_c`` (rows ``ld`` apart in ``s``), the key
    ``jj`` at ``kf[k_off + jj*k_step:]``. Whole groups of ``W`` keys by ``vdot_keys`` (keys in
    the inner loop of each group: its K rows are read from memory once, then from L1 for the
    other rows), the rest and any head-dim tail by scalar dot products.

    ``k_buf`` (``W * d`` floats, or empty): a group of float16/int8 keys is first converted
    into it once, for all rows, instead of once per row inside the dot products (which made a
    float16 cache no faster than float32 with 4 rows)."""
    lanes = simd.lanes_of(s)
    n_full = n_c // lanes * lanes if d_vec > 0 else 0
    staged = k_buf.size > 0
    for jj in range(0, n_full, lanes):
        if staged:
            convert_rows(k_buf, kf, k_off + jj * k_step, k_step, lanes, d, d_vec)
            for r in range(rows):
                simd.vstore(s, r * ld + jj, simd.vdot_keys(q_s, r * d, k_buf, 0, d, d_vec))
        else:
            for r in range(rows):
                simd.vstore(s, r * ld + jj, simd.vdot_keys(q_s, r * d, kf, k_off + jj * k_step,
                                                           k_step, d_vec))
    for r in range(rows):
        if d_vec < d:
            for jj in range(n_full):
                s[r * ld + jj] += dot_rows(q_s, r * d + d_vec, kf,
                                           k_off + jj * k_step + d_vec, d - d_vec, 0)
        for jj in range(n_full, n_c):
            s[r * ld + jj] = dot_rows(q_s, r * d, kf, k_off + jj * k_step, d, d_vec)


@helper
def scale_scores(s, off, scales, sc_off, sc_step, n):
    """``s[off + j] *= scales[sc_off + j*sc_step]`` for ``j < n``: an int8 cache's per-key
    scales, by whole vectors where they are contiguous (KVCache's layout)."""
    lanes = simd.lanes_of(s)
    n_vec = n // lanes * lanes if sc_step == 1 else 0
    for j in range(0, n_vec, lanes):
        simd.vstore(s, off + j, simd.vmul(simd.vload(s, off + j),
                                          simd.vload(scales, sc_off + j)))
    for j in range(n_vec, n):
        s[off + j] *= scales[sc_off + j * sc_step]


@helper
def hint_rows(kf, off, k_step, r0, r1, n_keys):
    """Hint rows ``r0 .. r1 - 1`` of a transposed K over ``n_keys`` keys into L2, each row's
    lines in turn (row ``r`` at ``kf[off + r*k_step:]``)."""
    per_line = ALIGN_BYTES // kf.itemsize
    for r in range(r0, r1):
        for j in range(0, n_keys, per_line):
            simd.prefetch_line(kf, off + r * k_step + j)


@helper
def hint_next_block(kf, k_head, k_step, d, c0, j_start, j_stop):
    """With the chunk from key ``c0``, the ``nth`` of its block of ``HINT_BLOCK`` keys counted
    from ``j_start``, hint its share of K^T's rows over the next block's keys (``g`` rows a
    chunk, all D in a block); with the first chunk, the whole first block too. Keys from
    ``j_stop`` on are not hinted."""
    if c0 == j_start:
        hint_rows(kf, k_head + c0, k_step, 0, d, min(HINT_BLOCK, j_stop - c0))
    nth = (c0 - j_start) // CHUNK % (HINT_BLOCK // CHUNK)
    nxt = c0 + HINT_BLOCK - nth * CHUNK
    g = -(-d * CHUNK // HINT_BLOCK)
    hint_rows(kf, k_head + nxt, k_step, min(d, nth * g), min(d, (nth + 1) * g),
              max(0, min(HINT_BLOCK, j_stop - nxt)))


@helper
def key_offset(t, k_step, k_panel):
    """Where key ``t`` of a block of a transposed K starts: at ``t`` where a row of K^T holds
    the block's keys (``k_panel = 1``); in KVCache's panels of ``k_step`` keys, each (D,
    k_step) and ``k_panel * k_step`` apart (``block_layout``), at its panel's start plus its
    column."""
    if k_panel == 1:
        return t
    return t // k_step * k_step * k_panel + t % k_step


@helper
def transposed_scores(s, ld, q_s, rows, d, kf, k_off, k_step, k_block, k_panel, n_c, ahead,
                      n_hinted):
    """``s[r, jj] = q_r . k_jj`` for ``jj < n_c`` (rows ``ld`` apart in ``s``) of a
    transposed K: dim ``dd`` of key ``jj = KEY_BLOCK * n + t`` at ``kf[k_off + n*k_block +
    key_offset(t, k_step, k_panel) + dd*k_step]``. A tile product over all ``d`` rows of K^T
    per block of keys for their whole vectors (its panels of columns ``k_panel`` apart), each
    row it reads also hinted ``ahead`` elements further on (none if 0: see ``AHEAD``) in the
    blocks that start before key ``n_hinted``; the keys past them by scalar dot products."""
    n_vec = n_c // simd.lanes_of(s) * simd.lanes_of(s)
    for first in range(0, n_vec, KEY_BLOCK):
        at = k_off + first // KEY_BLOCK * k_block
        cols = min(KEY_BLOCK, n_vec - first)
        if ahead > 0 and first < n_hinted:
            tile_product_ahead(s, first, ld, q_s, 0, d, 1, kf, at, k_step, k_panel, rows, cols,
                               d, ahead)
        else:
            tile_product(s, first, ld, q_s, 0, d, 1, kf, at, k_step, k_panel, rows, cols, d,
                         False, False)
    for r in range(rows):
        for jj in range(n_vec, n_c):
            s[r * ld + jj] = dot_strided(
                q_s, r * d, kf,
                k_off + jj // KEY_BLOCK * k_block + key_offset(jj % KEY_BLOCK, k_step, k_panel),
                k_step, d)


@helper
def combine_row(m_part, l_part, acc_part, sink, out, lse, b, h, i):
    """Merge the splits of one row in split order, with the head's sink ``c`` (``sink``, in
    natural units; -inf for none, ``sink_of``) as one more term of the sum:
    ``out = sum_s acc_s 2^(m_s - M) / (2^(c' - M) + sum_s l_s 2^(m_s - M))``, ``c' = c log2(e)``
    and ``M`` the largest of ``c'`` and the ``m_s``, so no term exceeds 1. Without a sink the
    first term is 0: the same sum as before sinks, bit for bit."""
    n_s = m_part.shape[0]
    dv = out.shape[3]
    m = -np.inf
    for sp in range(n_s):
        m = max(m, m_part[sp, b, h, i])
    if m == -np.inf:  # the row sees no key: output 0; lse the sink's own logit (or -inf)
        for c in range(dv):
            out[b, h, i, c] = 0.0
        lse[b, h, i] = sink
        return
    top, total = m, 0.0  # the largest exponent; the sum, from the sink's term (0 for none)
    if sink != -np.inf:
        top = max(m, sink * LOG2_E)
        total = np.exp2(sink * LOG2_E - top)
    for c in range(dv):
        out[b, h, i, c] = 0.0
    for sp in range(n_s):
        w = np.exp2(m_part[sp, b, h, i] - top)
        total += w * l_part[sp, b, h, i]
        for c in range(dv):
            out[b, h, i, c] += w * acc_part[sp, b, h, i, c]
    for c in range(dv):
        out[b, h, i, c] /= total
    lse[b, h, i] = (top + np.log2(total)) * LN2


@helper
def sink_of(sinks, b, h):
    """The sink logit of head ``h`` of batch ``b`` in ``sinks`` ((B or 1, Hq), or empty: -inf)."""
    if sinks.shape[1] == 0:
        return -np.inf
    return sinks[b if sinks.shape[0] > 1 else 0, h]


@kernel(strided=("q", "k", "v", "k_scale_4", "v_scale_4", "mask_bools", "mask_adds", "sinks"),
        read_only=("kv_lens", "slopes2"))
def decode(q, k, k_strides, k_block, k_panel, k_storage, prefetch, v, v_strides, v_block,
           v_panel, k_scale_4, ks_strides, v_scale_4, vs_strides, n_hkv, n_k, d, dv, n_splits,
           chunk, scale2, left, right, kv_lens, softcap2, slopes2, mask_bools, mask_adds,
           mask_is_bool, mask_given, drop_below, inv_keep, seed, sinks, out, lse, serial_merge):
    """q: (B, Hq, Nq, D) any strides, compute dtype. k, v: 4-D arrays in their storage type
    (the compute dtype, float16 bits as uint16, or int8), read through 1-D views ``kf``,
    ``vf`` from their first elements (``span_of``: made here, not by a Python call per step).
    Key j = KEY_BLOCK * n + t (``t < KEY_BLOCK``), dim c of head (b, h) is at ``b*s0 + h*s1 +
    n*k_block + t*s2 + c*s3`` with ``k_strides = (s0, s1, s2, s3)``: a (B, Hkv, Nk, D) array
    has ``k_block = KEY_BLOCK * s2`` and ``k_panel = 1`` (``element_strides``). ``s3 = 1``:
    rows of K contiguous, scores by ``vdot_keys``; ``s2 = 1``: keys contiguous, scores by the
    tile product. KVCache's blocks (``k`` then (B, Hkv, blocks, D * KEY_BLOCK);
    ``block_layout``) are K^T in panels of ``w`` keys, each (D, w) in one piece: ``s2 = 1``,
    ``s3 = w``, ``k_block`` the block stride and ``k_panel = D`` (key t of a block at
    ``key_offset``; ``k_panel = 1`` where ``w = KEY_BLOCK``). v: (B, Hkv, Nk, Dv), value j, dim
    c at ``b*s0 + h*s1 + n*v_block + t*s2 + c`` with ``v_strides = (s0, s1, s2, 1)``, and
    ``v_block = KEY_BLOCK * s2``, ``v_panel = 1`` for an array; KVCache's blocks (B, Hkv,
    blocks, Dv * KEY_BLOCK) hold V in panels of ``s2`` columns, each (KEY_BLOCK, s2) in one
    piece and ``v_panel * s2`` apart (``v_panel = KEY_BLOCK``; 1 where a panel is a whole
    row), and P @ V runs a product per block. ``k_storage``: whether K is in a storage type
    (not the compute dtype). ``prefetch``: ``HINT_K``, ``HINT_V`` bits (``hinted``): the
    scores' and P @ V's tile products hint K's and V's rows ``AHEAD * CHUNK`` keys ahead (V by
    rows only), and with ``HINT_K`` a transposed K not in blocks is hinted ``HINT_BLOCK`` keys
    ahead.
    k_scale, v_scale: int8 dequantization scales as (B, Hkv, Nk, 1), read as K and V are, with
    strides ``ks_strides``, ``vs_strides`` over (b, h, j) (``K = kf * k_scale``), or empty
    arrays when K/V are floats.
    left, right, kv_lens: the band of keys each row sees (masking.py); the splits divide the
    array's ``n_k`` keys, and keys past the last that a row of the group sees (``kv_lens``,
    ``causal``) are never read, nor values before the first; a window's first chunk starts at
    a multiple of CHUNK, so up to CHUNK - 1 keys before the band are read, their scores
    masked.
    sinks: float64 (B or 1, Hq), attention sinks' logits (``cpuflash/sinks.py``), or empty
    (``NO_SINKS``): they join the merge as one more term.
    Each split leaves its m, l (``m_part``, ``l_part``: (n_splits, B, Hq, Nq), made here) and
    its unnormalized output (``acc_part``, (..., Dv)); then they are merged into out (B, Hq,
    Nq, Dv, C-contiguous, the compute dtype) and lse (B, Hq, Nq) (``combine_row``), in this
    call: a second call would cost a dispatch and its Python, 15 us of a 0.7 ms step. The
    partial results are made here, not by the caller: each array made in Python and passed in
    cost a numpy call and a dispatch's unboxing, paid per step in Python that runs right after
    a step has swept the caches (``StepPlan``). The merge runs
    on this thread if ``serial_merge``, else spread over the threads (the same arithmetic per
    row either way)."""
    n_b, n_hq, n_q, _ = q.shape
    kf, vf = span_of(k), span_of(v)
    k_scale, v_scale = span_of(k_scale_4), span_of(v_scale_4)
    group = n_hq // n_hkv
    rows = group * n_q
    m_part = np.empty((n_splits, n_b, n_hq, n_q), dtype=out.dtype)
    l_part = np.empty((n_splits, n_b, n_hq, n_q), dtype=out.dtype)
    acc_part = np.empty((n_splits, n_b, n_hq, n_q, dv), dtype=out.dtype)
    lanes = simd.lanes_of(m_part)
    d_vec = d // lanes * lanes
    dv_vec = dv // lanes * lanes
    # P @ V by the micro-kernel, V rows read in place, when they are whole vectors (a padded
    # read past the last row would leave the array); else one row update per key.
    tiled = dv == dv_vec
    # V by rows ``v_strides[2]`` apart (an array), or in KVCache's blocks of KEY_BLOCK keys,
    # ``v_block`` apart, each in panels of ``v_strides[2]`` columns ``KEY_BLOCK * v_strides[2]``
    # apart (``v_panel = KEY_BLOCK``; ``block_layout``).
    v_by_rows = v_panel == 1 and v_block == KEY_BLOCK * v_strides[2]
    ld = dv  # acc row stride
    # whole chunks per split: every chunk but the array's last is full and starts aligned
    split_len = ((n_k + n_splits - 1) // n_splits + CHUNK - 1) // CHUNK * CHUNK
    modify = modifies(softcap2, slopes2)
    quantized = k_scale.size > 0
    keys_unit = k_strides[3] != 1  # K stored transposed: a key's D values k_strides[3] apart
    blocked = k_block != KEY_BLOCK * k_strides[2]  # K in blocks (KVCache's layout)
    stage_k = rows > 1 and k_storage and not keys_unit  # convert float16/int8 keys once
    no_t = np.empty(0, dtype=acc_part.dtype)
    for task in prange(n_b * n_hkv * n_splits):
        b, hk, split = unravel(task, n_hkv, n_splits)
        q_s = scratch(rows * d, acc_part)  # rows (h, i) of the group, scaled
        for g in range(group):
            for i in range(n_q):
                for dd in range(d):
                    q_s[(g * n_q + i) * d + dd] = q[b, hk * group + g, i, dd] * scale2
        s = scratch(rows * chunk, acc_part)  # a chunk's scores, rows ``chunk`` apart
        m_i = np.full(rows, -np.inf, dtype=acc_part.dtype)
        l_i = np.zeros(rows, dtype=acc_part.dtype)
        l_tile = np.empty(rows, dtype=acc_part.dtype)
        alpha_i = np.empty(rows, dtype=acc_part.dtype)
        acc = scratch(rows * ld, acc_part)
        acc[:] = 0.0
        pv = scratch(rows * ld, acc_part)
        k_buf = scratch(lanes * d if stage_k else 0, acc_part)
        first_r = np.empty(rows, dtype=np.int64)  # each row's band of visible keys
        last_r = np.empty(rows, dtype=np.int64)
        kv_len = kv_lens[b]
        for r in range(rows):
            first_r[r], last_r[r] = row_band(r % n_q, n_q, kv_len, left, right)
        # The keys of this split that some row of the group sees.
        j_start = max(split * split_len, first_r[0])
        j_stop = min(split * split_len + split_len, last_r[n_q - 1] + 1)
        # Chunks start on multiples of CHUNK (whole blocks of KVCache's K): a window's first
        # chunk begins up to CHUNK - 1 keys before the band. Their scores are masked, and
        # P @ V starts at the band (``j_first``): values no row sees are never read, and a
        # NaN among them cannot reach the output as 0 * NaN.
        j_first = j_start
        if j_start < j_stop:
            j_start = j_start // CHUNK * CHUNK
        k_head = b * k_strides[0] + hk * k_strides[1]
        v_head = b * v_strides[0] + hk * v_strides[1]
        ks_head = b * ks_strides[0] + hk * ks_strides[1]
        vs_head = b * vs_strides[0] + hk * vs_strides[1]
        for c0 in range(j_start, j_stop, chunk):
            n_c = min(chunk, j_stop - c0)
            # The softmax and the masks run over the chunk's keys in whole vectors, not the
            # whole chunk: a cache shorter than a chunk (or a split's last chunk) leaves most
            # of it unused (Nk=64, one thread: 20 % of the step went to the unused scores).
            # The same bits: the columns between are -inf, their exponentials 0.
            width = min(chunk, -(-n_c // lanes) * lanes)
            k_chunk = k_head + c0 // KEY_BLOCK * k_block
            # The chunk's first keys whose hints (AHEAD * CHUNK keys on) land on keys. In a
            # KVCache's blocks past the filled ones there is nothing to read, and K's blocks
            # and V's rows whose hints would land there give none (MHA, Nk=256: every hint
            # did, and a step took 1.4-1.6x the time of one without them, 12 layers in turn);
            # past a plain array's head lies the next head's K/V.
            n_hinted = min(n_c, n_k - AHEAD * CHUNK - c0) if blocked else n_c
            if keys_unit:
                if prefetch & HINT_K and not blocked:
                    for c1 in range(c0, c0 + n_c, CHUNK):
                        hint_next_block(kf, k_head, k_strides[3], d, c1, j_start, j_stop)
                transposed_scores(s, chunk, q_s, rows, d, kf, k_chunk, k_strides[3], k_block,
                                  k_panel, n_c, AHEAD * CHUNK // KEY_BLOCK * k_block
                                  if prefetch & HINT_K else 0, n_hinted)
            else:
                chunk_scores(s, chunk, q_s, rows, d, d_vec, kf, k_chunk, k_strides[2], n_c,
                             k_buf)
            for r in range(rows):
                row = r * chunk
                if quantized:
                    scale_scores(s, row, k_scale, ks_head + c0 * ks_strides[2],
                                 ks_strides[2], n_c)
                i = r % n_q
                h = hk * group + r // n_q
                if modify:
                    modify_row(s, row, width, i + kv_len - n_q, c0, softcap2,
                               slopes2[b, h], no_t, False)
                if mask_given:
                    # (its row max unused: l_tile is scratch)
                    apply_user_mask(s, row, chunk, 1, mask_bools, mask_adds, mask_is_bool, b,
                                    h, i, c0, n_c, LOG2_E, l_tile)
                # Masked after the modifiers, as the tiled kernel; a chunk inside the row's
                # band (the common case) needs only its tail past n_c.
                if first_r[r] <= c0 and c0 + n_c - 1 <= last_r[r]:
                    for jj in range(n_c, width):
                        s[row + jj] = -np.inf
                else:
                    for jj in range(width):
                        if not (jj < n_c and first_r[r] <= c0 + jj <= last_r[r]):
                            s[row + jj] = -np.inf
            online_softmax(s, 0, chunk, width, rows, rows, m_i, l_tile, alpha_i, l_tile, False,
                           False, False)  # scores in base 2
            for r in range(rows):
                row = r * chunk
                l_i[r] = alpha_i[r] * l_i[r] + l_tile[r]
                if drop_below > 0:
                    dropout_row(s, row, width, seed,
                                (b * n_hq + hk * group + r // n_q) * n_q + r % n_q, c0,
                                drop_below, inv_keep)
                if quantized:  # P @ (V_int8 * v_scale) as (P * v_scale) @ V_int8
                    scale_scores(s, row, v_scale, vs_head + c0 * vs_strides[2],
                                 vs_strides[2], n_c)
            skip = max(0, j_first - c0)  # keys before the band: first chunk only
            if tiled:
                if v_by_rows:  # the chunk in one product, or two: its keys hinted, the rest
                    v_off = v_head + (c0 + skip) * v_strides[2]
                    n_ahead = max(0, n_hinted - skip) if prefetch & HINT_V else 0  # hinted
                    if n_ahead > 0:
                        tile_product_ahead(pv, 0, ld, s, skip, chunk, 1, vf, v_off,
                                           v_strides[2], 1, rows, dv, n_ahead,
                                           AHEAD * CHUNK * v_strides[2])
                    if n_ahead < n_c - skip:  # the same sums in the same order
                        tile_product(pv, 0, ld, s, skip + n_ahead, chunk, 1, vf,
                                     v_off + n_ahead * v_strides[2], v_strides[2], 1, rows, dv,
                                     n_c - skip - n_ahead, n_ahead > 0, False)
                else:  # KVCache's blocks of panels (never hinted: ``hinted``): a product per
                    # block, summed into pv after the first (the same sums in the same order)
                    j0 = c0 + skip
                    while j0 < c0 + n_c:
                        j1 = min(c0 + n_c, (j0 // KEY_BLOCK + 1) * KEY_BLOCK)
                        block_at = v_head + j0 // KEY_BLOCK * v_block
                        tile_product(pv, 0, ld, s, j0 - c0, chunk, 1, vf,
                                     block_at + j0 % KEY_BLOCK * v_strides[2], v_strides[2],
                                     v_panel, rows, dv, j1 - j0, j0 > c0 + skip, False)
                        j0 = j1
                rescale_add(acc, pv, ld, rows, alpha_i, False)
            else:
                for r in range(rows):
                    for c in range(dv):
                        acc[r * ld + c] *= alpha_i[r]
                    for jj in range(skip, n_c):
                        j = c0 + jj
                        axpy_row(acc, r * ld, s[r * chunk + jj], vf, v_head + j // KEY_BLOCK
                                 * v_block + j % KEY_BLOCK * v_strides[2], dv, dv_vec)
        for g in range(group):
            for i in range(n_q):
                r = g * n_q + i
                h = hk * group + g
                m_part[split, b, h, i] = m_i[r]
                l_part[split, b, h, i] = l_i[r]
                for c in range(dv):
                    acc_part[split, b, h, i, c] = acc[r * ld + c]
    n_rows = n_b * n_hq * n_q
    if serial_merge and sinks.shape[1] == 0:
        # small merges: waking the pool would cost more than the work. Without sinks, merged
        # with the constant -inf for them, which the compiler folds away: read from ``sinks``,
        # the plain step at Nk=64 took 0.3 us (2 %) longer than before sinks.
        for row in range(n_rows):
            b, h, i = unravel(row, n_hq, n_q)
            combine_row(m_part, l_part, acc_part, -np.inf, out, lse, b, h, i)
    elif serial_merge:
        for row in range(n_rows):
            b, h, i = unravel(row, n_hq, n_q)
            combine_row(m_part, l_part, acc_part, sink_of(sinks, b, h), out, lse, b, h, i)
    else:
        for row in prange(n_rows):
            b, h, i = unravel(row, n_hq, n_q)
            combine_row(m_part, l_part, acc_part, sink_of(sinks, b, h), out, lse, b, h, i)


def merges_serially(n_splits, out_size):
    """Whether the decode kernel merges its splits on one thread: where the partial outputs
    (``n_splits`` times the output's ``out_size`` elements) are few (``SERIAL_COMBINE``)."""
    return n_splits * out_size <= SERIAL_COMBINE


def element_strides(x, unit_axes=(3,)):
    """The 4 strides of the 4-D ``x`` in elements, as the decode kernel reads it from its first
    element (``span_of``); None unless one of ``unit_axes`` is unit-stride (or of length 1; the
    first such one is reported as stride 1) and the other strides are non-negative whole
    elements. Plain Python on the strides' tuple: no numpy call (see ``run_decode``)."""
    item = x.itemsize
    st = x.strides
    for unit_axis in unit_axes:
        if st[unit_axis] == item or x.shape[unit_axis] <= 1:
            break
    else:
        return None
    if min(st) < 0 or (st[0] | st[1] | st[2] | st[3]) % item:  # itemsize: a power of two
        return None
    steps = (st[0] // item, st[1] // item, st[2] // item, st[3] // item)
    if x.shape[unit_axis] <= 1:
        steps = steps[:unit_axis] + (1,) + steps[unit_axis + 1:]
    return steps


@functools.lru_cache(maxsize=4)
def _no_scales(dtype):
    """The int8 scales' stand-in for float K/V: an empty 4-D array and strides."""
    return np.empty((0, 0, 0, 1), dtype=dtype), (0, 0, 0)


def _scales_4d(x):
    """An int8 cache's scales (B, Hkv, Nk) as the kernel reads them: (B, Hkv, Nk, 1) and their
    strides in elements over (b, h, j); copied first only where they are not whole-element
    non-negative strides."""
    x4 = x[..., None]
    steps = element_strides(x4)
    if steps is None:
        x4 = np.ascontiguousarray(x)[..., None]
        steps = element_strides(x4)
    return x4, steps[:3]


def _storage_view(x):
    """``x`` as the kernels read it: float16 as its uint16 bits (Numba has no float16)."""
    return x.view(np.uint16) if x.dtype == np.float16 else x


def key_panel_width(dtype):
    """Keys per panel of KVCache's K for compute ``dtype``: the micro-kernel's width
    (``config.panel_width``: 16 float32 on AVX2, 64 on AVX-512), at most KEY_BLOCK."""
    return min(KEY_BLOCK, config.panel_width(np.dtype(dtype)))


def value_panel_width(dtype, dv):
    """Columns per panel of KVCache's V for compute ``dtype`` and head dim ``dv``: the
    micro-kernel's width where it divides ``dv``, else ``dv`` (rows)."""
    width = config.panel_width(np.dtype(dtype))
    return width if dv % width == 0 else dv


def block_layout(k_blocks, v_blocks, dtype):
    """KVCache's K and V in blocks of KEY_BLOCK keys, as the decode kernel reads them: K (B,
    Hkv, blocks, KEY_BLOCK // w, D, w), each block its keys' K^T in panels of ``w`` keys; V (B,
    Hkv, blocks, Dv // u, KEY_BLOCK, u), each block its values in panels of ``u`` columns (the
    last three axes of each contiguous). Returns ``(k, k_strides, k_block, k_panel, v,
    v_strides, v_block, v_panel)``, ``k`` and ``v`` 4-D views (B, Hkv, blocks, block) in their
    storage type (see ``decode``); or None where the panels are not of a width that this
    host's micro-kernel reads for compute ``dtype`` (a cache made under another
    ``CPUFLASH_SIMD`` or on another machine): the caller then copies K and V out instead."""
    k, v = _storage_view(k_blocks), _storage_view(v_blocks)
    n_b, n_hkv, n_blocks, n_panels, d, w = k.shape
    u = v.shape[5]
    if w not in (KEY_BLOCK, key_panel_width(dtype)) or (
            v.shape[3] > 1 and u != config.panel_width(np.dtype(dtype))):
        return None
    k_item, v_item = k.itemsize, v.itemsize
    return (k.reshape(n_b, n_hkv, n_blocks, KEY_BLOCK * d),
            (k.strides[0] // k_item, k.strides[1] // k_item, 1, w), k.strides[2] // k_item,
            d if n_panels > 1 else 1,
            v.reshape(n_b, n_hkv, n_blocks, -1),
            (v.strides[0] // v_item, v.strides[1] // v_item, u, 1), v.strides[2] // v_item,
            KEY_BLOCK if v.shape[3] > 1 else 1)


class Blocks(NamedTuple):
    """One layer of KVCache's storage as the decode path takes it: its K and V blocks and the
    kernel's view of them, made once (``block_layout`` for the cache's compute dtype; None
    where this host's micro-kernel does not read their panels): 6.5 us a call, 5 % of a hot
    step at Nk = 4096, where a step otherwise runs no numpy call on the blocks."""
    k: np.ndarray
    v: np.ndarray
    layout: tuple


def layer_blocks(k_blocks, v_blocks, dtype):
    """``Blocks`` of one layer's K and V blocks for compute ``dtype``."""
    return Blocks(k_blocks, v_blocks, block_layout(k_blocks, v_blocks, dtype))


def arrays_of_blocks(blocks, n_k):
    """The first ``n_k`` keys and values of a layer's ``Blocks`` as (B, Hkv, n_k, D) and (B,
    Hkv, n_k, Dv) arrays (``keys_of_blocks``, ``values_of_blocks``); a bfloat16 cache's (int16
    bits) as float32 copies, exact (numpy has no bfloat16)."""
    k, v = keys_of_blocks(blocks.k, n_k), values_of_blocks(blocks.v, n_k)
    if k.dtype == bfloat16.BITS:
        k, v = bfloat16.to_float32(k), bfloat16.to_float32(v)
    return k, v


def keys_of_blocks(k_blocks, n_k):
    """The first ``n_k`` keys of K in KVCache's blocks (B, Hkv, blocks, panels, D, w) as a (B,
    Hkv, n_k, D) array (a copy)."""
    n_b, n_hkv, n_blocks, _, d, _ = k_blocks.shape
    n_blocks = -(-n_k // KEY_BLOCK)
    keys = np.empty((n_b, n_hkv, n_blocks, k_blocks.shape[3], k_blocks.shape[5], d),
                    k_blocks.dtype)
    keys[...] = k_blocks[:, :, :n_blocks].transpose(0, 1, 2, 3, 5, 4)
    return keys.reshape(n_b, n_hkv, n_blocks * KEY_BLOCK, d)[:, :, :n_k]


def values_of_blocks(v_blocks, n_k):
    """The first ``n_k`` values of V in KVCache's blocks (B, Hkv, blocks, panels, KEY_BLOCK,
    u) as a (B, Hkv, n_k, Dv) array (a view where V's panels are whole rows, else a copy)."""
    n_b, n_hkv, n_blocks, n_panels, _, u = v_blocks.shape
    n_blocks = -(-n_k // KEY_BLOCK)
    if n_panels == 1:
        return v_blocks.reshape(n_b, n_hkv, -1, u)[:, :, :n_k]
    values = np.empty((n_b, n_hkv, n_blocks, KEY_BLOCK, n_panels, u), v_blocks.dtype)
    values[...] = v_blocks[:, :, :n_blocks].transpose(0, 1, 2, 4, 3, 5)
    return values.reshape(n_b, n_hkv, n_blocks * KEY_BLOCK, n_panels * u)[:, :, :n_k]


def run_decode(q, k, v, scale, band, mods, user_mask, drop, out=None, kv_scales=None,
               lse=None, kv_blocks=None, sinks=None):
    """The decode path for 4-D arrays, or None where it does not apply (``Nq`` large, or K or V
    rows not unit-stride): the caller then takes the tiled path. ``q`` is in the compute dtype;
    ``k``, ``v`` in it too, or a float16 cache (float32 compute), or int8 with ``kv_scales =
    (k_scale, v_scale)`` of shape (B, Hkv, Nk), read in place either way. ``band``: the
    ``(left, right, kv_lens)`` of masking.py. ``out``, ``lse``: written in place if given.
    ``kv_blocks``: a layer of KVCache's ``Blocks``, read in their place where this host reads
    their panels (else None is returned); ``k`` and ``v`` then give only their shapes and
    dtypes. ``sinks``: float64 (B or 1, Hq) sink logits merged into the rows, or None.
    Returns ``(out, lse)``."""
    args = decode_args(q, k, v, scale, band, mods, user_mask, drop, out, kv_scales, lse,
                       kv_blocks, sinks)
    if args is None:
        return None
    decode(*args)
    return args[ARG["out"]], args[ARG["lse"]]


def decode_args(q, k, v, scale, band, mods, user_mask, drop, out=None, kv_scales=None,
                lse=None, kv_blocks=None, sinks=None):
    """The decode kernel's argument list for ``run_decode``'s call, or None where the decode
    path does not apply.

    This Python runs right after the previous step's kernel has streamed K/V through the
    caches, where each numpy call costs several microseconds: it stays short."""
    n_b, n_hq, n_q, d = q.shape
    n_hkv, n_k, dv = v.shape[1], v.shape[2], v.shape[3]
    if n_q > MAX_NQ or n_k == 0 or q.size == 0 or v.size == 0:
        return None
    left, right, kv_lens = band
    softcap2, slopes2 = mods[0] * LOG2_E, mods[1] * LOG2_E
    if kv_blocks is not None:
        if kv_blocks.layout is None:
            return None
        k_store, k_steps, k_block, k_panel, v_store, v_steps, v_block, v_panel = \
            kv_blocks.layout
    else:  # K with unit-stride rows, or transposed (unit-stride keys); V by rows
        k_store, v_store = _storage_view(k), _storage_view(v)
        k_steps = element_strides(k_store, unit_axes=(3, 2))
        v_steps = element_strides(v_store)
        if k_steps is None or v_steps is None:
            return None
        k_block, k_panel = KEY_BLOCK * k_steps[2], 1
        v_block, v_panel = KEY_BLOCK * v_steps[2], 1
    dtype = q.dtype
    if kv_scales is None:
        (k_scale, ks_strides), (v_scale, vs_strides) = (_no_scales(dtype),) * 2
    else:  # read in place, as K and V (a trailing unit axis stands in for the head dim)
        (k_scale, ks_strides), (v_scale, vs_strides) = (_scales_4d(x) for x in kv_scales)
    n_splits = split_count(n_b, n_hkv, n_k)
    chunk = chunk_keys(n_hq // n_hkv * n_q, dtype.itemsize)
    if out is None:
        out = np.empty((n_b, n_hq, n_q, dv), dtype=dtype)
    if lse is None:
        lse = np.empty((n_b, n_hq, n_q), dtype=dtype)
    k_storage = k.dtype != dtype
    prefetch = hinted(k_storage, k_steps[3] != 1, k_block != KEY_BLOCK * k_steps[2],
                      k_panel != 1)
    return [q, k_store, k_steps, k_block, k_panel, k_storage, prefetch, v_store, v_steps,
            v_block, v_panel, k_scale, ks_strides, v_scale, vs_strides, n_hkv, n_k, d, dv,
            n_splits, chunk, scale * LOG2_E, left, right, kv_lens, softcap2, slopes2,
            *user_mask.kernel_args(), user_mask.given, drop[0], drop[2], drop[1],
            NO_SINKS if sinks is None else sinks, out, lse, merges_serially(n_splits, out.size)]


# The decode kernel's arguments by name: their places in ``decode_args``' list.
ARG = {name: i for i, name in enumerate(inspect.signature(decode.py_func).parameters)}
# Those that ``StepPlan.run`` makes anew for each step, and their places.
PER_STEP = ("q", "n_k", "n_splits", "kv_lens", "out", "serial_merge")
PER_STEP_AT = tuple(ARG[name] for name in PER_STEP)
K_SCALE_AT, V_SCALE_AT = ARG["k_scale_4"], ARG["v_scale_4"]
LSE_AT, SINKS_AT = ARG["lse"], ARG["sinks"]
# The decode kernel's ``sinks`` where a call has none.
NO_SINKS = np.empty((0, 0), dtype=np.float64)


class StepPlan:
    """Decode steps of one KVCache layer for queries of one shape and dtype, one ``causal``
    and one ``scale``: the kernel's argument list of one such step (``decode_args``), kept,
    with what changes from step to step made anew by ``run`` (``PER_STEP``: the queries, the
    number of keys and what follows from it, and the output; and an int8 cache's scales over
    that length) the way ``decode_args`` makes it. The same kernel on the same arguments as
    the plain path: the same bits. The log-sum-exp goes to one array the plan keeps (two
    threads' steps of one plan at once both write it; nothing reads it), or, for a step that
    returns it (``run(..., with_lse=True)``), to one of its own. A step with sinks passes
    them for that step alone (``run(..., sinks=...)``).

    Why: a step from DRAM runs right after the previous layer's kernel has swept every cache,
    and there the Python of the plain decode path (``api._plain_decode``: checks, stand-ins,
    the band, modifiers and mask objects, the layout) took 40-90 us of a 1.3-1.7 ms step
    (Hkv=2, Nk=32768, float32; time stamps from the cycle counter, stop 49). Hot, at Nk=64,
    ``KVCache.attention`` took 36 us against the kernel's 15-19. With plans (against stop 48's
    code, alternating rounds): Nk=64 hot 1.31-1.39x as fast, GPT-2 small's shapes (Nk=1024,
    Hkv=12) 1.14-1.15x, from DRAM 1.02-1.03x; the planned step within 0.4 % of the kernel
    called alone."""

    __slots__ = ("args", "n_b", "n_hkv", "out_shape", "dtype", "scales")

    def __init__(self, args, scales=None):
        """``args``: a step's ``decode_args``; ``scales``: an int8 cache's ``(k_scale,
        v_scale)`` of the layer over all its ``max_len`` tokens, (B, Hkv, max_len) each (the
        step reads its first ``n_k``), else None."""
        q = args[ARG["q"]]
        self.n_b, self.n_hkv = q.shape[0], args[ARG["n_hkv"]]
        self.out_shape = args[ARG["out"]].shape
        self.dtype = q.dtype
        self.args = list(args)
        for at in PER_STEP_AT + ((K_SCALE_AT, V_SCALE_AT) if scales is not None else ()):
            self.args[at] = None  # not kept: the step's output, for one, is the caller's
        self.scales = scales

    def run(self, q, n_k, with_lse=False, sinks=None):
        """The step's output for ``q`` (of the plan's shape and dtype) over the layer's first
        ``n_k`` keys (``n_k >= 1``); ``with_lse``: ``(out, lse)``, the log-sum-exp in an array
        of the step's own. ``sinks``: the step's sink logits, float64 (B or 1, Hq), checked
        (``sinks.check``), or None."""
        n_splits = split_count(self.n_b, self.n_hkv, n_k)
        out = np.empty(self.out_shape, dtype=self.dtype)
        args = self.args.copy()
        if with_lse:
            args[LSE_AT] = lse = np.empty(self.out_shape[:3], dtype=self.dtype)
        for at, value in zip(PER_STEP_AT, (q, n_k, n_splits, key_lengths(None, self.n_b, n_k),
                                           out, merges_serially(n_splits, out.size))):
            args[at] = value
        if sinks is not None:
            args[SINKS_AT] = sinks
        if self.scales is not None:
            args[K_SCALE_AT] = _scales_4d(self.scales[0][:, :, :n_k])[0]
            args[V_SCALE_AT] = _scales_4d(self.scales[1][:, :, :n_k])[0]
        decode.call_built(args)
        return (out, lse) if with_lse else out
