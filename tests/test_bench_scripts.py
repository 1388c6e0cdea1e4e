"""The benchmark scripts outside pytest-benchmark reject bad arguments with a message that
names the argument, before any work (they import torch: skipped without it)."""
import runpy
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
BENCH = Path(__file__).resolve().parent.parent / "bench"


def run(script, args, monkeypatch):
    """Run ``script`` as ``python bench/script args`` would, in this process (a process each
    cost 2-4 s, mostly importing torch): its exit status from argparse's SystemExit, or 0."""
    monkeypatch.setattr(sys, "argv", [str(BENCH / script), *args])
    monkeypatch.syspath_prepend(str(BENCH))  # the scripts' own folder, as python puts it first
    try:
        runpy.run_path(str(BENCH / script), run_name="__main__")
    except SystemExit as stop:
        return stop.code
    return 0


@pytest.mark.parametrize("script,args,words", [
    ("after_torch.py", ["alone", "fwd", "0", "64", "0", "3"], "argument n: must be at least 1"),
    ("after_torch.py", ["later", "fwd", "64", "64", "0", "3"], "argument mode"),
    ("after_torch.py", ["alone", "fwd", "64", "64", "2", "3"], "argument causal"),
    ("cuda_bench.py", ["--calls", "0"], "--calls must be at least 1"),
    ("cuda_bench.py", ["--reps", "-1"], "--reps must be at least 1"),
    ("cuda_ab.py", ["NOPE", "1,2"], "argument name: 'NOPE' is not an integer constant"),
    ("cuda_ab.py", ["SHAPES", "1,2"], "argument name: 'SHAPES' is not an integer constant"),
    ("cuda_ab.py", ["PV_GROUP", "a,b"], "argument values: expected comma-separated integers"),
    ("cuda_ab.py", ["PV_GROUP", "1,2", "--calls", "0"], "--calls must be at least 1"),
    ("cuda_ab.py", ["PV_GROUP", "1,2", "--n", "0"], "argument --n: must be at least 1"),
    ("cpu_block_ab.py", ["--rows", "64,-1"], "argument --rows: must be at least 0"),
    ("cpu_block_ab.py", ["--shapes", "512x"], "argument --shapes: expected NxD"),
    ("cpu_block_ab.py", ["--rounds", "0"], "--rounds must be at least 1"),
    ("cpu_block_ab.py", ["--rows", "64,50"], "--rows: each must be 0 or a multiple of"),
    ("cpu_accuracy.py", ["--seeds", "0"], "--seeds must be at least 1"),
    ("cpu_sinks_cost.py", ["--rounds", "0"], "--rounds must be at least 1"),
    ("cpu_ab.py", ["--base", "HEAD", "--rounds", "7"], "--rounds must be at least 8"),
    ("cpu_ab.py", ["--base", "no-such-commit"], "--base: no commit 'no-such-commit'"),
    ("cpu_ab.py", [], "the following arguments are required: --base"),
    ("cpu_kv_layout.py", ["--keys", "0"], "--keys must be at least 1"),
    ("cpu_kv_layout.py", ["--rounds", "0"], "--rounds must be at least 1"),
    ("cpu_accuracy.py", ["--peaked", "-1"], "--peaked must be 0 (off) or positive"),
    ("cpu_accuracy.py", ["--peaked", "nan"], "--peaked must be 0 (off) or positive"),
    ("cpu_decode_python.py", ["--layers", "0"], "--layers must be at least 1"),
    ("cpu_decode_python.py", ["--hkv", "3"], "--hkv must divide the 8 query heads"),
    ("cpu_decode_python.py", ["--grow", "--nk", "1"], "--grow needs --nk of at least 2"),
    ("cpu_profile.py", ["backward"], "argument case: invalid choice"),
    ("cpu_profile.py", ["forward", "--threads", "0"], "--threads must be at least 1"),
    ("cpu_profile.py", ["forward", "--seconds", "nan"], "--seconds must be positive"),
    ("cpu_profile.py", ["decode", "--hkv", "3"], "--h (8) must be a multiple of --hkv (3)"),
    ("cpu_profile.py", ["decode", "--cache", "float64"], "argument --cache: invalid choice"),
    ("cpu_decode_steps.py", ["--panels", "--keys", "100"], "--keys: a multiple of 128"),
    ("cpu_decode_stream_model.py", ["--rounds", "0"], "--rounds, --repeats and --layers must"),
    ("cpu_decode_stream_model.py", ["--nk", "1000"], "--nk must be a positive multiple of 8192"),
    ("cpu_decode_stream_model.py", ["--distances", "100"], "--distances must be multiples of 64"),
    ("cpu_decode_stream_model.py", ["--fmas", "2"], "argument --fmas: invalid choice"),
    ("cpu_decode_targets.py", ["--rounds", "0"], "--rounds, --repeats and --nk must be at"),
    ("cpu_decode_targets.py", ["--hkv", "3"], "--hkv must divide the 8 query heads"),
    ("cpu_decode_targets.py", ["--repeats", "0"], "--rounds, --repeats and --nk must be at"),
    ("cpu_decode_targets.py", ["--nk", "0"], "--rounds, --repeats and --nk must be at"),
    ("cpu_forward_targets.py", ["--rounds", "0"], "--rounds and --repeats must be at least 1"),
    ("cpu_forward_targets.py", ["--repeats", "0"], "--rounds and --repeats must be at least 1"),
    ("cpu_amx_probe.py", ["--reps", "0"], "--reps and --rounds must be at least 1"),
    ("cpu_amx_probe.py", ["--rounds", "0"], "--reps and --rounds must be at least 1"),
    ("cpu_fuzz.py", ["--seconds", "0"], "--seconds must be positive"),
    ("cpu_fuzz.py", ["--cases", "-1"], "--cases must be 0 (no limit) or positive"),
    ("cpu_fuzz.py", ["--max-nk", "0"], "--max-nk must be at least 1"),
    ("cpu_fuzz.py", ["--tol64", "nan"], "--tol32, --tol64 and --tol16 must be positive"),
    ("cpu_fuzz.py", ["--kinds", "decode,forward"], "--kinds: expected some of decode, tiled"),
])
def test_bad_arguments(script, args, words, monkeypatch, capsys):
    status = run(script, args, monkeypatch)
    err = capsys.readouterr().err
    assert status == 2 and words in err, err


