"""Could Intel's AMX tiles compute the forward's score product faster than AVX-512, to float32
accuracy? A probe, not a kernel of the library (stop 45): on a host with AMX-BF16, one thread,
hot in the caches, it times

- ``tdpbf16ps`` alone (16 x 16 float32 += 16 x 32 bf16 @ 32 x 16 bf16) and tile loads alone;
- S = Q K^T of one forward tile (``--rows`` 128 x ``--keys`` 128, D=64) as six bf16 products:
  every float32 is split exactly into three bf16 (``x = x1 + x2 + x3``, each the rounded rest
  of the one before), and ``q.k = q1.k1 + q1.k2 + q2.k1 + q1.k3 + q2.k2 + q3.k1``: the three
  dropped products are 2^-24 of |q||k| or less, as float32 rounding itself; bf16 alone (one
  product) keeps 8 bits, three products 16;
- beside it, in alternation, the AVX-512 product the forward uses (``tiles.tile_product_max``
  through ``bench/cpu_tile_products.py``), and both products' largest error against float64.

The six products run in 2 x 2 blocks of 16 x 16 (4 accumulator tiles, 2 of Q, 2 of K: all 8
tiles), each tile loaded just before the first product that reads it. On stop 45's Xeon this
order took 18.5-37.6 us a tile over 10 rounds (13.0 once), against 13.2-19.1 for AVX-512;
with all four loads of a step first 34, in 1 x 2 blocks (tiles loaded twice as often) 26. Needs
Linux's permission for the tile state (``arch_prctl(ARCH_REQ_XCOMP_PERM)``, asked here).
Run with ``NUMBA_NUM_THREADS=1`` and nothing else on the machine. Not collected by pytest.

    NUMBA_NUM_THREADS=1 python bench/cpu_amx_probe.py [--reps 2000] [--rounds 3]
"""
import argparse
import ctypes
import sys

import numba
import numpy as np
from llvmlite import binding as llvm
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils, errors
from numba.extending import intrinsic

from cpu_tile_products import best_seconds, scores  # the AVX-512 product, as timed there
from cpuflash import config
from cpuflash._cpu.pack import on_line, packed_transposed

ROWS, KEYS, D = 128, 128, 64
SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA = 158, 0x1023, 18
TERM_Q = (0, 0, 1, 0, 1, 2)  # the six products q_a . k_b kept of the nine
TERM_K = (0, 1, 0, 2, 1, 0)
_I8, _VOID, _PTR = ir.IntType(8), ir.VoidType(), ir.IntType(8).as_pointer()


