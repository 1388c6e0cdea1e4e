"""Dropout on the GPU: the CPU path's counter-based hash (``_cpu/dropout.py``), bit for bit.

Whether key ``j`` survives for query row ``row = (b * Hq + h) * Nq + i`` is murmur3's 32-bit
finalizer of ``row_key(seed, row) + j * 0xC2B2AE3D`` (mod 2^32), compared with ``p * 2^32``:
the same decision as on the CPU for every element, so a GPU run and a CPU run of the same call
drop the same probabilities, and the backward kernels regenerate the forward's.

On the GPU both functions are intrinsics in LLVM IR on 32-bit integers, whose products wrap
mod 2^32 by themselves: the CPU's arithmetic (which masks 64-bit products back to 32 bits).
Intrinsics rather than device functions: a numba-cuda device function asks the driver for the
device when it is compiled, so ``cuda.compile_ptx`` of a kernel calling one needs a GPU (the
PTX tests run in CI without one). The simulator runs the same steps in numpy uint64, every
product of two values below 2^32 (nothing wraps) and masked back to 32 bits.

The seed's part of ``row_key`` is folded on the host (``seed_mix``): the seed may be up to
2^63, which the 32-bit steps would not see whole.
"""
import hashlib
import pathlib

import numpy as np

from .._cpu.dropout import MASK32
from .runtime import load, simulated

cuda = load()

ROW_LOW, ROW_HIGH, KEY = 0x85EBCA77, 0x27D4EB2F, 0xC2B2AE3D
FMIX1, FMIX2 = 0x85EBCA6B, 0xC2B2AE35

# This file's text as a number: the kernels that call these functions put it among their
# constants, so a change here renames their generated files (``codegen.build``) and numba-cuda's
# disk cache cannot hand back a kernel compiled against the old hash.
SOURCE_STAMP = int(hashlib.sha256(pathlib.Path(__file__).read_bytes()).hexdigest()[:12], 16)


def seed_mix(seed):
    """The seed's part of ``_cpu.dropout.row_key``, mod 2^32 (host side)."""
    return (int(seed) * 0x9E3779B1) & MASK32


if simulated():
    _M32 = np.uint64(MASK32)

    def _times(x, c):
        return (np.uint64(x) * np.uint64(c)) & _M32

    @cuda.jit(device=True)
    def row_mix(mix_of_seed, row):
        """``_cpu.dropout.row_key(seed, row)`` from ``seed_mix(seed)``; ``row`` >= 0."""
        r = np.uint64(row)
        return (np.uint64(mix_of_seed) + _times(r & _M32, ROW_LOW)
                + _times(r >> np.uint64(32), ROW_HIGH)) & _M32

    @cuda.jit(device=True)
    def keep_scale(mix, key, drop_below, inv_keep):
        """``inv_keep`` (``1 / (1 - p)``) where key ``key`` of the row whose ``row_mix`` is
        ``mix`` survives, else 0: ``_cpu.dropout.hash_bits(mix, key) >= drop_below``."""
        x = (np.uint64(mix) + _times(key, KEY)) & _M32
        x ^= x >> np.uint64(16)
        x = _times(x, FMIX1)
        x ^= x >> np.uint64(13)
        x = _times(x, FMIX2)
        x ^= x >> np.uint64(16)
        return inv_keep if x >= np.uint64(drop_below) else np.float32(0.0)
else:
    from llvmlite import ir
    from numba.core import types
    from numba.cuda.extending import intrinsic

    _I32, _I64 = ir.IntType(32), ir.IntType(64)

    def _const(value):
        return ir.Constant(_I32, value)

    @intrinsic
    def row_mix(typingctx, mix_of_seed, row):
        """``_cpu.dropout.row_key(seed, row)`` from ``seed_mix(seed)``, as an int64 below
        2^32; both arguments int64, ``row`` >= 0."""
        if mix_of_seed != types.int64 or row != types.int64:
            return None

        def codegen(context, builder, sig, args):
            seed32 = builder.trunc(args[0], _I32)
            low = builder.trunc(args[1], _I32)
            high = builder.trunc(builder.lshr(args[1], ir.Constant(_I64, 32)), _I32)
            x = builder.add(seed32, builder.mul(low, _const(ROW_LOW)))
            x = builder.add(x, builder.mul(high, _const(ROW_HIGH)))
            return builder.zext(x, _I64)

        return types.int64(types.int64, types.int64), codegen

    @intrinsic
    def keep_scale(typingctx, mix, key, drop_below, inv_keep):
        """``inv_keep`` (``1 / (1 - p)``) where key ``key`` of the row whose ``row_mix`` is
        ``mix`` survives, else 0: ``_cpu.dropout.hash_bits(mix, key) >= drop_below``
        (an unsigned compare: ``drop_below`` is up to 2^32)."""
        if (mix, key, drop_below, inv_keep) != (types.int64, types.int64, types.int64,
                                                types.float32):
            return None

        def codegen(context, builder, sig, args):
            x = builder.add(builder.trunc(args[0], _I32),
                            builder.mul(builder.trunc(args[1], _I32), _const(KEY)))
            x = builder.xor(x, builder.lshr(x, _const(16)))
            x = builder.mul(x, _const(FMIX1))
            x = builder.xor(x, builder.lshr(x, _const(13)))
            x = builder.mul(x, _const(FMIX2))
            x = builder.xor(x, builder.lshr(x, _const(16)))
            keep = builder.icmp_unsigned(">=", builder.zext(x, _I64), args[2])
            return builder.select(keep, args[3], ir.Constant(ir.FloatType(), 0.0))

        return types.float32(types.int64, types.int64, types.int64, types.float32), codegen
