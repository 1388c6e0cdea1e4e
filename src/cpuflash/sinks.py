"""Attention sinks: one learned logit per query head that joins every row's softmax and
carries no value (gpt-oss; FlashAttention's ``learnable_sink``, llama.cpp's soft_max sinks).

With ``c`` the sink of the row's head, its probabilities become ``p_j = e^(s_j - lse')`` with

    lse' = log(e^lse + e^c) = logaddexp(lse, c),

where ``lse`` is the log-sum-exp of the row's own scores. That is the attention without a sink
times one factor a row, and the tiled kernels need not know of it:

    out' = out * e^(lse - lse'),

folded in after the kernel from the ``lse`` it returns (in float64, rounded once into ``out``;
one pass over the rows, ``_cpu/sinks.py``). The decode kernel, which merges its splits' partial
sums anyway, takes the sink as one more term of that merge (``_cpu/decode.py``'s
``combine_row``): no second pass, and no Python after a step that swept the caches.
The backward kernels, given ``out'`` and ``lse'``, already compute the right ``dq, dk, dv``:
they recompute ``P' = e^(S - lse')`` and use ``D = rowsum(dO * out')``, which is also
``rowsum(P' * dP)`` with the sink's ``dP = 0``. The sink's own gradient is the softmax's
``dc = p_c (0 - D)`` summed over the head's rows, ``p_c = e^(c - lse')``.

A row that sees no key gives ``out' = 0`` and ``lse' = c``; a sink of ``-inf`` is no sink
(``out' = out`` and ``lse' = lse`` bit for bit).
"""
import numpy as np

from ._cpu.sinks import fold_rows


def check(sinks, n_b, n_hq):
    """``sinks`` as float64 ``(B or 1, Hq)``: a real numpy array of shape ``(Hq,)`` (one logit a
    query head) or ``(B, Hq)``; each finite or ``-inf`` (that head has none)."""
    if not isinstance(sinks, np.ndarray) or sinks.dtype.kind not in "fiu":
        got = sinks.dtype if isinstance(sinks, np.ndarray) else type(sinks).__name__
        raise TypeError(f"sinks: expected a real numpy array of shape ({n_hq},) or "
                        f"({n_b}, {n_hq}), got {got}")
    if sinks.shape not in ((n_hq,), (n_b, n_hq)):
        raise ValueError(f"sinks: expected shape ({n_hq},) or ({n_b}, {n_hq}) (one logit a "
                         f"query head), got {sinks.shape}")
    logits = sinks.astype(np.float64, copy=False)
    if sinks.size and not logits.max() < np.inf:  # NaN or +inf
        raise ValueError("sinks: expected finite logits or -inf (no sink), got NaN or +inf")
    return logits.reshape((1, n_hq) if sinks.ndim == 1 else (n_b, n_hq))


def check_for_queries(sinks, q_shape):
    """``check`` against the queries of shape ``q_shape`` (2-D ``(N, D)``, 3-D ``(H, N, D)`` or
    4-D ``(B, H, N, D)``, already checked): their B and Hq."""
    n_b, n_hq = ((1, 1) + tuple(q_shape))[-4:-2]
    return check(sinks, n_b, n_hq)


def fold(out, lse, sink):
    """The sinks ``sink`` (float64, 3-D, each axis 1 or ``lse``'s) folded into one call's
    results, ``out`` (``(B, H, N, Dv)``) scaled in place by ``e^(lse - lse')`` and ``lse``
    ``(B, H, N)``; returns ``lse'`` in ``lse``'s dtype (``_cpu.sinks.fold_rows``; a float16 or
    strided ``out``, the ``out=`` of a caller, through a C-contiguous float32 or float64
    copy). NaN in ``lse`` (a row that met NaN) stays NaN in both."""
    lse_new = np.empty(lse.shape, lse.dtype)
    if out.dtype != np.float16 and out.flags.c_contiguous:
        fold_rows(out, lse, sink, lse_new)
        return lse_new
    wide = np.ascontiguousarray(out, dtype=np.float64 if out.dtype == np.float64 else np.float32)
    fold_rows(wide, lse, sink, lse_new)
    out[...] = wide
    return lse_new


def row_gradients(dout, out, lse, sink):
    """Each row's share of ``d loss / d sink``, float64 shaped like ``lse``: ``-p_c * D`` with
    ``p_c = e^(c - lse')`` and ``D = rowsum(dout * out)``, from the ``out'`` and ``lse'`` that
    the call with sinks returned."""
    lse64 = lse.astype(np.float64)
    rowsum = np.einsum("...d,...d->...", dout.astype(np.float64), out.astype(np.float64))
    with np.errstate(invalid="ignore"):  # a row with no key and no sink: p_c = 0
        p_sink = np.where(lse64 > -np.inf, np.exp(sink - lse64), 0.0)
    return -p_sink * rowsum
