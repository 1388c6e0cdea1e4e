"""Backward pass by recomputation: tasks over (batch*kv-head, key chunk); no atomic sums.

Saved from the forward pass: ``out`` and ``lse`` only. With ``delta_i = rowsum(dO_i * O_i)``,
for each key tile of a task's chunk, and each query block of each query head of its GQA group:

    S   = Q @ K_tile^T                 # Q pre-multiplied by scale, as in the forward pass
    P   = 2^((S - lse_i) * log2(e))    # the forward's probabilities, regenerated
    dP  = dO @ V_tile^T
    dS  = P * (dP - delta_i)
    dV_tile += P^T @ dO                # owned by this task: written once, at the tile's end
    dK_tile += dS^T @ Q                # Q carries the scale
    dQ[chunk] += dS @ K_tile           # one partial per key chunk, summed in chunk order

A task owns its key tiles' dK/dV outright. Its dQ contributions go to a partial buffer of its
chunk; the partials are summed afterwards in chunk order. The chunking is a function of the
shapes only, so the result is bitwise the same for any thread count. Five tile products per
tile, the same micro-kernels and exp2 as the forward pass; never built in full: any (Nq, Nk)
matrix. Memory: packed K/V (three O(Nk) copies) and ``n_chunks`` dQ partials.
"""
import functools

import numpy as np
from numba import prange

from .. import config
from . import simd
from ._jit import kernel, portable_twin
from .sequences import computed_rows
from .tasks import new_claims, next_task, run_shared, unravel
from .masking import (HIDDEN, MIXED, apply_user_mask, band_runs, fill, mask_tile,
                      tile_key_range, tile_needs_mask)
from .dropout import dropout_row
from .scores import modifies, modify_row, tanh_grad_row
from .pack import (pack_tiles, packed_rows, packed_transposed, reusable, scratch,
                   workspace)
from .tiles import (exp_shifted, softmax_grad_row, tile_product_add, tile_product_kahan,
                    tile_product_softmax_grad, tile_product_store)

PORTABLE = False  # True in ``backward_portable``: a compile-time constant (_jit.portable_twin)
TASKS_WANTED = 4  # key chunks per (batch, kv head) are added until there are this many tasks


