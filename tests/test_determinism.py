"""Results do not depend on the thread count, on run order or on the kernels' cache."""
import os
import subprocess
import sys

import numpy as np
import pytest

import cpuflash
from cpuflash import config
from conftest import on_threads, rands


@pytest.mark.parametrize("causal", [False, True])
def test_bitwise_identical_for_one_and_two_threads(kernels, causal):
    q, k, v = rands((2, 4, 150, 32), (2, 2, 300, 32), (2, 2, 300, 32))
    counts = sorted({1, min(2, cpuflash.get_num_threads()), cpuflash.get_num_threads()})
    results = on_threads(lambda: cpuflash.attention(q, k, v, causal=causal, return_lse=True),
                         [n for n in counts for _ in range(2)])  # each count twice
    for out, lse in results[1:]:
        assert np.array_equal(out, results[0][0]) and np.array_equal(lse, results[0][1])


@pytest.mark.parametrize("workers", [1, 3, 7])
def test_shared_tasks_keep_the_bits_and_the_callers_chunk_size(workers, monkeypatch):
    """The forward and backward kernels' workers share the tasks out (``tasks.next_task``):
    with 1 worker, or with more workers than threads (some threads then run several, and the
    first of them takes over the others' tasks), the bits are those of one worker a thread;
    and the caller's own Numba chunk size is back in place after each call."""
    import numba
    from cpuflash._cpu import backward, forward
    q, k, v, dout = rands((2, 4, 150, 32), (2, 2, 200, 32), (2, 2, 200, 32), (2, 4, 150, 32))

    def both():
        out, lse = cpuflash.attention(q, k, v, causal=True, return_lse=True)
        return (out, lse, *cpuflash.attention_backward(dout, q, k, v, out, lse, causal=True))

    old = numba.set_parallel_chunksize(7)
    try:
        shared = both()
        assert numba.get_parallel_chunksize() == 7
    finally:
        numba.set_parallel_chunksize(old)
    for module in (forward, backward):
        monkeypatch.setattr(module, "run_shared",
                            lambda kernel, *args: kernel(*args, workers))
    for a, b in zip(shared, both()):
        assert np.array_equal(a, b)


@pytest.mark.parametrize("opts", [{}, {"causal": True}, {"window": (40, 3), "softcap": 5.0},
                                  {"dropout_p": 0.2, "seed": 3}], ids=str)
def test_query_block_size_keeps_the_bits(opts, monkeypatch):
    """``config.block_q`` picks 64- or 128-row query blocks (by N, the head dim and the task
    count): a row's arithmetic is the same in either, so are its bits (GQA, a tail block)."""
    from cpuflash import config
    q, k, v = rands((1, 4, 300, 64), (1, 2, 320, 64), (1, 2, 320, 64))
    chosen = config.block_q
    results = []
    for rows in (config.BLOCK_Q, 2 * config.BLOCK_Q):
        monkeypatch.setattr(config, "block_q", lambda *args, rows=rows: rows)
        results.append(cpuflash.attention(q, k, v, return_lse=True, **opts))
    monkeypatch.setattr(config, "block_q", chosen)
    for out, lse in results[1:]:
        assert np.array_equal(out, results[0][0]) and np.array_equal(lse, results[0][1])


