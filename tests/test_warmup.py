"""``cpuflash warmup`` / ``warmup.precompile``: the kernels compiled into Numba's cache by
processes of their own, so that a later process loads them instead of compiling."""
import json
import os
import subprocess
import sys

import pytest

from cpuflash import config, warmup


def test_job_names():
    assert warmup.job_names() == ["forward:float32", "backward:float32", "decode:float32",
                                  "decode-float16:float32", "decode-bfloat16:float32",
                                  "decode-int8:float32"]
    # float16 computes in float32; the cache-type decode families exist for float32 only
    assert warmup.job_names(("float16",), ["forward"]) == ["forward:float32"]
    assert warmup.job_names(("float64",)) == ["forward:float64", "backward:float64",
                                              "decode:float64"]


@pytest.mark.parametrize("dtypes, kinds, error, match", [
    (("int8",), None, ValueError, r"dtypes: expected some of .*\['int8'\]"),
    (("no such type",), None, ValueError, "dtypes: expected"),
    ("float32", None, TypeError, "dtypes: expected a list"),
    (("float32",), ["forwards"], ValueError, r"kinds: expected some of .*\['forwards'\]"),
    (("float32",), "forward", TypeError, "kinds: expected a list"),
])
def test_bad_job_names_arguments(dtypes, kinds, error, match):
    with pytest.raises(error, match=match):
        warmup.job_names(dtypes, kinds)


@pytest.mark.parametrize("names, kwargs, error, match", [
    (["forward:float16"], {}, ValueError, "precompile: unknown job 'forward:float16'"),
    (["sideways:float32"], {}, ValueError, "unknown job"),
    (["forward"], {}, ValueError, "unknown job"),
    ("forward:float32", {}, TypeError, "names: expected a list"),
    (["forward:float32"], {"processes": -1}, ValueError, "processes must be at least 1"),
    (["forward:float32"], {"processes": 0}, ValueError, "processes must be at least 1"),
    (["forward:float32"], {"processes": 1.5}, TypeError, "processes must be an integer"),
    (["forward:float32"], {"processes": True}, TypeError, "processes must be an integer"),
    (["forward:float32"], {"timeout_s": 0}, ValueError, "timeout_s must be positive"),
    (["forward:float32"], {"timeout_s": "60"}, TypeError, "timeout_s must be a number"),
])
def test_bad_jobs_are_refused_before_any_process(names, kwargs, error, match, monkeypatch):
    monkeypatch.setattr(warmup.subprocess, "run", None)  # a started process would fail
    with pytest.raises(error, match=match):
        warmup.precompile(names, **kwargs)


@pytest.mark.parametrize("name", ["decode-int8:float64", "forward"])
def test_unknown_job_in_the_job_process(name):
    with pytest.raises(ValueError, match="run_job: unknown job"):
        warmup.run_job(name)


def test_processes_default_to_the_cpu_count(monkeypatch):
    """None: as many at once as there are cores (each job sees how many run beside it)."""
    import threading
    running, most = [0], [0]
    lock = threading.Lock()

    def fake_run(*args, **kwargs):
        import time
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        time.sleep(0.2)
        with lock:
            running[0] -= 1
        return subprocess.CompletedProcess(args, 0, "", "")

    monkeypatch.setattr(warmup.subprocess, "run", fake_run)
    monkeypatch.setattr(warmup.os, "cpu_count", lambda: 3)
    results = warmup.precompile(warmup.job_names(("float32", "float64")))
    assert len(results) == 9 and not any(err for _, err in results.values())
    assert most[0] == (3 if warmup._jit.SAVES_LOCKED else 1)


@pytest.mark.parametrize("why", ["disabled", "unwritable"])
def test_without_a_cache_nothing_runs(why, monkeypatch):
    from cpuflash._cpu import _jit
    if why == "disabled":  # CPUFLASH_DISABLE_CACHE=1
        monkeypatch.setattr(config, "CACHE_ENABLED", False)
    else:  # kernels compiled in memory: no writable cache location at import
        monkeypatch.setattr(_jit, "cache_fallbacks", ["forward"])
    monkeypatch.setattr(warmup.subprocess, "run", None)
    assert warmup.precompile() == {}


@pytest.mark.parametrize("executable", ["false", "/nonexistent/python"])
def test_a_failed_job_is_reported_not_raised(executable, monkeypatch):
    # "false" exits 1 whatever its arguments; the other cannot be started at all
    monkeypatch.setattr(warmup.sys, "executable", executable)
    (seconds, error), = warmup.precompile(["decode:float32"]).values()
    assert seconds >= 0 and error


def test_warmup_fills_an_empty_cache(tmp_path):
    """``cpuflash warmup --kind forward`` with an empty cache directory compiles the forward
    kernel there; a new process then loads it (a cache hit, no miss) and computes the right
    numbers with it."""
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path))
    proc = subprocess.run([sys.executable, "-m", "cpuflash", "warmup", "--kind", "forward"],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "forward:float32" in proc.stdout and "FAILED" not in proc.stdout
    assert list(tmp_path.rglob("*.nbi")), "nothing cached"
    check = r"""
import json
import numpy as np
import cpuflash
from cpuflash._cpu import forward
rng = np.random.default_rng(3)
q, k, v = (rng.standard_normal((2, 3, 70, 24)).astype(np.float32) for _ in range(3))
out = cpuflash.attention(q, k, v, causal=True)
err = float(np.abs(out - cpuflash.reference.attention(q, k, v, causal=True)).max())
stats = forward.forward.compiler.stats
print(json.dumps({"hits": sum(stats.cache_hits.values()),
                  "misses": sum(stats.cache_misses.values()), "err": err}))
"""
    proc = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True,
                          env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert found["hits"] == 1 and found["misses"] == 0 and found["err"] < 1e-5, found
