"""``cpuflash`` / ``python -m cpuflash``: bench, warmup, info and demo."""
import argparse
import json
import os
import platform
import sys
import time

import numpy as np

from . import warmup

# (B, H, N, D, causal): the main job on built-in defaults, about a minute with torch installed
# and the kernels in the cache: the shapes the targets name. ``--long``: the whole sweep.
DEFAULT_SHAPES = [
    (1, 8, 512, 64, False),
    (1, 8, 512, 128, False),
    (1, 8, 2048, 64, False),
    (1, 8, 2048, 64, True),
    (1, 8, 8192, 64, True),
]
LONG_SHAPES = DEFAULT_SHAPES + [
    (1, 8, 2048, 128, False),
    (1, 8, 512, 64, True),
    (1, 8, 8192, 64, False),
    (1, 8, 8192, 128, True),
    (1, 8, 2048, 128, True),
]
BACKWARD_SHAPES = [
    (1, 8, 512, 64, False),
    (1, 8, 2048, 64, False),
    (1, 8, 2048, 64, True),
]
LONG_BACKWARD_SHAPES = BACKWARD_SHAPES + [
    (1, 8, 8192, 64, True), (1, 8, 512, 64, True), (1, 8, 8192, 64, False)]
CACHE_DTYPES = ("float32", "float16", "bfloat16", "int8")  # KVCache's, as --decode-case names
# (Hkv, Nk, cache dtype, cold) of decode steps: Nq=1, Hq=8, D=64; cold = a model's worth of
# layers whose K/V together exceed the L3 cache, so that they stream from DRAM.
DECODE_CASES = ([(2, 4096, "float32", False), (8, 32768, "float32", False)]
                + [(2, 32768, cache, False) for cache in ("float32", "float16", "int8")]
                + [(2, 32768, cache, True) for cache in ("float32", "float16")])
LONG_DECODE_CASES = ([(h_kv, n_k, cache, False) for n_k in (4096, 32768) for h_kv in (8, 2)
                      for cache in ("float32", "float16", "int8")]
                     + [(2, 32768, cache, True) for cache in CACHE_DTYPES])
# Seconds of side-by-side rounds per forward shape before it stops short of --repeats: the
# best of 3 at N=8192 (1.3 s a round with torch), of all 5 below.
FORWARD_BUDGET_S = 3.0
NAIVE_MAX_BYTES = 2 << 30  # skip the naive peer when its score matrix would exceed 2 GiB


def _parse_shape(text):
    parts = text.split(",")
    if len(parts) != 5:
        raise argparse.ArgumentTypeError(f"--shape: expected B,H,N,D,causal, got {text!r}")
    b, h, n, d = (int(p) for p in parts[:4])
    return b, h, n, d, parts[4].strip().lower() in ("1", "true", "yes", "causal")


def _parse_decode_case(text):
    parts = [p.strip() for p in text.split(",")]
    if len(parts) not in (3, 4) or parts[2] not in CACHE_DTYPES:
        raise argparse.ArgumentTypeError(
            f"--decode-case: expected Hkv,Nk,{'|'.join(CACHE_DTYPES)}[,cold], got {text!r}")
    return int(parts[0]), int(parts[1]), parts[2], len(parts) == 4 and parts[3] == "cold"


def bench(args):
    import cpuflash
    from cpuflash import _measure

    if args.threads:
        cpuflash.set_num_threads(args.threads)
    dtype = np.dtype(args.dtype)
    # torch first: when Numba's OpenMP pool starts before torch's, torch runs 10x slower.
    torch_run, torch_version = (None, None) if args.no_torch else _measure.torch_sdpa()
    if torch_run is not None:
        torch_run(*_measure.make_qkv(1, 1, 8, 8))
    warmup_s = None if args.no_warmup else _warm_up(args, dtype)
    t_compile = time.perf_counter()
    q, k, v = _measure.make_qkv(1, 1, 8, 64, dtype)
    cpuflash.attention(q, k, v)
    t_compile = time.perf_counter() - t_compile
    if args.plot:  # the sweep of the plot only, no tables
        from . import _plot
        return _plot.main(args, torch_run, torch_version)
    forward_shapes, backward_shapes, decode_cases = _bench_cases(args)
    peaks = {} if args.no_memory else _peak_memory(forward_shapes, backward_shapes)
    report = {}
    if forward_shapes:
        report["forward"] = _bench_forward(args, forward_shapes, dtype, torch_run, peaks)
    if backward_shapes:
        grad_run = None if args.no_torch else _measure.torch_sdpa_grad()
        report["backward"] = _bench_backward(args, backward_shapes, dtype, grad_run, peaks)
    if decode_cases:
        report["decode"] = _bench_decode(args, decode_cases, None if args.no_torch else
                                         _measure.torch_decode())
    report["meta"] = {
        "cpuflash": cpuflash.__version__, "numba": _numba_version(), "numpy": np.__version__,
        "torch": torch_version, "threads": cpuflash.get_num_threads(),
        "warmup_s": warmup_s, "first_call_s": round(t_compile, 3), "cpu": _cpu_name()}
    if args.json:
        json.dump(report, sys.stdout, indent=1)
        print()
    else:
        print(f"\n{json.dumps(report['meta'])}")
        print("GFLOP/s count 4*B*H*N^2*D for the forward pass, 3.5x that for forward+backward "
              "(halved for causal); x torch > 1 means cpuflash is faster; peak = RSS growth of "
              "one call beyond its inputs and outputs, in a fresh process; err = max abs error "
              "vs the float64 reference (head 0).")


