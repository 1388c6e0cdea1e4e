"""``pack_tiles``: each combination of the copies asked for (None for one not wanted) is its
own specialization, and each copy holds the same bytes whichever others come with it."""
import numpy as np
import pytest

from cpuflash import config
from cpuflash._cpu.pack import pack_tiles
from conftest import rands


@pytest.mark.parametrize("n_k", [1, 37, 300])
def test_each_copy_alone_equals_it_among_all(n_k):
    k, v = rands((1, 2, n_k, 16), (1, 2, n_k, 16), seed=n_k)
    k[0, 1, 0, 3] = np.nan  # kn stores NaN/Inf as 0, the others keep them
    block_k, w = 64, config.panel_width(np.dtype(np.float32))
    n_kb = -(-n_k // block_k)

    def fresh():
        return [np.full((2, n_kb, 16 * block_k), 7.0, np.float32) for _ in range(4)]

    every = fresh()
    pack_tiles(k, v, block_k, w, *every)
    for wanted in ((0, 3), (0, 1, 2), (0,), (2,), (3,)):
        alone = fresh()
        pack_tiles(k, v, block_k, w, *[a if i in wanted else None for i, a in enumerate(alone)])
        for i in wanted:
            np.testing.assert_array_equal(alone[i], every[i], err_msg=f"copy {i} of {wanted}")
    assert np.isnan(every[0]).any() and not np.isnan(every[2]).any()
