"""Measuring helpers shared by ``cpuflash bench`` and ``bench/``: inputs, FLOP counts, peers,
timing side by side, and peak memory in a fresh subprocess."""
import json
import os
import subprocess
import sys
import time

import numpy as np

from . import reference


def make_qkv(b, h, n, d, dtype=np.float32, seed=0, n_q=None, h_kv=None):
    rng = np.random.default_rng(seed)
    n_q = n if n_q is None else n_q
    h_kv = h if h_kv is None else h_kv
    draw_dtype = np.float64 if dtype == np.float64 else np.float32  # no float64 temporaries

    def draw(shape):
        return rng.standard_normal(shape, dtype=draw_dtype).astype(dtype, copy=False)

    return draw((b, h, n_q, d)), draw((b, h_kv, n, d)), draw((b, h_kv, n, d))


def forward_flops(b, h, n_q, n_k, d, causal):
    """4*B*H*Nq*Nk*D, halved for causal (only the useful work counts), as FIELD_NOTES."""
    flops = 4.0 * b * h * n_q * n_k * d
    return flops / 2 if causal else flops


def naive_attention(q, k, v, causal=False):
    """The textbook numpy version in the input dtype: materializes the (Nq, Nk) scores."""
    s = (q @ np.swapaxes(k, -1, -2)) * q.dtype.type(1.0 / np.sqrt(q.shape[-1]))
    if causal:
        n_q, n_k = s.shape[-2:]
        s = np.where(reference.visible(n_q, n_k, True), s, -np.inf)
    s = np.exp(s - s.max(axis=-1, keepdims=True))
    s /= s.sum(axis=-1, keepdims=True)
    return s @ v


def torch_sdpa():
    """torch's CPU ``scaled_dot_product_attention`` on numpy arrays, or None without torch."""
    try:
        import torch
    except ImportError:
        return None, None
    torch.set_num_threads(_threads())

    def run(q, k, v, causal=False):
        with torch.no_grad():
            return torch.nn.functional.scaled_dot_product_attention(
                torch.from_numpy(q), torch.from_numpy(k), torch.from_numpy(v),
                is_causal=causal).numpy()

    return run, torch.__version__


def torch_sdpa_grad():
    """torch's CPU SDPA forward + autograd backward on numpy arrays: returns (dq, dk, dv)."""
    try:
        import torch
    except ImportError:
        return None
    torch.set_num_threads(_threads())

    def run(q, k, v, dout, causal=False):
        tq, tk, tv = (torch.from_numpy(x).requires_grad_() for x in (q, k, v))
        out = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=causal,
                                                               enable_gqa=True)
        out.backward(torch.from_numpy(dout))
        return tq.grad.numpy(), tk.grad.numpy(), tv.grad.numpy()

    return run


def _threads():
    import numba
    return numba.get_num_threads()


def time_side_by_side(fns, repeats=5, budget_s=10.0, settle_s=0.5):
    """Best-of-``repeats`` seconds of each zero-argument callable, interleaved round by round
    so that machine noise hits all of them alike. Each is called once first (warm-up).

    Do not interleave the naive numpy peer with the others: OpenBLAS's threads spin after each
    call and steal the cores from whatever runs next (measured: cpuflash 40 % slower, and
    2.3x slower for a few calls after the float64 reference's matmul). For the same reason it
    first waits ``settle_s`` for any earlier BLAS call's threads to go to sleep."""
    time.sleep(settle_s)
    for fn in fns.values():
        fn()
    best = {name: float("inf") for name in fns}
    start = time.perf_counter()
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t0)
        if time.perf_counter() - start > budget_s:
            break
    return best


