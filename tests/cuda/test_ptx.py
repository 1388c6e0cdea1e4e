"""Every kernel template compiled to PTX for sm_90 (Hopper) without a GPU: catches what the
simulator cannot judge, such as float64 arithmetic creeping into float32 kernels, register
tiles spilled to local memory, or calls that do not exist on the device."""
import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
    pytest.skip("compile_ptx is not in the simulator", allow_module_level=True)

from numba import cuda

from cpuflash._cuda import backward, forward, tiles

# one head dim per tile shape (tiles.forward_shape/backward_shape); softcap and ALiBi on,
# the superset of the code
CASES = [(64, np.float32), (16, np.float16), (128, np.float32), (256, np.float32)]
if os.environ.get("CPUFLASH_PTX_QUICK") == "1":  # CI: one shape class, the float16 loads
    CASES = [(64, np.float16)]


def _check(ptx):
    assert ".f64" not in ptx, "float64 arithmetic in a float32 kernel"
    assert "ld.local" not in ptx and "st.local" not in ptx, "register tile spilled to local memory"


def _ptxas():
    """ptxas from the nvidia-cuda-nvcc wheel that numba-cuda[cu12] installs, or on PATH."""
    try:
        import nvidia.cuda_nvcc as nvcc
        path = Path(list(nvcc.__path__)[0]) / "bin" / "ptxas"
        if path.exists():
            return str(path)
    except ImportError:
        pass
    return shutil.which("ptxas")


MAX_SPILL_BYTES = 64  # D = 128 spills 8 bytes; a slip once spilled 312 at D = 64 (15 % slower)


def _check_spills(ptx, tmp_path, max_bytes=MAX_SPILL_BYTES):
    """The machine code's spills (ptxas -v): PTX keeps every value in virtual registers, so a
    kernel past the 255 registers of a thread spills only there."""
    ptxas = _ptxas()
    if ptxas is None:
        pytest.skip("no ptxas (the nvidia-cuda-nvcc wheel) to count spills")
    src = tmp_path / "kernel.ptx"
    src.write_text(ptx)
    done = subprocess.run([ptxas, "-arch=sm_90", "-v", str(src), "-o", str(tmp_path / "k.cubin")],
                          capture_output=True, text=True, check=True)
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", done.stderr)]
    assert spills and max(spills) <= max_bytes, done.stderr


@pytest.mark.parametrize("d, dtype", CASES, ids=str)
def test_ptx(d, dtype, tmp_path):
    fn = forward.make_forward(d, d, True)[0]
    forward_ptx = cuda.compile_ptx(fn, tiles.signature(dtype, tiles.SIMT_FORWARD_ARGS),
                                   cc=(9, 0))[0]
    _check(forward_ptx)
    fn = backward.make_dkdv(d, d, True)[0]
    _check(cuda.compile_ptx(fn, tiles.signature(dtype, tiles.DKDV_ARGS), cc=(9, 0))[0])
    fn = backward.make_dq(d, d, True)[0]
    _check(cuda.compile_ptx(fn, tiles.signature(dtype, tiles.DQ_ARGS), cc=(9, 0))[0])
    ptx = cuda.compile_ptx(backward.prep, tiles.signature(dtype, tiles.PREP_ARGS), cc=(9, 0))[0]
    _check(ptx)
    _check_spills(forward_ptx, tmp_path)  # last: it skips where ptxas is missing


def test_ptx_sinks():
    """The sinks' gradient sums in float64 on purpose (a thread adds every row of its head),
    so only local memory is checked there. (The forward kernels add the sinks themselves:
    their PTX tests take the sinks' argument.)"""
    from cpuflash._cuda import sinks
    ptx = cuda.compile_ptx(sinks.dsinks, tiles.signature(np.float32, sinks.DSINKS_ARGS),
                           cc=(9, 0))[0]
    assert "ld.local" not in ptx and "st.local" not in ptx


MASK_CASES = [("bool", np.bool_, True), ("float", np.float16, False)]
if os.environ.get("CPUFLASH_PTX_QUICK") == "1":  # CI: the forward with a bool mask (25 s)
    MASK_CASES = [("bool", np.bool_, False)]