def amx_allowed():
    """Whether this host has AMX-BF16 and Linux grants this process the tile state."""
    if not llvm.get_host_cpu_features().get("amx-bf16", False):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.syscall(SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0


def _call(builder, name, args):
    fn = cgutils.get_or_insert_function(builder.module,
                                        ir.FunctionType(_VOID, [a.type for a in args]), name)
    builder.call(fn, args)


def _tile(t):
    """A tile register's number: AMX names its registers in the instruction, so a literal."""
    if not isinstance(t, types.IntegerLiteral):
        raise errors.RequireLiteralValue(t)
    return ir.Constant(_I8, t.literal_value)


def _address(context, builder, ary_type, ary, offset):
    data = context.make_array(ary_type)(context, builder, ary).data
    return builder.bitcast(builder.gep(data, [offset]), _PTR)


@intrinsic
def tile_config(typingctx, cfg):
    def codegen(context, builder, sig, args):
        _call(builder, "llvm.x86.ldtilecfg", [_address(context, builder, sig.args[0], args[0],
                                                        ir.Constant(ir.IntType(64), 0))])
        return context.get_dummy_value()
    return types.void(cfg), codegen


@intrinsic
def tile_release(typingctx):
    def codegen(context, builder, sig, args):
        _call(builder, "llvm.x86.tilerelease", [])
        return context.get_dummy_value()
    return types.void(), codegen


@intrinsic
def tile_zero(typingctx, t):
    reg = _tile(t)

    def codegen(context, builder, sig, args):
        _call(builder, "llvm.x86.tilezero", [reg])
        return context.get_dummy_value()
    return types.void(t), codegen


def _tile_move(name):
    @intrinsic
    def move(typingctx, t, ary, offset, stride_bytes):
        reg = _tile(t)

        def codegen(context, builder, sig, args):
            ptr = _address(context, builder, sig.args[1], args[1], args[2])
            _call(builder, name, [reg, ptr, args[3]])
            return context.get_dummy_value()
        return types.void(t, ary, offset, stride_bytes), codegen
    return move


tile_load = _tile_move("llvm.x86.tileloadd64")    # 16 rows of 64 bytes, ``stride_bytes`` apart
tile_store = _tile_move("llvm.x86.tilestored64")


@intrinsic
def dot_bf16(typingctx, c, a, b):
    """Tile c (16 x 16 float32) += a (16 x 32 bf16) @ b (32 x 16 bf16, pairs of rows
    interleaved)."""
    regs = [_tile(c), _tile(a), _tile(b)]

    def codegen(context, builder, sig, args):
        _call(builder, "llvm.x86.tdpbf16ps", regs)
        return context.get_dummy_value()
    return types.void(c, a, b), codegen


def tile_configuration():
    """Palette 1, all eight tiles 16 rows of 64 bytes."""
    cfg = np.zeros(64, np.uint8)
    cfg[0] = 1
    cfg[16:32].view(np.uint16)[:8] = 64
    cfg[48:56] = 16
    return cfg


@njit(inline="always")
def bf16_rounded(bits):
    """The float32 ``bits`` rounded to their upper 16 (to nearest, ties to even)."""
    return (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) \
        & np.uint32(0xFFFF0000)


@njit
def split3(x, parts):
    """x (n, d) float32 -> parts (3, n, d) bf16 bits with x = parts[0] + parts[1] + parts[2]
    exactly: each part the bf16 nearest to what the parts before it left."""
    rest = np.empty(x.shape[1], np.float32)
    high = np.empty(x.shape[1], np.float32)
    rest_bits, high_bits = rest.view(np.uint32), high.view(np.uint32)
    for i in range(x.shape[0]):
        rest[:] = x[i]
        for p in range(3):
            for j in range(x.shape[1]):
                high_bits[j] = bf16_rounded(rest_bits[j])
                parts[p, i, j] = np.uint16(high_bits[j] >> np.uint32(16))
                rest[j] -= high[j]


def as_float32(bf16_bits):
    return (bf16_bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


def pairs_interleaved(parts):
    """(3, keys, d) -> (3, d / 2, keys, 2): K^T with each pair of rows interleaved, the layout
    of ``tdpbf16ps``'s right operand."""
    p, keys, d = parts.shape
    return np.ascontiguousarray(parts.reshape(p, keys, d // 2, 2).transpose(0, 2, 1, 3))


@njit
def scores_six_products(cfg, q_parts, k_pairs, s, reps):
    """s (rows, keys) = sum of the six products q_a k_b^T, in 2 x 2 blocks of 16 x 16."""
    tile_config(cfg)
    qf, kf, sf = q_parts.reshape(-1), k_pairs.reshape(-1), s.reshape(-1)
    rows, d, keys = q_parts.shape[1], q_parts.shape[2], k_pairs.shape[2]
    for _ in range(reps):
        for i0 in range(0, rows, 32):
            for j0 in range(0, keys, 32):
                tile_zero(0)
                tile_zero(1)
                tile_zero(2)
                tile_zero(3)
                for t in range(6):
                    for d0 in range(0, d, 32):
                        q_at = (TERM_Q[t] * rows + i0) * d + d0
                        k_at = ((TERM_K[t] * (d // 2) + d0 // 2) * keys + j0) * 2
                        tile_load(4, qf, q_at, d * 2)
                        tile_load(6, kf, k_at, keys * 4)
                        dot_bf16(0, 4, 6)
                        tile_load(7, kf, k_at + 32, keys * 4)
                        dot_bf16(1, 4, 7)
                        tile_load(5, qf, q_at + 16 * d, d * 2)
                        dot_bf16(2, 5, 6)
                        dot_bf16(3, 5, 7)
                s_at = i0 * keys + j0
                tile_store(0, sf, s_at, keys * 4)
                tile_store(1, sf, s_at + 16, keys * 4)
                tile_store(2, sf, s_at + 16 * keys, keys * 4)
                tile_store(3, sf, s_at + 16 * keys + 16, keys * 4)
    tile_release()


@njit
def products_alone(cfg, reps):
    """4 independent ``tdpbf16ps`` a step, no loads."""
    tile_config(cfg)
    tile_zero(0)
    tile_zero(1)
    tile_zero(2)
    tile_zero(3)
    tile_zero(4)
    tile_zero(5)
    tile_zero(6)
    tile_zero(7)
    for _ in range(reps):
        dot_bf16(0, 4, 6)
        dot_bf16(1, 4, 7)
        dot_bf16(2, 5, 6)
        dot_bf16(3, 5, 7)
    tile_release()


@njit
def loads_alone(cfg, q_parts, k_pairs, reps):
    """The four tile loads of one step of ``scores_six_products``, no products."""
    tile_config(cfg)
    qf, kf = q_parts.reshape(-1), k_pairs.reshape(-1)
    d, keys = q_parts.shape[2], k_pairs.shape[2]
    for _ in range(reps):
        tile_load(4, qf, 0, d * 2)
        tile_load(5, qf, 16 * d, d * 2)
        tile_load(6, kf, 0, keys * 4)
        tile_load(7, kf, 32, keys * 4)
    tile_release()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=2000, help="tiles a run")
    p.add_argument("--rounds", type=int, default=3, help="rounds, AMX and AVX-512 in turn")
    a = p.parse_args(argv)
    if a.reps < 1 or a.rounds < 1:
        p.error("--reps and --rounds must be at least 1")
    if not amx_allowed():
        print("no AMX-BF16 here (or Linux refused the tile state): nothing to probe")
        return 0
    rng = np.random.default_rng(0)
    q = rng.standard_normal((ROWS, D)).astype(np.float32)
    k = rng.standard_normal((KEYS, D)).astype(np.float32)
    q_parts = np.empty((3, ROWS, D), np.uint16)
    k_parts = np.empty((3, KEYS, D), np.uint16)
    split3(q, q_parts)
    split3(k, k_parts)
    k_pairs = pairs_interleaved(k_parts)
    cfg = tile_configuration()
    s_amx = np.zeros((ROWS, KEYS), np.float32)
    exact = q.astype(np.float64) @ k.astype(np.float64).T

    # The AVX-512 product on the same q, k: K packed by the forward's own packer, one tile.
    lanes = config.LANES_F32
    ld_s = KEYS + lanes
    q_s = on_line((ROWS * D,), np.float32)
    q_s[:] = q.reshape(-1)
    kt = packed_transposed(k[None, None], KEYS, config.panel_width(k.dtype), "keys").reshape(-1)
    s_avx = on_line((ROWS * ld_s,), np.float32)
    row_vmax = on_line((ROWS * lanes,), np.float32)
    tile_max = np.zeros(ROWS, np.float32)
    avx = (s_avx, ld_s, q_s, kt, ROWS, KEYS, D, row_vmax, tile_max)
    scores(*avx, 1, 1)
    scores_six_products(cfg, q_parts, k_pairs, s_amx, 1)
    err_amx = np.abs(s_amx - exact).max()
    err_avx = np.abs(s_avx.reshape(ROWS, ld_s)[:, :KEYS] - exact).max()
    print(f"one thread (NUMBA_NUM_THREADS={numba.config.NUMBA_NUM_THREADS}), {ROWS} rows x "
          f"{KEYS} keys, D={D}; |S| up to {np.abs(exact).max():.1f}")
    q_again = sum(as_float32(q_parts[i]).astype(np.float64) for i in range(3))
    print(f"largest error vs float64: six bf16 products {err_amx:.2e}, AVX-512 float32 "
          f"{err_avx:.2e}; q1 + q2 + q3 == q: {bool(np.array_equal(q_again, q))}")
    steps = 100_000
    t = best_seconds(products_alone, cfg, steps)
    print(f"tdpbf16ps alone:   {t / (4 * steps) * 1e9:6.2f} ns each "
          f"({4 * steps * 16 * 16 * 32 * 2 / t / 1e12:.2f} bf16 TFLOP/s)")
    t = best_seconds(loads_alone, cfg, q_parts, k_pairs, steps)
    print(f"tile loads alone:  {t / (4 * steps) * 1e9:6.2f} ns each")
    flops = 2.0 * ROWS * KEYS * D * a.reps
    for r in range(a.rounds):
        t_amx = best_seconds(scores_six_products, cfg, q_parts, k_pairs, s_amx, a.reps)
        t_avx = best_seconds(scores, *avx, a.reps, 1)
        print(f"round {r + 1}: S six bf16 products {t_amx / a.reps * 1e6:6.2f} us a tile "
              f"({flops / t_amx / 1e9:6.1f} float32-equivalent GFLOP/s); AVX-512 "
              f"{t_avx / a.reps * 1e6:6.2f} us ({flops / t_avx / 1e9:6.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
