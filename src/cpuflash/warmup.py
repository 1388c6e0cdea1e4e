"""Compile the CPU kernels ahead of their first use, several processes at once.

Numba compiles one function at a time on one core, and the kernels here take 25-45 s each
(forward, backward, one decode kernel per K/V cache type) on this project's 2-core machines.
What it compiles goes to its on-disk cache, which every later process reads in well under a
second. ``precompile`` runs one small call per kernel family (``JOBS``), each in a fresh
process, as many at once as there are cores: on a fresh machine the compilation takes about
as long as its longest part instead of the sum of all of them. Where the cache already holds a
kernel, its job only loads it (a second or two, mostly the import of numba).

The jobs call the public API on tiny shapes; the kernels compile once per dtype combination,
whatever the shapes (``_cpu/_jit.Kernel``), so what they compile is what larger calls use.
"""
import numbers
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from . import config
from ._cpu import _jit

# The families, each one process: (name, compute dtype). float16 inputs compute in float32,
# so "float32" covers them; the decode kernel compiles once per K/V storage type.
JOBS = {
    "forward": ("float32", "float64"),
    "backward": ("float32", "float64"),
    "decode": ("float32", "float64"),
    "decode-float16": ("float32",),
    "decode-bfloat16": ("float32",),
    "decode-int8": ("float32",),
}


FLOAT_DTYPES = ("float16", "float32", "float64")


def _sequence(value, name):
    """``value`` as a list, for arguments that take several names: a lone string would be
    taken letter by letter."""
    if isinstance(value, (str, bytes)):
        raise TypeError(f"{name}: expected a list or tuple of names, got the string {value!r}")
    return list(value)


def _dtype_name(d):
    try:
        return np.dtype(d).name
    except TypeError:  # not a dtype at all
        return None


def job_names(dtypes=("float32",), kinds=None):
    """``kind:dtype`` names of the jobs for ``dtypes`` (float16, float32, float64; float16
    computes in float32) and ``kinds`` (keys of ``JOBS``; None for all)."""
    dtypes = _sequence(dtypes, "dtypes")
    bad = [d for d in dtypes if _dtype_name(d) not in FLOAT_DTYPES]
    if bad:
        raise ValueError(f"dtypes: expected some of {FLOAT_DTYPES}, got {bad}")
    if kinds is not None:
        kinds = _sequence(kinds, "kinds")
        unknown = [k for k in kinds if k not in JOBS]
        if unknown:
            raise ValueError(f"kinds: expected some of {list(JOBS)}, got {unknown}")
    wanted = {"float32" if _dtype_name(d) == "float16" else _dtype_name(d) for d in dtypes}
    names = []
    for kind, dtypes_of_kind in JOBS.items():
        if kinds is not None and kind not in kinds:
            continue
        names += [f"{kind}:{d}" for d in dtypes_of_kind if d in wanted]
    return names


def _check_job(name, who):
    """``name`` split into ``(kind, dtype)``; ValueError naming ``who`` unless it is a job."""
    kind, _, dtype = str(name).partition(":")
    if dtype not in JOBS.get(kind, ()):
        raise ValueError(f"{who}: unknown job {name!r}; expected one of "
                         f"{job_names(('float32', 'float64'))}")
    return kind, dtype


def run_job(name):
    """Run job ``name`` (``kind:dtype``) in this process: a tiny call that compiles, or loads
    from the cache, that family's kernels."""
    import cpuflash
    kind, dtype = _check_job(name, "run_job")
    rng = np.random.default_rng(0)
    dt = np.dtype(dtype)
    # Nq above the decode path's limit (decode.MAX_NQ) for the tiled kernels, 1 for decode
    n_q = 1 if kind.startswith("decode") else 40
    q = rng.standard_normal((1, 2, n_q, 16)).astype(dt)
    k, v = (rng.standard_normal((1, 2, 40, 16)).astype(dt) for _ in range(2))
    if kind == "forward":  # dense, then packed sequences (the same kernel, their own packing)
        cpuflash.attention(q, k, v, return_lse=True)
        cu = np.array([0, 15, 40])
        cpuflash.attention_varlen(q[0].transpose(1, 0, 2), k[0].transpose(1, 0, 2),
                                  v[0].transpose(1, 0, 2), cu, cu)
    elif kind == "backward":  # out and lse from the reference: no forward kernel compiled here
        out, lse = cpuflash.reference.attention(q, k, v, return_lse=True)
        cpuflash.attention_backward(q, q, k, v, out.astype(dt), lse.astype(dt))
    else:  # decode, from a KVCache in the job's storage type
        store = kind.split("-")[1] if "-" in kind else dtype
        cache = cpuflash.KVCache(1, 1, 2, 40, 16, dtype=store)
        cache.append(0, k, v)
        cache.attention(0, q)


def precompile(names=None, processes=None, timeout_s=900):
    """Compile (or load) the kernels of the jobs ``names`` (``job_names()``'s: the float32
    ones if None) in separate processes, ``processes`` at a time (default: the CPU count),
    each given ``timeout_s`` seconds.
    Returns ``{name: (seconds, error text or None)}``; a failed job is reported, not raised:
    the kernel then compiles in the process that calls it, as without a warm-up. Returns {}
    where kernels are not cached (``CPUFLASH_DISABLE_CACHE``, or no writable cache location,
    where ``_cpu/_jit.py`` compiles in memory): a warm-up would be lost."""
    from . import api  # noqa: F401  (imports the kernel modules: their cache fallbacks known)
    if not config.CACHE_ENABLED or _jit.cache_fallbacks:
        return {}
    names = job_names() if names is None else _sequence(names, "names")
    for name in names:
        _check_job(name, "precompile")
    if processes is not None and (isinstance(processes, bool)
                                  or not isinstance(processes, numbers.Integral)):
        raise TypeError(f"precompile: processes must be an integer or None, got {processes!r}")
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, numbers.Real):
        raise TypeError(f"precompile: timeout_s must be a number, got {timeout_s!r}")
    if not timeout_s > 0:
        raise ValueError(f"precompile: timeout_s must be positive, got {timeout_s}")
    processes = (os.cpu_count() or 1) if processes is None else int(processes)
    if processes < 1:
        raise ValueError(f"precompile: processes must be at least 1, got {processes}")
    if not _jit.SAVES_LOCKED:  # concurrent saves could mix up cache entries (_cpu/_jit.py)
        processes = 1
    # One thread per job process: the tiny calls need no more, and the compilations none.
    env = dict(os.environ, NUMBA_NUM_THREADS="1")
    code = "import sys; from cpuflash.warmup import run_job; run_job(sys.argv[1])"

    def one(name):
        start = time.perf_counter()
        try:
            proc = subprocess.run([sys.executable, "-c", code, name], capture_output=True,
                                  text=True, env=env, timeout=timeout_s)
            error = None if proc.returncode == 0 else proc.stderr[-2000:] or "failed"
        except subprocess.TimeoutExpired:
            error = f"timed out after {timeout_s} s"
        except OSError as exc:  # no interpreter to start (an embedded Python, say)
            error = f"could not start {sys.executable!r}: {exc}"
        return name, (time.perf_counter() - start, error)

    # Longest first (the backward and decode kernels), so the last to start is a short one.
    order = sorted(names, key=lambda n: n.startswith("forward"))
    with ThreadPoolExecutor(max_workers=min(processes, max(1, len(order)))) as pool:
        done = dict(pool.map(one, order))
    return {name: done[name] for name in names}