@pytest.mark.parametrize("mask, mask_dtype, with_backward", MASK_CASES, ids=str)
def test_ptx_mask_and_dropout(mask, mask_dtype, with_backward):
    """The SIMT kernels with the caller's mask and dropout (the 32-bit hash of
    ``_cuda/dropout.py``, its multipliers in the code) for sm_90, no float64, no spills."""
    from cpuflash._cuda.dropout import FMIX1
    sig = {name: tiles.signature(np.float32, args, mask_dtype) for name, args in
           (("forward", tiles.SIMT_FORWARD_ARGS), ("dkdv", tiles.DKDV_ARGS),
            ("dq", tiles.DQ_ARGS))}
    makers = [("forward", forward.make_forward)]
    if with_backward:
        makers += [("dkdv", backward.make_dkdv), ("dq", backward.make_dq)]
    for name, make in makers:
        ptx = cuda.compile_ptx(make(64, 64, False, mask, True)[0], sig[name], cc=(9, 0))[0]
        _check(ptx)
        assert str(FMIX1 - 2**32) in ptx or str(FMIX1) in ptx, name


@pytest.mark.skipif(os.environ.get("CPUFLASH_PTX_QUICK") == "1",
                    reason="CI: one shape class (the float16 loads)")
@pytest.mark.parametrize("q_dtype", [np.float32, np.float16], ids=str)
def test_ptx_int8_cache(q_dtype):
    """The SIMT forward kernel reading an int8 K/V cache times its scales: no float64."""
    sig = tiles.signature(q_dtype, tiles.SIMT_FORWARD_ARGS, kv_dtype=np.int8)
    _check(cuda.compile_ptx(forward.make_forward(64, 64, False, quantized=True)[0], sig,
                            cc=(9, 0))[0])


@pytest.mark.skipif(os.environ.get("CPUFLASH_PTX_QUICK") == "1",
                    reason="CI: the masks' and dropout's lines are checked in the SIMT kernel")
@pytest.mark.parametrize("module, dtype, max_spill", [("forward_mma", np.float32, 64),
                                                      ("forward_f16", np.float16, 128)], ids=str)
def test_ptx_tensor_cores_mask_and_dropout(module, dtype, max_spill, tmp_path):
    """Both tensor-core kernels at D=64 with a bool mask and dropout: no float64, no local
    memory in the PTX, at most ``max_spill`` bytes spilled by ptxas (the float16 kernel with
    a mask: 96-128 bytes, its mask's indices and strides on top of 255 registers; measured on
    the H200 in stop 21's README table)."""
    import importlib
    make = importlib.import_module(f"cpuflash._cuda.{module}").make_forward
    ptx = cuda.compile_ptx(make(64, 64, False, "bool", True)[0],
                           tiles.signature(dtype, tiles.FORWARD_ARGS, np.bool_), cc=(9, 0))[0]
    _check(ptx)
    _check_spills(ptx, tmp_path, max_spill)


@pytest.mark.parametrize("pad, threads, keys", [(64, 128, 64), (128, 128, 32), (256, 128, 16),
                                                (40, 128, 64), (8, 32, 8), (24, 32, 8),
                                                (8, 128, 8), (16, 128, 12)])
def test_tile_elements_cover_the_tile_once(pad, threads, keys):
    """The elements the threads of a block fetch and store (``tiles.tile_elements``, text
    evaluated here per thread) are each element of the ``keys x pad`` tile exactly once."""
    elements, check = tiles.tile_elements(pad, threads, keys)
    seen = []
    for tid in range(threads):
        for u, (j, c) in enumerate(elements):
            if check and tid + u * threads >= keys * pad:
                continue
            seen.append((eval(j, {"tid": tid}), eval(c, {"tid": tid})))  # noqa: S307
    assert sorted(seen) == [(j, c) for j in range(keys) for c in range(pad)]


