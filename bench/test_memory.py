"""Peak RSS growth of one call, measured in a fresh subprocess, vs N (H=1, D=64): the forward
pass, and forward and backward with every option on at once.

    python -m pytest bench/test_memory.py -s

The growth excludes q/k/v/out (allocated and touched before the baseline); it is what the
call itself needs: packed K/V copies and per-thread tiles, O(N). Naive numpy needs the
(N, N) scores: 16 GiB at N=65536.
"""
import pytest

from cpuflash import _measure
from conftest import record

MIB = 2**20


@pytest.mark.parametrize("n", [4096, 16384, 65536])
def test_forward_peak_memory(benchmark, n):
    growth = benchmark.pedantic(_measure.peak_memory_growth, args=(1, 1, n, 64), rounds=1)
    record(benchmark, impl="cpuflash", B=1, H=1, N=n, D=64, peak_growth_mib=growth / MIB,
           naive_scores_mib=n * n * 4 / MIB)
    print(f"\nN={n}: peak RSS growth {growth / MIB:.1f} MiB "
          f"(naive scores alone: {n * n * 4 / MIB:.0f} MiB)")
    assert growth < 64 * MIB * n / 65536 + 8 * MIB  # O(N): the budget, scaled


@pytest.mark.parametrize("impl", ["cpuflash", "cpuflash-grad"])
@pytest.mark.parametrize("n", [4096, 16384, 65536])
def test_peak_memory_with_every_option(benchmark, n, impl):
    """Causal, window, kv_lens, ALiBi, softcap, dropout and a key-padding mask in one call:
    memory stays O(N) (issue 4), for the forward pass and for the backward pass."""
    growth = benchmark.pedantic(_measure.peak_memory_growth, args=(1, 1, n, 64),
                                kwargs={"impl": impl, "every_option": True}, rounds=1)
    pass_name = "backward" if impl == "cpuflash-grad" else "forward"
    record(benchmark, impl=impl, B=1, H=1, N=n, D=64, every_option=True,
           peak_growth_mib=growth / MIB)
    print(f"\nN={n}, every option, {pass_name}: peak RSS growth {growth / MIB:.1f} MiB")
    assert growth < 128 * MIB * n / 65536 + 8 * MIB  # the backward budget of issue 3, scaled
