"""Packed variable-length sequences against the reference, sequence by sequence."""
import numpy as np
import pytest

import cpuflash
from cpuflash import config, reference
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


def sequence_heads(x, cu, b):
    """Sequence ``b`` of packed ``x`` as (H, n, D)."""
    return x[cu[b]:cu[b + 1]].transpose(1, 0, 2)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_varlen_forward_is_one_kernel_call_over_every_sequence(dtype, kernels, monkeypatch):
    # short and long sequences, empty ones of either kind, GQA, Dv not whole vectors (20)
    lens_q, lens_k = [3, 70, 0, 129, 2, 33], [3, 90, 5, 129, 0, 64]
    q, cu_q = packed(lens_q, 6, 24, 1)
    k, cu_k = packed(lens_k, 2, 24, 2)
    v, _ = packed(lens_k, 2, 20, 3)
    q, k, v = (x.astype(dtype) for x in (q, k, v))
    from cpuflash._cpu import forward
    calls = []
    real = forward.run_shared
    monkeypatch.setattr(forward, "run_shared", lambda *a: calls.append(a[0]) or real(*a))
    out, lse = cpuflash.attention_varlen(q, k, v, cu_q, cu_k, causal=True, return_lse=True,
                                         alibi_slopes=np.linspace(0.1, 0.6, 6))
    assert len(calls) == 1 and out.dtype == dtype and lse.shape == (6, sum(lens_q))
    tol = {np.float16: 2e-3, np.float32: 2e-5, np.float64: 1e-12}[dtype]
    for b in range(len(lens_q)):
        want, want_lse = reference.attention(
            *(sequence_heads(x, cu, b) for x, cu in ((q, cu_q), (k, cu_k), (v, cu_k))),
            causal=True, alibi_slopes=np.linspace(0.1, 0.6, 6), return_lse=True)
        got = sequence_heads(out, cu_q, b)
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol)
        np.testing.assert_allclose(lse[:, cu_q[b]:cu_q[b + 1]], want_lse, rtol=tol, atol=tol)
        if lens_k[b] == 0:  # rows that see no key: 0 and -inf, no NaN
            assert np.all(got == 0) and np.all(lse[:, cu_q[b]:cu_q[b + 1]] == -np.inf)


def test_varlen_dropout_is_each_sequences_own_seed():
    lens = [40, 7, 65]
    q, cu = packed(lens, 2, 8, 1)
    out = cpuflash.attention_varlen(q, q, q, cu, cu, dropout_p=0.25, seed=11, causal=True)
    for b in range(len(lens)):
        heads = [sequence_heads(q, cu, b)] * 3
        want = reference.attention(*heads, dropout_p=0.25, seed=(11 * 1000003 + b) % 2**63,
                                   causal=True)
        np.testing.assert_allclose(sequence_heads(out, cu, b), want, rtol=2e-5, atol=2e-6)


def test_varlen_reads_a_fused_qkv_projection_in_place():
    from cpuflash._cpu.pack import flat_rows
    lens = [5, 70, 128]
    qkv = rand((sum(lens), 3, 4, 32), seed=5)  # MiniLM's layout: (tokens, q/k/v, H, D)
    cu = np.concatenate([[0], np.cumsum(lens)])
    flat, steps = flat_rows(qkv[:, 1])
    assert np.shares_memory(flat, qkv) and steps == (3 * 4 * 32, 32)
    assert flat[steps[0] * 7 + steps[1] * 2 + 5] == qkv[7, 1, 2, 5]
    strided = cpuflash.attention_varlen(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu, cu)
    copies = cpuflash.attention_varlen(*(np.ascontiguousarray(qkv[:, i]) for i in range(3)),
                                       cu, cu)
    assert np.array_equal(strided, copies)
    reversed_rows = qkv[::-1]  # a negative stride: copied first, same numbers
    out = cpuflash.attention_varlen(reversed_rows[:, 0], reversed_rows[:, 1],
                                    reversed_rows[:, 2], cu, cu)
    want = cpuflash.attention_varlen(*(np.ascontiguousarray(reversed_rows[:, i])
                                       for i in range(3)), cu, cu)
    assert np.array_equal(out, want)