@pytest.mark.parametrize("d", [64, 128])
def test_ptx_tensor_cores(d, tmp_path):
    """The 3xTF32 tensor-core forward kernel (inline PTX mma.sync and cp.async) through NVVM
    and ptxas for sm_90, with nothing spilled: three MMAs per 16 x 8 x 8 piece of ``Q K^T``
    and of ``P V`` per key tile of a warp's dims; past D = 32 (Q's two TF32 parts, 128 rows)
    its shared memory is sized at launch."""
    from cpuflash._cuda import forward_mma
    fn, _, _, dynamic_bytes = forward_mma.make_forward(d, d, True)
    ptx = cuda.compile_ptx(fn, tiles.signature(np.float32, tiles.FORWARD_ARGS), cc=(9, 0))[0]
    _check(ptx)
    _, m_tiles, keys, split = forward_mma.SHAPES[d]  # a warp: d / split of the dims
    assert ptx.count("mma.sync.aligned.m16n8k8") == (3 * m_tiles * (d // split // 8)
                                                     * (keys // 8) * 2)
    # The per-tile TF32 splits (K, V, P) by bit masks (two per value: big and small), not by
    # cvt.rna, which Q's split alone keeps, outside the key loop (forward_mma._split).
    per_tile = (2 * 2 * (d // split // 8) * (keys // 8)  # K and V fragments: 2 values each
                + 4 * m_tiles * (keys // 8))             # P: 4 values per m-tile and n-tile
    assert ptx.count(", -8192;") == 2 * per_tile
    assert ptx.count("cvt.rna.tf32.f32") < per_tile
    assert "cp.async.cg.shared.global" in ptx
    # Q's A operands, a quad of each TF32 part per m-tile and k-step: one 16-byte load each
    # (forward_mma.load_q_lines), not pairs that the compiler moves into place
    assert ptx.count("ld.shared.v4") == 2 * m_tiles * (d // split // 8)
    assert dynamic_bytes > 48 * 1024
    assert ".extern .shared" in ptx
    _check_spills(ptx, tmp_path)


@pytest.mark.parametrize("d", [64, 128])
def test_ptx_tensor_cores_float16(d, tmp_path):
    """The float16 tensor-core forward kernel (mma.sync m16n8k16, ldmatrix.trans, cp.async)
    through NVVM and ptxas for sm_90, with nothing spilled: one MMA per 16 x 8 x 16 piece of
    ``Q K^T`` and of ``P V`` per key tile."""
    from cpuflash._cuda import forward_f16
    fn = forward_f16.make_forward(d, d, True)[0]
    ptx = cuda.compile_ptx(fn, tiles.signature(np.float16, tiles.FORWARD_ARGS), cc=(9, 0))[0]
    _check(ptx)
    _, m_tiles, keys, _ = forward_f16.SHAPES[d]
    assert ptx.count("mma.sync.aligned.m16n8k16") == m_tiles * (d // 16) * (keys // 8) * 2
    assert ptx.count("ldmatrix.sync.aligned.m8n8.x4.trans") == (keys // 16) * (d // 16)
    assert "cp.async.cg.shared.global" in ptx
    _check_spills(ptx, tmp_path)


def test_float16_tensor_core_kernel_takes_only_what_it_can():
    """``forward_f16.usable``: float16 on sm_80+, head dims up to 128 in multiples of 8, K and
    V rows unit-stride and 16-byte aligned; else forward.py."""
    from cpuflash._cuda.forward_f16 import usable

    def arr(shape=(1, 2, 64, 64), dtype=np.float16, ptr=4096, strides=None):
        return _gpu_array(shape, dtype, ptr, strides)

    q = arr()
    assert usable(q, arr(), arr(), (9, 0)) and usable(q, arr(), arr(), (8, 0))
    assert not usable(q, arr(), arr(), (7, 5))
    assert not usable(arr(dtype=np.float32), arr(dtype=np.float32), arr(dtype=np.float32),
                      (9, 0))
    assert not usable(q, arr(), arr(dtype=np.float32), (9, 0))
    wide = arr((1, 2, 64, 128))
    assert usable(wide, wide, wide, (9, 0))
    wider = arr((1, 2, 64, 136))
    assert not usable(wider, wider, wider, (9, 0))
    odd = arr((1, 2, 64, 44))  # 88 bytes a row: not whole 16-byte pieces
    assert not usable(odd, odd, odd, (9, 0))
    assert usable(arr((1, 2, 64, 40)), arr((1, 2, 64, 40)), arr((1, 2, 64, 72)), (9, 0))
    assert not usable(q, arr(ptr=4104), arr(), (9, 0))  # K not 16-byte aligned
    transposed = arr(strides=(2 * 64 * 64 * 2, 64 * 64 * 2, 2, 64 * 2))
    assert not usable(q, arr(), transposed, (9, 0))
    heads_inner = arr(strides=(64 * 2 * 64 * 2, 64 * 2, 2 * 64 * 2, 2))  # (B, N, H, D) view
    assert usable(q, heads_inner, heads_inner, (9, 0))


def _gpu_array(shape, dtype, ptr, strides):
    from cpuflash._cuda.arrays import GpuArray
    item = np.dtype(dtype).itemsize
    strides = strides or tuple(int(s) * item for s in np.cumprod((1,) + shape[:0:-1])[::-1])
    return GpuArray(ptr, shape, strides, np.dtype(dtype), None, None)


def test_tensor_core_kernel_takes_only_what_it_can():
    """``forward_mma.usable``: float32 on sm_80+, head dims up to 128 in multiples of 4, K and
    V rows unit-stride and 16-byte aligned (cp.async moves 16-byte pieces); else forward.py."""
    from cpuflash._cuda.forward_mma import usable

    def arr(shape=(1, 2, 64, 64), dtype=np.float32, ptr=4096, strides=None):
        return _gpu_array(shape, dtype, ptr, strides)

    q = arr()
    assert usable(q, arr(), arr(), (9, 0)) and usable(q, arr(), arr(), (8, 0))
    assert not usable(q, arr(), arr(), (7, 5))
    assert not usable(arr(dtype=np.float16), arr(dtype=np.float16), arr(dtype=np.float16), (9, 0))
    assert not usable(q, arr(), arr(dtype=np.float16), (9, 0))
    wide = arr((1, 2, 64, 128))
    assert usable(wide, wide, wide, (9, 0))
    wider = arr((1, 2, 64, 132))
    assert not usable(wider, wider, wider, (9, 0))
    odd = arr((1, 2, 64, 42))
    assert not usable(odd, odd, odd, (9, 0))
    assert not usable(q, arr(ptr=4100), arr(), (9, 0))  # K not 16-byte aligned
    transposed = arr(strides=(2 * 64 * 64 * 4, 64 * 64 * 4, 4, 64 * 4))  # dims 64 floats apart
    assert not usable(q, arr(), transposed, (9, 0))
    heads_inner = arr(strides=(64 * 2 * 64 * 4, 64 * 4, 2 * 64 * 4, 4))  # (B, N, H, D) view
    assert usable(q, heads_inner, heads_inner, (9, 0))


def _tf32_round(x):
    """``cvt.rna.tf32.f32`` of a float32 in numpy: nearest, ties away from zero."""
    bits = np.array([x], np.float32).view(np.uint32)
    return ((bits + np.uint32(0x1000)) & np.uint32(0xFFFFE000)).view(np.float32)[0]


class _Shared:
    """A block's shared memory for a kernel's lines run as Python: counts every store."""

    def __init__(self, n):
        self.words = np.full(n, np.nan, np.float32)
        self.stores = np.zeros(n, np.int64)

    def __setitem__(self, i, x):
        self.words[i] = x
        self.stores[i] += 1


@pytest.mark.parametrize("d_pad, n_q, d", [(64, 100, 64), (128, 64, 120), (48, 300, 44)])
def test_tensor_core_q_quads(d_pad, n_q, d):
    """The tensor-core forward's Q prologue (``forward_mma.load_q_lines``), run as Python by
    every thread of a block: each word of Q's two TF32 parts stored exactly once, nothing past
    them, and quad ``e = (m-tile * KS + k-step) * 32 + 4g + t`` holding Q[g, 2t], Q[g + 8,
    2t], Q[g, 2t + 1], Q[g + 8, 2t + 1] of its m-tile and k-step, scaled, rows past ``n_q``
    and dims past ``d`` zero (the A operands of ``S = Q K^T``: one 16-byte load each)."""
    from cpuflash._cuda import forward_mma
    warps, mt, _, split = forward_mma.SHAPES[d_pad]
    bm, nt, ks = 16 * mt * warps // split, 32 * warps, d_pad // 8
    ql_at = bm * d_pad
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 2, n_q, d)).astype(np.float32)
    scale2 = np.float32(0.3)
    q0 = n_q - 40 if n_q > bm else 0  # the last block: rows past n_q when n_q < q0 + bm
    rows = min(bm, n_q - q0)
    source = "def prologue(tid, sm):\n" + "\n".join(
        "    " + line for line in forward_mma.load_q_lines(ks))
    names = {"BM": bm, "NT": nt, "QL_AT": ql_at, "ANY": tiles.index_mask(1),
             "ALIGN4": tiles.index_mask(4), "ZERO": np.float32(0), "float32": np.float32,
             "tf32": _tf32_round, "q": q, "b": 0, "h": 1, "q0": q0, "rows": rows, "d": d,
             "scale2": scale2}
    exec(source, names)
    sm = _Shared(2 * ql_at + 64)
    for tid in range(nt):
        names["prologue"](tid, sm)
    assert (sm.stores[:2 * ql_at] == 1).all() and not sm.stores[2 * ql_at:].any()
    want = np.zeros((bm, d_pad), np.float32)
    want[:rows, :d] = q[0, 1, q0:q0 + rows] * scale2
    quads = want.reshape(bm // 16, 2, 8, ks, 4, 2)  # (m-tile, g + 8?, g, k-step, t, 2t + 1?)
    quads = quads.transpose(0, 3, 2, 4, 5, 1).reshape(-1)  # (m, ks, g, t, dim 2t+1?, row g+8?)
    big = np.array([_tf32_round(x) for x in quads], np.float32)
    np.testing.assert_array_equal(sm.words[:ql_at], big)
    np.testing.assert_array_equal(sm.words[ql_at:2 * ql_at],
                                  [_tf32_round(x) for x in quads - big])
