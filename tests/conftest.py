import os
import sys

import numpy as np
import pytest

from background import BackgroundRuns

from cpuflash import config


def _halve_q_heads(a):  # Hq % Hkv != 0
    a["q"] = a["q"][:, :3]


def _narrow_k(a):  # head dims differ
    a["k"] = a["k"][..., :16]


# Bad input that both plain paths (api._plain_decode, api._plain_forward) leave to the general
# checks, as ``(edit of the q, k, v dict, options, error, message)``; Hq = 4, Hkv = 2, D = 32.
PLAIN_CALL_REFUSALS = [
    (_halve_q_heads, {}, ValueError, "k: query heads"),
    (_narrow_k, {}, ValueError, "k: expected head dim"),
    (None, dict(scale=float("nan")), ValueError, "scale:"),
    (None, dict(scale=0.0), ValueError, "scale:"),
    (None, dict(causal=1), TypeError, "causal:"),
]


def rand(shape, dtype=np.float32, seed=0, scale=1.0):
    rng = np.random.default_rng(seed)
    return (scale * rng.standard_normal(shape)).astype(dtype)


def rands(*shapes, dtype=np.float32, seed=1):
    """One seeded random array per shape, seeds ``seed, seed + 1, ...``."""
    return tuple(rand(shape, dtype, seed + i) for i, shape in enumerate(shapes))


def on_threads(call, counts):
    """``[call() for each thread count in counts]``, ``None`` standing for the count in use;
    the kernels' thread count is restored afterwards."""
    import cpuflash
    before = cpuflash.get_num_threads()
    try:
        results = []
        for n in counts:
            cpuflash.set_num_threads(before if n is None else n)
            results.append(call())
        return results
    finally:
        cpuflash.set_num_threads(before)


@pytest.fixture(params=[False, True], ids=["simd", "portable"])
def kernels(request, monkeypatch):
    """Run a test on the SIMD kernels and on the portable pure-Numba fallback."""
    monkeypatch.setattr(config, "PORTABLE", request.param)
    return request.param


def naive_error(q, k, v, ref, causal=False, scale=None):
    """Max abs error of the textbook computation in the inputs' own dtype (float32 for f16)."""
    dt = np.float64 if q.dtype == np.float64 else np.float32
    q, k, v = (np.asarray(x, dtype=dt) for x in (q, k, v))
    from cpuflash import reference
    group = q.shape[-3] // k.shape[-3] if q.ndim > 2 else 1
    if group > 1:
        k, v = np.repeat(k, group, axis=-3), np.repeat(v, group, axis=-3)
    d = q.shape[-1]
    s = (q @ np.swapaxes(k, -1, -2)) * dt(1 / np.sqrt(d) if scale is None else scale)
    seen = reference.visible(q.shape[-2], k.shape[-2], causal)
    s = np.where(seen, s, -np.inf)
    m = s.max(-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0)
    p = np.where(seen, np.exp(s - m), 0)
    lsum = p.sum(-1, keepdims=True)
    out = np.where(lsum > 0, (p / np.where(lsum > 0, lsum, 1)) @ v, 0)
    return float(np.max(np.abs(out - ref))) if out.size else 0.0


def assert_close_to_reference(out, ref, q, k, v, causal=False, scale=None, factor=2.0):
    """err(ours) <= factor * err(naive same-dtype) + atol, with atol from the dtype's epsilon."""
    assert out.shape == ref.shape
    if out.size == 0:
        return
    err = float(np.max(np.abs(out.astype(np.float64) - ref)))
    base = naive_error(q, k, v, ref, causal, scale)
    eps = np.finfo(np.float64 if q.dtype == np.float64 else np.float32).eps
    atol = 8 * eps * max(1.0, float(np.max(np.abs(ref))))
    if out.dtype == np.float16:
        atol += float(np.max(np.abs(ref))) * np.finfo(np.float16).eps
    assert err <= factor * base + atol, f"error {err:.3g} vs naive {base:.3g} (atol {atol:.3g})"


# tests/cuda runs in processes of its own (tests/test_cuda_path.py starts them, one with the
# CUDA simulator), so that numba.cuda and the simulator never load into the CPU tests' process.
collect_ignore = [] if os.environ.get("CPUFLASH_CUDA_TESTS") else ["cuda"]


def pytest_collection_modifyitems(session, config, items):
    """The tests that wait for a background run (their module's ``RUNS``) go last: until then
    this process runs the other tests while those runs compile on the other core."""
    def waits(item):
        return item.name in getattr(getattr(item, "module", None), "RUNS", {})

    items.sort(key=waits)  # stable: the rest keep their order


def pytest_collection_finish(session):
    """Start the background runs of the selected tests now: the CUDA runs of
    tests/test_cuda_path.py and the narrower host's kernels of tests/test_simd_shapes.py (see
    RUNS in each: a module's ``start_in_background(test name)``), and the kernels' warm-up
    where the session has many CPU tests (below)."""
    if session.config.option.collectonly:
        return
    for item in session.items:
        start = getattr(getattr(item, "module", None), "start_in_background", None)
        if start is not None:
            start(item.name)
    cpu_tests = [item for item in session.items if "cuda" not in item.path.parent.name]
    if len(cpu_tests) >= WARM_UP_FROM:
        _warm_up.start("warm-up", [sys.executable, "-c", WARM_UP.format(jobs=WARM_UP_JOBS)],
                       nice=WARM_UP_NICE)


# Compiling is most of this process's time (a kernel family takes 20-30 s, one core), one
# family at a time, when a test first calls it. A session of many tests also compiles, in one
# process in the background, the families that its tests reach only later (by the order of
# tests/test_backward.py, then the other modules): by then they are in the on-disk cache, and
# the tests load them. Where this process gets to one first, both compile it (the cache's
# saves are locked: _cpu/_jit.py), which costs time, not correctness.
WARM_UP_FROM = 100  # CPU tests (not those of tests/cuda, run on a GPU by hand)
WARM_UP_NICE = 0  # ahead of the other background runs (19): this process soon needs its work
WARM_UP_JOBS = [("forward:float64", False), ("backward:float64", False),
                ("forward:float64", True), ("backward:float64", True),
                ("decode:float64", False), ("decode-int8:float32", False),
                ("decode-float16:float32", False)]
WARM_UP = """
from cpuflash import config
from cpuflash.warmup import run_job
for name, portable in {jobs}:
    config.PORTABLE = portable  # as the kernels fixture sets it
    run_job(name)
"""
_warm_up = BackgroundRuns()


def pytest_sessionfinish(session):
    """Kill the background runs that no test waited for (a session stopped early, by -x say),
    in every module that has them, and the warm-up if it still runs."""
    _warm_up.stop_all()
    modules = {getattr(item, "module", None) for item in getattr(session, "items", [])}
    for module in modules:
        stop = getattr(module, "stop_all", None)
        if stop is not None:
            stop()
