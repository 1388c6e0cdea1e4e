"""Nothing leaks: every public path called again and again holds no more memory than once.

Two ledgers, kept in a fresh process:

* Numba's runtime (NRT) counts every allocation the kernels make (their ``np.empty`` scratch
  inside ``prange`` bodies, arrays they return) and every free; with ``NUMBA_NRT_STATS=1`` the
  counts are readable, and every allocation of the measured rounds must be freed again: an
  exact count.
* ``tracemalloc`` traces Python's allocations and numpy's array buffers. Tracing starts after
  a warm-up; buffers that caches and workspaces replace while traced count as growth once (about
  50 KiB, measured), so the memory held is compared between the ends of two equal windows of
  rounds after that: a leak grows in each. Measured: 6.0-6.6 KiB in the second window of 40
  rounds (three runs); one leaked output of the smallest forward call would be 35 KiB a round.

Both ledgers were checked to fail: a float32 array of 3000 elements kept by each
``attention`` call (traced growth 5.3 MB over the second window), and a Numba-allocated array
of 4 kept by each call (880 allocations more than frees).

The workload touches each path once a round: forward with each kind of mask and modifier,
backward, float16, the decode path (float32 and float16), ``merge``, the varlen pair, a
KVCache's append and step, and bad input rejected before any kernel runs.
"""
import json
import os
import subprocess
import sys

_LEDGERS = r"""
import gc, json, sys, tracemalloc
import numpy as np
import cpuflash
from numba.core.runtime import rtsys

rng = np.random.default_rng(0)
def r(*shape):
    return rng.standard_normal(shape).astype(np.float32)

D = 32
q, k, v, dout = r(1, 4, 70, D), r(1, 2, 90, D), r(1, 2, 90, D), r(1, 4, 70, D)
q_step, k_long, v_long = r(1, 4, 1, D), r(1, 2, 1500, D), r(1, 2, 1500, D)
mask = rng.random((70, 90)) < 0.7
q_packed, k_packed, v_packed, dout_packed = r(70, 4, D), r(90, 2, D), r(90, 2, D), r(70, 4, D)
cu_q, cu_k = np.array([0, 30, 70]), np.array([0, 40, 90])
cache = cpuflash.KVCache(1, 1, 2, 256, D, dtype=np.int8)
k_new, v_new = r(1, 2, 3, D), r(1, 2, 3, D)
options = [{}, {"causal": True}, {"mask": mask, "softcap": 5.0},
           {"window": (20, 0), "alibi_slopes": np.linspace(0.1, 0.4, 4)},
           {"kv_lens": np.array([60]), "dropout_p": 0.1, "seed": 3}]

def workload():
    for opts in options:
        out, lse = cpuflash.attention(q, k, v, return_lse=True, **opts)
        cpuflash.attention_backward(dout, q, k, v, out, lse, **opts)
    cpuflash.attention(*(x.astype(np.float16) for x in (q, k, v)))
    cpuflash.attention(q_step, k_long, v_long)
    cpuflash.attention(q_step, k_long.astype(np.float16), v_long.astype(np.float16))
    parts = [cpuflash.attention(q, k[:, :, s], v[:, :, s], return_lse=True)
             for s in (slice(0, 40), slice(40, 90))]
    cpuflash.merge(*zip(*parts))
    out, lse = cpuflash.attention_varlen(q_packed, k_packed, v_packed, cu_q, cu_k, causal=True,
                                         return_lse=True)
    cpuflash.attention_varlen_backward(dout_packed, q_packed, k_packed, v_packed, out, lse,
                                       cu_q, cu_k, causal=True)
    cache.reset()  # the same shapes every round: caches keyed on them fill once
    cache.append(0, k_new, v_new)
    cache.append(0, k_new, v_new)
    cache.attention(0, q_step)
    for bad in ({"scale": float("nan")}, {"window": (-2, 0)}, {"kv_lens": np.array([91])}):
        try:
            cpuflash.attention(q, k, v, **bad)
        except ValueError:
            pass
        else:
            raise AssertionError(f"{bad} was accepted")

def held():
    gc.collect()
    stats = rtsys.get_allocation_stats()
    return stats.alloc, stats.free, tracemalloc.get_traced_memory()[0]

rounds = int(sys.argv[1])
for _ in range(5):  # compile or load the kernels, fill the caches
    workload()
tracemalloc.start()
alloc_0, free_0, _ = held()
for _ in range(rounds):  # what the caches replace from now on is traced: a first window
    workload()
_, _, traced_1 = held()
for _ in range(rounds):  # a leak grows as much again
    workload()
alloc_2, free_2, traced_2 = held()
print(json.dumps({"allocs": alloc_2 - alloc_0, "frees": free_2 - free_0,
                  "traced_growth": traced_2 - traced_1}))
"""

ROUNDS = 40
TRACED_SLACK = 64 << 10  # bytes over ROUNDS rounds (see the module's docstring)


def test_repeated_calls_hold_no_more_memory():
    env = dict(os.environ, NUMBA_NRT_STATS="1")
    proc = subprocess.run([sys.executable, "-c", _LEDGERS, str(ROUNDS)], env=env,
                          capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ledger = json.loads(proc.stdout.strip().splitlines()[-1])
    assert ledger["allocs"] >= ROUNDS, ledger  # the ledger saw the kernels' scratch
    assert ledger["frees"] == ledger["allocs"], ledger  # and all of it freed again
    assert ledger["traced_growth"] < TRACED_SLACK, ledger
