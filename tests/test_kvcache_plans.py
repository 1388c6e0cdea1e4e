"""KVCache's step plans (``decode.StepPlan``): a decode step like one that passed every check
runs from that step's kernel arguments. They must give the checked path's bits at every length,
take no call that the checks would refuse, and be safe to share between threads. And copies of
a cache (``copy``, ``pickle``) read their own storage."""
import copy
import pickle
import re
import threading

import numpy as np
import pytest

import cpuflash
from cpuflash import api, kvcache, reference
from cpuflash._cpu import decode
from cpuflash._cpu.pack import aligned
from conftest import rand

D = 32


def _filled(dtype, layers=2, n=40, max_len=400, h_kv=2, seed=0):
    cache = cpuflash.KVCache(layers, 2, h_kv, max_len, D, dtype=dtype)
    for layer in range(layers):
        cache.append(layer, rand((2, h_kv, n, D), seed=seed + 2 * layer),
                     rand((2, h_kv, n, D), seed=seed + 2 * layer + 1))
    return cache


def _checked(cache, layer, q, **options):
    """The step through every check (asking for the lse takes the general path)."""
    return cache.attention(layer, q, return_lse=True, **options)[0]


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16, np.int8])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n_q", [1, 3])
def test_planned_steps_give_the_checked_bits_as_the_cache_grows(dtype, causal, n_q):
    """Steps over a growing cache (the splits, kv_lens and an int8 cache's scales change with
    its length) give the bits of the checked path and the reference's values; each layer and
    kind of query has its plan."""
    cache = _filled(dtype, max_len=1200)
    q_dtype = np.float64 if dtype == np.float64 else np.float32
    for step in range(4):
        for layer in range(2):
            n_new = 1 + 1100 * (step == 2)  # past 1024 keys: two splits from there on
            cache.append(layer, rand((2, 2, n_new, D), seed=10 * step + layer),
                         rand((2, 2, n_new, D), seed=10 * step + layer + 5))
            q = rand((2, 4, n_q, D), seed=100 + step).astype(q_dtype)
            planned = cache.attention(layer, q, causal=causal)
            np.testing.assert_array_equal(planned, _checked(cache, layer, q, causal=causal))
            k, v = (x.astype(np.float64) for x in _dequantized(cache, layer))
            atol = 1e-12 if dtype == np.float64 else 3e-6
            np.testing.assert_allclose(planned, reference.attention(q, k, v, causal=causal),
                                       atol=atol, rtol=0)
    plans = {key[0]: plan for key, plan in cache._plans.items()}
    assert sorted(plans) == [0, 1] and all(isinstance(p, decode.StepPlan)
                                           for p in plans.values())


def _dequantized(cache, layer):
    k, v, scales = cache.view(layer)
    if scales:
        return k * scales["k_scale"][..., None], v * scales["v_scale"][..., None]
    return k, v


def test_a_planned_step_skips_the_checks(monkeypatch):
    """After one checked step, steps like it (any strides of q, a new length) run without the
    checks' code; a step of another kind (another scale) is checked first."""
    cache = _filled(np.float32)
    q = rand((2, 4, 1, D), seed=1)
    first = cache.attention(0, q, scale=0.25)
    calls = []
    real = api._plain_decode_args
    monkeypatch.setattr(kvcache, "step_plan", lambda *a: calls.append(a) or api.step_plan(*a))
    monkeypatch.setattr(api, "_plain_decode_args", lambda *a: calls.append(a) or real(*a))
    q_view = np.asfortranarray(q)  # the plan takes q's values, not its layout
    np.testing.assert_array_equal(cache.attention(0, q_view, scale=0.25), first)
    cache.append(0, rand((2, 2, 1, D), seed=2), rand((2, 2, 1, D), seed=3))
    cache.attention(0, q, scale=0.25)
    assert calls == []
    cache.attention(0, q, scale=0.5)
    assert len(calls) == 2  # step_plan, and the plain path's checks in it


@pytest.mark.parametrize("q_shape, q_dtype, options, error, message", [
    ((2, 4, 1, D), np.float64, {}, TypeError, "q, k, v: expected one dtype"),
    ((2, 3, 1, D), np.float32, {}, ValueError, "k: query heads"),
    ((2, 4, 1, 16), np.float32, {}, ValueError, "k: expected head dim"),
    ((2, 4, 1, D), np.float32, {"scale": 0.0}, ValueError, "scale:"),
    ((2, 4, 1, D), np.float32, {"scale": float("nan")}, ValueError, "scale:"),
    ((2, 4, 1, D), np.float32, {"causal": 1}, TypeError, "causal:"),
    ((2, 4, 1, D), np.float32, {"causal": None}, TypeError, "causal:"),
])
def test_planned_cache_still_refuses_bad_input(q_shape, q_dtype, options, error, message):
    """With plans made for good steps (scale None and 1.0, causal True and False), bad
    queries and options still meet the checks, which name them."""
    cache = _filled(np.float32)
    good = rand((2, 4, 1, D), seed=1)
    for causal in (False, True):
        for scale in (None, 1.0):
            cache.attention(0, good, causal=causal, scale=scale)
            cache.attention(0, good, causal=causal, scale=scale)
    with pytest.raises(error, match=re.escape(message)):
        cache.attention(0, rand(q_shape, seed=3).astype(q_dtype), **options)


@pytest.mark.parametrize("layer, error", [(True, TypeError), (-1, ValueError),
                                          (np.int64(5), ValueError), (1.0, TypeError)])
def test_planned_cache_still_refuses_bad_layers(layer, error):
    """``True == 1`` and ``1.0 == 1``: a plan for layer 1 must not take them."""
    cache = _filled(np.float32)
    q = rand((2, 4, 1, D), seed=1)
    cache.attention(1, q)
    cache.attention(1, q)
    with pytest.raises(error, match="layer"):
        cache.attention(layer, q)


