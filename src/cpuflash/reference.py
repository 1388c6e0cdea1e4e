"""The oracle: plain float64 numpy attention, written for clarity, not speed or memory.

It builds the full (Nq, Nk) score matrix and follows API.md literally; every test compares
the kernels with it.
"""
import math

import numpy as np

__all__ = ["attention", "attention_backward", "visible"]


def _t(x):
    """The last two axes swapped: ``x^T`` per (batch, head). Products are written as matmuls
    (float64 BLAS) rather than ``np.einsum``, whose plain loops took 3.3 s against 0.75 s for
    one 8192 x 8192 x 64 score matrix."""
    return np.swapaxes(x, -1, -2)


def _as_4d(x):
    return np.asarray(x, dtype=np.float64).reshape((1,) * (4 - np.ndim(x)) + np.shape(x))


def visible(n_q, n_k, causal=False, window=None, kv_len=None):
    """Bool (Nq, Nk): may query i see key j. Aligned bottom-right to the ``kv_len`` keys that
    exist (``Nk`` if None): with ``off = kv_len - Nq``, ``j < kv_len``, causal ``j <= i + off``,
    window ``(left, right)`` ``i + off - left <= j <= i + off + right`` (None/-1: unbounded)."""
    kv_len = n_k if kv_len is None else int(kv_len)
    i = np.arange(n_q)[:, None]
    j = np.arange(n_k)[None, :]
    off = kv_len - n_q
    seen = j < kv_len
    if causal:
        seen = seen & (j <= i + off)
    if window is not None:
        left, right = window
        if left is not None and left != -1:
            seen = seen & (j >= i + off - left)
        if right is not None and right != -1:
            seen = seen & (j <= i + off + right)
    return np.broadcast_to(seen, (n_q, n_k))


def _seen(n_b, n_q, n_k, causal, window, kv_lens):
    """Bool (B, 1, Nq, Nk) from ``visible`` per batch."""
    lens = [None] * n_b if kv_lens is None else list(kv_lens)
    if not lens:  # B = 0
        return np.zeros((0, 1, n_q, n_k), dtype=bool)
    return np.stack([visible(n_q, n_k, causal, window, n) for n in lens])[:, None]


def _modified(s, n_b, n_q, n_k, kv_lens, softcap, alibi_slopes):
    """Softcap, then ALiBi, on raw scores (B, H, Nq, Nk); also returns tanh (or None)."""
    t = None
    if softcap:
        t = np.tanh(s / softcap)
        s = softcap * t
    if alibi_slopes is not None:
        slopes = np.broadcast_to(np.asarray(alibi_slopes, np.float64), (n_b, s.shape[1]))
        lens = np.full(n_b, n_k) if kv_lens is None else np.asarray(kv_lens)
        i = np.arange(n_q)[:, None]
        j = np.arange(n_k)[None, :]
        dist = np.abs(i + (lens[:, None, None] - n_q) - j)  # (B, Nq, Nk)
        s = s - slopes[:, :, None, None] * dist[:, None]
    return s, t


def _user_mask(s, seen, mask):
    """A bool mask joins ``seen``; a float mask is added to the scores."""
    if mask is None:
        return s, seen
    mask = np.asarray(mask)
    if mask.dtype == np.bool_:
        return s, seen & mask
    return s + mask.astype(np.float64), seen


def _dropout_scale(n_b, n_h, n_q, n_k, dropout_p, seed):
    """(B, H, Nq, Nk): ``keep / (1 - p)`` from the kernels' hash, or None without dropout."""
    if not dropout_p:
        return None
    from ._cpu.dropout import keep_mask
    rows = np.arange(n_b * n_h * n_q)
    keep = keep_mask(seed, rows, np.arange(n_k), dropout_p).reshape(n_b, n_h, n_q, n_k)
    return keep / (1.0 - dropout_p)


def _sink_column(sinks, n_b, n_h):
    """(B, H, 1, 1) float64 sink logits, or None: one more score column of every row, seen,
    with no value."""
    if sinks is None:
        return None
    return np.broadcast_to(np.asarray(sinks, np.float64), (n_b, n_h))[:, :, None, None]


