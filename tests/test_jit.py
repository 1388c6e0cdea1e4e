"""The kernels compile once per dtype combination (``_cpu/_jit.Kernel``), not per array layout,
flag or mask kind, and give the same results whatever layout they are called with."""
import os

import numba
import numpy as np
import pytest
from numba.core import types

import cpuflash
from cpuflash import reference
from cpuflash._cpu import _ir_only, _jit, backward, decode, forward
from conftest import assert_close_to_reference, rands


def _specializations():
    return {name: len(k.dispatcher.overloads) for name, k in
            (("forward", forward.forward), ("backward", backward.backward),
             ("decode", decode.decode))}


def test_layouts_flags_and_masks_share_one_compilation():
    q, k, v, dout = rands((1, 2, 40, 16), (1, 2, 56, 16), (1, 2, 56, 16), (1, 2, 40, 16))
    masks = {"bool": rands((40, 56), seed=7)[0] > -0.5,
             "float32": rands((2, 40, 1), seed=8)[0],
             "float64": rands((40, 56), dtype=np.float64, seed=9)[0]}
    # every kernel compiled (or loaded) once for float32, with C-contiguous inputs, no mask
    out, lse = cpuflash.attention(q, k, v, return_lse=True)
    cpuflash.attention_backward(dout, q, k, v, out, lse)
    decoded = cpuflash.attention(q[:, :, :2], k, v)  # the decode path
    before = _specializations()

    strided_q = np.ascontiguousarray(q.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
    read_only = q.copy()
    read_only.flags.writeable = False
    for q_in in (strided_q, read_only):
        assert np.array_equal(cpuflash.attention(q_in, k, v), out)
        assert np.array_equal(cpuflash.attention(q_in[:, :, :2], k, v), decoded)
    for name, mask in masks.items():
        got, got_lse = cpuflash.attention(q, k, v, mask=mask, return_lse=True)
        assert_close_to_reference(got, reference.attention(q, k, v, mask=mask), q, k, v)
        grads = cpuflash.attention_backward(dout, q, k, v, got, got_lse, mask=mask)
        want = reference.attention_backward(dout, q, k, v, mask=mask)
        for g, w in zip(grads, want):
            np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5, err_msg=name)
        rows = mask[..., :2, :] if mask.shape[-2] > 1 else mask
        assert_close_to_reference(cpuflash.attention(q[:, :, :2], k, v, mask=rows),
                                  reference.attention(q[:, :, :2], k, v, mask=rows),
                                  q[:, :, :2], k, v)
    assert _specializations() == before


def test_canonical_signature():
    """Named arrays become read-only of any layout; integers int64, floats float64; other
    arrays keep their exact type."""
    def fn(a, b, n, x, flag):
        return a[0] + b[0] + n + x + flag

    kern = _jit.kernel(fn, strided=("a",), parallel=False)
    a = np.arange(6.0)[::2]
    b = np.arange(3.0)
    sig = kern.canonical((a, b, np.uint64(2), np.float32(0.5), True))
    assert sig == (types.Array(types.float64, 1, "A", readonly=True),
                   numba.typeof(b), types.int64, types.float64, types.boolean)
    assert kern(a, b, 2, 0.5, True) == 0.0 + 0.0 + 2 + 0.5 + 1
    assert kern(np.arange(3.0), b, np.uint64(3), np.float32(1.5), False) == 4.5
    assert len(kern.dispatcher.overloads) == 1  # the second call converted, not compiled
    for x in (2.5, np.float32(2.0)):  # Numba would truncate it: refused
        with pytest.raises(TypeError, match="argument 'n' is a float"):
            kern(a, b, x, 0.5, True)
    with pytest.raises(AssertionError, match="no arguments"):
        _jit.kernel(fn, strided=("nope",), parallel=False)


