"""Packed sequences of different lengths, as FlashAttention's varlen API.

``q`` is ``(total_q, Hq, D)``, ``k``/``v`` ``(total_k, Hkv, D)``/``(total_k, Hkv, Dv)``, and
sequence ``b`` owns rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` of ``q`` and
``cu_seqlens_k[b]:cu_seqlens_k[b+1]`` of ``k``/``v``. The forward pass is one kernel call over
all sequences (tasks over sequence, head and query block; each sequence's query blocks sized
to its length), with no padding: a batch pays for its real tokens only. The backward pass is
one ``attention_backward`` call per sequence, on ``(H, n, D)`` views of the packed arrays.
``lse`` is ``(Hq, total_q)``, as FlashAttention's.

Per sequence, ``causal``/``window`` align to that sequence's bottom-right corner, ``alibi_slopes``
may be ``(Hq,)`` or ``(B, Hq)``, and dropout uses the seed ``seed * 1000003 + b`` (mod 2^63), so
sequences get independent masks. ``sinks`` may be ``(Hq,)`` or ``(B, Hq)`` too, added to each
row's sum by the kernel as ``cpuflash.attention``'s (``sinks.py``).
"""
import numpy as np

from . import _checks, config, masks
from . import sinks as _sinks
from ._cpu.forward import run_varlen
from .api import attention_backward

__all__ = ["attention_varlen", "attention_varlen_backward"]


def _sequences(cu_seqlens_q, cu_seqlens_k, total_q, total_k):
    for name, cu, total in (("cu_seqlens_q", cu_seqlens_q, total_q),
                            ("cu_seqlens_k", cu_seqlens_k, total_k)):
        if not isinstance(cu, np.ndarray) or not np.issubdtype(cu.dtype, np.integer):
            raise TypeError(f"{name}: expected a 1-D integer numpy array, got "
                            f"{cu.dtype if isinstance(cu, np.ndarray) else type(cu).__name__}")
        if cu.ndim != 1 or cu.size < 1:
            raise ValueError(f"{name}: expected a 1-D array of B + 1 offsets, got shape {cu.shape}")
        if cu[0] != 0 or cu[-1] != total or np.any(np.diff(cu) < 0):
            raise ValueError(f"{name}: expected non-decreasing offsets from 0 to {total} "
                             f"(the packed length), got {cu.tolist()[:8]}")
    if cu_seqlens_q.size != cu_seqlens_k.size:
        raise ValueError(f"cu_seqlens_q, cu_seqlens_k: expected the same number of sequences, "
                         f"got {cu_seqlens_q.size - 1} and {cu_seqlens_k.size - 1}")
    return [(int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1]), int(cu_seqlens_k[b]),
             int(cu_seqlens_k[b + 1])) for b in range(cu_seqlens_q.size - 1)]


def _packed(q, k, v):
    for name, x in (("q", q), ("k", k), ("v", v)):
        _checks.array(name, x)
        if x.ndim != 3:
            raise ValueError(f"{name}: expected packed (total, H, D), got shape {x.shape}")
    _checks.same_dtype(q=q, k=k, v=v)


def _sequence_seed(seed, b):
    """Sequence ``b``'s dropout seed (module docstring)."""
    return (int(seed) * 1000003 + b) % 2**63


def _per_sequence(b, alibi_slopes, seed, dropout_p):
    slopes = alibi_slopes
    if isinstance(alibi_slopes, np.ndarray) and alibi_slopes.ndim == 2:
        slopes = alibi_slopes[b]
    seq_seed = None if seed is None or not dropout_p else _sequence_seed(seed, b)
    return slopes, seq_seed


def _heads_first(x):
    """(n, H, D) rows of the packed array as an (H, n, D) view."""
    return x.transpose(1, 0, 2)


