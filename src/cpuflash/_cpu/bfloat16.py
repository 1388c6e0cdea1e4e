"""bfloat16 for ``cpuflash.torch`` (numpy has no such dtype): a bfloat16 is the upper 16 bits of
a float32, so it widens to float32 exactly, and a float32 result rounds back to the nearest
bfloat16, ties to even, as torch's ``.to(torch.bfloat16)`` does.

Both conversions run on the kernels' threads. Done by torch's ``.float()`` and
``.to(torch.bfloat16)`` instead (stop 60, Xeon, B=1 H=8 N=2048 D=64), torch's OpenMP threads
went on spinning after the conversions, on the two cores the attention kernel ran on next: the
bfloat16 call took 35.2 ms against 31.2 ms for float32, where the conversions alone take
0.6 ms (with ``OMP_WAIT_POLICY=PASSIVE``, 32.9 against 30.9-32.4).
"""
import numpy as np
from numba import prange

from . import pack
from ._jit import kernel

# The one carrier of bfloat16 bits in the package (``KVCache``'s storage, the drop-in's views
# of torch's tensors): the kernels read an int16 array as bfloat16 (``simd._load_cvt``), and the
# public checks refuse int16 (no caller can pass one by mistake)
BITS = np.dtype(np.int16)
BFLOAT16_NAN = 0x7FC0  # what a NaN rounds to (torch's scalar conversion: sign and payload lost)


@kernel(strided=("bits",), read_only=("bits",))
def widen(bits, wide):
    """``bits``: (A, B, R, C) bfloat16 patterns (``BITS``), any strides; writes ``wide``, uint32
    of the same shape: the bits of the same values as float32 (the pattern shifted up 16 bits;
    through uint16, so that a pattern with its top bit set is not sign-extended)."""
    n_a, n_b, n_r, n_c = bits.shape
    for row in prange(n_a * n_b * n_r):
        a, b, r = row // (n_b * n_r), (row // n_r) % n_b, row % n_r
        for c in range(n_c):
            wide[a, b, r, c] = np.uint32(np.uint16(bits[a, b, r, c])) << np.uint32(16)


@kernel(read_only=("bits",))
def widen_flat(bits, wide):
    """``widen`` of (n,) contiguous ``bits`` into (n,) ``wide``: a loop LLVM vectorizes (through
    ``widen``'s strided rows, 2.5 times as long at B=1 H=8 N=2048 D=64)."""
    for i in prange(bits.size):
        wide[i] = np.uint32(np.uint16(bits[i])) << np.uint32(16)


@kernel(read_only=("wide",))
def narrow(wide, bits):
    """``wide``: (n,) uint32, the bits of float32 values; writes ``bits`` (n,) ``BITS``, each
    value rounded to the nearest bfloat16, ties to even: the 16 bits dropped are added with
    ``0x7FFF`` and the kept bits' lowest, so that more than half an ulp, or exactly half next to
    an odd last bit, carries into the kept bits (and through the exponent: the largest floats
    round to infinity). A NaN gives ``BFLOAT16_NAN``."""
    for i in prange(wide.size):
        w = np.int64(wide[i])
        if (w & 0x7FFFFFFF) > 0x7F800000:  # NaN: a carry could make it infinite
            bits[i] = BFLOAT16_NAN
        else:
            bits[i] = np.int16(np.uint16((w + 0x7FFF + ((w >> 16) & 1)) >> 16))


def to_float32(bits, workspace=None):
    """The float32 values of the bfloat16 patterns ``bits`` (``BITS``, 0-D to 4-D, any strides),
    as a new C-ordered array; or in this thread's ``pack.workspace`` of that name, which the
    next call for the name overwrites (its pages faulted in once, not on every call)."""
    wide = (np.empty(bits.shape, dtype=np.uint32) if workspace is None
            else pack.workspace(workspace, bits.shape, np.uint32))
    if bits.flags.c_contiguous:
        widen_flat(bits.reshape(-1), wide.reshape(-1))
    else:
        lead = (None,) * (4 - bits.ndim)  # views: (n,) as (1, 1, 1, n)
        widen(bits[lead], wide[lead])
    return wide.view(np.float32)


def from_float32(x):
    """The bfloat16 patterns (``BITS``) nearest to the float32 ``x`` (any shape), C-ordered."""
    x = np.ascontiguousarray(x)
    bits = np.empty(x.shape, dtype=BITS)
    narrow(x.reshape(-1).view(np.uint32), bits.reshape(-1))
    return bits
