"""bfloat16's conversions (``_cpu/bfloat16.py``) against torch's own, bit for bit: every one
of the 65536 patterns widened, and float32 values rounded to nearest even at the edges (ties,
carries into the exponent and to infinity, subnormals, signed zeros) and at random."""
import numpy as np
import pytest

from cpuflash._cpu import bfloat16

torch = pytest.importorskip("torch")


def test_every_pattern_widens_as_torch():  # contiguous: widen_flat
    bits = np.arange(1 << 16, dtype=np.uint16).view(bfloat16.BITS)
    want = torch.from_numpy(bits).view(torch.bfloat16).float().numpy()
    got = bfloat16.to_float32(bits)
    assert got.dtype == np.float32 and np.array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("shape", [(), (3,), (4, 5), (2, 3, 4)])
def test_widen_reads_any_strides(shape):
    bits = np.random.default_rng(1).integers(-(1 << 15), 1 << 15, (7,) + shape,
                                             dtype=bfloat16.BITS)
    view = np.moveaxis(bits, 0, -1)[..., ::2]  # strided, on the last axis too
    got = bfloat16.to_float32(view)
    assert got.shape == view.shape and got.flags.c_contiguous
    assert np.array_equal(got.view(np.uint32), view.view(np.uint16).astype(np.uint32) << 16)


def test_rounding_matches_torch():
    edges = np.array([0x3F808000, 0x3F818000, 0x3F808001, 0x3F817FFF, 0x7F7FFFFF, 0x7F7F8000,
                      0x7F7F7FFF, 0xFF7FFFFF, 0x00008000, 0x00018000, 0x007FFFFF, 0x80000000,
                      0x00000000, 0x7F800000, 0xFF800000, 0x3F7FFFFF, 0xBF7FC000],
                     dtype=np.uint32)
    rng = np.random.default_rng(2)
    x = np.concatenate([edges, rng.integers(0, 1 << 32, 100003, dtype=np.uint32)])
    x = x.view(np.float32)
    x = np.where(np.isnan(x), np.float32(1.5), x).reshape(4, -1)
    got = bfloat16.from_float32(x)
    want = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy()
    assert got.shape == x.shape and np.array_equal(got, want)
    assert bfloat16.from_float32(np.array([np.nan, -np.nan], np.float32)).tolist() == [
        bfloat16.BFLOAT16_NAN] * 2
    assert bfloat16.from_float32(np.zeros((0, 3), np.float32)).shape == (0, 3)