def _sink_rows(sinks, seqs, n_hq):
    """``sinks`` (``sinks.check``: ``(Hq,)`` or one row a sequence) as each packed query's
    logits, broadcastable to (total_q, Hq), for their gradient; None without sinks."""
    if sinks is None:
        return None
    logits = _sinks.check(sinks, len(seqs), n_hq)
    if sinks.ndim == 1:
        return logits
    return np.repeat(logits, [q1 - q0 for q0, q1, _, _ in seqs], axis=0)


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, *, causal=False, scale=None,
                     window=None, alibi_slopes=None, softcap=None, dropout_p=0.0, seed=None,
                     sinks=None, return_lse=False):
    """Attention over packed variable-length sequences; returns ``out`` (total_q, Hq, Dv) and,
    with ``return_lse``, ``lse`` (Hq, total_q). Options as ``cpuflash.attention``."""
    _packed(q, k, v)
    seqs = _sequences(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0])
    return_lse = _checks.flag("return_lse", return_lse)
    causal = _checks.flag("causal", causal)
    *_, d, _ = _checks.qkv_shapes(*(_heads_first(x)[None] for x in (q, k, v)))
    n_seq = len(seqs)
    if isinstance(alibi_slopes, np.ndarray) and alibi_slopes.ndim == 2 and \
            alibi_slopes.shape[0] != n_seq:
        raise ValueError(f"alibi_slopes: expected ({q.shape[1]},) or ({n_seq}, "
                         f"{q.shape[1]}), got {alibi_slopes.shape}")
    scale = _checks.scale(scale, d)
    left, right, _ = masks.band(causal, window, None, 1, 0)
    mods = masks.modifiers(softcap, alibi_slopes, n_seq, q.shape[1])
    logits = None if sinks is None else _sinks.check(sinks, n_seq, q.shape[1])
    drop_below, seed, inv_keep = masks.dropout(dropout_p, seed)
    seeds = np.array([_sequence_seed(seed, b) if drop_below else 0 for b in range(n_seq)],
                     dtype=np.int64)
    compute = np.float64 if q.dtype == np.float64 else np.float32
    out, lse = run_varlen(*(x if x.dtype == compute else x.astype(compute) for x in (q, k, v)),
                          cu_seqlens_q.astype(np.int64), cu_seqlens_k.astype(np.int64), scale,
                          (left, right), mods, (drop_below, seeds, inv_keep), config.PORTABLE,
                          logits)
    out = out.astype(q.dtype, copy=False)
    return (out, lse) if return_lse else out


def attention_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, *,
                              causal=False, scale=None, window=None, alibi_slopes=None,
                              softcap=None, dropout_p=0.0, seed=None, sinks=None):
    """Gradients ``(dq, dk, dv)`` of ``attention_varlen``, packed like ``q``, ``k``, ``v``;
    the options must be the forward call's. With ``sinks``, ``(dq, dk, dv, dsinks)``, as
    ``cpuflash.attention_backward``."""
    _packed(q, k, v)
    seqs = _sequences(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0])
    _checks.matches("dout", dout, q.shape[:2] + (v.shape[2],), q.dtype)
    _checks.matches("out", out, q.shape[:2] + (v.shape[2],), q.dtype)
    _checks.matches("lse", lse, (q.shape[1], q.shape[0]),
                    np.float64 if q.dtype == np.float64 else np.float32)
    sink_rows = _sink_rows(sinks, seqs, q.shape[1])
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    for b, (q0, q1, k0, k1) in enumerate(seqs):
        if q1 == q0 or k1 == k0:
            continue
        slopes, seq_seed = _per_sequence(b, alibi_slopes, seed, dropout_p)
        grads = attention_backward(
            _heads_first(dout[q0:q1]), _heads_first(q[q0:q1]), _heads_first(k[k0:k1]),
            _heads_first(v[k0:k1]), np.ascontiguousarray(_heads_first(out[q0:q1])),
            np.ascontiguousarray(lse[:, q0:q1]), causal=causal, scale=scale, window=window,
            alibi_slopes=slopes, softcap=softcap, dropout_p=dropout_p, seed=seq_seed)
        for full, g, (a, z) in zip((dq, dk, dv), grads, ((q0, q1), (k0, k1), (k0, k1))):
            full[a:z] = g.transpose(1, 0, 2)
    if sink_rows is None:
        return dq, dk, dv
    rows = _sinks.row_gradients(dout, out, lse.T, sink_rows)  # (total_q, Hq)
    dsinks = (rows.sum(axis=0) if sinks.ndim == 1
              else np.stack([rows[q0:q1].sum(axis=0) for q0, q1, _, _ in seqs]))
    return dq, dk, dv, dsinks.astype(lse.dtype)
