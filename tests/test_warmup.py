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
                                  "decode-float16:float32", "decode-int8:float32"]
    # float16 computes in float32; the cache-type decode families exist for float32 only
    assert warmup.job_names(("float16",), ["forward"]) == ["forward:float32"]
    assert warmup.job_names(("float64",)) == ["forward:float64", "backward:float64",
                                              "decode:float64"]


@pytest.mark.parametrize("names, processes, match", [
    (["forward:float16"], None, "unknown job 'forward:float16'"),
    (["sideways:float32"], None, "unknown job"),
    (["forward"], None, "unknown job"),
    (["forward:float32"], -1, "processes must be at least 1"),
])
def test_bad_jobs_are_refused_before_any_process(names, processes, match, monkeypatch):
    monkeypatch.setattr(warmup.subprocess, "run", None)  # a started process would fail
    with pytest.raises(ValueError, match=match):
        warmup.precompile(names, processes=processes)


def test_unknown_job_in_the_job_process():
    with pytest.raises(ValueError, match="unknown warm-up job"):
        warmup.run_job("decode-int8:float64")


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