def test_python_threads_at_once_get_a_lone_calls_bits():
    """Four Python threads calling the forward and backward passes at once (each call's tasks
    shared out by its own workers, ``tasks.next_task``) get the bits of each call made alone."""
    import threading
    inputs = [rands((1, 4, 130, 32), (1, 2, 150, 32), (1, 2, 150, 32), (1, 4, 130, 32),
                    seed=10 * i) for i in range(4)]

    def both(q, k, v, dout):
        out, lse = cpuflash.attention(q, k, v, causal=True, return_lse=True)
        return (out, lse, *cpuflash.attention_backward(dout, q, k, v, out, lse, causal=True))

    alone = [both(*x) for x in inputs]
    start = threading.Barrier(len(inputs))
    together = [None] * len(inputs)

    def call(i):
        start.wait()
        together[i] = [both(*inputs[i]) for _ in range(3)]

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(inputs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for want, runs in zip(alone, together):
        assert runs is not None
        for got in runs:
            for a, b in zip(got, want):
                assert np.array_equal(a, b)


def _run(code, **env):
    full_env = dict(os.environ, **env)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=full_env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


CALL = ("import numpy as np, cpuflash;"
        "x = np.random.default_rng(0).standard_normal((1, 2, 70, 8)).astype(np.float32);"
        "print(cpuflash.attention(x, x, x, causal=True).tobytes().hex()[:4000])")


def test_numba_num_threads_env_gives_same_bits():
    one = _run(CALL, NUMBA_NUM_THREADS="1").stdout
    two = _run(CALL, NUMBA_NUM_THREADS="2").stdout
    assert one == two and len(one) > 100


def test_import_works_without_a_writable_cache(tmp_path):
    # Numba raises when no cache location is usable; cpuflash must compile in memory instead.
    code = ("import numba.core.caching as c\n"
            "def refuse(*a, **k): raise RuntimeError('no locator available (simulated)')\n"
            "c.CacheImpl.__init__ = refuse\n"
            "import warnings; warnings.simplefilter('ignore')\n" + CALL.replace(";", "\n"))
    no_cache = _run(code).stdout
    assert no_cache == _run(CALL).stdout


@pytest.mark.skipif(config.VECTOR_BYTES <= 16, reason="no narrower tile shapes to force here")
def test_other_tile_shapes_keep_their_own_cache_files(tmp_path):
    """A process with other tile shapes (``CPUFLASH_SIMD``) writes its own cache files
    (``_jit.CONFIG_TAG`` in their names) and leaves this host's in place: Numba keeps one stamp
    per index file, and a process with another stamp used to empty it."""
    (tmp_path / "toy_kernel.py").write_text(
        "from cpuflash._cpu._jit import kernel\n"
        "@kernel(parallel=False)\n"
        "def toy(x):\n"
        "    return x + 1\n")
    code = ("import toy_kernel; assert toy_kernel.toy(1) == 2; s = toy_kernel.toy.compiler.stats;"
            "print(sum(s.cache_hits.values()), sum(s.cache_misses.values()))")
    # A cache directory of its own, whatever NUMBA_CACHE_DIR the session has
    env = dict(PYTHONPATH=os.pathsep.join([str(tmp_path)] + sys.path),
               NUMBA_CACHE_DIR=str(tmp_path / "cache"))
    narrower = "avx2" if config.VECTOR_BYTES > 32 else "128"
    assert _run(code, **env).stdout.split() == ["0", "1"]  # compiled, saved
    assert _run(code, **env, CPUFLASH_SIMD=narrower).stdout.split() == ["0", "1"]
    assert _run(code, **env).stdout.split() == ["1", "0"]  # still this host's
    assert len(list((tmp_path / "cache").rglob("toy_kernel.toy-*.nbi"))) == 2


@pytest.mark.parametrize("n_q,n_k,causal", [(20, 20, False), (100, 37, True), (7, 200, False),
                                            (300, 70, True)])
def test_key_tiles_fitted_to_few_keys_give_the_full_tiles_bits(monkeypatch, n_q, n_k, causal):
    """Fewer keys than a tile get a tile of just the panels that hold them
    (``config.block_k``): the same sums over the same keys in the same order, so the same bits
    as the host's full tile, forward and backward."""
    q, dout = rands((1, 4, n_q, 32), (1, 4, n_q, 32))
    k, v = rands((1, 4, n_k, 32), (1, 4, n_k, 32), seed=5)
    fitted = cpuflash.attention_vjp(q, k, v, dout, causal=causal)
    monkeypatch.setattr(config, "block_k", lambda d, n: config.BLOCK_K)
    monkeypatch.setattr(config, "backward_block_k", lambda d, n: config.BACKWARD_BLOCK_K)
    full = cpuflash.attention_vjp(q, k, v, dout, causal=causal)
    for got, want in zip(fitted, full):
        assert np.array_equal(got, want)