def test_varlen_bits_do_not_depend_on_the_thread_count():
    lens = [3, 70, 129, 1, 64]
    q, cu = packed(lens, 4, 16, 1)
    k, _ = packed(lens, 2, 16, 2)
    runs = []
    for threads in (1, 2):
        cpuflash.set_num_threads(threads)
        runs.append(cpuflash.attention_varlen(q, k, k, cu, cu, causal=True, return_lse=True))
    cpuflash.set_num_threads(2)
    assert all(np.array_equal(a, b) for a, b in zip(*runs))


def test_sequence_table_blocks_and_task_lookup():
    from cpuflash._cpu import sequences as sq
    assert sq.fitted_block(70, 64, 4) == 36  # two blocks of 36, not 64 + 64
    assert sq.fitted_block(64, 64, 4) == 64 and sq.fitted_block(5, 64, 4) == 8
    assert sq.fitted_block(0, 64, 4) == 4
    q_lens, k_lens = np.array([5, 0, 70]), np.array([5, 3, 0])
    table, n_tasks, n_tiles = sq.varlen(np.array([0, 5, 5]), q_lens, k_lens, 2, 1, 64, 64, 4)
    assert n_tasks == 2 * (1 + 0 + 2) and n_tiles == 1 + 1 + 0
    owners = [sq.find_task(table, 2, t) for t in range(n_tasks)]
    assert owners == [(0, 0, 0), (0, 1, 0), (2, 0, 0), (2, 0, 1), (2, 1, 0), (2, 1, 1)]
    assert [sq.owner(table, sq.TILE0, t) for t in range(n_tiles)] == [0, 1]
    # the rows a block computes: its own in whole micro-tiles, never past the block
    mr = config.MICRO_ROWS
    assert sq.computed_rows(1, 64) == mr and sq.computed_rows(64, 64) == 64
    assert sq.computed_rows(mr + 1, 64) == 2 * mr and sq.computed_rows(63, 64) == 64


@pytest.mark.parametrize("kwargs,exc,words", [
    ({"return_lse": "yes"}, TypeError, "return_lse: expected True or False"),
    ({"causal": 1}, TypeError, "causal: expected True or False"),
    ({"scale": 0.0}, ValueError, "scale"),
    ({"dropout_p": 0.5}, ValueError, "seed: required"),
])
def test_bad_options(kwargs, exc, words):
    q, cu = packed([5, 7], 2, 4, 1)
    with pytest.raises(exc, match=words):
        cpuflash.attention_varlen(q, q, q, cu, cu, **kwargs)


def test_bad_heads_and_head_dims():
    q, cu = packed([5, 7], 3, 4, 1)
    k, _ = packed([5, 7], 2, 4, 2)
    with pytest.raises(ValueError, match="Hkv|heads"):
        cpuflash.attention_varlen(q, k, k, cu, cu)  # 3 query heads over 2 key heads
    k8, _ = packed([5, 7], 3, 8, 2)
    with pytest.raises(ValueError, match="D|head dim"):
        cpuflash.attention_varlen(q, k8, k8, cu, cu)


def test_dense_sequence_table_is_kept_per_shape_and_read_only():
    from cpuflash._cpu import sequences as sq
    table, n_tasks = sq.dense(2, 3, 130, 64, 1, 3)
    assert sq.dense(2, 3, 130, 64, 1, 3)[0] is table and not table.flags.writeable
    assert n_tasks == 2 * 3 * 3 and table[1, sq.TILE0] == 3 and table[1, sq.TASK0] == 9
    assert [sq.find_task(table, 3, t) for t in (0, 8, 9, 17)] == [(0, 0, 0), (0, 2, 2),
                                                                   (1, 0, 0), (1, 2, 2)]