def _bench_cases(args):
    """(forward shapes, backward shapes, decode cases) of the sections ``args`` asks for:
    ``--shape``/``--decode-case`` if given, else the defaults or, with ``--long``, the whole
    sweep; an empty list for a section not run."""
    def section(name, given, default, long):
        if args.section not in (name, "all"):
            return []
        return given or (long if args.long else default)

    return (section("forward", args.shape, DEFAULT_SHAPES, LONG_SHAPES),
            section("backward", args.shape, BACKWARD_SHAPES, LONG_BACKWARD_SHAPES),
            section("decode", args.decode_case, DECODE_CASES, LONG_DECODE_CASES))


def _peak_memory(forward_shapes, backward_shapes):
    """Peak RSS growth in MiB of one call per shape, keyed by ("forward" | "backward", shape),
    each in a fresh process, as many at once as there are cores, before anything is timed."""
    from cpuflash import _measure

    keys = ([("forward", s) for s in forward_shapes]
            + [("backward", s) for s in backward_shapes])
    probes = [{"b": b, "h": h, "n": n, "d": d, "causal": causal,
               "impl": "cpuflash" if kind == "forward" else "cpuflash-grad"}
              for kind, (b, h, n, d, causal) in keys]
    return {key: growth / 2**20
            for key, growth in zip(keys, _measure.peak_memory_growths(probes))}


def _bench_jobs(args, dtype):
    """The ``warmup`` jobs of the kernels that ``bench`` with ``args`` calls: forward and
    decode (its first call is a decode step, Nq=8) and, with the backward section, backward,
    in ``dtype``; and the decode section's, whose steps compute in float32 on a cache of each
    case's type."""
    kinds = ["forward", "decode"]
    if args.section in ("backward", "all") and not args.plot:
        kinds.append("backward")
    names = warmup.job_names((dtype,), kinds)
    decode_cases = _bench_cases(args)[2]
    if decode_cases and not args.plot:
        caches = {case[2] for case in decode_cases}
        kinds = ["decode" if c == "float32" else f"decode-{c}" for c in caches]
        names += [n for n in warmup.job_names(("float32",), kinds) if n not in names]
    return names


def _warm_up(args, dtype):
    """Compile (or load) the kernels the run needs, one process per family at once
    (``warmup.precompile``); returns the seconds it took, or None without a cache."""
    start = time.perf_counter()
    results = warmup.precompile(_bench_jobs(args, dtype))
    if not results:
        return None
    took = time.perf_counter() - start
    failed = [n for n, (_, err) in results.items() if err]
    print(f"kernels compiled or loaded in {took:.1f} s ({len(results)} families in processes "
          "of their own; cpuflash warmup)" + (f"; failed: {failed}" if failed else ""),
          file=sys.stderr, flush=True)
    return round(took, 1)


