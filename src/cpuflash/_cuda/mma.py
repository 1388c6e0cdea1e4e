"""Tensor-core products for numba.cuda: ``mma.sync`` (m16n8k8, TF32 in, float32 accumulate)
and the rounding to TF32, as numba intrinsics written in inline PTX.

numba.cuda has no tensor-core API, but an intrinsic can emit any PTX instruction through
LLVM's inline assembly, which NVVM passes on to ptxas. Only on a real GPU: the simulator runs
kernels as Python and has no warp-wide matrix unit (the kernels that use these are never
picked there; CI compiles them to PTX instead).

**3xTF32.** A TF32 product rounds each input to 10 mantissa bits (about 3 decimal digits).
Split each float32 ``x`` into ``big = tf32(x)`` and ``small = tf32(x - big)`` (the next 11
bits; ``x - big`` is exact); then ``a * b ~= a_big*b_big + a_big*b_small + a_small*b_big``,
with only the ``a_small*b_small`` term (2^-22 of the product) left out, and float32
accumulation. Three MMAs per product give float32-class accuracy at tensor-core speed: what
CUTLASS calls ``OpMultiplyAddFastF32``, and what torch's "efficient" SDPA kernel uses for
float32 on sm_80 and newer. ``tf32`` rounds with ``cvt.rna`` (and keeps NaN a NaN);
``tf32_trunc`` and ``tf32_near`` are CUTLASS's cheaper split in integer instructions (big
truncated, small rounded), for the operands split in every tile (``forward_mma._split``).

Fragments of ``m16n8k8`` (``g = lane // 4``, ``t = lane % 4``), from the PTX ISA:

* A (16 x 8): ``a0 = A[g, t]``, ``a1 = A[g + 8, t]``, ``a2 = A[g, t + 4]``, ``a3 = A[g + 8, t + 4]``
* B (8 x 8): ``b0 = B[t, g]``, ``b1 = B[t + 4, g]``
* C, D (16 x 8): ``c0 = C[g, 2t]``, ``c1 = C[g, 2t + 1]``, ``c2 = C[g + 8, 2t]``,
  ``c3 = C[g + 8, 2t + 1]``
"""
from llvmlite import ir
from numba.core import types

from .runtime import load

load()
from numba.cuda.extending import intrinsic  # noqa: E402  (after load(): numba-cuda's numba)

_F32 = ir.FloatType()
_I32 = ir.IntType(32)


def _mma(context, builder, sig, shape, operands):
    """LLVM: one ``mma.sync.aligned.<shape>`` on six 32-bit A/B registers and four float32
    accumulators; the result as numba's tuple of four float32."""
    fnty = ir.FunctionType(ir.LiteralStructType([_F32] * 4), [_I32] * 6 + [_F32] * 4)
    mma = ir.InlineAsm(
        fnty, f"mma.sync.aligned.{shape} "
        "{$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};",
        "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f")
    res = builder.call(mma, operands)
    return context.make_tuple(builder, sig.return_type,
                              [builder.extract_value(res, i) for i in range(4)])


@intrinsic
def tf32(typingctx, x):
    """``x`` rounded to TF32 (nearest, ties away from zero), as a float32 whose low 13 mantissa
    bits are zero."""
    if x != types.float32:
        return None

    def codegen(context, builder, sig, args):
        cvt = ir.InlineAsm(ir.FunctionType(_I32, [_F32]), "cvt.rna.tf32.f32 $0, $1;", "=r,f")
        return builder.bitcast(builder.call(cvt, [args[0]]), _F32)

    return types.float32(types.float32), codegen


def _tf32_bits(builder, x, add):
    """LLVM: float32 ``x`` with ``add`` added to its bits, then the low 13 mantissa bits
    cleared: a TF32 value (``add = 0``: truncated; ``0x1000``: rounded to nearest, ties away
    from zero, as a carry into the exponent rounds up a power of two)."""
    bits = builder.bitcast(x, _I32)
    if add:
        bits = builder.add(bits, ir.Constant(_I32, add))
    return builder.bitcast(builder.and_(bits, ir.Constant(_I32, 0xFFFFE000)), _F32)