def test_call_built_compiles_on_first_use_and_shares_the_specializations():
    """``Kernel.call_built`` (a step plan's call: an argument list the package made, whose
    integers are not checked again) compiles on its first use as a call does, and both take
    the same specialization."""
    def fn(a, n):
        return a[0] * n

    kern = _jit.kernel(fn, parallel=False)
    a = np.arange(3.0) + 2.0
    assert kern.call_built([a, 3]) == 6.0
    assert kern(a, 4) == 8.0
    assert kern.call_built((a, 5)) == 10.0
    assert len(kern.dispatcher.overloads) == 1


def test_first_calls_from_threads_at_once():
    """Threads whose first calls of a kernel come at once all get their result (the
    compilation flag is set and cleared under a lock, not raced)."""
    import threading

    def fn(x, n):
        return x[0] * n

    kern = _jit.kernel(fn, parallel=False)
    start = threading.Barrier(4)
    results, errors = [], []

    def call(n):
        start.wait()
        try:
            results.append(kern(np.arange(1.0, 3.0), n))
        except Exception as exc:  # noqa: BLE001 - any failure is the finding
            errors.append(exc)

    threads = [threading.Thread(target=call, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and sorted(results) == [0.0, 1.0, 2.0, 3.0]


_SAVER = r"""
import sys
from numba.core.caching import IndexDataCacheFile
from cpuflash._cpu import _jit
path, who, locked = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
cache_file = IndexDataCacheFile(path, "toy", ("stamp",))
if locked:
    _jit._lock_saves(cache_file)
for i in range(150):
    cache_file.save(f"{who}{i}", f"{who}{i}" * 50)
"""


@pytest.mark.skipif(not _jit.SAVES_LOCKED, reason="no flock on this platform")
def test_cache_saves_from_processes_at_once_keep_every_entry(tmp_path):
    """Two processes saving new entries of one cache file at once (as ``cpuflash warmup``'s
    jobs do for shared helpers): every entry is kept and loads its own data. (Unlocked, Numba's
    saves lose entries and point some at the other process's data.)"""
    import subprocess
    import sys

    procs = [subprocess.Popen([sys.executable, "-c", _SAVER, str(tmp_path), who, "1"])
             for who in "ab"]
    assert [p.wait(timeout=300) for p in procs] == [0, 0]
    from numba.core.caching import IndexDataCacheFile
    cache_file = IndexDataCacheFile(str(tmp_path), "toy", ("stamp",))
    for key in [f"{who}{i}" for who in "ab" for i in range(150)]:
        assert cache_file.load(key) == key * 50, key


@pytest.mark.skipif(not _jit.SAVES_LOCKED, reason="no flock on this platform")
def test_cache_saves_wait_for_the_lock(tmp_path):
    import fcntl
    import threading

    from numba.core.caching import IndexDataCacheFile
    cache_file = IndexDataCacheFile(str(tmp_path), "toy", ("stamp",))
    _jit._lock_saves(cache_file)
    with open(_jit.lock_path(cache_file), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process's save, as far as flock can tell
        saver = threading.Thread(target=cache_file.save, args=("key", "data"))
        saver.start()
        saver.join(0.5)
        assert saver.is_alive() and not list(tmp_path.glob("*.nbi"))
        fcntl.flock(lock, fcntl.LOCK_UN)
    saver.join(30)
    assert not saver.is_alive() and cache_file.load("key") == "data"
    # and the kernels' own cache files save that way
    assert forward.forward.compiler._cache._cache_file.save.__name__ == "locked_save"


def test_portable_fallback_runs_as_kernels_of_their_own(monkeypatch):
    """``config.PORTABLE`` picks the portable twins (``_jit.portable_twin``): the same code with
    the module's ``PORTABLE`` constant True, under names and cache files of their own, so the
    SIMD kernels hold no portable code. The twin that runs matches the float64 reference."""
    pairs = ((forward.forward, forward.forward_portable),
             (backward.backward, backward.backward_portable))
    for simd_kernel, twin in pairs:
        assert simd_kernel.py_func.__globals__["PORTABLE"] is False
        assert twin.py_func.__globals__["PORTABLE"] is True
        assert twin.py_func.__code__ is simd_kernel.py_func.__code__
        assert twin.__name__ == f"{simd_kernel.__name__}_portable"
        if hasattr(twin.compiler, "_cache") and hasattr(twin.compiler._cache, "_cache_file"):
            names = {k.compiler._cache._cache_file._index_name for k in (simd_kernel, twin)}
            assert len(names) == 2
    ran = []

    def recording(kern, *args, run=forward.run_shared):
        ran.append(kern.__name__)
        return run(kern, *args)

    monkeypatch.setattr(forward, "run_shared", recording)
    monkeypatch.setattr(backward, "run_shared", recording)
    q, k, v, dout = rands((1, 2, 37, 16), (1, 2, 41, 16), (1, 2, 41, 16), (1, 2, 37, 16))
    for portable in (False, True):
        monkeypatch.setattr(cpuflash.config, "PORTABLE", portable)
        out, lse = cpuflash.attention(q, k, v, causal=True, return_lse=True)
        assert_close_to_reference(out, reference.attention(q, k, v, causal=True), q, k, v,
                                  causal=True)
        grads = cpuflash.attention_backward(dout, q, k, v, out, lse, causal=True)
        expected = reference.attention_backward(dout, q, k, v, causal=True)
        for got, want in zip(grads, expected):
            assert np.max(np.abs(got - want)) < 1e-4 * max(1.0, np.max(np.abs(want)))
    assert ran == ["forward", "backward", "forward_portable", "backward_portable"]


def test_helpers_have_no_python_wrapper_and_calls_from_python_go_to_a_twin():
    """Helpers compile without the wrapper for calls from Python (``_jit.Helper``): kernels
    call them directly, and a call from Python runs a twin ``<name>_py`` compiled with one
    (the same code, its own cache files). Both give the same bits, and the dot product's."""
    helper = decode.dot_rows
    assert isinstance(helper, _jit.Helper)
    assert helper.targetoptions.get("no_cpython_wrapper") is True
    q_s = np.linspace(-1.0, 1.0, 37, dtype=np.float32)
    kf = np.linspace(2.0, -3.0, 80, dtype=np.float32)

    @numba.njit
    def through_jitted_code(q_s, kf):
        return helper(q_s, 0, kf, 5, 37, 32)

    by_python = helper(q_s, 0, kf, 5, 37, 32)
    assert by_python == through_jitted_code(q_s, kf)
    exact = np.dot(q_s.astype(np.float64), kf[5:42].astype(np.float64))
    assert abs(by_python - exact) < 1e-5
    twin = helper.__dict__["_python_twin"]
    assert twin.py_func.__name__ == "dot_rows_py"
    assert twin.py_func.__code__ is helper.py_func.__code__
    assert "no_cpython_wrapper" not in twin.targetoptions


_IR_USER = r"""
import sys
import numba
import numpy as np
from cpuflash._cpu import _ir_only, decode

@numba.njit(cache=True)
def dot_{which}(q_s, kf):
    return decode.dot_rows(q_s, 0, kf, 5, 37, 32)

q_s = np.linspace(-1.0, 1.0, 37, dtype=np.float32)
kf = np.linspace(2.0, -3.0, 80, dtype=np.float32)
got = dot_{which}(q_s, kf)
exact = np.dot(q_s.astype(np.float64), kf[5:42].astype(np.float64))
assert abs(got - exact) < 1e-5, (got, exact)
(cres,) = decode.dot_rows.overloads.values()
assert cres.library.serialize_using_object_code()[1] == _ir_only.IR_KIND
print(sum(decode.dot_rows._cache_hits.values()), sum(decode.dot_rows._cache_misses.values()))
"""


@pytest.mark.skipif(not _ir_only.INSTALLED, reason="this Numba lacks the internals it hooks")
def test_helpers_are_kept_as_ir_and_cached_as_ir(tmp_path):
    """A helper's library is finalized without machine code and saved in the disk cache as
    its IR (``_ir_only``): a first process compiles it for one jitted caller; a second loads
    it from the cache (a hit, no miss) for another, and both callers compute the dot product."""
    import subprocess
    import sys

    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "cache"))
    counts = []
    for which in ("first", "second"):
        script = tmp_path / f"{which}.py"
        script.write_text(_IR_USER.replace("{which}", which))
        run = subprocess.run([sys.executable, str(script)], env=env, capture_output=True,
                             text=True, timeout=300)
        assert run.returncode == 0, run.stderr
        counts.append(tuple(int(n) for n in run.stdout.split()))
    assert counts == [(0, 1), (1, 0)]


_PARFOR_USER = r"""
import sys
import numba
import numpy as np
from numba.core import codegen
from cpuflash._cpu import _ir_only, _jit

_ir_only.PARFORS = sys.argv[1] == "on"
machine_code = []  # the libraries finalized with machine code, by name
finalize_specific = codegen.JITCodeLibrary._finalize_specific

def recorded(library):
    machine_code.append(library.name)
    return finalize_specific(library)

codegen.JITCodeLibrary._finalize_specific = recorded

@_jit.kernel
def softmax_rows(x, out):
    for r in numba.prange(x.shape[0]):
        m = x[r].max()
        e = np.exp(x[r] - m)
        out[r] = e / e.sum()

x = np.linspace(-3.0, 5.0, 7 * 33, dtype=np.float32).reshape(7, 33)
out = np.empty_like(x)
softmax_rows(x, out)
exact = np.exp(x.astype(np.float64) - x.max(axis=1, keepdims=True))
assert np.abs(out - exact / exact.sum(axis=1, keepdims=True)).max() < 1e-6
kernel_libraries = list(machine_code)

@numba.njit(parallel=True)  # a user's own parallel code, compiled outside any Kernel
def doubled(x):
    y = np.empty_like(x)
    for i in numba.prange(x.size):
        y[i] = 2.0 * x[i]
    return y

assert np.array_equal(doubled(x.ravel()), 2.0 * x.ravel())
user_libraries = machine_code[len(kernel_libraries):]
in_between = ("__numba_parfor_gufunc", "parallelgufuncwrapper", "GufuncWrapper")
print(sum(any(s in name for s in in_between) for name in kernel_libraries),
      sum(any(s in name for s in in_between) for name in user_libraries),
      sum(softmax_rows.compiler._cache_hits.values()), out.tobytes().hex())
"""


@pytest.mark.skipif(not _ir_only.INSTALLED, reason="this Numba lacks the internals it hooks")
def test_parallel_loops_of_kernels_are_kept_as_ir(tmp_path):
    """A kernel's parallel loop body and Numba's two wrappers around it (these unoptimized)
    are finalized as IR only (``_ir_only.parfors_as_ir``): no machine code of their own, the
    same bits as with them (``PARFORS`` off), and the kernel cached and loaded as before; a user's own
    ``prange`` code outside the kernels keeps Numba's usual finalization (three in-between
    libraries with machine code)."""
    import subprocess
    import sys

    script = tmp_path / "parfor_user.py"
    script.write_text(_PARFOR_USER)
    runs = {}
    for mode, cache in (("off", "a"), ("on", "b"), ("on", "b")):
        env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / cache))
        run = subprocess.run([sys.executable, str(script), mode], env=env,
                             capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr
        runs.setdefault(mode, []).append(run.stdout.split())
    (off,), (on, loaded) = runs["off"], runs["on"]
    assert off[:3] == ["3", "3", "0"]  # Numba's own way: body and both wrappers compiled
    assert on[:3] == ["0", "3", "0"]  # the kernel's loop as IR; the user's code untouched
    assert loaded[:3] == ["0", "3", "1"]  # the kernel from the cache, nothing compiled
    assert on[3] == off[3] == loaded[3]  # the same bits