@kernel(strided=("mask_bools", "mask_adds", "tile_state"), read_only=("kv_lens", "slopes"))
def backward(qp, dout, lse_p, delta, kt, vtt, kn, block_q, d_pad, dv_pad,
             left, right, kv_lens, softcap, slopes, mask_bools, mask_adds, mask_is_bool,
             tile_state, drop_below, inv_keep, seed, chunk_starts, dq_part, dk, dv, scale, dq,
             n_threads):
    """qp: (B, Hq, n_qb * block_q, d_pad) Q times ``scale``, zero-padded, contiguous.
    dout: (B, Hq, Nq, Dv), contiguous. left, right, kv_lens: the band (masking.py).
    softcap, slopes (B, Hq): score modifiers, 0 for off (scores.py).
    mask_bools, mask_adds, mask_is_bool, tile_state: the caller's mask and its tile table
    (masks.UserMask).
    drop_below, inv_keep, seed: dropout (``masks.dropout``), the forward's; ``drop_below = 0``
    for none.
    lse_p: (B, Hq, Nq) the forward's lse, ``+inf`` for rows that see no key (so their P is 0).
    delta: (B, Hq, Nq).
    kt, vtt: K and V tiles transposed, kn: K tiles as rows (pack.py). chunk_starts: key-tile
    boundaries of the chunks. dq_part: (n_chunks, B, Hq, n_qb * block_q, d_pad), scratch (each
    task zeroes its part).
    dk: (B, Hkv, Nk, D), dv: (B, Hkv, Nk, Dv), contiguous: written, in units of the result.
    dq: (B, Hq, Nq, D), written here as ``scale * dq_part`` when there is one chunk (each task
    then holds its heads' whole dQ), else left to ``finish_dq``.
    n_threads: the workers that share the tasks out (``tasks.next_task``), one a thread.
    """
    n_b, n_hq, n_q, n_dv = dout.shape
    d = dk.shape[3]
    n_hkv = kt.shape[0] // n_b
    group = n_hq // n_hkv
    n_chunks = chunk_starts.size - 1
    n_kb = kt.shape[1]
    block_k = kt.shape[2] // d
    n_qb = (n_q + block_q - 1) // block_q
    kt_flat, vtt_flat, kn_flat = kt.reshape(-1), vtt.reshape(-1), kn.reshape(-1)
    dq_flat = dq_part.reshape(-1)
    rows_padded = n_qb * block_q
    # Full dO blocks are read in place when rows are whole vectors; others are copied.
    # Wherever dO starts: off a cache line (pack.ALIGN_BYTES) its rows, the B of dV = P^T dO,
    # cost two lines a vector, but copying it costs more (stop 31, backward at N=2048: a
    # copy of each block into do_s 75.6-83.4 ms, read in place 73.6-78.3 ms, one aligned copy
    # of all of dO first 71.5-73.7 ms, but that is O(N) memory: 16 MiB at N=65536).
    direct = n_dv == dv_pad
    qp_flat, do_flat = qp.reshape(-1), dout.reshape(-1)
    rows_q = qp.shape[2]
    modify = modifies(softcap, slopes)
    ld_s = block_k + simd.lanes_of(dk)  # score rows a vector longer: see forward.py
    width = config.MICRO_VECS * simd.lanes_of(dk)  # a key panel (masking.band_runs)
    n_k_all = mask_bools.shape[3]
    n_k_arr = dk.shape[2]
    n_tasks = n_b * n_hkv * n_chunks
    n_workers = min(n_threads, n_tasks)
    claims = new_claims(n_workers)
    for worker in prange(n_workers):  # one a thread: they share the tasks out (tasks.py)
        for _ in range(n_tasks):
            task = next_task(claims, worker, n_workers, n_tasks)
            if task < 0:
                break
            b, hk, chunk = unravel(task, n_hkv, n_chunks)
            n_k = kv_lens[b]
            part_rows = group * rows_padded * d_pad  # this task's dQ partial: its heads' rows
            part0 = ((chunk * n_b + b) * n_hq + hk * group) * rows_padded * d_pad
            dq_flat[part0:part0 + part_rows] = 0.0
            do_s = scratch(block_q * dv_pad, dk)  # dO block, when copied
            do_s[:] = 0.0
            s = scratch(block_q * ld_s, dk)  # S, then P
            ds = scratch(block_q * ld_s, dk)  # dP, then dS
            t_cap = scratch(block_q * ld_s if softcap != 0.0 else 0, dk)  # tanh
            t_cap[:] = 0.0
            dk_acc = scratch(block_k * d_pad, dk)
            dv_acc = scratch(block_k * dv_pad, dk)
            dk_comp = scratch(block_k * d_pad, dk)  # Kahan compensation terms
            dv_comp = scratch(block_k * dv_pad, dk)
            # The portable kernels form each product here before adding it (the SIMD ones finish
            # each product in registers: see tiles._product_with_epilogue).
            n_part = 1 if PORTABLE else 0
            dk_part = scratch(n_part * block_k * d_pad, dk)
            dv_part = scratch(n_part * block_k * dv_pad, dk)
            dq_tile = scratch(n_part * block_q * d_pad, dk)
            dp_tile = scratch(n_part * block_q * block_k, dk)  # S, dP
            lse_r = np.empty(block_q, dtype=dk.dtype)
            delta_r = np.empty(block_q, dtype=dk.dtype)
            max_unused = np.empty(block_q, dtype=dk.dtype)  # row maxima of the masking pass
            runs = np.empty((block_q // config.MICRO_ROWS + 1, 3), dtype=np.int64)  # band_runs
            for kb in range(chunk_starts[chunk], chunk_starts[chunk + 1]):
                k0 = kb * block_k
                n_valid = min(block_k, n_k - k0)  # keys past kv_len: gradient 0, V never read
                for j in range(max(n_valid, 0), min(block_k, n_k_arr - k0)):
                    dk[b, hk, k0 + j, :] = 0.0
                    dv[b, hk, k0 + j, :] = 0.0
                if n_valid <= 0:
                    continue
                tile = (b * n_hkv + hk) * n_kb + kb
                dk_acc[:] = 0.0
                dv_acc[:] = 0.0
                dk_comp[:] = 0.0
                dv_comp[:] = 0.0
                for h in range(hk * group, (hk + 1) * group):
                    for qb in range(n_qb):
                        q0 = qb * block_q
                        rows = min(block_q, n_q - q0)
                        rows_up = computed_rows(rows, block_q)  # as the forward pass's
                        kb_lo, kb_hi = tile_key_range(q0, q0 + rows, n_q, n_k, block_k, left,
                                                      right)
                        state = tile_state[b, h, qb, kb]
                        if kb < kb_lo or kb >= kb_hi or state == HIDDEN:
                            continue  # the block sees no key of this tile
                        row0 = (b * n_hq + h) * n_q + q0
                        for r in range(block_q):
                            if r < rows:
                                lse_r[r] = lse_p[b, h, q0 + r]
                                delta_r[r] = delta[b, h, q0 + r]
                            else:  # padding rows: P = 0 and dO = 0, so they add nothing
                                lse_r[r] = np.inf
                                delta_r[r] = 0.0
                        qa, qa_off = qp_flat, ((b * n_hq + h) * rows_q + q0) * d_pad
                        if direct and rows == block_q:
                            doa, doa_off = do_flat, row0 * n_dv
                        else:
                            do_s[:] = 0.0
                            for r in range(rows):
                                for c in range(n_dv):
                                    do_s[r * dv_pad + c] = dout[b, h, q0 + r, c]
                            doa, doa_off = do_s, 0
                        # The same product, on the same packed operands, as the forward pass: P
                        # comes out as the forward's probabilities, consistent with its lse
                        # (measured: scaling S here instead doubles the dQ error). On a tile
                        # that crosses a mask edge, each run of row blocks over only the key
                        # panels it may see (masking.band_runs, as the forward's band_scores):
                        # mask_tile sets the rest to -inf, so P is 0 there, and dP, dS and dQ
                        # skip them too.
                        banded = tile_needs_mask(q0, q0 + rows, k0, block_k, n_q, n_k, left,
                                                 right)
                        n_runs = band_runs(runs, rows_up, banded, rows, q0, k0, n_q, n_k, left,
                                           right, block_k, width)
                        for i in range(n_runs):
                            r0, r1, need = runs[i, 0], runs[i, 1], runs[i, 2]
                            if need > 0:
                                tile_product_store(s, r0 * ld_s, ld_s, qa, qa_off + r0 * d_pad,
                                                   d_pad, 1, kt_flat, tile * d * block_k, 0, d,
                                                   r1 - r0, need, d, s, 0, s, 0, dp_tile,
                                                   PORTABLE)
                            if modify:  # the skipped scores finite for the modifiers (tanh)
                                for r in range(r0, r1):
                                    fill(s, r * ld_s + need, r * ld_s + block_k, 0.0, PORTABLE)
                        if modify:
                            for r in range(rows):
                                modify_row(s, r * ld_s, block_k, q0 + r + n_k - n_q, k0,
                                           softcap, slopes[b, h], t_cap, PORTABLE)
                        if state == MIXED:
                            apply_user_mask(s, 0, ld_s, rows, mask_bools, mask_adds, mask_is_bool,
                                            b, h, q0, k0, min(block_k, n_k_all - k0), 1.0,
                                            max_unused)
                        if banded:
                            mask_tile(s, ld_s, rows, q0, k0, block_k, n_q, n_k, left, right,
                                      -np.inf, PORTABLE)
                        for i in range(n_runs):  # P = 0 past the panels computed
                            r0, r1, need = runs[i, 0], runs[i, 1], runs[i, 2]
                            for r in range(r0, r1):
                                exp_shifted(s, r * ld_s, need, lse_r[r], PORTABLE)
                                fill(s, r * ld_s + need, r * ld_s + block_k, 0.0, PORTABLE)
                        # Padding rows: P = 0 exactly, even where a NaN key made their score NaN.
                        s[rows * ld_s:rows_up * ld_s] = 0.0
                        # dP = dO V^T, then dS = P * (dP - delta) (dropout first drops dP's keys)
                        if drop_below > 0:
                            # By runs too (dS is 0 past them, where P is): with the S product's
                            # argument types, so that both calls share one compilation.
                            for i in range(n_runs):
                                r0, r1, need = runs[i, 0], runs[i, 1], runs[i, 2]
                                if need > 0:
                                    tile_product_store(ds, r0 * ld_s, ld_s, doa,
                                                       doa_off + r0 * dv_pad, dv_pad, 1,
                                                       vtt_flat, tile * n_dv * block_k, 0, n_dv,
                                                       r1 - r0, need, n_dv, ds, 0, ds, 0,
                                                       dp_tile, PORTABLE)
                            for r in range(rows):
                                dropout_row(ds, r * ld_s, block_k, seed,
                                            (b * n_hq + h) * n_q + q0 + r, k0, drop_below,
                                            inv_keep)
                            for r in range(rows_up):
                                softmax_grad_row(s, ds, r * ld_s, block_k, delta_r[r], PORTABLE)
                        else:  # dS = 0 where P = 0 past the panels computed
                            for i in range(n_runs):
                                r0, r1, need = runs[i, 0], runs[i, 1], runs[i, 2]
                                if need > 0:
                                    tile_product_softmax_grad(
                                        ds, r0 * ld_s, ld_s, doa, doa_off + r0 * dv_pad, dv_pad,
                                        1, vtt_flat, tile * n_dv * block_k, 0, n_dv, r1 - r0,
                                        need, n_dv, s, r0 * ld_s, delta_r, r0, dp_tile,
                                        PORTABLE)
                                for r in range(r0, r1):
                                    fill(ds, r * ld_s + need, r * ld_s + block_k, 0.0,
                                         PORTABLE)
                        if drop_below > 0:  # dV takes the dropped P
                            for r in range(rows):
                                dropout_row(s, r * ld_s, block_k, seed,
                                            (b * n_hq + h) * n_q + q0 + r, k0, drop_below,
                                            inv_keep)
                        if softcap != 0.0:  # back through the tanh to the raw scores
                            for r in range(rows):
                                tanh_grad_row(ds, t_cap, r * ld_s, block_k, PORTABLE)
                        # dV += P^T dO and dK += dS^T Q: P and dS read transposed (row stride 1).
                        # Each block's products are formed on their own, then added with
                        # compensation: one long running sum over every query row rounds more
                        # (measured at N=8192, causal: dV error 2.0e-6 that way; 2.2e-6 summing 4
                        # blocks before each compensated add; 1.2e-6 this way; torch 1.3e-6).
                        # Keys past every run's panels have P = dS = 0 in this block: their rows
                        # are left alone. (Under causal and right-bounded windows a block's rows
                        # see a key only if every later block's do, so with one query head a
                        # group those keys' sums are still 0 and the bits are the same; with
                        # several, a compensated add of 0 would have folded the compensation
                        # into the sum a block earlier than the next add does.) The sums run over
                        # the computed rows only: a short last block's padding rows gave terms
                        # P * dO = dS * Q = 0 * 0 at the end of one running sum started at +0,
                        # which never turns -0, so leaving them out changes no bit.
                        key_rows = 0
                        for i in range(n_runs):
                            key_rows = max(key_rows, runs[i, 2])
                        tile_product_kahan(dv_acc, 0, dv_pad, s, 0, 1, ld_s, doa, doa_off, dv_pad,
                                           1, key_rows, dv_pad, rows_up, dv_comp, 0, dv_comp, 0,
                                           dv_part, PORTABLE)
                        tile_product_kahan(dk_acc, 0, d_pad, ds, 0, 1, ld_s, qa, qa_off, d_pad, 1,
                                           key_rows, d_pad, rows_up, dk_comp, 0, dk_comp, 0,
                                           dk_part, PORTABLE)
                        dq_off = (((chunk * n_b + b) * n_hq + h) * rows_padded + q0) * d_pad
                        for i in range(n_runs):  # dS is 0 past a run's panels
                            r0, r1, need = runs[i, 0], runs[i, 1], runs[i, 2]
                            n_keys = min(n_valid, need)
                            if n_keys > 0:
                                tile_product_add(dq_flat, dq_off + r0 * d_pad, d_pad, ds,
                                                 r0 * ld_s, ld_s, 1, kn_flat,
                                                 tile * block_k * d_pad, 0, block_k, r1 - r0,
                                                 d_pad, n_keys, dq_flat, 0, dq_flat, 0, dq_tile,
                                                 PORTABLE)
                for j in range(n_valid):
                    for dd in range(d):
                        dk[b, hk, k0 + j, dd] = dk_acc[j * d_pad + dd]
                    for c in range(n_dv):
                        dv[b, hk, k0 + j, c] = dv_acc[j * dv_pad + c]
            if n_chunks == 1:  # as finish_dq does, without its own pass and parallel region
                for h in range(hk * group, (hk + 1) * group):
                    for i in range(n_q):
                        row = ((b * n_hq + h) * rows_padded + i) * d_pad
                        for dd in range(d):
                            dq[b, h, i, dd] = dq_flat[row + dd] * scale


backward_portable = portable_twin(backward)


@kernel(strided=("dout", "out", "lse", "q"))
def row_terms(dout, out, lse, q, factor, lse_p, delta, qp):
    """The per-row terms of the backward pass, (B, H, Nq) each, one pass over ``dout``/``out``,
    and Q scaled: ``qp[b, h, i, :D] = q[b, h, i, :] * factor`` (the product in
    float64, rounded once, as the forward kernel scales its Q blocks; qp's padding rows and
    columns stay as they are), in the same parallel region:

    * ``lse_p``: ``lse``, but ``+inf`` for a row that saw no key (``lse = -inf``: its
      P = e^(S - inf) = 0; see ``tiles.exp_shifted``).
    * ``delta = rowsum(dO * O)``, summed in float64: ``dS = P * (dP - delta)`` cancels where
      ``dP ~ delta``, so delta's rounding would show directly in the gradients.
    """
    n_b, n_h, n_q, n_dv = out.shape
    d = q.shape[3]
    for task in prange(n_b * n_h):
        b, h, _ = unravel(task, n_h, 1)
        for i in range(n_q):
            for dd in range(d):
                qp[b, h, i, dd] = q[b, h, i, dd] * factor
            x = lse[b, h, i]
            lse_p[b, h, i] = np.inf if x == -np.inf else x
            # four partial sums: four chains of float64 adds, not one, run side by side
            t0 = t1 = t2 = t3 = 0.0
            n_four = n_dv // 4 * 4
            for c in range(0, n_four, 4):
                t0 += np.float64(dout[b, h, i, c]) * np.float64(out[b, h, i, c])
                t1 += np.float64(dout[b, h, i, c + 1]) * np.float64(out[b, h, i, c + 1])
                t2 += np.float64(dout[b, h, i, c + 2]) * np.float64(out[b, h, i, c + 2])
                t3 += np.float64(dout[b, h, i, c + 3]) * np.float64(out[b, h, i, c + 3])
            for c in range(n_four, n_dv):
                t0 += np.float64(dout[b, h, i, c]) * np.float64(out[b, h, i, c])
            delta[b, h, i] = (t0 + t1) + (t2 + t3)


@functools.lru_cache(maxsize=256)
def _chunk_starts(n_q, n_k, block_k, left, right, n_bh_kv):
    starts = _balanced_chunk_starts(n_q, n_k, block_k, left, right, n_bh_kv)
    starts.flags.writeable = False
    return starts


def chunk_starts(n_q, n_k, block_k, left, right, n_bh_kv):
    """Key-tile boundaries of the chunks (a read-only int64 array), balanced by work; a
    function of the shapes only, so made once per shape."""
    return _chunk_starts(int(n_q), int(n_k), int(block_k), int(left), int(right),
                         int(n_bh_kv))


def _balanced_chunk_starts(n_q, n_k, block_k, left, right, n_bh_kv):
    n_kb = max(1, -(-n_k // block_k))
    n_chunks = min(n_kb, -(-TASKS_WANTED // max(1, n_bh_kv)))
    # work of tile kb ~ the query rows whose band [i + off - left, i + off + right] meets it
    k0 = np.arange(n_kb) * block_k
    off = n_k - n_q
    i_lo = np.clip(k0 - off - right, 0, n_q)
    i_hi = np.clip(k0 + block_k - 1 - off + left + 1, 0, n_q)
    work = i_hi - i_lo
    work = np.maximum(work, 1).astype(np.float64)
    cum = np.concatenate([[0.0], np.cumsum(work)])
    targets = cum[-1] * np.arange(1, n_chunks) / n_chunks
    inner = np.searchsorted(cum, targets)
    starts = np.unique(np.concatenate([[0], np.clip(inner, 1, n_kb - 1), [n_kb]]))
    return starts.astype(np.int64)


@kernel
def finish_dq(dq_part, scale, dq):
    """``dq = scale * sum_c dq_part[c]`` (the product in float64, rounded once), the chunks
    summed in their order (the same bits for any thread count), rows spread over the threads:
    one pass in place of numpy's ``+=`` per chunk and ``multiply``. (What made that step cost
    60-100 ms at N=8192, D=128 was faulting in a calloc'd dQ; ``run_backward`` now fills the
    gradients first, and this pass takes 2.7 ms there.)"""
    n_chunks = dq_part.shape[0]
    n_b, n_h, n_q, d = dq.shape
    for task in prange(n_b * n_h):
        b, h = task // n_h, task % n_h
        for i in range(n_q):
            for dd in range(d):
                total = dq_part[0, b, h, i, dd]
                for c in range(1, n_chunks):
                    total += dq_part[c, b, h, i, dd]
                dq[b, h, i, dd] = total * scale


def run_backward(dout, q, k, v, out, lse, scale, band, mods, user_mask, drop, portable):
    """Gradients for 4-D arrays of one compute dtype; returns contiguous (dq, dk, dv).
    ``band``: the ``(left, right, kv_lens)`` of masking.py; ``mods``: ``(softcap, slopes)``."""
    left, right, kv_lens = band
    n_b, n_hq, n_q, d = q.shape
    n_hkv, n_k, n_dv = v.shape[1], v.shape[2], v.shape[3]
    dtype = q.dtype
    # The kernels write every element of the gradients (zeros for keys past kv_lens). Fresh
    # ones are faulted in here, on one thread: pages first touched inside a kernel, by both
    # threads at once, cost more (see dq_part below; measured at N=8192, D=128: 60-100 ms for
    # a calloc'd dQ first written after the kernel, 5 ms filled here). Up to a few MiB they
    # are the previous call's if the caller let go of those (pack.reusable: no faults at all).
    grads = []
    for name, shape in (("dq", (n_b, n_hq, n_q, d)), ("dk", (n_b, n_hkv, n_k, d)),
                        ("dv", (n_b, n_hkv, n_k, n_dv))):
        grad, fresh = reusable(name, shape, dtype)  # very large: plain pages (pack.empty)
        if fresh:
            grad.fill(0.0)
        grads.append(grad)
    dq, dk, dv = grads
    if n_q == 0 or n_k == 0 or dq.size == 0 and dk.size == 0:
        for grad in grads:
            grad.fill(0.0)
        return dq, dk, dv
    block_k = config.backward_block_k(d, n_k)
    block_q = config.BLOCK_Q
    lanes, width = config.lanes(dtype), config.panel_width(dtype)
    d_pad = -(-d // lanes) * lanes
    dv_pad = -(-n_dv // lanes) * lanes
    n_kb = -(-n_k // block_k)
    if k.flags.c_contiguous and v.flags.c_contiguous and d == d_pad:  # one parallel region
        kt = workspace("keys", (n_b * n_hkv, n_kb, d * block_k), dtype)
        vtt = workspace("values_t", (n_b * n_hkv, n_kb, n_dv * block_k), dtype)
        kn = workspace("keys_rows", (n_b * n_hkv, n_kb, block_k * d_pad), dtype)
        pack_tiles(k, v, block_k, width, kt, vtt, kn, None)
    else:
        kt = packed_transposed(k, block_k, width, "keys")
        vtt = packed_transposed(v, block_k, width, "values_t")
        kn = packed_rows(k, block_k, lanes, width, "keys_rows", zero_nonfinite=True)
    starts = chunk_starts(n_q, n_k, block_k, left, right, n_b * n_hkv)
    n_qb = -(-n_q // block_q)
    # Scratch from the per-thread workspace: fresh pages would be faulted in by both threads
    # inside the kernel (measured at N=512, D=128: 1.8 ms of a 12 ms call). Each task zeroes
    # its own part of it, in cache for its first products.
    n_chunks = starts.size - 1
    dq_part = workspace("dq_part", (n_chunks, n_b, n_hq, n_qb * block_q, d_pad), dtype)
    # Q scaled exactly as the forward pass scales it (a float64 product rounded
    # once), in zero-padded rows: one O(N) copy that every key tile reads in place.
    qp = workspace("q_scaled", (n_b, n_hq, n_qb * block_q, d_pad), dtype)
    if n_q % block_q or d != d_pad:  # padding rows or columns: zero
        qp.fill(0.0)
    lse_p = np.empty(lse.shape, dtype=dtype)
    delta = np.empty(lse.shape, dtype=dtype)
    row_terms(dout, out, lse, q, scale, lse_p, delta, qp)
    dout = np.ascontiguousarray(dout)  # the kernel reads it flat (do_flat)
    run_shared(backward_portable if portable else backward, qp, dout, lse_p, delta, kt,
                vtt, kn, block_q, d_pad, dv_pad, left, right, kv_lens, mods[0], mods[1],
                *user_mask.kernel_args(), user_mask.tile_states(block_q, block_k), drop[0],
                drop[2], drop[1], starts, dq_part, dk, dv, scale, dq)
    if n_chunks > 1:  # else the kernel wrote dQ; here the partials are summed in chunk order
        finish_dq(dq_part, scale, dq)
    return dq, dk, dv