def _tf32_by_bits(name, add, doc):
    """An intrinsic ``name(x)``: float32 ``x`` to TF32 by ``_tf32_bits`` with ``add``."""
    def impl(typingctx, x):
        if x != types.float32:
            return None

        def codegen(context, builder, sig, args):
            return _tf32_bits(builder, args[0], add)

        return types.float32(types.float32), codegen

    impl.__name__ = impl.__qualname__ = name
    impl.__doc__ = doc
    return intrinsic(impl)


tf32_trunc = _tf32_by_bits(
    "tf32_trunc", 0, """``x`` truncated to TF32 (toward zero): one logic instruction, and exact to
    subtract from ``x``, which the small part of a split needs.""")
tf32_near = _tf32_by_bits(
    "tf32_near", 0x1000, """``x`` rounded to TF32 by adding half an ulp to its bits and
    truncating (CUTLASS's ``round_half_ulp_truncate``): two integer instructions; for finite
    values as ``tf32``.""")


@intrinsic
def mma_tf32(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
    """``D = A @ B + C`` for one warp's 16 x 8 x 8 tile: ``(d0, d1, d2, d3)``, the fragments
    above. A and B values must be TF32 already (``tf32``); all arguments float32."""
    args = (a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)
    if any(a != types.float32 for a in args):
        return None
    sig = types.UniTuple(types.float32, 4)(*args)

    def codegen(context, builder, sig, args):
        ab = [builder.bitcast(x, _I32) for x in args[:6]]  # TF32 values travel as bits
        return _mma(context, builder, sig, "m16n8k8.row.col.f32.tf32.tf32.f32",
                    ab + list(args[6:]))

    return sig, codegen


# ---------------------------------------------------------------------------------------------
# Asynchronous copies global -> shared (cp.async, sm_80+): a tile is in flight with no
# register holding it, so the next tile loads while this one is multiplied.

_I64 = ir.IntType(64)


def _element(context, builder, array_type, array, indices):
    """LLVM: the address of ``array[indices]`` (no negative-index wraparound)."""
    from numba.cuda import cgutils
    ary = context.make_array(array_type)(context, builder, array)
    return cgutils.get_item_pointer(context, builder, array_type, ary, indices,
                                    wraparound=False)


@intrinsic
def copy_async16(typingctx, dst, dst_index, src, row, col, nbytes):
    """Start copying 16 bytes from ``src[row, col]`` (a 2-D array, 16-byte aligned there) to
    ``dst[dst_index]`` (a 1-D shared array, 16-byte aligned there); of them, only the first
    ``nbytes`` (0 or 16) are read, the rest are zero-filled. Completes at ``copy_wait``."""
    if not (isinstance(dst, types.Array) and isinstance(src, types.Array) and src.ndim == 2):
        return None
    sig = types.void(dst, types.int64, src, types.int64, types.int64, types.int64)

    def codegen(context, builder, sig, args):
        dty, _, sty, _, _, _ = sig.args
        dst_ptr = _element(context, builder, dty, args[0], [args[1]])
        src_ptr = _element(context, builder, sty, args[2], [args[3], args[4]])
        copy = ir.InlineAsm(
            ir.FunctionType(ir.VoidType(), [_I64, _I64, _I32]),
            "{ .reg .u64 s, g; cvta.to.shared.u64 s, $0; cvta.to.global.u64 g, $1; "
            "cp.async.cg.shared.global [s], [g], 16, $2; }",
            "l,l,r,~{memory}", side_effect=True)
        builder.call(copy, [builder.ptrtoint(dst_ptr, _I64), builder.ptrtoint(src_ptr, _I64),
                            builder.trunc(args[5], _I32)])
        return context.get_dummy_value()

    return sig, codegen


def _asm_statement(text):
    @intrinsic
    def statement(typingctx):
        def codegen(context, builder, sig, args):
            asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), []), text, "~{memory}",
                               side_effect=True)
            builder.call(asm, [])
            return context.get_dummy_value()

        return types.void(), codegen

    return statement


