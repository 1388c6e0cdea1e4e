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


def torch_decode():
    """torch's CPU SDPA for a decode step on numpy arrays (GQA through ``enable_gqa``), float32
    K/V; None without torch."""
    try:
        import torch
    except ImportError:
        return None
    torch.set_num_threads(_threads())

    def run(q, k, v):
        with torch.no_grad():
            return torch.nn.functional.scaled_dot_product_attention(
                torch.from_numpy(q), torch.from_numpy(k), torch.from_numpy(v),
                enable_gqa=True).numpy()

    return run


def decode_cache(k, v, cache_dtype, layers=1):
    """``(cache, nbytes)``: a ``cpuflash.KVCache`` in ``cache_dtype`` ("float32", "float16",
    "bfloat16", "int8") of ``layers`` layers, each holding ``k``, ``v``; and the unique bytes a
    decode step over one layer reads (its keys, values and int8 scales)."""
    import cpuflash
    n_b, n_h, n_k, d = k.shape
    cache = cpuflash.KVCache(layers, n_b, n_h, n_k, d, v_head_dim=v.shape[3], dtype=cache_dtype)
    for layer in range(layers):
        cache.append(layer, k, v)
    return cache, step_bytes(k.shape, v.shape[3], cache_dtype)


def step_bytes(k_shape, dv, cache_dtype):
    """The unique bytes a decode step reads from a cache in ``cache_dtype`` holding keys of
    ``k_shape`` (B, Hkv, Nk, D) and values of head dim ``dv``: K, V and int8's two float32
    scales per token and head."""
    n_b, n_h, n_k, d = k_shape
    itemsize = 2 if cache_dtype == "bfloat16" else np.dtype(cache_dtype).itemsize
    per_token = (d + dv) * itemsize + (8 if cache_dtype == "int8" else 0)
    return n_b * n_h * n_k * per_token


COLD_BYTES = 600 << 20  # more than twice this machine's L3 (260 MiB): K/V come from DRAM


DECODE_REPEATS = 100  # hot steps; a cold step runs a model's worth of layers: 20 of those
# Seconds of rounds per implementation after which a decode case stops early: torch's
# 10 ms hot step gets its best of ~50, a cold step of 19 layers (0.2 s) its best of ~10.
DECODE_BUDGET_S = 0.5
COLD_DECODE_BUDGET_S = 2.0