def test_calls_no_plan_takes_are_remembered(monkeypatch):
    """A call that is no plain decode step (17 queries: the tiled path) is answered right and
    remembered as such: the next one like it does not try to make a plan again."""
    cache = _filled(np.float32, n=100)
    q = rand((2, 4, 17, D), seed=1)
    first = cache.attention(0, q, causal=True)
    made = []
    monkeypatch.setattr(kvcache, "step_plan", lambda *a: made.append(a))
    np.testing.assert_array_equal(cache.attention(0, q, causal=True), first)
    assert made == []
    k, v = _dequantized(cache, 0)
    np.testing.assert_allclose(first, reference.attention(q, k, v, causal=True), atol=3e-6,
                               rtol=0)


def test_an_empty_layer_takes_the_checked_path():
    """A plan's layer emptied by ``reset``: its next step sees no key (output 0), as checked.
    A step on a layer still empty makes no plan (a plan needs a length to check); the first
    step after an append does."""
    empty = cpuflash.KVCache(1, 2, 2, 64, D)
    q = rand((2, 4, 1, D), seed=1)
    np.testing.assert_array_equal(empty.attention(0, q), np.zeros((2, 4, 1, D), np.float32))
    assert empty._plans == {}
    empty.append(0, rand((2, 2, 3, D), seed=2), rand((2, 2, 3, D), seed=3))
    np.testing.assert_array_equal(empty.attention(0, q), _checked(empty, 0, q))
    assert [type(p) for p in empty._plans.values()] == [decode.StepPlan]
    cache = _filled(np.float32)
    cache.attention(0, q)
    cache.attention(0, q)
    cache.reset()
    np.testing.assert_array_equal(cache.attention(0, q), np.zeros((2, 4, 1, D), np.float32))


def test_plans_are_dropped_past_their_limit(monkeypatch):
    """Past ``MAX_PLANS`` kinds of call the plans start over (bounded memory), and steps still
    give the checked bits."""
    monkeypatch.setattr(kvcache, "MAX_PLANS", 3)
    cache = _filled(np.float32)
    q = rand((2, 4, 1, D), seed=1)
    for scale in (0.1, 0.2, 0.3, 0.4, 0.5):
        cache.attention(0, q, scale=scale)
        assert len(cache._plans) <= 3
    np.testing.assert_array_equal(cache.attention(0, q, scale=0.5),
                                  _checked(cache, 0, q, scale=0.5))


def test_threads_share_a_plan():
    """Threads stepping layers of one cache at once, with queries of their own, through the
    same plans: each gets what a lone checked step gives."""
    cache = _filled(np.float32, n=300)
    queries = [rand((2, 4, 1, D), seed=50 + i) for i in range(4)]
    want = [_checked(cache, i % 2, q) for i, q in enumerate(queries)]
    for i, q in enumerate(queries[:2]):
        cache.attention(i % 2, q)  # the plans
    got, errors = [[] for _ in queries], []

    def worker(i):
        try:
            for _ in range(30):
                got[i].append(cache.attention(i % 2, queries[i]))
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(queries))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    for i in range(len(queries)):
        for out in got[i]:
            np.testing.assert_array_equal(out, want[i])


@pytest.mark.parametrize("dtype", [np.float32, np.int8])
@pytest.mark.parametrize("how", ["deepcopy", "pickle", "copy"])
def test_a_copied_cache_reads_its_own_storage(dtype, how):
    """A deep copy or an unpickled cache appends to and reads its own storage (a copy of the
    layers' views used to be no view of the copied storage: a step read K as it was when
    copied); the original is untouched. A shallow copy shares the storage, as ``copy`` does."""
    cache = _filled(dtype, n=30)
    q = rand((2, 4, 1, D), seed=1)
    before = cache.attention(0, q)
    cache.attention(0, q)  # a plan, which the copy must not take over
    twin = {"deepcopy": copy.deepcopy, "pickle": lambda c: pickle.loads(pickle.dumps(c)),
            "copy": copy.copy}[how](cache)
    twin.append(0, rand((2, 2, 5, D), seed=7), rand((2, 2, 5, D), seed=8))
    k, v = (x.astype(np.float64) for x in _dequantized(twin, 0))
    np.testing.assert_allclose(twin.attention(0, q), reference.attention(q, k, v), atol=3e-6,
                               rtol=0)
    assert aligned(twin.k_blocks) and aligned(twin.v_blocks)
    if how == "copy":
        assert twin.k_blocks is cache.k_blocks and int(cache.lengths[0]) == 35
    else:
        assert not np.shares_memory(twin.k_blocks, cache.k_blocks)
        assert int(cache.lengths[0]) == 30
        np.testing.assert_array_equal(cache.attention(0, q), before)


@pytest.mark.parametrize("bad_length", [-1, 401])
def test_a_length_the_storage_cannot_back_is_refused(bad_length):
    """``lengths`` is a public array: a length past ``max_len`` (or below 0) written there is
    refused by ``attention`` (with or without a plan), ``append`` and ``view``, never read past
    the storage."""
    cache = _filled(np.float32)
    q = rand((2, 4, 1, D), seed=1)
    cache.attention(0, q)
    cache.attention(0, q)
    cache.lengths[0] = bad_length
    message = f"lengths[0]: expected 0..400 (max_len), got {bad_length}"
    for call in (lambda: cache.attention(0, q), lambda: cache.view(0),
                 lambda: cache.append(0, rand((2, 2, 1, D), seed=2), rand((2, 2, 1, D), seed=3))):
        with pytest.raises(ValueError, match=re.escape(message)):
            call()