def _softmax(s, seen, sink):
    """Rows of ``s`` (-inf where not ``seen``) softmaxed, with the ``sink`` column (or None)
    joining each row's denominator. Returns ``(p, lse, p_sink)``; a row with nothing to
    attend to gives p = 0 and lse = -inf."""
    if sink is not None:
        s = np.concatenate([s, np.broadcast_to(sink, s.shape[:3] + (1,))], axis=-1)
        seen = np.concatenate([np.broadcast_to(seen, s.shape[:3] + (s.shape[3] - 1,)),
                               np.broadcast_to(sink > -np.inf, s.shape[:3] + (1,))], axis=-1)
    m = s.max(axis=-1, keepdims=True, initial=-np.inf)
    m_safe = np.where(np.isfinite(m), m, 0.0)
    p = np.where(seen, np.exp(s - m_safe), 0.0)
    lsum = p.sum(axis=-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        p = np.where(lsum > 0, p / np.where(lsum > 0, lsum, 1.0), 0.0)
        lse = np.where(lsum[..., 0] > 0, (m_safe + np.log(lsum))[..., 0], -np.inf)
    if sink is None:
        return p, lse, None
    return p[..., :-1], lse, p[..., -1]


def attention(q, k, v, *, causal=False, scale=None, mask=None, window=None, kv_lens=None,
              alibi_slopes=None, softcap=None, dropout_p=0.0, seed=None, sinks=None,
              return_lse=False):
    """float64 ``softmax(scale * q k^T) v`` with the shapes and semantics of ``cpuflash.attention``.

    A row that sees no key gives output 0 and ``lse = -inf`` (``lse = c`` with a sink ``c``).
    ``sinks``: one more column of each row's scores, the head's logit, with no value.
    """
    q4, k4, v4 = _as_4d(q), _as_4d(k), _as_4d(v)
    n_q, d = q4.shape[2], q4.shape[3]
    n_k = k4.shape[2]
    group = q4.shape[1] // k4.shape[1]
    k4 = np.repeat(k4, group, axis=1)  # GQA: query head h reads kv head h // group
    v4 = np.repeat(v4, group, axis=1)
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    s = scale * (q4 @ _t(k4))
    s, _ = _modified(s, q4.shape[0], n_q, n_k, kv_lens, softcap, alibi_slopes)
    seen = _seen(q4.shape[0], n_q, n_k, causal, window, kv_lens)
    s, seen = _user_mask(s, seen, mask)
    seen = seen & (s > -np.inf)  # a float mask's -inf hides the key too
    s = np.where(seen, s, -np.inf)
    p, lse, _ = _softmax(s, seen, _sink_column(sinks, *q4.shape[:2]))
    drop = _dropout_scale(*p.shape, dropout_p, seed)
    out = (p if drop is None else p * drop) @ v4
    out = out.reshape(np.shape(q)[:-1] + (v4.shape[-1],))
    if return_lse:
        return out, lse.reshape(np.shape(q)[:-1])
    return out



def attention_backward(dout, q, k, v, *, causal=False, scale=None, mask=None, window=None,
                       kv_lens=None, alibi_slopes=None, softcap=None, dropout_p=0.0, seed=None,
                       sinks=None):
    """float64 gradients ``(dq, dk, dv)`` of ``sum(dout * attention(q, k, v))``.

    ``P = softmax(S)``, ``dV = P^T dO``, ``dP = dO V^T``, ``dS = P * (dP - rowsum(dP * P))``,
    ``dQ = scale dS K``, ``dK = scale dS^T Q``; for GQA, dK and dV sum over the query heads of
    each group. Rows that see no key have P = 0 and contribute nothing.

    With ``sinks``, also ``dsinks`` (shaped like ``sinks``): the sink's column has ``dP = 0``,
    so its ``dS = P_sink * (0 - rowsum(dP * P))``, summed over the head's rows.
    """
    q4, k4, v4, do4 = _as_4d(q), _as_4d(k), _as_4d(v), _as_4d(dout)
    n_q, d = q4.shape[2], q4.shape[3]
    n_b, n_hkv, n_k = k4.shape[:3]
    group = q4.shape[1] // n_hkv
    kr, vr = np.repeat(k4, group, axis=1), np.repeat(v4, group, axis=1)
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    s = scale * (q4 @ _t(kr))
    s, t = _modified(s, n_b, n_q, n_k, kv_lens, softcap, alibi_slopes)
    seen = _seen(n_b, n_q, n_k, causal, window, kv_lens)
    s, seen = _user_mask(s, seen, mask)
    seen = seen & (s > -np.inf)
    s = np.where(seen, s, -np.inf)
    p, _, p_sink = _softmax(s, seen, _sink_column(sinks, *q4.shape[:2]))
    drop = _dropout_scale(*p.shape, dropout_p, seed)
    dv = _t(p if drop is None else p * drop) @ do4
    dp = do4 @ _t(vr)
    if drop is not None:
        dp = dp * drop
    row_d = (dp * p).sum(axis=-1, keepdims=True)
    ds = p * (dp - row_d)
    if t is not None:  # through s = softcap * tanh(s_raw / softcap)
        ds = ds * (1.0 - t * t)
    dq = scale * (ds @ kr)
    dk = scale * (_t(ds) @ q4)
    dk = dk.reshape(n_b, n_hkv, group, n_k, d).sum(axis=2)
    dv = dv.reshape(n_b, n_hkv, group, n_k, v4.shape[3]).sum(axis=2)
    grads = (dq.reshape(np.shape(q)), dk.reshape(np.shape(k)), dv.reshape(np.shape(v)))
    if sinks is None:
        return grads
    dsinks = -(p_sink * row_d[..., 0]).sum(axis=2)  # (B, H)
    return (*grads, dsinks.sum(axis=0) if np.ndim(sinks) == 1 else dsinks)