def _bench_forward(args, shapes, dtype, torch_run, peaks):
    import cpuflash
    from cpuflash import _measure

    rows = []
    for (b, h, n, d, causal) in shapes:
        q, k, v = _measure.make_qkv(b, h, n, d, dtype, seed=1)
        fns = {"cpuflash": lambda: cpuflash.attention(q, k, v, causal=causal)}
        if torch_run is not None:
            fns["torch"] = lambda: torch_run(q, k, v, causal)
        best = _measure.time_side_by_side(fns, repeats=args.repeats, budget_s=FORWARD_BUDGET_S)
        if b * h * n * n * dtype.itemsize * 3 <= NAIVE_MAX_BYTES and not args.no_naive:
            naive = {"naive": lambda: _measure.naive_attention(q, k, v, causal)}
            best.update(_measure.time_side_by_side(naive, repeats=min(2, args.repeats)))
        flops = _measure.forward_flops(b, h, n, n, d, causal)
        row = _row(b, h, n, d, causal, dtype, best, flops)
        outs = [cpuflash.attention(q, k, v, causal=causal)]
        if "torch" in best:
            outs.append(torch_run(q, k, v, causal))
        errors = _measure.max_errors_vs_reference(outs, q, k, v, causal)
        row["err"] = errors[0]
        if "torch" in best:
            row["torch_err"] = errors[1]
        if ("forward", (b, h, n, d, causal)) in peaks:
            row["peak_mib"] = peaks["forward", (b, h, n, d, causal)]
        rows.append(row)
        if not args.json:
            _print_row(row, first=len(rows) == 1, title="forward")
    return rows


