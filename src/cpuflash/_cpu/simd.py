"""SIMD building blocks written as LLVM vector IR through ``numba.extending.intrinsic``.

Numba does not turn plain loops into register-blocked code (SLP vectorization is off) and has
no vector ``exp``. These intrinsics give the kernels explicit vectors of the host's SIMD width:

* ``gemm_tile``: ``C[MR, NV*W] (+)= A[MR, K] @ B[K, NV*W]``; all ``MR*NV`` accumulators live in
  vector registers while ``K`` streams (one broadcast of an ``A`` element times ``NV`` contiguous
  vectors of a ``B`` row per step). Both tile products of attention have this shape:
  ``S = Q @ K^T`` (with K packed as ``(D, Bk)`` tiles) and ``acc += P @ V``.
* ``vload``/``vstore``/``vsplat``/``vmax``/``vexp2``/... for the row softmax.

LLVM's generic vector types lower to AVX-512, AVX2 or NEON as the host has them. The vector
width is a property of the host (``config.VECTOR_BYTES``), so Numba's cache, which is keyed on
the CPU name and features, stays valid.
"""
import math

import numpy as np
from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic, models, register_model

from .. import config


class Vec(types.Type):
    """A SIMD vector of ``width`` lanes of ``dtype`` (float32 or float64)."""

    def __init__(self, dtype, width):
        self.dtype = dtype
        self.width = width
        super().__init__(name=f"Vec({dtype}x{width})")


