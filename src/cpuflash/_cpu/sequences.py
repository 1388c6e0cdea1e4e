"""The sequences a forward kernel call covers, as one int64 table with a row per sequence.

A dense call is ``B`` sequences of ``Nq`` queries each; a varlen call (``cpuflash.varlen``) is
the packed sequences, each with its own length, in one kernel call: its tasks run over
(sequence, head, query block), so many short sentences keep every thread busy without a call
per sentence. Each row says where a sequence's queries, outputs and packed K/V tiles are:

* ``Q_BATCH``, ``Q_ROW0``, ``N_Q``: its queries are rows ``Q_ROW0 .. Q_ROW0 + N_Q`` of batch
  ``Q_BATCH`` of the kernel's ``q`` (and of ``out``, ``lse``); a dense call's batch ``b`` is
  ``(b, 0, Nq)``, a varlen call's ``q`` is ``(1, Hq, total_q, D)``.
* ``BLOCK_Q``, ``N_QB``: its query block (a multiple of the micro-tile rows, at most the call's
  ``block_q``) and how many blocks cover ``N_Q``.
* ``TILE0``, ``TILES``: its K/V tiles for key head ``hk`` are ``TILE0 + hk * TILES + kb`` in
  the packed tile lists.
* ``TASK0``: its first task; it owns tasks ``TASK0 .. TASK0 + Hq * N_QB`` (head-major).
"""
import functools

import numpy as np

from .. import config
from ._jit import helper

Q_BATCH, Q_ROW0, N_Q, BLOCK_Q, N_QB, TILE0, TILES, TASK0 = range(8)
COLUMNS = 8


def _with_tasks(table, n_hq):
    """Fill ``TASK0`` from the blocks per sequence; returns ``(table, number of tasks)``."""
    tasks = n_hq * table[:, N_QB]
    table[:, TASK0] = np.cumsum(tasks) - tasks
    return table, int(tasks.sum())


@functools.lru_cache(maxsize=64)
def dense(n_b, n_hq, n_q, block_q, n_hkv, n_tiles):
    """``(table, tasks)`` for ``B`` sequences of ``n_q`` queries, K/V tiles as ``pack``'s
    ``(B * Hkv, n_tiles, ...)``; read-only, and kept per shape (building it took 15 us, a
    tenth of a small call's 145 us at B=1, H=8, N=64)."""
    table = np.empty((n_b, COLUMNS), dtype=np.int64)
    table[:, Q_BATCH] = np.arange(n_b)
    table[:, Q_ROW0] = 0
    table[:, N_Q] = n_q
    table[:, BLOCK_Q] = block_q
    table[:, N_QB] = -(-n_q // block_q)
    table[:, TILE0] = np.arange(n_b) * (n_hkv * n_tiles)
    table[:, TILES] = n_tiles
    table, n_tasks = _with_tasks(table, n_hq)
    table.flags.writeable = False
    return table, n_tasks


def fitted_block(n_q, block_q, rows_quantum):
    """The query block for one sequence of ``n_q`` rows: as many blocks as ``block_q`` needs,
    each as small as whole micro-tiles allow (a 70-token sentence as two blocks of 36 rows,
    not 64 + 64 rows of which 58 are padding)."""
    n_qb = max(1, -(-n_q // block_q))
    rows = max(1, -(-n_q // n_qb))
    return -(-rows // rows_quantum) * rows_quantum


@helper
def computed_rows(rows, block):
    """The rows a query block of ``block`` rows computes for its ``rows`` real ones, forward and
    backward: whole micro-tiles (``MICRO_ROWS``), not the block's padding past them. A dense
    sequence's last block may hold few rows (N=65 in blocks of 64: one, which until stop 62
    computed 64, and a head took 2.5 times N=64's time); a varlen sequence's blocks are fitted
    to it (``fitted_block``), so its padding is less than a micro-tile a block anyway."""
    return min(block, -(-rows // config.MICRO_ROWS) * config.MICRO_ROWS)


def varlen(q_starts, q_lens, k_lens, n_hq, n_hkv, block_q, block_k, rows_quantum):
    """``(table, tasks, tiles)`` for packed sequences: ``q_starts``/``q_lens`` their query rows,
    ``k_lens`` their keys (int64 arrays), each sequence's K/V tiles after the previous one's
    (``tiles`` in all)."""
    n_seq = len(q_lens)
    table = np.empty((n_seq, COLUMNS), dtype=np.int64)
    table[:, Q_BATCH] = 0
    table[:, Q_ROW0] = q_starts
    table[:, N_Q] = q_lens
    blocks = np.array([fitted_block(int(n), block_q, rows_quantum) for n in q_lens],
                      dtype=np.int64).reshape(n_seq)
    table[:, BLOCK_Q] = blocks
    table[:, N_QB] = -(-q_lens // blocks)
    tiles = -(-k_lens // block_k)
    per_seq = n_hkv * tiles
    table[:, TILE0] = np.cumsum(per_seq) - per_seq
    table[:, TILES] = tiles
    table, n_tasks = _with_tasks(table, n_hq)
    return table, n_tasks, int(per_seq.sum())


@helper
def owner(table, column, value):
    """The last row of ``table`` whose ``column`` is at most ``value`` (binary search over a
    non-decreasing column): the sequence that owns task or tile ``value``, sequences with none
    sharing their successor's first index and so skipped."""
    lo, hi = 0, table.shape[0] - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if table[mid, column] <= value:
            lo = mid
        else:
            hi = mid - 1
    return lo


@helper
def find_task(table, n_hq, task):
    """``(sequence, head, block)`` of kernel task ``task``."""
    s = owner(table, TASK0, np.int64(task))
    h, qb = divmod(np.int64(task) - table[s, TASK0], table[s, N_QB])
    return s, h, qb
