"""Attention sinks: one learned logit per query head that joins every row's softmax and
carries no value (gpt-oss; FlashAttention's ``learnable_sink``, llama.cpp's soft_max sinks).

With ``c`` the sink of the row's head, its probabilities become ``p_j = e^(s_j - lse')`` with

    lse' = log(e^lse + e^c) = logaddexp(lse, c),

where ``lse`` is the log-sum-exp of the row's own scores. That is the attention without a sink
times one factor a row, ``out' = out * e^(lse - lse')``; in the kernels (``_cpu/forward.py``'s
``finish_row``, ``_cpu/decode.py``'s ``combine_row``) the sink is one more term of the row's
sum of exponentials, ``l' = l + e^(c - m)`` with ``m`` the row's running max, added when the row
ends: its output is ``acc / l'`` (one division, as without a sink) and its
``lse' = m + log(l')`` (where ``e^(c - m)`` overflows: output 0, ``lse' = c + log1p(l e^(m -
c))``).
The decode kernel adds it where it merges its splits. (Stop 57 folded sinks in after the
kernels, from ``lse``: a second pass over the output, one thread, and a second rounding of a
float16 result; 1 ms of a 31 ms forward at N=2048, and 9-64 us of Python and a numpy pass
after each decode step.)
The backward kernels, given ``out'`` and ``lse'``, already compute the right ``dq, dk, dv``:
they recompute ``P' = e^(S - lse')`` and use ``D = rowsum(dO * out')``, which is also
``rowsum(P' * dP)`` with the sink's ``dP = 0``. The sink's own gradient is the softmax's
``dc = p_c (0 - D)`` summed over the head's rows, ``p_c = e^(c - lse')``.

A row that sees no key gives ``out' = 0`` and ``lse' = c``; a sink of ``-inf`` is no sink
(``out' = out`` and ``lse' = lse`` bit for bit).
"""
import math

import numpy as np


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
    # A decode step checks its sinks right after its kernel swept the caches, where each numpy
    # call costs microseconds: a copy and a scan of a Python list took 15 us there, against
    # 30 us for astype, max and reshape (Hq=8, after a step over 32768 keys).
    logits = np.array(sinks, np.float64, ndmin=2)  # (Hq,) -> (1, Hq)
    values = logits.ravel().tolist()
    if math.inf in values or any(map(math.isnan, values)):
        raise ValueError("sinks: expected finite logits or -inf (no sink), got NaN or +inf")
    return logits


def check_for_queries(sinks, q_shape):
    """``check`` against the queries of shape ``q_shape`` (2-D ``(N, D)``, 3-D ``(H, N, D)`` or
    4-D ``(B, H, N, D)``, already checked): their B and Hq."""
    n_b, n_hq = ((1, 1) + tuple(q_shape))[-4:-2]
    return check(sinks, n_b, n_hq)


def row_gradients(dout, out, lse, sink):
    """Each row's share of ``d loss / d sink``, float64 shaped like ``lse``: ``-p_c * D`` with
    ``p_c = e^(c - lse')`` and ``D = rowsum(dout * out)``, from the ``out'`` and ``lse'`` that
    the call with sinks returned."""
    lse64 = lse.astype(np.float64)
    rowsum = np.einsum("...d,...d->...", dout.astype(np.float64), out.astype(np.float64))
    with np.errstate(invalid="ignore"):  # a row with no key and no sink: p_c = 0
        p_sink = np.where(lse64 > -np.inf, np.exp(sink - lse64), 0.0)
    return -p_sink * rowsum
