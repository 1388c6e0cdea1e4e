"""``cpuflash bench --plot out.png``: throughput vs N for cpuflash, torch SDPA and naive numpy
(B=1, H=8, D=64, float32, not causal), and peak memory of one call vs N on a log scale
(H=1, D=64; RSS growth in a fresh process, as ``_measure.peak_memory_growth``). Two panels in
one PNG. matplotlib is imported here only (the ``plot`` extra)."""
from . import _measure
from ._progress import Progress

__all__ = ["draw", "main", "summary", "sweep"]

THROUGHPUT_NS = (256, 512, 1024, 2048, 4096, 8192)
MEMORY_NS = (1024, 4096, 16384, 65536)
NAIVE_MAX_BYTES = 2 << 30  # naive peer only while its scores (and temporaries) fit in 2 GiB
COLORS = {"cpuflash": "tab:blue", "torch SDPA": "tab:orange", "naive numpy": "tab:gray"}


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("cpuflash bench --plot: matplotlib is not installed; run: "
                         "pip install \"cpuflash[plot]\" (or pip install matplotlib)") from None
    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt
    return plt


def sweep(torch_run, repeats=3, throughput_ns=THROUGHPUT_NS, memory_ns=MEMORY_NS, h=8, d=64):
    """``{"throughput": {impl: [(N, GFLOP/s)]}, "memory": {impl: [(N, MiB)]}}``."""
    import cpuflash

    res = {"throughput": {k: [] for k in COLORS}, "memory": {k: [] for k in COLORS},
           "h": h, "d": d}
    naive_mem_ns = [n for n in memory_ns if n * n * 4 <= NAIVE_MAX_BYTES]  # scores, H=1
    memory_runs = [("cpuflash", "cpuflash", memory_ns), ("naive numpy", "naive", naive_mem_ns)]
    if torch_run is not None:
        memory_runs.insert(1, ("torch SDPA", "torch", memory_ns))
    steps = len(throughput_ns) + sum(len(ns) for _, _, ns in memory_runs)
    with Progress(steps, "cpuflash bench --plot") as bar:
        for n in throughput_ns:
            bar.step(f"throughput N={n}")
            q, k, v = _measure.make_qkv(1, h, n, d, seed=1)
            calls = max(1, (2048 // n) ** 2)  # back-to-back calls: short ones time thread wake-ups
            fns = {"cpuflash": _calls(calls, lambda: cpuflash.attention(q, k, v))}
            if torch_run is not None:
                fns["torch SDPA"] = _calls(calls, lambda: torch_run(q, k, v, False))
            best = _measure.time_side_by_side(fns, repeats=repeats)
            if 3 * h * n * n * 4 <= NAIVE_MAX_BYTES:  # alone: BLAS threads spin after it
                naive = _calls(calls, lambda: _measure.naive_attention(q, k, v))
                best["naive numpy"] = _measure.time_side_by_side(
                    {"naive": naive}, repeats=min(2, repeats))["naive"]
            flops = calls * _measure.forward_flops(1, h, n, n, d, False)
            for impl, t in best.items():
                res["throughput"][impl].append((n, flops / t / 1e9))
        for impl, probe, ns in memory_runs:
            for n in ns:
                bar.step(f"memory {impl} N={n}")
                growth = _measure.peak_memory_growth(1, 1, n, d, impl=probe)
                res["memory"][impl].append((n, max(growth, 0) / 2**20))
    return res


def _calls(count, fn):
    def run():
        for _ in range(count):
            fn()
    return run


def draw(res, path, title):
    plt = _pyplot()
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(10, 4), dpi=100)
    for impl, pts in res["throughput"].items():
        if pts:
            ns, vals = zip(*pts)
            ax_t.plot(ns, vals, "o-", label=impl, color=COLORS[impl])
    ax_t.set(xscale="log", xlabel="N (sequence length)", ylabel="GFLOP/s (4 N^2 D H / time)",
             title=f"forward throughput, B=1 H={res['h']} D={res['d']} float32")
    ax_t.set_ylim(bottom=0)
    for impl, pts in res["memory"].items():
        if pts:
            ns, vals = zip(*pts)
            ax_m.plot(ns, vals, "o-", label=impl, color=COLORS[impl])
    ax_m.set(xscale="log", yscale="log", xlabel="N (sequence length)",
             ylabel="peak RSS growth of one call (MiB)",
             title=f"memory beyond inputs and output, H=1 D={res['d']}")
    for ax, key in ((ax_t, "throughput"), (ax_m, "memory")):
        ns = sorted({n for pts in res[key].values() for n, _ in pts})
        ax.set_xticks(ns, [str(n) for n in ns])
        ax.minorticks_off()
        ax.grid(True, which="major", alpha=0.3)
        ax.legend()
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(args, torch_run, torch_version):
    """Sweep, draw ``args.plot``, print the numbers; returns 0."""
    import numpy as np

    import cpuflash
    from .cli import _cpu_name

    _pyplot()  # fail before minutes of measuring if matplotlib is missing
    res = sweep(torch_run, repeats=args.repeats)
    title = (f"cpuflash {cpuflash.__version__}, {cpuflash.get_num_threads()} threads, "
             f"{_cpu_name()}, torch {torch_version}, numpy {np.__version__}")
    draw(res, args.plot, title)
    print(summary(res))
    print(f"wrote {args.plot}")
    return 0


def summary(res):
    """A few lines of text with the plotted numbers."""
    lines = []
    for key, unit in (("throughput", "GFLOP/s"), ("memory", "MiB")):
        for impl, pts in res[key].items():
            if pts:
                vals = ", ".join(f"N={n}: {v:.1f}" for n, v in pts)
                lines.append(f"{key} {impl} ({unit}): {vals}")
    return "\n".join(lines)