@pytest.mark.parametrize("script,finder", [
    ("cpu_forward_targets.py", "torch_sdpa"),
    ("cpu_accuracy.py", "torch_sdpa"),
    ("cpu_decode_targets.py", "torch_decode"),
])
def test_torch_missing(script, finder, monkeypatch, capsys):
    """The scripts that compare with torch say how to install it where it is missing, before
    any work (torch stands in as absent: ``_measure``'s finder returns no runner)."""
    from cpuflash import _measure
    monkeypatch.setattr(_measure, finder,
                        lambda: (None, None) if finder == "torch_sdpa" else None)
    status = run(script, [], monkeypatch)
    err = capsys.readouterr().err
    assert status == 2 and "torch is not installed: pip install torch==2.13.0" in err, err


def test_profile_names_and_shares(monkeypatch):
    """cpu_profile's reading of Numba's symbols and its count of samples per function."""
    monkeypatch.syspath_prepend(str(BENCH))
    from cpu_profile import python_name, share_table
    assert python_name("_ZN8cpuflash4_cpu5tiles14online_softmaxB3v50B94c8tJT") == \
        "cpuflash._cpu.tiles.online_softmax"
    assert python_name("cpython._ZN8cpuflash4_cpu6decode6decodeB2v5") == \
        "cpython.cpuflash._cpu.decode.decode"
    assert python_name("_ZN13_3cdynamic_3e36__numba_parfor_gufunc_0x7f4c6a5f0cd0B3v73") == \
        "<prange body>"
    assert python_name("NRT_decref") == "NRT_decref"
    counts, outside = share_table([5, 9, 10, 19, 20, 3000],
                                  [(10, 10, "_ZN1b1fB"), (0, 10, "_ZN1a1gB")])
    assert counts == {"a.g": 2, "b.f": 2} and outside == [20, 3000]


def test_fuzz_passes_and_reports_a_mismatch(monkeypatch, capsys):
    """A few random cases pass against the reference; with tolerances no rounding meets, the
    first case is reported as a mismatch and the script exits 1. (Seed 0's first four cases are
    float32, whose kernels the other tests have compiled: the float64 ones would compile
    more.)"""
    args = ["--cases", "4", "--max-nk", "300", "--seed", "0", "--kinds", "decode"]
    assert run("cpu_fuzz.py", args, monkeypatch) == 0
    assert "4 cases, no mismatch" in capsys.readouterr().out
    assert run("cpu_fuzz.py", args + ["--tol32", "1e-300", "--tol64", "1e-300"],
               monkeypatch) == 1
    assert "MISMATCH" in capsys.readouterr().out


@pytest.mark.parametrize("kind", ["views", "cache", "varlen", "merge", "formats", "torch"])
def test_fuzz_kinds_pass_and_report_a_mismatch(kind, monkeypatch, capsys):
    """The kinds beyond plain arrays (views of q/k/v, KVCache of every dtype, packed
    sequences, partial results merged, float16 and int8 K/V arrays; the torch drop-in against
    torch's own SDPA) compare with their oracle: a few cases pass, and with tolerances no
    rounding meets, the first is reported as a mismatch of that kind."""
    args = ["--cases", "3", "--max-nk", "300", "--seed", "1", "--kinds", kind]
    assert run("cpu_fuzz.py", args, monkeypatch) == 0
    assert "3 cases, no mismatch" in capsys.readouterr().out
    assert run("cpu_fuzz.py", args + ["--tol32", "1e-300", "--tol64", "1e-300",
                                      "--tol16", "1e-300"], monkeypatch) == 1
    assert f"MISMATCH {kind}" in capsys.readouterr().out