def _bench_backward(args, shapes, dtype, grad_run, peaks):
    import cpuflash
    from cpuflash import _measure

    rows = []
    for (b, h, n, d, causal) in shapes:
        q, k, v = _measure.make_qkv(b, h, n, d, dtype, seed=1)
        dout = _measure.make_qkv(b, h, n, d, dtype, seed=2)[0]
        fns = {"cpuflash": lambda: cpuflash.attention_vjp(q, k, v, dout, causal=causal)}
        if grad_run is not None:
            fns["torch"] = lambda: grad_run(q, k, v, dout, causal)
        best = _measure.time_side_by_side(fns, repeats=max(2, args.repeats // 2))
        flops = 3.5 * _measure.forward_flops(b, h, n, n, d, causal)
        row = _row(b, h, n, d, causal, dtype, best, flops)
        grads = [cpuflash.attention_vjp(q, k, v, dout, causal=causal)[1:]]
        if grad_run is not None:
            grads.append(grad_run(q, k, v, dout, causal))
        errors = _measure.max_grad_errors_vs_reference(grads, q, k, v, dout, causal)
        row["err"] = errors[0]
        if grad_run is not None:
            row["torch_err"] = errors[1]
        if ("backward", (b, h, n, d, causal)) in peaks:
            row["peak_mib"] = peaks["backward", (b, h, n, d, causal)]
        rows.append(row)
        if not args.json:
            _print_row(row, first=len(rows) == 1, title="forward + backward")
    return rows


def _bench_decode(args, cases, torch_run):
    from cpuflash import _measure

    rows = []
    for h_kv, n_k, cache, cold in cases:
        row = _measure.decode_case(h_kv, n_k, cache, cold=cold, torch_run=torch_run)
        rows.append(row)
        if not args.json:
            _print_decode_row(row, first=len(rows) == 1)
    if not args.json:
        print("decode: one step, B=1, Nq=1, Hq=8, D=64, K/V in a KVCache of the given dtype; "
              "GB/s = unique K/V bytes read per second; stream = the machine's streaming read "
              "of as many bytes; torch = SDPA (enable_gqa) on float32 K/V; cold = layers run "
              "in turn with K/V from DRAM, hot = one layer again and again; err = max abs "
              "error vs the float64 reference on the float32 K/V.")
    return rows


def _print_decode_row(row, first):
    if first:
        print("\ndecode")
        print(f"{'Hkv':>3} {'Nk':>6} {'cache':>8} {'mode':>9} | {'ms':>7} {'GB/s':>6} "
              f"{'stream':>6} {'of str':>6} | {'torch ms':>8} {'x torch':>7} | {'err':>7}")
    vs = f"{row['vs_torch']:7.2f}" if "vs_torch" in row else f"{'-':>7}"
    torch_ms = f"{row['torch_ms']:8.3f}" if "torch_ms" in row else f"{'-':>8}"
    print(f"{row['Hkv']:>3} {row['Nk']:>6} {row['cache']:>8} {row['mode']:>9} | "
          f"{row['ms']:7.3f} {row['gbs']:6.1f} {row['stream_gbs']:6.1f} "
          f"{row['of_stream']:6.0%} | {torch_ms} {vs} | {row['err']:7.1e}", flush=True)


def _row(b, h, n, d, causal, dtype, best, flops):
    return {
        "B": b, "H": h, "N": n, "D": d, "causal": causal, "dtype": dtype.name,
        "ms": best["cpuflash"] * 1e3,
        "gflops": flops / best["cpuflash"] / 1e9,
        "vs_naive": best["naive"] / best["cpuflash"] if "naive" in best else None,
        "vs_torch": best["torch"] / best["cpuflash"] if "torch" in best else None,
        "torch_gflops": flops / best["torch"] / 1e9 if "torch" in best else None,
    }


def _print_row(row, first, title):
    if first:
        print(f"\n{title}")
        print(f"{'B':>2} {'H':>3} {'N':>6} {'D':>4} {'causal':>6} | {'ms':>8} {'GFLOP/s':>8} "
              f"{'x naive':>8} {'x torch':>8} {'torch GF/s':>10} | {'peak MiB':>8} "
              f"{'err':>8} {'torch err':>9}")

    def fmt(x, spec):
        return format(x, spec) if x is not None else "-"

    print(f"{row['B']:>2} {row['H']:>3} {row['N']:>6} {row['D']:>4} {str(row['causal']):>6} | "
          f"{row['ms']:8.2f} {row['gflops']:8.1f} {fmt(row['vs_naive'], '8.2f'):>8} "
          f"{fmt(row['vs_torch'], '8.2f'):>8} {fmt(row['torch_gflops'], '10.1f'):>10} | "
          f"{fmt(row.get('peak_mib'), '8.1f'):>8} {row['err']:8.1e} "
          f"{fmt(row.get('torch_err'), '9.1e'):>9}", flush=True)


def _numba_version():
    import numba
    return numba.__version__


def _cpu_name():
    from cpuflash import config
    return config.cpuinfo_field("model name") or platform.processor() or platform.machine()


# The host features the kernels' shapes and conversions depend on (LLVM's names), as ``cpuflash
# info`` lists those present.
KERNEL_FEATURES = ("sse4.2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl",
                   "avx512fp16", "avx512bf16", "amx-tile", "neon", "sve")


def _cpu_caches():
    """``config.HOST_CACHES`` for people: ``{"L1d": "32 KiB", ..., "L3": "32 MiB (shared by 2
    CPUs)"}``."""
    def size(n):
        return f"{n >> 20} MiB" if n % (1 << 20) == 0 else f"{n >> 10} KiB"

    from cpuflash import config
    return {name: size(n) + (f" (shared by {cpus} CPUs)" if cpus > 1 else "")
            for name, (n, cpus) in config.HOST_CACHES.items()}


def info(args):
    import numba

    import cpuflash
    from cpuflash import config
    from cpuflash._cpu import _jit, decode
    from cpuflash._cuda import codegen  # numpy only: numba.cuda stays unimported

    q, k, v = (np.zeros((1, 1, 4, 8), np.float32) for _ in range(3))
    cpuflash.attention(q, k, v)  # starts the thread pool, so the layer is known
    facts = {
        "cpuflash": cpuflash.__version__,
        "cpu_model": _cpu_name(),
        "cpu_features": [f for f in KERNEL_FEATURES if f in config.HOST_FEATURES],
        "cpu_caches": _cpu_caches(),
        **config.describe(),  # "cpu": LLVM's name for the host, which Numba compiles for
        "block_k_by_head_dim": {d: config.block_k(d, 1 << 30) for d in (64, 128, 256)},
        "portable": config.PORTABLE,
        "decode_hints": ("K and V" if decode.HINT_VALUES else "by layout")
        + f" ({config.HOST_VENDOR or 'vendor unknown'}"
        + ("; none in KVCache's AVX2 panels)" if config.VECTOR_BYTES == 32 else ")"),
        "threads": cpuflash.get_num_threads(),
        "numba": numba.__version__,
        "threading_layer": numba.threading_layer(),
        "cache": (f"off ({', '.join(_jit.cache_fallbacks)})" if _jit.cache_fallbacks
                  else "on" if config.CACHE_ENABLED else "off (CPUFLASH_DISABLE_CACHE)"),
        "cache_dir": _cache_dir(),
        "cache_files_tag": _jit.CONFIG_TAG,  # this tile configuration's cache files
        "cuda_kernel_cache": codegen.cache_location() or "off (CPUFLASH_CUDA_CACHE_DIR=0)",
    }
    if args.json:
        json.dump(facts, sys.stdout, indent=1)
        print()
    else:
        for key, value in facts.items():
            print(f"{key:>20}: {value}")


def _cache_dir():
    from cpuflash._cpu import forward
    cache = getattr(forward.forward.dispatcher, "_cache", None)
    return getattr(cache, "_cache_path", None) or os.environ.get("NUMBA_CACHE_DIR", "-")


def main(argv=None):
    parser = argparse.ArgumentParser(prog="cpuflash", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p_bench = sub.add_parser("bench", help="time the forward pass against torch SDPA and numpy")
    p_bench.add_argument("--shape", type=_parse_shape, action="append",
                         help="B,H,N,D,causal (repeatable); default: a one-minute set")
    p_bench.add_argument("--decode-case", type=_parse_decode_case, action="append",
                         help="Hkv,Nk,float32|float16|bfloat16|int8[,cold] (repeatable): decode "
                              "steps with Nq=1, Hq=8, D=64; default: a set of 7 (--long: 16)")
    p_bench.add_argument("--long", action="store_true",
                         help="the whole sweep of shapes and decode cases (about 4 minutes "
                              "with the kernels cached)")
    p_bench.add_argument("--section", default="all",
                         choices=["forward", "backward", "decode", "all"])
    p_bench.add_argument("--dtype", default="float32", choices=["float32", "float64", "float16"])
    p_bench.add_argument("--threads", type=int, default=0, help="threads (default: Numba's)")
    p_bench.add_argument("--repeats", type=int, default=5)
    p_bench.add_argument("--no-torch", action="store_true")
    p_bench.add_argument("--no-naive", action="store_true")
    p_bench.add_argument("--no-memory", action="store_true", help="skip the RSS subprocesses")
    p_bench.add_argument("--json", action="store_true", help="machine-readable output")
    p_bench.add_argument("--no-warmup", action="store_true",
                         help="compile in this process, one kernel at a time (see warmup)")
    p_bench.add_argument("--plot", metavar="OUT.png",
                         help="only sweep N and save throughput and memory plots (matplotlib)")
    p_bench.set_defaults(func=bench)
    p_warm = sub.add_parser("warmup", help="compile the kernels into Numba's cache, one "
                            "process per kernel family at once")
    p_warm.add_argument("--dtype", action="append", choices=["float32", "float64", "float16"],
                        help="compute dtypes (repeatable; default float32)")
    p_warm.add_argument("--kind", action="append", choices=list(warmup.JOBS),
                        help="kernel families (repeatable; default all)")
    p_warm.add_argument("--processes", type=int, default=0,
                        help="at once (default: the CPU count)")
    p_warm.set_defaults(func=warmup_command)
    p_info = sub.add_parser("info", help="CPU features, tiles, threads, cache")
    p_info.add_argument("--json", action="store_true")
    p_info.set_defaults(func=info)
    p_demo = sub.add_parser("demo", help="all-MiniLM-L6-v2 sentence embeddings in numpy")
    p_demo.add_argument("--sentence", action="append", help="a sentence (repeatable)")
    p_demo.add_argument("--batch", type=int, default=32,
                        help="sentences in the timed batch (0: no timing)")
    p_demo.add_argument("--repeats", type=int, default=3)
    p_demo.set_defaults(func=demo)
    args = parser.parse_args(argv)
    return args.func(args) or 0


def warmup_command(args):
    if args.processes < 0:
        raise SystemExit(f"cpuflash warmup: --processes must be >= 0, got {args.processes}")
    names = warmup.job_names(args.dtype or ("float32",), args.kind)
    if not names:
        raise SystemExit("cpuflash warmup: no kernel family for these --dtype/--kind "
                         f"(the decode-float16/-bfloat16/-int8 families compute in float32)")
    start = time.perf_counter()
    results = warmup.precompile(names, processes=args.processes or None)
    if not results:
        print("cpuflash warmup: kernels are not cached (CPUFLASH_DISABLE_CACHE, or no writable "
              "cache location): nothing to do")
        return 0
    for name, (seconds, error) in results.items():
        print(f"{name:24s} {seconds:6.1f} s" + (f"  FAILED: {error.strip()}" if error else ""))
    print(f"{'all':24s} {time.perf_counter() - start:6.1f} s")
    return 1 if any(err for _, err in results.values()) else 0


def demo(args):
    from .models import demo as minilm_demo
    return minilm_demo.main(args)


if __name__ == "__main__":
    sys.exit(main())