@register_model(Vec)
class _VecModel(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        lltype = ir.VectorType(dmm.lookup(fe_type.dtype).get_value_type(), fe_type.width)
        super().__init__(dmm, fe_type, lltype)


def lanes(dtype):
    """Lanes of one vector register for a float dtype (a Numba type)."""
    return config.VECTOR_BYTES * 8 // dtype.bitwidth


def _vec_of(arrty):
    if not isinstance(arrty, types.Array) or arrty.dtype not in (types.float32, types.float64):
        return None
    return Vec(arrty.dtype, lanes(arrty.dtype))


def _elem_ptr(context, builder, arrty, arr, index):
    data = context.make_array(arrty)(context, builder, arr).data
    return builder.gep(data, [index])


def _fma(builder, a, b, c):
    """``a * b + c`` rounded once, on vectors (llvmlite's ``builder.fma`` takes scalars only)."""
    return builder.call(_vector_intrinsic(builder, "llvm.fma", a.type, 3), [a, b, c])


def _vector_intrinsic(builder, name, vty, n_args):
    """Declare an overloaded LLVM intrinsic such as ``llvm.fma.v16f32`` for a vector type."""
    elem = "f32" if isinstance(vty.element, ir.FloatType) else "f64"
    fnty = ir.FunctionType(vty, [vty] * n_args)
    return cgutils.get_or_insert_function(builder.module, fnty, f"{name}.v{vty.count}{elem}")


def _vec_ptr(builder, ptr, vty):
    return builder.bitcast(ptr, vty.as_pointer())


# Storage types a K/V cache may have besides the compute dtype: float16 (passed as its uint16
# bits: Numba has no float16 arrays), bfloat16 (as its int16 bits: numpy has no bfloat16 either;
# only ``KVCache`` makes such arrays) and int8 (quantized, scaled by the caller); and uint8, the
# bytes of a bool mask. Loads convert to the compute type exactly (every float16, bfloat16, int8
# and uint8 value is a float32; a bfloat16 is a float32's upper half, so its bits shifted up).
STORAGE_TYPES = (types.float32, types.float64, types.uint16, types.int16, types.int8,
                 types.uint8)


def _storage_ok(arrty, vt):
    return (isinstance(arrty, types.Array) and arrty.dtype in STORAGE_TYPES
            and (arrty.dtype in (vt.dtype, types.uint8, types.float32, types.float64)
                 or vt.dtype == types.float32))


def _load_cvt(builder, ptr, arrty, lvt):
    """Load ``lvt.count`` consecutive elements at ``ptr`` (an element pointer of ``arrty``'s
    storage type) as the float vector type ``lvt``."""
    n = lvt.count
    dtype = arrty.dtype
    if dtype in (types.float32, types.float64):
        src_ty = ir.VectorType(ir.FloatType() if dtype == types.float32 else ir.DoubleType(), n)
        raw = builder.load(_vec_ptr(builder, ptr, src_ty), align=dtype.bitwidth // 8)
        if src_ty == lvt:
            return raw
        # a float64 mask on float32 scores, rounded once (or float32 widened: exact)
        return (builder.fptrunc(raw, lvt) if dtype == types.float64
                else builder.fpext(raw, lvt))
    raw_ty = ir.VectorType(ir.IntType(dtype.bitwidth), n)
    raw = builder.load(_vec_ptr(builder, ptr, raw_ty), align=dtype.bitwidth // 8)
    if dtype == types.uint16:  # IEEE half bits
        return builder.fpext(builder.bitcast(raw, ir.VectorType(ir.HalfType(), n)), lvt)
    if dtype == types.int16:  # bfloat16 bits
        wide = builder.shl(builder.zext(raw, ir.VectorType(ir.IntType(32), n)),
                           ir.Constant(ir.VectorType(ir.IntType(32), n), 16))
        return builder.bitcast(wide, ir.VectorType(ir.FloatType(), n))
    if dtype == types.uint8:
        return builder.uitofp(raw, lvt)
    return builder.sitofp(raw, lvt)


def _load_cvt_scalar(builder, ptr, arrty, lty):
    dtype = arrty.dtype
    raw = builder.load(ptr)
    if dtype in (types.float32, types.float64):
        if raw.type == lty:
            return raw
        return builder.fptrunc(raw, lty) if dtype == types.float64 else builder.fpext(raw, lty)
    if dtype == types.uint16:
        return builder.fpext(builder.bitcast(raw, ir.HalfType()), lty)
    if dtype == types.int16:  # bfloat16 bits
        wide = builder.shl(builder.zext(raw, ir.IntType(32)), ir.Constant(ir.IntType(32), 16))
        return builder.bitcast(wide, ir.FloatType())
    if dtype == types.uint8:
        return builder.uitofp(raw, lty)
    return builder.sitofp(raw, lty)


# ---------------------------------------------------------------------------------------------
# element-wise vector ops


@intrinsic
def vload(typingctx, arr, index):
    """Load ``W`` lanes from ``arr.flat[index:index+W]`` (``arr`` must be contiguous)."""
    vt = _vec_of(arr)
    if vt is None:
        return None

    def codegen(context, builder, sig, args):
        ptr = _elem_ptr(context, builder, sig.args[0], args[0], args[1])
        lvt = context.get_value_type(vt)
        return builder.load(_vec_ptr(builder, ptr, lvt), align=sig.args[0].dtype.bitwidth // 8)

    return vt(arr, types.intp), codegen


@intrinsic
def vload_as(typingctx, like, arr, index):
    """``W`` lanes of ``arr.flat[index:index+W]`` converted to ``like``'s vector type; ``arr``
    may hold a storage type (``STORAGE_TYPES``)."""
    vt = _vec_of(like)
    if vt is None or not _storage_ok(arr, vt):
        return None

    def codegen(context, builder, sig, args):
        ptr = _elem_ptr(context, builder, sig.args[1], args[1], args[2])
        return _load_cvt(builder, ptr, sig.args[1], context.get_value_type(vt))

    return vt(like, arr, types.intp), codegen


@intrinsic
def vload_scaled(typingctx, arr, index, scale):
    """``W`` lanes of ``arr.flat[index:index+W] * scale`` with ``scale`` a float64: each product
    formed in float64 (exact for float32 lanes) and rounded once to ``arr``'s type, as the scalar
    ``x * scale`` of a float32 ``x`` and a float64 ``scale`` in Numba rounds. (A float32 product
    with ``scale`` rounded first would round twice.) The first element of ``arr.flat`` is at
    ``arr``'s data pointer and the next ones follow it: ``arr`` may be a view of any layout
    whose elements from there are consecutive (a unit-stride row of a strided array)."""
    vt = _vec_of(arr)
    if vt is None or not isinstance(scale, types.Float):
        return None

    def codegen(context, builder, sig, args):
        ptr = _elem_ptr(context, builder, sig.args[0], args[0], args[1])
        lvt = context.get_value_type(vt)
        x = builder.load(_vec_ptr(builder, ptr, lvt), align=sig.args[0].dtype.bitwidth // 8)
        wide = ir.VectorType(ir.DoubleType(), vt.width)
        s = _splat(builder, context.cast(builder, args[2], sig.args[2], types.float64), wide)
        prod = builder.fmul(x if lvt == wide else builder.fpext(x, wide), s)
        return prod if lvt == wide else builder.fptrunc(prod, lvt)

    return vt(arr, types.intp, scale), codegen


@intrinsic
def load_as(typingctx, like, arr, index):
    """``arr.flat[index]`` converted to ``like``'s element type (see ``vload_as``)."""
    vt = _vec_of(like)
    if vt is None or not _storage_ok(arr, vt):
        return None

    def codegen(context, builder, sig, args):
        ptr = _elem_ptr(context, builder, sig.args[1], args[1], args[2])
        return _load_cvt_scalar(builder, ptr, sig.args[1], context.get_value_type(vt.dtype))

    return vt.dtype(like, arr, types.intp), codegen


@intrinsic
def vstore(typingctx, arr, index, vec):
    """Store ``vec`` to ``arr.flat[index:index+W]``."""
    if _vec_of(arr) != vec:
        return None

    def codegen(context, builder, sig, args):
        ptr = _elem_ptr(context, builder, sig.args[0], args[0], args[1])
        lvt = context.get_value_type(vec)
        builder.store(args[2], _vec_ptr(builder, ptr, lvt), align=sig.args[0].dtype.bitwidth // 8)
        return context.get_dummy_value()

    return types.void(arr, types.intp, vec), codegen


def _splat(builder, value, lvt):
    undef = ir.Constant(lvt, ir.Undefined)
    one = builder.insert_element(undef, value, ir.Constant(ir.IntType(32), 0))
    mask = ir.Constant(ir.VectorType(ir.IntType(32), lvt.count), [0] * lvt.count)
    return builder.shuffle_vector(one, undef, mask)


@intrinsic
def vsplat(typingctx, arr, value):
    """A vector of ``arr``'s element type with every lane ``value`` (``arr`` gives the type)."""
    vt = _vec_of(arr)
    if vt is None:
        return None

    def codegen(context, builder, sig, args):
        x = context.cast(builder, args[1], sig.args[1], vt.dtype)
        return _splat(builder, x, context.get_value_type(vt))

    return vt(arr, vt.dtype), codegen


def _binary(op):
    @intrinsic
    def _op(typingctx, a, b):
        if not isinstance(a, Vec) or a != b:
            return None

        def codegen(context, builder, sig, args):
            return op(builder, *args)

        return a(a, b), codegen

    return _op


vadd = _binary(lambda b, x, y: b.fadd(x, y))
vsub = _binary(lambda b, x, y: b.fsub(x, y))
vmul = _binary(lambda b, x, y: b.fmul(x, y))
vdiv = _binary(lambda b, x, y: b.fdiv(x, y))
# max that passes over a NaN in ``y`` (``y > x`` is false for NaN): as vmax(running, new), the
# running max never turns NaN. A NaN score still reaches the output: 2^(NaN - m) is NaN.
vmax = _binary(lambda b, x, y: b.select(b.fcmp_ordered(">", y, x), y, x))


@intrinsic
def vabs(typingctx, v):
    """|v| lane by lane (clears the sign bit; NaN stays NaN)."""
    if not isinstance(v, Vec):
        return None

    def codegen(context, builder, sig, args):
        fabs = _vector_intrinsic(builder, "llvm.fabs", args[0].type, 1)
        return builder.call(fabs, [args[0]])

    return v(v), codegen


@intrinsic
def viota(typingctx, arr):
    """The vector ``[0, 1, ..., W-1]`` of ``arr``'s element type."""
    vt = _vec_of(arr)
    if vt is None:
        return None

    def codegen(context, builder, sig, args):
        lvt = context.get_value_type(vt)
        return ir.Constant(lvt, [float(i) for i in range(vt.width)])

    return vt(arr), codegen


@intrinsic
def vwhere_lt(typingctx, a, b, x, y):
    """Lane by lane: ``x`` where ``a < b``, else ``y`` (NaN compares false: ``y``)."""
    if not isinstance(a, Vec) or not (a == b == x == y):
        return None

    def codegen(context, builder, sig, args):
        return builder.select(builder.fcmp_ordered("<", args[0], args[1]), args[2], args[3])

    return a(a, b, x, y), codegen


@intrinsic
def vall_lt(typingctx, a, b):
    """Whether ``a < b`` in every lane (False where a lane is NaN): one compare and one mask
    test, where a horizontal max and a scalar compare take a shuffle tree."""
    if not isinstance(a, Vec) or a != b:
        return None

    def codegen(context, builder, sig, args):
        lt = builder.fcmp_ordered("<", args[0], args[1])
        bits = builder.bitcast(lt, ir.IntType(a.width))
        return builder.icmp_unsigned("==", bits, ir.Constant(ir.IntType(a.width), -1))

    return types.boolean(a, b), codegen


@intrinsic
def vselect_nonzero(typingctx, m, a, b):
    """Lane by lane: ``a`` where ``m != 0`` (NaN counts as nonzero), else ``b``."""
    if not isinstance(m, Vec) or not (m == a == b):
        return None

    def codegen(context, builder, sig, args):
        zero = ir.Constant(args[0].type, None)
        return builder.select(builder.fcmp_unordered("!=", args[0], zero), args[1], args[2])

    return a(m, a, b), codegen


@intrinsic
def vfma(typingctx, a, b, c):
    """``a * b + c`` with one rounding."""
    if not isinstance(a, Vec) or not (a == b == c):
        return None

    def codegen(context, builder, sig, args):
        return _fma(builder, *args)

    return a(a, b, c), codegen


def _tree_reduce(builder, vec, combine):
    """Pairwise halving reduction: a fixed order, so the result never depends on anything else."""
    n = vec.type.count
    while n > 1:
        half = n // 2
        lanes_ty = ir.VectorType(ir.IntType(32), half)
        lo = builder.shuffle_vector(vec, vec, ir.Constant(lanes_ty, list(range(half))))
        hi = builder.shuffle_vector(vec, vec, ir.Constant(lanes_ty, list(range(half, n))))
        vec = combine(builder, lo, hi)
        n = half
    return builder.extract_element(vec, ir.Constant(ir.IntType(32), 0))


@intrinsic
def vhsum(typingctx, v):
    """Sum of the lanes of ``v``."""
    if not isinstance(v, Vec):
        return None

    def codegen(context, builder, sig, args):
        return _tree_reduce(builder, args[0], lambda b, x, y: b.fadd(x, y))

    return v.dtype(v), codegen


@intrinsic
def vhmax(typingctx, v):
    """Max of the lanes of ``v`` (NaN lanes are passed over, as by ``vmax``)."""
    if not isinstance(v, Vec):
        return None

    def codegen(context, builder, sig, args):
        return _tree_reduce(builder, args[0],
                            lambda b, x, y: b.select(b.fcmp_ordered(">", x, y), x, y))

    return v.dtype(v), codegen


# ---------------------------------------------------------------------------------------------
# exp2
#
# 2^x = 2^n * 2^f with n = round(x), f = x - n in [-0.5, 0.5]; 2^f by a polynomial, 2^n built
# in the exponent bits. The rounding is the "magic number" trick: t = x + (1.5 * 2^m + bias)
# rounds x to an integer in float arithmetic and leaves n + bias in t's low mantissa bits, so
# t's bits shifted left by m are exactly the bits of 2^n (the 1.5 * 2^m part shifts out).
# No float->int conversion, so NaN needs no special case: a NaN lane stays NaN through
# f and the product (an input NaN must show in the output, never turn into 0).
# x is clamped below at -bias, where 2^n is the bit pattern 0: exp2(-inf) is exactly 0 (masked
# scores vanish), and values below 2^-126 flush to 0 (under 1e-38 of the row max, far below
# float32 resolution). x must be <= 0 (scores minus their running max) or at least below 2^m.

LOG2_E = 1.0 / math.log(2.0)
LOG2_E_LO = 2.0355273740931033e-17  # log2(e) - LOG2_E, for float64

# float32: near-minimax degree 6 on [-0.5, 0.5], max relative error 1.0e-7 (float32 rounding).
EXP2_F32 = (1.0, 0.6931471824645996, 0.24022646248340607, 0.05550329014658928,
            0.009618519805371761, 0.0013399859890341759, 0.00015337577497120947)
# float32, degree 5 with 2^0 = 1 exactly (a relative minimax fit, coefficients rounded to
# float32): 9.2e-8 relative in exact arithmetic, 1.6e-7 (2.7 ulp) evaluated in float32 by fused
# multiply-adds, against degree 6's 7.9e-8. One multiply-add fewer of the 13 a vector of the
# forward's exponentials (``vexp_once``): that loop 6.7 % faster on one Xeon core (stop 64, 10
# rounds), about 0.7 % of a forward call. The forward's errors against the float64 reference
# stayed as they were (``python bench/cpu_accuracy.py --seeds 2 [--peaked 2.0]``, max over 16
# heads, degree 6 / 5 / torch): N=512 3.60e-7 / 3.60e-7 / 9.81e-7, N=512 D=128 2.73e-7 /
# 2.42e-7 / 5.29e-7, N=2048 2.19e-7 / 2.19e-7 / 4.21e-7, causal N=2048 4.52e-7 / 4.92e-7 /
# 7.98e-7; peaked the same to three digits (2.15e-6, 2.25e-7, 2.62e-6, 1.30e-6). Where
# ``x log2(e)`` is rounded once, its rounding (up to 2^-24 |x| relative) outweighs the
# polynomial's below x = -3.
EXP2_F32_SHORT = (1.0, 0.6931470036506653, 0.24022242426872253, 0.05550733581185341,
                  0.009671509265899658, 0.0013264714507386088)
# float64: Taylor series of e^(f ln 2) to degree 13, truncation < 2e-17 on [-0.5, 0.5].
EXP2_F64 = tuple(math.log(2.0) ** n / math.factorial(n) for n in range(14))


def exp2_coefficients(bits, short=False):
    """The polynomial of 2^f for floats of ``bits``; ``short``: float32's of degree 5."""
    if bits == 32:
        return EXP2_F32_SHORT if short else EXP2_F32
    return EXP2_F64


def _exp2_ir(builder, x, natural=False, once=False):
    """2^x; with ``natural``, e^x = 2^(x log2(e)), the product never rounded as a whole: n
    from the rounded product, then ``f = x * log2(e) - n`` by two fused multiply-adds with
    log2(e) split into a float and its remainder, so f (at most 0.5) carries the rounding of
    its own size only. (Rounding ``x * log2(e)`` first costs half an ulp of the product in
    the exponent: 2^-24 * |x| relative in e^x, 1.2e-6 at x = -20.)

    ``once`` (with ``natural``): that product rounded once after all, ``f = y - n`` from the
    rounded ``y = x * log2(e)`` (exact), in place of the two fused multiply-adds, and 2^f by
    float32's polynomial of degree 5 (``EXP2_F32_SHORT``, since stop 64). The relative
    error it adds to e^x, under 2^-23 * |x| (half an ulp of y, and log2(e)'s own rounding to
    float32), is largest where e^x is small: against the row's largest probability, 1, at most
    2^-23 / e (4.4e-8, at x = -1). The forward pass's softmax takes
    it (``tiles.exp_shifted_sum``): two fewer operations on the multiply-add pipes of 13 a
    vector, the softmax of a hot 128 x 128 tile 3.21 -> 2.79 us on one Zen 4 core (stop 43);
    its errors stayed below torch's (``vexp_once``). The backward pass's ``P = exp(S - lse)``
    keeps the two fused multiply-adds: with ``once`` there too, the causal N=2048 dK's maximum
    over 16 heads rose from 1.30e-6 to 1.47e-6, above torch's 1.46e-6.

    On 512-bit vectors (AVX-512) the rounding and the scaling are one instruction each:
    ``vrndscale`` (``llvm.roundeven``) gives n, and ``vscalef`` multiplies p by 2^n taking n as
    a float, its zero mask flushing lanes where y < -(bias - 1) (y = -inf included: its f is
    NaN, masked away; a NaN y passes the mask and stays NaN). 12 vector operations a score,
    not 15 (the softmax of a hot 128 x 128 tile, one Zen 4 core: 4.9 -> 3.4 us)."""
    vty = x.type
    bits = 32 if isinstance(vty.element, ir.FloatType) else 64
    mant, bias = (23, 127) if bits == 32 else (52, 1023)
    scalef = vty.count * bits == 512  # only an AVX-512 host has 512-bit vectors (config)

    def splat(c, ty=vty):
        return ir.Constant(ty, [c] * vty.count)

    def at_least(lowest, v):  # max(lowest, v) that keeps a NaN v: "lowest > v" is false for
        # NaN (one vmaxps on x86)
        return builder.select(builder.fcmp_ordered(">", splat(lowest), v), splat(lowest), v)

    if natural:
        unit_hi = float(np.float32(LOG2_E)) if bits == 32 else LOG2_E
        unit_lo = LOG2_E - unit_hi if bits == 32 else LOG2_E_LO
        if not scalef:
            # x clamped where y = x log2(e) is -bias, give or take its rounding (never below
            # -bias - 1/2, which would borrow from the magic number's bits): n = -bias, 2^n's
            # bits 0, e^x exactly 0, x = -inf included, with a finite f. The same bits as
            # clamping y for every x above; and fewer live vectors than a mask kept for f
            # (which spilled the sum's register in the softmax's loop on AVX2, 12 -> 8
            # cycles a vector of exponentials).
            x = at_least(-(bias * math.log(2.0)), x)
        y = builder.fmul(x, splat(unit_hi))
    else:
        y = x
    if scalef:
        n = builder.call(_vector_intrinsic(builder, "llvm.roundeven", vty, 1), [y])
        yc = y
    else:
        yc = at_least(float(-bias), y) if not natural else y
        magic = splat(1.5 * 2.0 ** mant + bias)
        t = builder.fadd(yc, magic)           # round(y) + bias in the low mantissa bits
        n = builder.fsub(t, magic)            # round(y), exactly
    if natural and not once:  # f = x log2(e) - n, one fused multiply-subtract and a correction
        f = _fma(builder, x, splat(unit_hi), builder.fneg(n))
        f = _fma(builder, x, splat(unit_lo), f)
    elif natural:  # f = y - n, y = x log2(e) rounded once
        f = builder.fsub(y, n)
    else:
        f = builder.fsub(yc, n)               # in [-0.5, 0.5]
    coeffs = exp2_coefficients(bits, short=once)
    p = splat(coeffs[-1])
    for c in coeffs[-2::-1]:
        p = _fma(builder, p, f, splat(c))
    if scalef:
        keep = builder.bitcast(builder.fcmp_unordered(">=", y, splat(float(1 - bias))),
                               ir.IntType(vty.count))  # true for NaN
        name = f"llvm.x86.avx512.mask.scalef.{'ps' if bits == 32 else 'pd'}.512"
        fnty = ir.FunctionType(vty, [vty, vty, vty, keep.type, ir.IntType(32)])
        fn = cgutils.get_or_insert_function(builder.module, fnty, name)
        return builder.call(fn, [p, n, splat(0.0), keep, ir.Constant(ir.IntType(32), 4)])
    ity = ir.VectorType(ir.IntType(bits), vty.count)
    scale = builder.bitcast(builder.shl(builder.bitcast(t, ity), splat(mant, ity)), vty)
    return builder.fmul(p, scale)             # n = -bias: scale bits 0, i.e. exactly +0.0


@intrinsic
def vexp2(typingctx, v):
    """2**v lane by lane, for v <= 0 (scores minus their running max); see the notes above."""
    if not isinstance(v, Vec):
        return None

    def codegen(context, builder, sig, args):
        return _exp2_ir(builder, args[0])

    return v(v), codegen


@intrinsic
def vexp(typingctx, v):
    """e**v lane by lane, for v <= 0 (scores minus their running max): ``_exp2_ir``'s natural
    mode."""
    if not isinstance(v, Vec):
        return None

    def codegen(context, builder, sig, args):
        return _exp2_ir(builder, args[0], natural=True)

    return v(v), codegen


@intrinsic
def vexp_once(typingctx, v):
    """e**v lane by lane, for v <= 0, as ``vexp`` but with ``v * log2(e)`` rounded once
    (``_exp2_ir``'s ``once``): the forward pass's probabilities. Measured (stop 43, Zen 4,
    ``python bench/cpu_accuracy.py --seeds 2 [--peaked 2.0|4.0]``, max over 16 heads, with it /
    without / torch): N=512 3.60e-7 / 3.45e-7 / 1.16e-6, N=512 D=128 2.73e-7 / 2.78e-7 /
    5.70e-7, N=2048 2.19e-7 / 2.04e-7 / 3.37e-7, causal N=2048 4.52e-7 / 4.92e-7 / 7.98e-7;
    the peaked cases the same to three digits. Since stop 64 in float32 with the polynomial of
    degree 5 (``EXP2_F32_SHORT``: its measurements there)."""
    if not isinstance(v, Vec):
        return None

    def codegen(context, builder, sig, args):
        return _exp2_ir(builder, args[0], natural=True, once=True)

    return v(v), codegen


# ---------------------------------------------------------------------------------------------
# the register-blocked tile product


# The locality of a prefetch hint (LLVM's 0-3; 2 is x86's prefetcht1): into L2, not L1. The
# decode kernel hints the next chunks of K^T's 64 rows and of V while it computes on the
# current one; into L1 (locality 3, prefetcht0) those lines evict the scores and the current
# chunk's rows from its 32 KiB. Measured (stop 33, Zen 4, Hkv=2, Nk=32768, float32 from DRAM,
# all 64 rows of K^T in one pass over 512-1024 keys with the next ones hinted, medians of 10
# rounds interleaved in one process): a step 1.56-1.67 ms with locality 2, 2.17-2.19 with 3,
# 1.68-1.90 with 1 (docs/HISTORY.md, stop 33).
PREFETCH_LOCALITY = 2
# The prefetching products (``_make_gemm(prefetch=True)``: the decode kernel's K^T and V) also
# hint each row of B NEAR_ROWS rows of float32 on into L1 (locality 3, prefetcht0; as many
# bytes of rows of the same width in another type: 64 rows of float16, 128 of int8): a stream's
# next lines reach L1 before the product's loads ask for them, which the far hints (into L2)
# and the hardware's own L1 prefetcher leave to the loads. Measured (stop 54, Intel Xeon,
# Hkv=2, Nk=32768, KVCache, layers from DRAM, variants side by side in one process, best of 4
# steps a round, 6 rounds each; GB/s): float32, 32 rows (8 KiB of rows of 64) 22.4-23.3
# against 19.7-20.8 without, 32 rows into L2 instead 21.9-22.6, 64 rows 21.9-22.4, 32 rows into
# L1 without the far hints 18.8-20.1; in a faster spell 8 rows 26.8-27.7 against 25.2-25.7;
# float16 (bound by its arithmetic), 64 rows against none: median 1.08x in one run (5 of 6
# rounds), 1.00x in another; 32 rows 1.01-1.02x, 128 rows 0.99x.
NEAR_ROWS = 32
NEAR_LOCALITY = 3


def _prefetch(builder, ptr, locality=PREFETCH_LOCALITY):
    """Hint the line holding ``ptr`` into L2 (``PREFETCH_LOCALITY``), or as ``locality`` says
    (LLVM's 0-3); a read; no fault if out of range."""
    i8p = ir.IntType(8).as_pointer()
    i32 = ir.IntType(32)
    fnty = ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32])
    fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0")
    builder.call(fn, [builder.bitcast(ptr, i8p), ir.Constant(i32, 0),
                      ir.Constant(i32, locality), ir.Constant(i32, 1)])


@intrinsic
def prefetch_line(typingctx, arr, index):
    """Hint the cache line holding ``arr[index]`` into L2 (``_prefetch``); an index past the
    array's end is harmless (a hint never faults)."""
    if not isinstance(arr, types.Array):
        return None

    def codegen(context, builder, sig, args):
        _prefetch(builder, _elem_ptr(context, builder, sig.args[0], args[0], args[1]))
        return context.get_dummy_value()

    return types.void(arr, types.intp), codegen


# Terms per partial sum of a gemm's inner product (``partial_terms``; tiles.py says which
# products use it). A float32 sum of n terms accumulated in one register rounds n times at the
# size of the whole running sum; in partial sums of m terms, each added to the total in order,
# most roundings are at the size of a partial sum, and the error's spread shrinks by about
# sqrt(n / m). The score of a D = 64 head is such a sum, and its rounding (not the
# exponential, not P V) decided the output's largest errors: in the first rows of a causal
# head, which see few keys, one score's error moves the output by that error times a value.
# Simulated at N = 2048, causal (float32 scores, the rest in float64): max error 4.5e-7 in one
# sum, 3.0e-7 in two of 32 terms. Measured (stop 31, ``bench/cpu_accuracy.py --backward``, 3
# seeds x 8 heads, max cpuflash / torch): causal forward N=2048 8.7e-7 / 8.0e-7 before, 5.2e-7
# after; dq N=2048 4.9e-7 / 4.6e-7 before, 4.3e-7 after. The cost: one vector add per
# accumulator per 32 multiply-adds and the whole sum's registers spilled around each part
# (the S product 5 % slower alone, 177 -> 168 GFLOP/s on one core, about 2 % of a forward).
PARTIAL_TERMS = 32


def _make_gemm(mr, nv, accumulate, prefetch=False, epilogue=None, partial_terms=0):
    """Build ``gemm(c, c_off, ldc, a, a_off, a_rs, a_ks, b, b_off, ldb, k)`` for one tile shape.

    ``C[r, :] (+)= sum_k A[r, k] * B[k, :]`` for ``r < mr`` and ``nv`` vectors of columns.
    Arrays are contiguous and addressed flat: ``C[r, c]`` is ``c[c_off + r*ldc + c]``,
    ``B[k, c]`` is ``b[b_off + k*ldb + c]``, and ``A[r, k]`` is ``a[a_off + r*a_rs + k*a_ks]``
    (``a_ks = 1`` for a row-major A; ``a_rs = 1`` reads a transposed one, as the backward
    pass does for ``P^T @ dO`` and ``dS^T @ Q``).

    ``prefetch``: the gemm takes one more argument, ``pf``, and with each row of B it reads it
    hints the same row ``pf`` elements further on into L2: the next tile of a stream (the decode
    kernel's K/V), one line per hint, spread evenly over the products; and the row
    ``NEAR_ROWS`` float32 rows on (as many bytes of B's type) into L1.

    ``epilogue`` (set mode only): the gemm takes four more arguments, ``e, e_off, f, f_off``
    (arrays of C's type and offsets into them), and finishes each row in registers, saving a
    pass over C through memory (see ``EPILOGUES``).

    ``partial_terms`` > 0: the sum over k runs in partial sums of that many terms, each formed
    from zero and added to the total in order (see ``PARTIAL_TERMS``); 0: one running sum.
    """
    n_extra = int(prefetch) + (4 if epilogue else 0)

    def typer(c, a, b, extra):
        vt = _vec_of(c)
        if vt is None or _vec_of(a) != vt or not _storage_ok(b, vt):  # B: a V cache, say
            return None
        if epilogue and not all(isinstance(x, types.Array) and x.dtype == vt.dtype
                                for x in (extra[0], extra[2])):
            return None
        ip = types.intp
        sig = types.void(c, ip, ip, a, ip, ip, ip, b, ip, ip, ip, *extra)

        def codegen(context, builder, sig, args):
            cty, _, _, aty, _, _, _, bty, _, _, _ = sig.args[:11]
            c_arr, c_off, ldc, a_arr, a_off, lda, a_ks, b_arr, b_off, ldb, kdim = args[:11]
            lvt = context.get_value_type(vt)
            align = vt.dtype.bitwidth // 8
            width = vt.width
            c_base = _elem_ptr(context, builder, cty, c_arr, c_off)
            a_base = _elem_ptr(context, builder, aty, a_arr, a_off)
            b_base = _elem_ptr(context, builder, bty, b_arr, b_off)

            def c_ptr(r, v):
                off = builder.add(builder.mul(ir.Constant(ldc.type, r), ldc),
                                  ir.Constant(ldc.type, v * width))
                return _vec_ptr(builder, builder.gep(c_base, [off]), lvt)

            accs = [[cgutils.alloca_once(builder, lvt) for _ in range(nv)] for _ in range(mr)]
            zero = ir.Constant(lvt, None)
            for r in range(mr):
                for v in range(nv):
                    init = builder.load(c_ptr(r, v), align=align) if accumulate else zero
                    builder.store(init, accs[r][v])
            def k_step(kk, sums):  # sums[r][v] += A[r, kk] * B[kk, v-th vector]
                b_row = builder.gep(b_base, [builder.mul(kk, ldb)])
                if prefetch:  # each line of the row pf elements on (L2), NEAR_ROWS rows on (L1)
                    per_line = 64 // (bty.dtype.bitwidth // 8)
                    near_rows = NEAR_ROWS * 4 // (bty.dtype.bitwidth // 8)
                    near = builder.mul(ldb, ir.Constant(ldb.type, near_rows))
                    for e in range(0, nv * width, per_line):
                        line = ir.Constant(kk.type, e)
                        _prefetch(builder, builder.gep(b_row, [builder.add(args[11], line)]))
                        _prefetch(builder, builder.gep(b_row, [builder.add(near, line)]),
                                  NEAR_LOCALITY)
                b_vecs = [_load_cvt(builder, builder.gep(
                    b_row, [ir.Constant(kk.type, v * width)]), bty, lvt) for v in range(nv)]
                for r in range(mr):
                    a_idx = builder.add(builder.mul(ir.Constant(lda.type, r), lda),
                                        builder.mul(kk, a_ks))
                    a_val = _splat(builder, builder.load(builder.gep(a_base, [a_idx])), lvt)
                    for v in range(nv):
                        acc = builder.load(sums[r][v])
                        builder.store(_fma(builder, a_val, b_vecs[v], acc), sums[r][v])

            if not partial_terms:
                with cgutils.for_range(builder, kdim) as loop:
                    k_step(loop.index, accs)
            else:  # partial sums of partial_terms terms, each added to the total in order
                parts = [[cgutils.alloca_once(builder, lvt) for _ in range(nv)]
                         for _ in range(mr)]
                terms = ir.Constant(kdim.type, partial_terms)

                def partial_sum(k0, n_terms):
                    for row in parts:
                        for p in row:
                            builder.store(zero, p)
                    with cgutils.for_range(builder, n_terms) as loop:
                        k_step(builder.add(k0, loop.index), parts)
                    for r in range(mr):
                        for v in range(nv):
                            builder.store(builder.fadd(builder.load(accs[r][v]),
                                                       builder.load(parts[r][v])), accs[r][v])

                # whole parts (a constant trip count), then the rest of k
                n_whole = builder.udiv(kdim, terms)
                with cgutils.for_range(builder, n_whole) as part:
                    partial_sum(builder.mul(part.index, terms), terms)
                done = builder.mul(n_whole, terms)
                rest = builder.sub(kdim, done)
                with builder.if_then(builder.icmp_signed(">", rest, ir.Constant(kdim.type, 0))):
                    partial_sum(done, rest)
            if epilogue:
                e_base = _elem_ptr(context, builder, sig.args[11], args[11], args[12])
                f_base = _elem_ptr(context, builder, sig.args[13], args[13], args[14])
            for r in range(mr):
                products = [builder.load(accs[r][v]) for v in range(nv)]
                if epilogue:
                    products = _finish_row(builder, epilogue, products, r, c_ptr, e_base, f_base,
                                           ldc, lvt, align)
                for v in range(nv):
                    builder.store(products[v], c_ptr(r, v), align=align)
            return context.get_dummy_value()

        return sig, codegen

    if n_extra == 0:
        @intrinsic
        def gemm(typingctx, c, c_off, ldc, a, a_off, a_rs, a_ks, b, b_off, ldb, k):
            return typer(c, a, b, ())

        return gemm
    if n_extra == 1:
        @intrinsic
        def gemm_pf(typingctx, c, c_off, ldc, a, a_off, a_rs, a_ks, b, b_off, ldb, k, pf):
            return typer(c, a, b, (types.intp,))

        return gemm_pf
    assert not prefetch and not accumulate and epilogue in EPILOGUES

    @intrinsic
    def gemm_epilogue(typingctx, c, c_off, ldc, a, a_off, a_rs, a_ks, b, b_off, ldb, k, e,
                      e_off, f, f_off):
        return typer(c, a, b, (e, types.intp, f, types.intp))

    return gemm_epilogue


# What a gemm's epilogue does with the product ``p`` of row r. "C's layout": an array indexed as
# C, element (r, c) at offset + r * ldc + c; "per row": one value per row, at offset + r.
#   store:        C = p.
#   rowmax:       C = p; e (W values per row) = vmax(e, p's vectors): lane-wise running row
#                 maxima, NaN passed over as by ``vmax``.
#   rescale:      C = e[r] * C + p, one fused multiply-add (as tiles.rescale_add).
#   add:          C = C + p.
#   kahan:        C += p with Kahan compensation in e, C's layout: y = p - e; t = C + y;
#                 e = (t - C) - y; C = t (the running sum's rounding error stays O(eps) however
#                 many blocks are added; no reassociation, which the fastmath flags forbid).
#   softmax_grad: C = e * (p - f[r]) where e != 0 (NaN counts), else 0 (as
#                 tiles.softmax_grad_row): dS from dP, with e = P in C's layout, f = delta.
# Each does the same operations in the same order as the pass over a stored product that it
# replaced (tests/test_tiles.py keeps those passes and checks the bits).
EPILOGUES = ("store", "rowmax", "rescale", "add", "kahan", "softmax_grad")


def _finish_row(builder, epilogue, products, r, c_ptr, e_base, f_base, ldc, lvt, align):
    """The epilogue's IR for row ``r`` (see ``EPILOGUES``); returns what to store in C (the
    rowmax epilogue also stores its maxima)."""
    width = lvt.count
    idx = ldc.type

    def same_layout(base, v):  # row r, vector v of an array laid out as C
        off = builder.add(builder.mul(ir.Constant(idx, r), ldc), ir.Constant(idx, v * width))
        return _vec_ptr(builder, builder.gep(base, [off]), lvt)

    def of_row(base):
        return _splat(builder, builder.load(builder.gep(base, [ir.Constant(idx, r)])), lvt)

    c_old = [builder.load(c_ptr(r, v), align=align) for v in range(len(products))] \
        if epilogue in ("rescale", "add", "kahan") else None
    if epilogue == "store":
        return products
    if epilogue == "rowmax":
        e_ptr = _vec_ptr(builder, builder.gep(e_base, [ir.Constant(idx, r * width)]), lvt)
        best = builder.load(e_ptr, align=align)
        for p in products:  # vmax(running, new)
            best = builder.select(builder.fcmp_ordered(">", p, best), p, best)
        builder.store(best, e_ptr, align=align)
        return products
    if epilogue == "rescale":
        alpha = of_row(e_base)
        return [_fma(builder, c, alpha, p) for c, p in zip(c_old, products)]
    if epilogue == "add":
        return [builder.fadd(c, p) for c, p in zip(c_old, products)]
    if epilogue == "kahan":
        out = []
        for v, (a, x) in enumerate(zip(c_old, products)):
            comp_ptr = same_layout(e_base, v)
            y = builder.fsub(x, builder.load(comp_ptr, align=align))
            t = builder.fadd(a, y)
            builder.store(builder.fsub(builder.fsub(t, a), y), comp_ptr, align=align)
            out.append(t)
        return out
    assert epilogue == "softmax_grad"
    delta = of_row(f_base)
    zero = ir.Constant(lvt, None)
    out = []
    for v, dp in enumerate(products):
        prob = builder.load(same_layout(e_base, v), align=align)
        ds = builder.fmul(prob, builder.fsub(dp, delta))
        out.append(builder.select(builder.fcmp_unordered("!=", prob, zero), ds, zero))
    return out


DOT_UNROLL = 4  # head-dim vectors per straight-line block of vdot_keys (D = 64 in float32)


@intrinsic
def vdot_keys(typingctx, q, q_off, k, k_off, k_stride, d_vec):
    """The vector of ``W`` dot products ``q[q_off:q_off+d_vec] . k[k_off+j*k_stride:][:d_vec]``
    for keys ``j = 0..W-1`` (``d_vec`` a multiple of ``W``): S for one query row and ``W`` keys
    read in place (decode), with no horizontal sum per key.

    Key ``j``'s products collect in its own vector ``acc_j``; then ``log2(W)`` folding levels
    turn the ``W`` vectors into one: each level pairs vectors and, by two shuffles and one add,
    halves the lanes each key occupies (``W`` -> ``W/2`` -> ... -> 1) while packing two vectors'
    keys into one, in key order. ``2W - 2`` shuffles and ``W - 1`` adds for ``W`` keys, where
    one horizontal sum per key would take ``2 log2(W)`` each; the order of the additions is
    fixed."""
    vt = _vec_of(q)
    if vt is None or not _storage_ok(k, vt):
        return None
    ip = types.intp
    sig = vt(q, ip, k, ip, ip, ip)

    def codegen(context, builder, sig, args):
        qty, _, kty, _, _, _ = sig.args
        q_arr, q_off, k_arr, k_off, k_stride, d_vec = args
        lvt = context.get_value_type(vt)
        align = vt.dtype.bitwidth // 8
        width = vt.width
        q_base = _elem_ptr(context, builder, qty, q_arr, q_off)
        k_base = _elem_ptr(context, builder, kty, k_arr, k_off)
        accs = [cgutils.alloca_once(builder, lvt) for _ in range(width)]
        for acc in accs:
            builder.store(ir.Constant(lvt, None), acc)
        const = ir.Constant

        def steps(start, n_vecs):
            """Straight-line FMAs over ``n_vecs`` vectors of the head dim from ``start``:
            all of their K loads in flight at once (a loop with one vector per step keeps
            fewer misses outstanding: measured 4.1 against 2.6 ns per key and row with K
            in L3)."""
            for v in range(n_vecs):
                dd = builder.add(start, const(d_vec.type, v * width))
                q_v = builder.load(_vec_ptr(builder, builder.gep(q_base, [dd]), lvt),
                                   align=align)
                for j in range(width):
                    off = builder.add(builder.mul(const(k_stride.type, j), k_stride), dd)
                    k_v = _load_cvt(builder, builder.gep(k_base, [off]), kty, lvt)
                    builder.store(_fma(builder, q_v, k_v, builder.load(accs[j])), accs[j])

        block = DOT_UNROLL * width
        n_blocks = builder.udiv(d_vec, const(d_vec.type, block))
        with cgutils.for_range(builder, n_blocks) as loop:
            steps(builder.mul(loop.index, const(d_vec.type, block)), DOT_UNROLL)
        done = builder.mul(n_blocks, const(d_vec.type, block))
        rest = builder.udiv(builder.sub(d_vec, done), const(d_vec.type, width))
        with cgutils.for_range(builder, rest) as loop:
            steps(builder.add(done, builder.mul(loop.index, const(d_vec.type, width))), 1)
        vecs = [builder.load(acc) for acc in accs]
        seg = width  # lanes each key occupies in every vector of this level
        idx_ty = ir.VectorType(ir.IntType(32), width)
        while len(vecs) > 1:
            half = seg // 2
            lo, hi = [], []
            for o in range(width):
                src = 0 if o < width // 2 else width  # x's lanes, then y's, in the shuffle
                key, pos = divmod(o % (width // 2), half)
                lo.append(src + key * seg + pos)
                hi.append(src + key * seg + half + pos)
            vecs = [builder.fadd(builder.shuffle_vector(x, y, ir.Constant(idx_ty, lo)),
                                 builder.shuffle_vector(x, y, ir.Constant(idx_ty, hi)))
                    for x, y in zip(vecs[0::2], vecs[1::2])]
            seg = half
        return vecs[0]

    return sig, codegen


def _transpose_codegen(context, builder, src_ty, src_arr, src_off, src_ld, n_rows, dst_ty,
                       dst_arr, dst_off, dst_ld, vt):
    """The IR of ``transpose_block`` (``n_rows`` None: all ``W`` rows) and of
    ``transpose_rows`` (rows from ``n_rows`` on zero, never loaded)."""
    lvt = context.get_value_type(vt)
    w = vt.width
    align = vt.dtype.bitwidth // 8
    s_base = _elem_ptr(context, builder, src_ty, src_arr, src_off)
    d_base = _elem_ptr(context, builder, dst_ty, dst_arr, dst_off)

    def row_ptr(base, ld, r):
        return _vec_ptr(builder, builder.gep(base, [builder.mul(ld, ir.Constant(ld.type, r))]),
                        lvt)

    def load_row(r):
        if n_rows is None:
            return builder.load(row_ptr(s_base, src_ld, r), align=align)
        ptr = row_ptr(s_base, src_ld, r)
        with builder.if_else(builder.icmp_signed("<", ir.Constant(n_rows.type, r),
                                                 n_rows)) as (inside, past):
            with inside:
                loaded = builder.load(ptr, align=align)
                inside_block = builder.block
            with past:
                past_block = builder.block
        row = builder.phi(lvt)
        row.add_incoming(loaded, inside_block)
        row.add_incoming(ir.Constant(lvt, None), past_block)
        return row

    rows = [load_row(r) for r in range(w)]
    i32 = ir.IntType(32)
    h = w // 2
    while h >= 1:
        # in the concatenation (row_i, row_i+h): lane c of row i+h is lane w + c
        top = [c if (c // h) % 2 == 0 else w + c - h for c in range(w)]
        bottom = [c + h if (c // h) % 2 == 0 else w + c for c in range(w)]
        top_m = ir.Constant(ir.VectorType(i32, w), top)
        bottom_m = ir.Constant(ir.VectorType(i32, w), bottom)
        for i in range(w):
            if (i // h) % 2 == 0:
                a, b = rows[i], rows[i + h]
                rows[i] = builder.shuffle_vector(a, b, top_m)
                rows[i + h] = builder.shuffle_vector(a, b, bottom_m)
        h //= 2
    for r in range(w):
        builder.store(rows[r], row_ptr(d_base, dst_ld, r), align=align)


@intrinsic
def transpose_block(typingctx, src, src_off, src_ld, dst, dst_off, dst_ld):
    """``dst[dst_off + c*dst_ld + r] = src[src_off + r*src_ld + c]`` for ``r, c < W``: one
    ``W x W`` block transposed in registers (``W`` rows loaded, ``log2(W)`` rounds of ``W``
    two-vector shuffles, ``W`` rows stored), for packing K as ``K^T`` tiles.

    Each round swaps the off-diagonal ``h x h`` sub-blocks of every ``2h x 2h`` block (h = W/2,
    ..., 1); all rounds together transpose the whole block."""
    vt = _vec_of(dst)
    if vt is None or _vec_of(src) != vt:
        return None
    ip = types.intp

    def codegen(context, builder, sig, args):
        src_arr, src_off, src_ld, dst_arr, dst_off, dst_ld = args
        _transpose_codegen(context, builder, sig.args[0], src_arr, src_off, src_ld, None,
                           sig.args[3], dst_arr, dst_off, dst_ld, vt)
        return context.get_dummy_value()

    return types.void(src, ip, ip, dst, ip, ip), codegen


@intrinsic
def transpose_rows(typingctx, src, src_off, src_ld, n_rows, dst, dst_off, dst_ld):
    """``transpose_block`` of a block whose rows from ``n_rows`` on (``0 <= n_rows <= W``) are
    zero: those rows are not loaded (they may lie past the end of ``src``), so column ``r``
    of ``dst`` is zero for ``r >= n_rows``. The last few keys of a K tile that ends inside a
    vector of keys, with the zero padding after them, in one transpose (stop 63: element by
    element before, 8-10 us of a 12-head call's packing at N=37 or 47, against N=32 or 48)."""
    vt = _vec_of(dst)
    if vt is None or _vec_of(src) != vt:
        return None
    ip = types.intp

    def codegen(context, builder, sig, args):
        src_arr, src_off, src_ld, n_rows, dst_arr, dst_off, dst_ld = args
        _transpose_codegen(context, builder, sig.args[0], src_arr, src_off, src_ld, n_rows,
                           sig.args[4], dst_arr, dst_off, dst_ld, vt)
        return context.get_dummy_value()

    return types.void(src, ip, ip, ip, dst, ip, ip), codegen


@intrinsic
def lanes_of(typingctx, arr):
    """Lanes of one vector of ``arr``'s element type (a compile-time constant)."""
    vt = _vec_of(arr)
    if vt is None:
        return None

    def codegen(context, builder, sig, args):
        return context.get_constant(types.intp, vt.width)

    return types.intp(arr), codegen


# ---------------------------------------------------------------------------------------------
# dropout: murmur3's 32-bit finalizer on vectors of 32-bit lanes (see dropout.py)


@intrinsic
def vdropout(typingctx, p, mix, j0, below, inv_keep):
    """``p`` with lane ``l`` kept (times ``inv_keep``) where ``hash(mix, j0 + l) >= below``,
    else 0; ``hash`` is ``dropout.hash_bits`` computed in 32-bit integer lanes."""
    if not isinstance(p, Vec):
        return None

    def codegen(context, builder, sig, args):
        p_v, mix_v, j0_v, below_v, inv_v = args
        n = p_v.type.count
        i32 = ir.IntType(32)
        ity = ir.VectorType(i32, n)

        def splat_int(value):
            return _splat(builder, value, ity)

        def const(c):
            return ir.Constant(ity, [c] * n)

        mix32 = builder.trunc(context.cast(builder, mix_v, sig.args[1], types.uint64), i32)
        j32 = builder.trunc(context.cast(builder, j0_v, sig.args[2], types.int64), i32)
        # mix + (j0 + l) * C as (mix + j0 * C) + l * C: one scalar product, no vector one
        c_j = ir.Constant(i32, 0xC2B2AE3D)
        base = builder.add(mix32, builder.mul(j32, c_j))
        lane_terms = ir.Constant(ity, [(lane * 0xC2B2AE3D) & 0xFFFFFFFF for lane in range(n)])
        x = builder.add(splat_int(base), lane_terms)
        x = builder.xor(x, builder.lshr(x, const(16)))
        x = builder.mul(x, const(0x85EBCA6B))
        x = builder.xor(x, builder.lshr(x, const(13)))
        x = builder.mul(x, const(0xC2B2AE35))
        x = builder.xor(x, builder.lshr(x, const(16)))
        below32 = builder.trunc(context.cast(builder, below_v, sig.args[3], types.uint64), i32)
        keep = builder.icmp_unsigned(">=", x, splat_int(below32))
        inv = context.cast(builder, inv_v, sig.args[4], p.dtype)
        kept = builder.fmul(p_v, _splat(builder, inv, p_v.type))
        return builder.select(keep, kept, ir.Constant(p_v.type, None))

    return p(p, types.uint64, types.int64, types.uint64, types.float64), codegen