_MEMORY_SCRIPT = r"""
import json, resource, sys
import numpy as np
import cpuflash
from cpuflash import _measure

def rss_kib(field):
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:  # no /proc: the lifetime peak, an over-estimate of the growth
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

args = json.loads(sys.argv[1])
if args["impl"] == "torch":  # torch's SDPA (started before Numba's pool) on the same arrays;
    run, _ = _measure.torch_sdpa()  # its fresh output (N*D floats) is subtracted below
    run(*_measure.make_qkv(1, 1, 8, args["d"]), args["causal"])
q, k, v = _measure.make_qkv(1, 1, 8, args["d"])
cpuflash.attention_vjp(q, k, v, q, causal=args["causal"])  # compile / load kernels first
q, k, v = _measure.make_qkv(args["b"], args["h"], args["n"], args["d"])
out = np.zeros_like(q)  # touched: its pages count as the output's, not as growth
if args["impl"] == "cpuflash-grad":  # inputs, output, lse and gradients exist beforehand
    dout = np.ones_like(q)
    out, lse = cpuflash.attention(q, k, v, causal=args["causal"], return_lse=True)
    grads = [np.ones_like(x) for x in (q, k, v)]
try:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak (VmHWM) to the current RSS
except OSError:
    pass
before = rss_kib("VmRSS")  # if the reset failed, growth is over- never under-estimated
if args["impl"] == "cpuflash":
    cpuflash.attention(q, k, v, causal=args["causal"], out=out)
elif args["impl"] == "cpuflash-grad":
    del grads  # the call returns fresh gradients: same bytes as those just freed
    grads = cpuflash.attention_backward(dout, q, k, v, out, lse, causal=args["causal"])
elif args["impl"] == "torch":
    out = run(q, k, v, args["causal"])
else:
    out[...] = _measure.naive_attention(q, k, v, args["causal"])
after = rss_kib("VmHWM")
fresh = q.nbytes if args["impl"] == "torch" else 0
print(json.dumps({"growth_bytes": (after - before) * 1024 - fresh}))
"""


def peak_memory_growth(b, h, n, d, causal=False, impl="cpuflash"):
    """Peak RSS growth in bytes of one call in a fresh process, beyond its inputs and outputs
    and the loaded kernels. ``impl``: "cpuflash" (forward; q/k/v/out exist beforehand),
    "cpuflash-grad" (backward; q/k/v/dout/out/lse and gradient-sized arrays exist beforehand,
    and are freed just before the call, which makes new gradients of the same size), "naive",
    "torch" (torch's SDPA; its fresh output is not counted)."""
    args = json.dumps({"b": b, "h": h, "n": n, "d": d, "causal": causal, "impl": impl})
    env = dict(os.environ)
    proc = subprocess.run([sys.executable, "-c", _MEMORY_SCRIPT, args], capture_output=True,
                          text=True, env=env, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"memory probe failed: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])["growth_bytes"]


def max_error_vs_reference(out, q, k, v, causal, heads=1):
    """Max abs error of ``out`` against the float64 reference, on the first ``heads`` heads."""
    h = min(heads, q.shape[1])
    ref = reference.attention(q[:1, :h], k[:1, : max(1, h * k.shape[1] // q.shape[1])],
                              v[:1, : max(1, h * k.shape[1] // q.shape[1])], causal=causal)
    return float(np.max(np.abs(out[:1, :h].astype(np.float64) - ref)))


def max_grad_error_vs_reference(grads, q, k, v, dout, causal, heads=1):
    """Max abs error of (dq, dk, dv) against the float64 reference, on the first query heads
    (and the kv heads they read; with GQA a kv head's gradient sums its whole group, so the
    whole group is taken)."""
    group = q.shape[1] // k.shape[1]
    hq = max(group, min(heads, q.shape[1]) // group * group)
    hk = hq // group
    want = reference.attention_backward(dout[:1, :hq], q[:1, :hq], k[:1, :hk], v[:1, :hk],
                                        causal=causal)
    got = (grads[0][:1, :hq], grads[1][:1, :hk], grads[2][:1, :hk])
    return max(float(np.max(np.abs(g.astype(np.float64) - w))) for g, w in zip(got, want))
