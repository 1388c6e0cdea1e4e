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
    ("cpu_kv_padding.py", ["--pads", "64,100"], "--pads: multiples of 64 bytes"),
    ("cpu_kv_padding.py", ["--rounds", "0"], "--rounds must be at least 1"),
    ("cpu_accuracy.py", ["--peaked", "-1"], "--peaked must be 0 (off) or positive"),
    ("cpu_accuracy.py", ["--peaked", "nan"], "--peaked must be 0 (off) or positive"),
])
def test_bad_arguments(script, args, words, monkeypatch, capsys):
    status = run(script, args, monkeypatch)
    err = capsys.readouterr().err
    assert status == 2 and words in err, err
