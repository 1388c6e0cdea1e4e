"""Issue 5's decode targets measured in one spell of the machine: rounds in one process, each
timing a float32 step, a float16 step and the streaming read of the float32 step's bytes side
by side (``_measure.time_side_by_side``), then torch's SDPA (``enable_gqa``) on the float32
K/V in a block of its own (its OpenMP threads spin after each call and would slow whatever
ran next). Every step runs a model's worth of layers in turn (``_measure.COLD_BYTES``), so K/V
come from DRAM, as the cold rows of ``cpuflash bench``; B=1, Nq=1, Hq=8, D=64.

This machine's DRAM bandwidth moves between spells minutes long (a streaming read of 33-37
GB/s in slow ones, 55-63 in fast ones), and ``cpuflash bench`` times float32 and float16 in
blocks of their own, which may fall into different spells. Here each round's ratios come from
one spell. Per round: the read's GB/s; the float32 step's GB/s of unique K/V and its share of
the read (target: >= 80 %); float32 x torch (target: >= 4); float16 x float32 a step (target:
>= 1.6). Then how many rounds met each target. Not collected by pytest.

    python bench/cpu_decode_targets.py [--rounds 8] [--hkv 2] [--nk 32768] [--repeats 3]
"""
import argparse
import statistics

from cpuflash import _measure


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--hkv", type=int, default=2)
    p.add_argument("--nk", type=int, default=32768)
    p.add_argument("--repeats", type=int, default=3, help="best of this many steps a round")
    a = p.parse_args(argv)
    if a.rounds < 1 or a.repeats < 1 or a.nk < 1:
        p.error("--rounds, --repeats and --nk must be at least 1")
    if a.hkv < 1 or 8 % a.hkv:
        p.error("--hkv must divide the 8 query heads")
    torch_run = _measure.torch_decode()
    if torch_run is None:
        p.error("torch is not installed: pip install torch==2.13.0")
    q, k, v = _measure.make_qkv(1, 8, a.nk, 64, n_q=1, h_kv=a.hkv, seed=0)
    steps, per_layer, nbytes = {}, {}, {}
    for dtype in ("float32", "float16"):
        steps[dtype], per_layer[dtype], nbytes[dtype], _ = _measure.decode_step(q, k, v, dtype,
                                                                                cold=True)
    f32_bytes = nbytes["float32"]
    read, n_read = _measure.stream_reader(f32_bytes * per_layer["float32"])
    torch_step, per_layer["torch"] = _measure.torch_decode_step(torch_run, q, k, v, cold=True)

    print(f"B=1 Nq=1 Hq=8 Hkv={a.hkv} Nk={a.nk} D=64; float32 steps of {per_layer['float32']} "
          f"layers, float16 of {per_layer['float16']}, from DRAM; ms a layer")
    print("round  read GB/s | f32 ms  GB/s  of read | f16 ms  f16 x f32 | torch ms  f32 x torch")
    met = {"of read >= 80 %": 0, "x torch >= 4": 0, "f16 x f32 >= 1.6": 0}
    seen = {name: [] for name in met}  # each round's figure, for the medians
    for rnd in range(a.rounds):
        best = _measure.time_side_by_side(
            {"float32": steps["float32"], "float16": steps["float16"], "read": read},
            repeats=a.repeats, budget_s=60.0)
        best.update(_measure.time_side_by_side({"torch": torch_step}, repeats=a.repeats,
                                               budget_s=60.0))
        f32 = best["float32"] / per_layer["float32"]
        f16 = best["float16"] / per_layer["float16"]
        torch_t = best["torch"] / per_layer["torch"]
        read_gbs = n_read / best["read"] / 1e9
        gbs = f32_bytes / f32 / 1e9
        share, vs_torch, f16_gain = gbs / read_gbs, torch_t / f32, f32 / f16
        met["of read >= 80 %"] += share >= 0.8
        met["x torch >= 4"] += vs_torch >= 4.0
        met["f16 x f32 >= 1.6"] += f16_gain >= 1.6
        for name, x in zip(met, (share, vs_torch, f16_gain)):
            seen[name].append(x)
        print(f"{rnd:5d}  {read_gbs:9.1f} | {f32 * 1e3:6.3f} {gbs:5.1f} {share:7.0%} | "
              f"{f16 * 1e3:6.3f} {f16_gain:9.2f} | {torch_t * 1e3:8.3f} {vs_torch:12.2f}",
              flush=True)
    print("met in: " + ", ".join(f"{name} {n} of {a.rounds}" for name, n in met.items()))
    print(f"medians: of read {statistics.median(seen['of read >= 80 %']):.1%}, x torch "
          f"{statistics.median(seen['x torch >= 4']):.2f}, f16 x f32 "
          f"{statistics.median(seen['f16 x f32 >= 1.6']):.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