copy_commit = _asm_statement("cp.async.commit_group;")  # close the group of copies started
copy_wait = _asm_statement("cp.async.wait_group 1;")    # all groups but the newest are done
copy_wait_all = _asm_statement("cp.async.wait_all;")


# ---------------------------------------------------------------------------------------------
# float16 products (m16n8k16): a 32-bit register holds two halves, the lower one the element
# of the smaller index. A (16 x 16): a0 = A[g, 2t:2t+2], a1 = A[g + 8, 2t:2t+2],
# a2 = A[g, 2t+8:2t+10], a3 = A[g + 8, 2t+8:2t+10]; B (16 x 8): b0 = B[2t:2t+2, g],
# b1 = B[2t+8:2t+10, g]; C, D as m16n8k8's. The products of halves are exact in float32.

@intrinsic
def mma_f16(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
    """``D = A @ B + C`` for one warp's 16 x 8 x 16 tile, A and B float16 pairs in int32
    registers (``pack_f16``, ``ldmatrix_x4_trans`` or a 32-bit shared load), C and D float32."""
    if any(a != types.int32 for a in (a0, a1, a2, a3, b0, b1)) or any(
            c != types.float32 for c in (c0, c1, c2, c3)):
        return None
    sig = types.UniTuple(types.float32, 4)(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)

    def codegen(context, builder, sig, args):
        return _mma(context, builder, sig, "m16n8k16.row.col.f32.f16.f16.f32", list(args))

    return sig, codegen


@intrinsic
def pack_f16(typingctx, lo, hi):
    """Two float32 rounded to float16 (nearest even) in one int32: ``lo`` in the lower half."""
    if lo != types.float32 or hi != types.float32:
        return None

    def codegen(context, builder, sig, args):
        cvt = ir.InlineAsm(ir.FunctionType(_I32, [_F32, _F32]),
                           "cvt.rn.f16x2.f32 $0, $2, $1;", "=r,f,f")  # $2 -> the upper half
        return builder.call(cvt, list(args))

    return types.int32(types.float32, types.float32), codegen


def _ldmatrix(trans):
    suffix = ".trans" if trans else ""

    @intrinsic
    def ldmatrix_x4(typingctx, arr, index):
        if not isinstance(arr, types.Array):
            return None
        sig = types.UniTuple(types.int32, 4)(arr, types.int64)

        def codegen(context, builder, sig, args):
            ptr = _element(context, builder, sig.args[0], args[0], [args[1]])
            load = ir.InlineAsm(
                ir.FunctionType(ir.LiteralStructType([_I32] * 4), [_I64]),
                "{ .reg .u64 s; cvta.to.shared.u64 s, $4; "
                f"ldmatrix.sync.aligned.m8n8.x4{suffix}.shared.b16 {{$0, $1, $2, $3}}, [s]; }}",
                "=r,=r,=r,=r,l,~{memory}", side_effect=True)  # reads what was stored: keep order
            res = builder.call(load, [builder.ptrtoint(ptr, _I64)])
            return context.make_tuple(builder, sig.return_type,
                                      [builder.extract_value(res, i) for i in range(4)])

        return sig, codegen

    return ldmatrix_x4


ldmatrix_x4 = _ldmatrix(False)
ldmatrix_x4.__doc__ = """Four 8 x 8 float16 matrices from shared memory as A (or B) operands:
lanes ``8i .. 8i + 7`` give the rows of matrix ``i``, each row 16 bytes at ``arr[index]`` (a 1-D
shared array, 16-byte aligned there); lane ``l`` gets, per matrix ``i``, the pair
``M_i[g, 2t:2t+2]``."""
ldmatrix_x4_trans = _ldmatrix(True)
ldmatrix_x4_trans.__doc__ = """As ``ldmatrix_x4``, each matrix transposed: lane ``l`` gets the
pair ``M_i[2t:2t+2, g]`` of its rows ``2t, 2t + 1`` and column ``g`` (the B operands of a
row-major tile)."""
