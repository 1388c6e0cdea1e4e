"""Packed variable-length sequences against the reference, sequence by sequence."""
import numpy as np
import pytest

import cpuflash
from cpuflash import reference
from conftest import rand

LENS_Q = [5, 1, 0, 130, 17]
LENS_K = [9, 1, 3, 130, 40]


def packed(lens, h, d, seed):
    return rand((sum(lens), h, d), seed=seed), np.concatenate([[0], np.cumsum(lens)])


@pytest.mark.parametrize("opts", [{}, {"causal": True, "window": (8, 0)},
                                  {"alibi_slopes": np.array([0.1, 0.2, 0.3, 0.4]),
                                   "softcap": 5.0}])
def test_varlen_forward_and_backward_match_each_sequence(opts):
    q, cu_q = packed(LENS_Q, 4, 16, 1)
    k, cu_k = packed(LENS_K, 2, 16, 2)
    v, _ = packed(LENS_K, 2, 8, 3)
    dout, _ = packed(LENS_Q, 4, 8, 4)
    out, lse = cpuflash.attention_varlen(q, k, v, cu_q, cu_k, return_lse=True, **opts)
    dq, dk, dv = cpuflash.attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, **opts)
    assert out.shape == (sum(LENS_Q), 4, 8) and lse.shape == (4, sum(LENS_Q))
    for b in range(len(LENS_Q)):
        sq, sk = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        heads = [x[s].transpose(1, 0, 2) for x, s in ((q, sq), (k, sk), (v, sk), (dout, sq))]
        want, want_lse = reference.attention(*heads[:3], return_lse=True, **opts)
        np.testing.assert_allclose(out[sq].transpose(1, 0, 2), want, rtol=2e-5, atol=2e-6)
        np.testing.assert_allclose(lse[:, sq], want_lse, rtol=2e-5, atol=2e-6)
        grads = reference.attention_backward(heads[3], *heads[:3], **opts)
        for got, w, s in zip((dq, dk, dv), grads, (sq, sk, sk)):
            np.testing.assert_allclose(got[s].transpose(1, 0, 2), w, rtol=2e-5, atol=2e-5)


def test_varlen_dropout_differs_between_sequences():
    q, cu = packed([50, 50], 1, 8, 1)
    k = np.concatenate([q[:50], q[:50]])  # two identical sequences
    out = cpuflash.attention_varlen(np.concatenate([q[:50], q[:50]]), k, k, cu, cu,
                                    dropout_p=0.5, seed=3)
    assert not np.array_equal(out[:50], out[50:])


@pytest.mark.parametrize("cu_q,cu_k,exc,words", [
    ([0, 5], np.array([0, 9]), TypeError, "cu_seqlens_q: expected a 1-D integer numpy array"),
    (np.array([0, 5, 3]), np.array([0, 9, 9]), ValueError, "non-decreasing"),
    (np.array([0, 4]), np.array([0, 9]), ValueError,
     "cu_seqlens_q: expected non-decreasing offsets from 0 to 5"),
    (np.array([0, 5]), np.array([0, 4, 9]), ValueError, "same number of sequences"),
])
def test_bad_offsets(cu_q, cu_k, exc, words):
    q, k = rand((5, 2, 4)), rand((9, 2, 4))
    with pytest.raises(exc, match=words):
        cpuflash.attention_varlen(q, k, k, cu_q, cu_k)


def test_bad_packed_shapes():
    with pytest.raises(ValueError, match="q: expected packed"):
        cpuflash.attention_varlen(rand((1, 5, 2, 4)), rand((9, 2, 4)), rand((9, 2, 4)),
                                  np.array([0, 5]), np.array([0, 9]))


def test_bad_alibi_slopes_per_sequence():
    q, cu = packed([5, 7], 2, 4, 1)
    with pytest.raises(ValueError, match=r"alibi_slopes: expected \(2,\) or \(2, 2\)"):
        cpuflash.attention_varlen(q, q, q, cu, cu, alibi_slopes=np.ones((3, 2)))
