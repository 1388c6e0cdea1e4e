"""The oracle itself, against a direct softmax(QK^T)V and known identities."""
import numpy as np
import pytest

from cpuflash import reference
from conftest import rand, rands


def direct(q, k, v, scale):
    s = scale * q @ k.T
    p = np.exp(s - s.max(axis=1, keepdims=True))
    return (p / p.sum(axis=1, keepdims=True)) @ v, np.log(np.exp(s).sum(axis=1))


@pytest.mark.parametrize("n_q,n_k,d", [(1, 1, 1), (7, 13, 5), (16, 3, 8)])
def test_matches_direct_softmax(n_q, n_k, d):
    q, k, v = rands((n_q, d), (n_k, d), (n_k, 3), dtype=np.float64)
    out, lse = reference.attention(q, k, v, scale=0.7, return_lse=True)
    want, want_lse = direct(q, k, v, 0.7)
    np.testing.assert_allclose(out, want, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-12)


def test_causal_is_bottom_right_and_rows_without_keys_are_zero():
    q, k, v = rand((5, 4), np.float64, 1), rand((3, 4), np.float64, 2), rand((3, 2), np.float64, 3)
    out, lse = reference.attention(q, k, v, causal=True, return_lse=True)
    # Nq=5, Nk=3: query i sees keys j <= i - 2, so rows 0 and 1 see nothing, row 4 sees all.
    assert np.all(out[:2] == 0) and np.all(lse[:2] == -np.inf)
    np.testing.assert_allclose(out[2], v[0])
    np.testing.assert_allclose(out[4:], reference.attention(q[4:], k, v))


def test_uniform_scores_average_values():
    q = np.zeros((3, 4))
    k, v = rand((6, 4), np.float64, 2), rand((6, 5), np.float64, 3)
    out, lse = reference.attention(q, k, v, return_lse=True)
    np.testing.assert_allclose(out, np.broadcast_to(v.mean(axis=0), out.shape))
    np.testing.assert_allclose(lse, np.log(6.0))


def test_gqa_reads_the_group_kv_head():
    q, k, v = rands((1, 4, 3, 8), (1, 2, 5, 8), (1, 2, 5, 8), dtype=np.float64)
    out = reference.attention(q, k, v)
    for h in range(4):
        want = reference.attention(q[0, h], k[0, h // 2], v[0, h // 2])
        np.testing.assert_allclose(out[0, h], want)