def layers_for(layer_bytes, cold):
    """Layers a decode step runs in turn: a model's worth (``COLD_BYTES`` together, so that
    K/V come from DRAM) if ``cold``, else one (called again and again, it stays in the caches
    if it fits)."""
    return max(1, -(-COLD_BYTES // layer_bytes)) if cold else 1


def decode_step(q, k, v, cache_dtype, cold):
    """``(step, layers, layer_bytes, cache)``: a zero-argument callable that runs one decode
    step of ``q`` over each of ``layers`` layers of a ``KVCache`` in ``cache_dtype`` holding
    ``k``, ``v`` (``layers_for``), the unique bytes one layer reads, and the cache."""
    layer_bytes = step_bytes(k.shape, v.shape[3], cache_dtype)
    layers = layers_for(layer_bytes, cold)
    cache = decode_cache(k, v, cache_dtype, layers)[0]

    def step():
        for layer in range(layers):
            cache.attention(layer, q)

    return step, layers, layer_bytes, cache


def torch_decode_step(torch_run, q, k, v, cold):
    """``(step, layers)``: ``torch_run`` (``torch_decode``) over as many copies of the float32
    ``k``, ``v`` in turn (``layers_for``)."""
    layers = layers_for(k.nbytes + v.nbytes, cold)
    kv32 = [(k, v)] + [(k.copy(), v.copy()) for _ in range(layers - 1)]

    def step():
        for k_l, v_l in kv32:
            torch_run(q, k_l, v_l)

    return step, layers


def decode_case(h_kv, n_k, cache_dtype, cold=False, h_q=8, d=64, torch_run=None, seed=0):
    """Time one decode step (B=1, Nq=1, ``h_q`` query heads, D=64) of cpuflash on a K/V cache
    in ``cache_dtype`` and of torch's SDPA on the float32 K/V, side by side; with the machine's
    streaming-read bandwidth for the same bytes.

    ``cold``: a model's worth of layers of one ``KVCache``, each holding the same K/V, at least
    ``COLD_BYTES`` together, run one after another as a forward step through a model does, so
    that K/V come from DRAM; else one layer, called again and again, which stays in the
    caches if it fits. Returns a dict: ``ms`` per layer, ``gbs`` (unique K/V bytes read per
    second, int8 scales included), ``stream_gbs``, ``torch_ms``, ``vs_torch``, ``err`` (max
    abs error against the float64 reference on the float32 K/V, i.e. with the cache format's
    rounding)."""
    q, k, v = make_qkv(1, h_q, n_k, d, n_q=1, h_kv=h_kv, seed=seed)
    step, layers, layer_bytes, cache = decode_step(q, k, v, cache_dtype, cold)
    fns = {"cpuflash": step}
    per_layer = {"cpuflash": layers}
    if torch_run is not None:
        fns["torch"], per_layer["torch"] = torch_decode_step(torch_run, q, k, v, cold)
    # Each library in its own block, not interleaved: a decode step is short, and the idle
    # OpenMP threads of the other library spin for a while after each of its calls, on the
    # cores this one needs (measured: cpuflash 0.87 ms alone, 1.35 ms interleaved with torch).
    # Best of as many for each and for the streaming read beside it: a hot step is short
    # and its best of a few is mostly noise (measured: best of 10 0.81-0.86 ms, of 200 0.75).
    # From DRAM the streaming read runs interleaved with cpuflash's steps, round by round (the
    # same thread pool): this machine's DRAM bandwidth drifts with its neighbours' load
    # (stop 33: 21-47 GB/s within a session), and read seconds apart the two saw different
    # machines. Hot, each keeps its own block, or each would evict the other from the caches.
    repeats = 20 if cold else DECODE_REPEATS
    budget_s = COLD_DECODE_BUDGET_S if cold else DECODE_BUDGET_S
    read, n_read = stream_reader(layer_bytes * layers)
    blocks = [{"cpuflash": step, "stream": read}] if cold else [{"cpuflash": step},
                                                                {"stream": read}]
    blocks += [{"torch": fns["torch"]}] if "torch" in fns else []
    best = {}
    for block in blocks:
        best.update(time_side_by_side(block, repeats=repeats, budget_s=budget_s))
    t = best["cpuflash"] / layers
    row = {"Hq": h_q, "Hkv": h_kv, "Nk": n_k, "D": d, "cache": cache_dtype,
           "mode": f"cold x{layers}" if cold else "hot", "ms": t * 1e3,
           "gbs": layer_bytes / t / 1e9,
           "stream_gbs": n_read / best["stream"] / 1e9,
           "err": float(np.max(np.abs(cache.attention(0, q).astype(np.float64)
                                      - decode_reference(q, k, v))))}
    row["of_stream"] = row["gbs"] / row["stream_gbs"]
    if "torch" in best:
        row["torch_ms"] = best["torch"] / per_layer["torch"] * 1e3
        row["vs_torch"] = row["torch_ms"] / row["ms"]
    return row


def decode_reference(q, k, v):
    """``reference.attention(q, k, v)`` for one decode step (``Nq = 1``, no option): each kv
    head's group of query heads as the rows of one call against that head's K and V, which are
    then not repeated for every query head of the group (as ``reference.attention`` does for
    GQA: at Hkv=2, Nk=32768, 4.3 s of ``cpuflash bench``'s decode section, stop 61)."""
    n_b, n_hq, n_q, d = q.shape
    n_hkv = k.shape[1]
    if n_q != 1:
        raise ValueError(f"q: expected one query row, got {n_q}")
    rows = q.reshape(n_b, n_hkv, n_hq // n_hkv, d)  # query head hk * group + g: row g of hk
    return reference.attention(rows, k, v).reshape(n_b, n_hq, 1, v.shape[3])


def stream_reader(nbytes):
    """``(read, nbytes_read)``: a zero-argument callable that makes the machine's parallel
    streaming read of a buffer of about ``nbytes`` (one vector sum per thread, the threads of
    the kernels), and the bytes it reads."""
    from ._cpu.pack import on_line
    from ._cpu.stream import stream_sum
    buf = on_line((max(nbytes // 4, 1),), np.float32)  # on a cache line, as KVCache's arrays
    buf[:] = 1.0
    return (lambda: stream_sum(buf)), buf.nbytes


def stream_read_bandwidth(nbytes, repeats=20):
    """Bytes per second of the machine's best parallel streaming read of a buffer of
    ``nbytes`` (``stream_reader``): what a decode step that reads that many bytes of K/V could
    reach at most. The buffer is read twice first, so like a decode step's K/V it sits in
    whatever cache level its size allows."""
    read, n_read = stream_reader(nbytes)
    read()
    read()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        read()
        best = min(best, time.perf_counter() - t0)
    return n_read / best


def _threads():
    import numba
    return numba.get_num_threads()


def time_side_by_side(fns, repeats=5, budget_s=10.0, settle_s=0.25, reduce=min):
    """Best-of-``repeats`` seconds of each zero-argument callable, interleaved round by round
    so that machine noise hits all of them alike. Each is called once first (warm-up).
    ``reduce``: what makes one figure of each callable's times (``min``; ``np.median`` in
    ``medians_side_by_side``).

    Do not interleave the naive numpy peer with the others: OpenBLAS's threads spin after each
    call and steal the cores from whatever runs next (measured: cpuflash 40 % slower, and
    2.3x slower for a few calls after the float64 reference's matmul). For the same reason it
    first waits ``settle_s`` for any earlier BLAS call's threads to go to sleep (OpenBLAS
    spins about 2**28 cycles, 0.1 s; a 2048 x 2048 float64 matmul then 0.25 s of sleep:
    cpuflash's next call at its usual time, 93 ms after 0.1 s against 73-79 after 0.25-0.5)."""
    time.sleep(settle_s)
    for fn in fns.values():
        fn()
    times = {name: [] for name in fns}
    start = time.perf_counter()
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
        if time.perf_counter() - start > budget_s:
            break
    return {name: float(reduce(t)) for name, t in times.items()}


def medians_side_by_side(fns, rounds):
    """Median seconds of each zero-argument callable over ``rounds`` calls, interleaved call by
    call after one warm-up call each (``time_side_by_side``, no time budget): the A/B scripts'
    measure (``bench/cpu_ab.py``, ``bench/cpu_sinks_cost.py``)."""
    return time_side_by_side(fns, repeats=rounds, budget_s=float("inf"), settle_s=0.0,
                             reduce=np.median)


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

def options(b, h, n):  # the call's options: causal only, or every option at once
    if not args.get("every_option"):
        return {"causal": args["causal"]}
    return {"causal": True, "window": (max(1, n // 4), 0), "kv_lens": np.full(b, max(1, n - 3)),
            "alibi_slopes": np.full(h, 0.01), "softcap": 30.0, "dropout_p": 0.1, "seed": 1,
            "mask": np.ones((b, 1, 1, n), bool)}

if args["impl"] == "torch":  # torch's SDPA (started before Numba's pool) on the same arrays;
    run, _ = _measure.torch_sdpa()  # its fresh output (N*D floats) is subtracted below
    run(*_measure.make_qkv(1, 1, 8, args["d"]), args["causal"])
for n in (8, 256):  # compile / load the kernels first: N=8 takes the decode path, N=256 the
    q, k, v = _measure.make_qkv(1, 1, n, args["d"])  # tiled one and a backward in key
    cpuflash.attention_vjp(q, k, v, q, **options(1, 1, n))  # chunks (finish_dq)
q, k, v = _measure.make_qkv(args["b"], args["h"], args["n"], args["d"])
opts = options(args["b"], args["h"], args["n"])
out = np.zeros_like(q)  # touched: its pages count as the output's, not as growth
if args["impl"] == "cpuflash-grad":  # inputs, output, lse and gradients exist beforehand
    dout = np.ones_like(q)
    out, lse = cpuflash.attention(q, k, v, return_lse=True, **opts)
    grads = [np.ones_like(x) for x in (q, k, v)]
try:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak (VmHWM) to the current RSS
except OSError:
    pass
before = rss_kib("VmRSS")  # if the reset failed, growth is over- never under-estimated
if args["impl"] == "cpuflash":
    cpuflash.attention(q, k, v, out=out, **opts)
elif args["impl"] == "cpuflash-grad":
    del grads  # the call returns fresh gradients: same bytes as those just freed
    grads = cpuflash.attention_backward(dout, q, k, v, out, lse, **opts)
elif args["impl"] == "torch":
    out = run(q, k, v, args["causal"])
else:
    out[...] = _measure.naive_attention(q, k, v, args["causal"])
after = rss_kib("VmHWM")
fresh = q.nbytes if args["impl"] == "torch" else 0
print(json.dumps({"growth_bytes": (after - before) * 1024 - fresh}))
"""


def peak_memory_growth(b, h, n, d, causal=False, impl="cpuflash", every_option=False):
    """Peak RSS growth in bytes of one call in a fresh process, beyond its inputs and outputs
    and the loaded kernels. ``impl``: "cpuflash" (forward; q/k/v/out exist beforehand),
    "cpuflash-grad" (backward; q/k/v/dout/out/lse and gradient-sized arrays exist beforehand,
    and are freed just before the call, which makes new gradients of the same size), "naive",
    "torch" (torch's SDPA; its fresh output is not counted). ``every_option`` (cpuflash only):
    causal, a window of N/4 keys, kv_lens, ALiBi, softcap, dropout and a key-padding mask at
    once, in place of ``causal``."""
    args = json.dumps({"b": b, "h": h, "n": n, "d": d, "causal": causal, "impl": impl,
                       "every_option": every_option})
    env = dict(os.environ)
    proc = subprocess.run([sys.executable, "-c", _MEMORY_SCRIPT, args], capture_output=True,
                          text=True, env=env, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"memory probe failed: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])["growth_bytes"]


def peak_memory_growths(probes, processes=None):
    """``peak_memory_growth`` of each of ``probes`` (dicts of its keyword arguments), in
    fresh processes run ``processes`` at a time (default: the CPU count). Each process
    measures its own RSS, so running them side by side changes no figure; only the time of
    the set does (they are run before, not while, anything is timed)."""
    from concurrent.futures import ThreadPoolExecutor
    workers = max(1, min(len(probes), processes or os.cpu_count() or 1))
    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(lambda p: peak_memory_growth(**p), probes))


def max_error_vs_reference(out, q, k, v, causal, heads=1):
    """Max abs error of ``out`` against the float64 reference, on the first ``heads`` heads."""
    return max_errors_vs_reference([out], q, k, v, causal, heads)[0]


REFERENCE_ROWS = 1024  # query rows per reference call (``max_errors_vs_reference``)


def max_errors_vs_reference(outs, q, k, v, causal, heads=1):
    """``max_error_vs_reference`` of each of ``outs`` (cpuflash's, torch's: outputs of the same
    inputs) against one float64 reference, computed once, ``REFERENCE_ROWS`` query rows at a
    time (each row's output is its own: causal as a bool mask of the block's rows, aligned to
    the end as ``causal``). The same numbers as all rows in one call, which at N=8192 held a
    512 MiB score matrix and a few temporaries of its size: 15.1 s for one causal head against
    1.7 s in blocks (stop 61), most of ``cpuflash bench``'s forward section."""
    h = min(heads, q.shape[1])
    h_kv = max(1, h * k.shape[1] // q.shape[1])
    n_q, n_k = q.shape[2], k.shape[2]
    worst = [0.0] * len(outs)
    for r0 in range(0, n_q, REFERENCE_ROWS):
        r1 = min(n_q, r0 + REFERENCE_ROWS)
        mask = (np.arange(n_k)[None, :] <= np.arange(r0, r1)[:, None] + (n_k - n_q)
                if causal else None)
        ref = reference.attention(q[:1, :h, r0:r1], k[:1, :h_kv], v[:1, :h_kv], mask=mask)
        for i, out in enumerate(outs):
            err = float(np.max(np.abs(out[:1, :h, r0:r1].astype(np.float64) - ref)))
            worst[i] = max(worst[i], err)
    return worst


def max_grad_error_vs_reference(grads, q, k, v, dout, causal, heads=1):
    """Max abs error of (dq, dk, dv) against the float64 reference, on the first query heads
    (and the kv heads they read; with GQA a kv head's gradient sums its whole group, so the
    whole group is taken)."""
    return max_grad_errors_vs_reference([grads], q, k, v, dout, causal, heads)[0]


def max_grad_errors_vs_reference(grads_list, q, k, v, dout, causal, heads=1):
    """``max_grad_error_vs_reference`` of each (dq, dk, dv) of ``grads_list`` against one
    float64 reference backward, computed once."""
    group = q.shape[1] // k.shape[1]
    hq = max(group, min(heads, q.shape[1]) // group * group)
    hk = hq // group
    want = reference.attention_backward(dout[:1, :hq], q[:1, :hq], k[:1, :hk], v[:1, :hk],
                                        causal=causal)
    errors = []
    for grads in grads_list:
        got = (grads[0][:1, :hq], grads[1][:1, :hk], grads[2][:1, :hk])
        errors.append(max(float(np.max(np.abs(g.astype(np.float64) - w)))
                          for g, w in zip(got, want)))
    return errors
