"""Shared set-up for the pytest-benchmark files: peers, version records, warm kernels."""
import platform

import numba
import numpy as np
import pytest

import cpuflash
from cpuflash import _measure, config


def pytest_configure(config):
    """Start torch's thread pool before Numba's. Both use the system's OpenMP runtime; when
    Numba starts it first, torch's SDPA then runs 10x slower (measured: 25 ms instead of
    2.7 ms at N=512), which would flatter cpuflash. The CLI does the same."""
    run, _ = _measure.torch_sdpa()
    if run is not None:
        q, k, v = _measure.make_qkv(1, 1, 8, 8)
        run(q, k, v)


@pytest.fixture(scope="session")
def torch_run():
    run, _ = _measure.torch_sdpa()
    if run is None:
        pytest.skip("torch is not installed (pip install torch==2.13.0)")
    return run


def record(benchmark, **shape):
    """Shapes, threads, versions and the tile configuration in ``extra_info``."""
    benchmark.extra_info.update(shape)
    benchmark.extra_info.update({
        "threads": cpuflash.get_num_threads(), "cpuflash": cpuflash.__version__,
        "numba": numba.__version__, "numpy": np.__version__, "python": platform.python_version(),
        **config.describe(),
    })
    try:
        import torch
        benchmark.extra_info["torch"] = torch.__version__
    except ImportError:
        pass


def add_gflops(benchmark, flops):
    """GFLOP/s from the best round (pytest-benchmark's stats are filled after the run)."""
    benchmark.extra_info["gflops"] = flops / benchmark.stats.stats.min / 1e9
