"""A preallocated K/V cache for incremental decoding, in float32/float64, float16 or int8.

Storage is allocated once: V as ``(layers, B, Hkv, max_len, Dv)`` and K transposed, as
``(layers, B, Hkv, D, max_len + pad)`` (``k_row_length``: rows padded so that they spread over
the cache sets): with the keys contiguous, the decode kernel computes the scores ``q . k_j`` as a
register-blocked product with the keys along the vector lanes (no horizontal sums; measured at
Hq=8, Hkv=2, Nk=32768 against row-major K: as fast in float32, 1.1-1.3x faster per step with
float16 and int8 caches, whose keys are converted once per load). ``append`` writes new tokens
in place and ``attention`` reads the filled part through views (K as a transposed view of
shape (B, Hkv, length, D)), so a decode step allocates nothing that grows with the cache.
``attention`` reads float16 and int8 caches in place and computes in float32 (the decode path
of ``cpuflash.attention``).

int8 is symmetric, one scale per token and head (``quantize_int8``): ``x ~= x8 * scale`` with
``scale = max|x| / 127`` over the head dim, so the rounding error of an element is at most
``max|x| / 254`` of its own row.
"""

import numpy as np

from . import _checks
from ._cpu.pack import on_line
from .api import attention as _attention

STORAGE_DTYPES = (np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.float16),
                  np.dtype(np.int8))


def quantize_int8(x, *, name="x"):
    """``(x8, scale)`` with ``x8`` int8 and ``scale`` float32 of shape ``x.shape[:-1]``, such that
    ``x8 * scale[..., None]`` approximates ``x``: symmetric, ``scale = max|x| / 127`` over the
    last axis (a row of zeros gets scale 0). NaN or Inf in ``x`` raise ValueError: int8 cannot
    hold them. ``name``: the argument named in errors."""
    x = np.asarray(x)
    if x.dtype not in _checks.FLOAT_DTYPES:
        raise TypeError(f"{name}: expected a float array, got {x.dtype}")
    if x.ndim == 0:
        raise ValueError(f"{name}: expected at least one axis (the head dim), got a scalar")
    x32 = x.astype(np.float32, copy=False)
    if not np.all(np.isfinite(x32)):
        raise ValueError(f"{name}: int8 quantization needs finite values, got NaN or Inf")
    amax = np.max(np.abs(x32), axis=-1) if x.shape[-1] else np.zeros(x.shape[:-1], np.float32)
    scale = (amax / np.float32(127.0)).astype(np.float32)
    safe = np.where(scale > 0, scale, np.float32(1.0))
    x8 = np.clip(np.rint(x32 / safe[..., None]), -127, 127).astype(np.int8)
    return x8, scale


# Rows of K^T (one dim of a head's keys each) are padded past ``max_len`` keys so that the
# lines the decode kernel reads from all of them at once fall in different cache sets. A set
# of a cache is picked by the address modulo its way size (a power of two: 4 KiB for the L1
# data caches here, 64-128 KiB for the L2s), so rows a power of two apart (any power-of-two
# ``max_len`` of 1024 float32 keys or more) all meet in one set, whose 8 ways cannot hold the
# dozens of rows that a chunk of keys reads at once (``_cpu.decode.CHUNK`` keys: 512 bytes of
# each float32 row), nor the rows hinted ahead of it: the kernel evicts its own lines.
#
# Rows of 4 KiB or more: the padded row is 512 bytes past a multiple of 4 KiB
# (``K_ROW_PHASE_BYTES``). Row r then starts 512 * (r * (8m + 1) mod W/512) bytes into a way of
# W bytes (m some integer): 8m + 1 is odd, so for r < W/512 (256 rows in a 128 KiB way, 128 in
# 64 KiB) these are distinct, and the 512 bytes each row gives to a float32 chunk (256 float16,
# 128 int8) take their own sets in every cache level. Costs 512 bytes a row at a power-of-two
# ``max_len`` (0.4 % at 32768 float32 keys), at most 4 KiB. Measured on the Zen 4 (stop 34,
# Hkv=2, Nk=32768, from DRAM, paddings side by side in one process, ``bench/cpu_kv_padding.py``):
# against one 64-byte line of padding, a step 2-9 % faster in each of the first 12 rounds
# (float32 1.09-1.50 ms against 1.14-1.58, float16 0.73-0.76 against 0.76-0.81), then -2 to
# +7 % in 10 more (faster in 8; log bench/results/cpu_kv_padding_stop34.txt). 2112 bytes
# (33 lines): -3 to +15 %, faster in 9 of those 10: as good, not clearly better.
# Shorter rows: one 64-byte line (``K_ROW_PAD_BYTES``); with one line more per row the
# rows step through the L1's sets one by one, which the tile product over all D rows of a chunk
# needs (measured on Zen 3, keys in L2, ``bench/cpu_decode_steps.py``: 16-25 -> 8-12 ns per key).
K_ROW_PAD_BYTES = 64
K_ROW_PHASE_BYTES = 512
_PAGE = 4096


def k_row_length(max_len, itemsize):
    """Elements in a row of KVCache's K^T: ``max_len`` keys and the padding (above)."""
    row_bytes = max_len * itemsize
    if row_bytes < _PAGE:
        return max_len + K_ROW_PAD_BYTES // itemsize
    return max_len + (K_ROW_PHASE_BYTES - row_bytes) % _PAGE // itemsize


def _count(name, x, minimum=1):
    if not _checks.is_integer(x):
        raise TypeError(f"{name}: expected an int, got {type(x).__name__}")
    if x < minimum:
        raise ValueError(f"{name}: expected at least {minimum}, got {x}")
    return int(x)


class KVCache:
    """Preallocated keys and values of ``layers`` attention layers.

    >>> cache = KVCache(layers=12, batch=1, kv_heads=2, max_len=1024, head_dim=64,
    ...                 dtype=np.float16)
    >>> cache.append(layer, k_new, v_new)          # (B, Hkv, n_new, D): written in place
    >>> out = cache.attention(layer, q, causal=True)  # q (B, Hq, n_new, D) vs all tokens so far

    ``dtype``: float32 or float64 (as the queries), float16 (half the bytes) or int8 (a quarter,
    plus a float32 scale per token and head). Every layer has its own length: a layer's
    ``append`` adds to that layer only, as a model's layers append one after another.
    """

    def __init__(self, layers, batch, kv_heads, max_len, head_dim, *, v_head_dim=None,
                 dtype=np.float32):
        layers, batch = _count("layers", layers), _count("batch", batch)
        kv_heads, max_len = _count("kv_heads", kv_heads), _count("max_len", max_len)
        head_dim = _count("head_dim", head_dim)
        v_head_dim = head_dim if v_head_dim is None else _count("v_head_dim", v_head_dim)
        try:
            dtype = np.dtype(dtype)
        except TypeError as exc:
            raise TypeError(f"dtype: expected one of float32, float64, float16, int8, "
                            f"got {dtype!r}") from exc
        if dtype not in STORAGE_DTYPES:
            raise TypeError(f"dtype: expected one of float32, float64, float16, int8, got {dtype}")
        self.dtype = dtype
        self.max_len = max_len
        k_row = k_row_length(max_len, dtype.itemsize)  # padded: see K_ROW_PHASE_BYTES
        # On a cache line (pack.on_line): a large numpy array starts 16 bytes past one, and
        # every AVX-512 load of a K/V row would straddle two (measured: the chunk loop of a
        # float32 decode step about 5 % slower on one thread).
        self.k_t = on_line((layers, batch, kv_heads, head_dim, k_row), dtype, zeroed=True)
        self.v = on_line((layers, batch, kv_heads, max_len, v_head_dim), dtype, zeroed=True)
        self.lengths = np.zeros(layers, dtype=np.int64)  # tokens held by each layer
        if dtype == np.int8:
            self.k_scale = np.zeros(self.v.shape[:-1], np.float32)
            self.v_scale = np.zeros(self.v.shape[:-1], np.float32)
        else:
            self.k_scale = self.v_scale = None

    @property
    def nbytes(self):
        scales = 0 if self.k_scale is None else self.k_scale.nbytes + self.v_scale.nbytes
        return self.k_t.nbytes + self.v.nbytes + scales

    def _layer(self, layer):
        if not _checks.is_integer(layer):
            raise TypeError(f"layer: expected an int, got {type(layer).__name__}")
        if not 0 <= layer < len(self.lengths):
            raise ValueError(f"layer: expected 0..{len(self.lengths) - 1}, got {layer}")
        return int(layer)

    def append(self, layer, k, v):
        """Write ``k`` (B, Hkv, n, D) and ``v`` (B, Hkv, n, Dv) after the layer's tokens, in
        place (converted to the cache's dtype; int8 quantized per token and head). Raises
        ValueError, writing nothing, if the cache would overflow ``max_len``."""
        layer = self._layer(layer)
        _, n_b, n_h, d, _ = self.k_t.shape
        for name, x, width in (("k", k, d), ("v", v, self.v.shape[4])):
            _checks.array(name, x)
            if x.ndim != 4 or x.shape[:2] != (n_b, n_h) or x.shape[3] != width:
                raise ValueError(f"{name}: expected shape (B, Hkv, n, D) = ({n_b}, {n_h}, n, "
                                 f"{width}), got {x.shape}")
        if k.shape[2] != v.shape[2]:
            raise ValueError(f"k, v: expected the same number of new tokens, got "
                             f"{k.shape[2]} and {v.shape[2]}")
        start, n_new = int(self.lengths[layer]), k.shape[2]
        if start + n_new > self.max_len:
            raise ValueError(f"cache overflow: layer {layer} holds {start} of max_len "
                             f"{self.max_len} tokens; appending {n_new} would exceed it")
        stop = start + n_new
        k_dst = self.k_t[layer, :, :, :, start:stop].transpose(0, 1, 3, 2)
        if self.dtype == np.int8:
            (k8, k_scale), (v8, v_scale) = quantize_int8(k, name="k"), quantize_int8(v, name="v")
            k_dst[...], self.k_scale[layer, :, :, start:stop] = k8, k_scale
            self.v[layer, :, :, start:stop], self.v_scale[layer, :, :, start:stop] = v8, v_scale
        else:
            k_dst[...] = k
            self.v[layer, :, :, start:stop] = v
        self.lengths[layer] = stop

    def view(self, layer):
        """The filled part of a layer as arguments for ``cpuflash.attention``:
        ``(k, v, scales)`` with views ``k`` (B, Hkv, length, D) (transposed: keys contiguous),
        ``v`` and, for int8, ``scales = {"k_scale": ..., "v_scale": ...}`` (else ``{}``)."""
        layer = self._layer(layer)
        n = int(self.lengths[layer])
        k = self.k_t[layer, :, :, :, :n].transpose(0, 1, 3, 2)
        v = self.v[layer, :, :, :n]
        if self.k_scale is None:
            return k, v, {}
        return k, v, {"k_scale": self.k_scale[layer, :, :, :n],
                      "v_scale": self.v_scale[layer, :, :, :n]}

    def attention(self, layer, q, **options):
        """``cpuflash.attention(q, k, v, **options)`` over the layer's tokens so far (``causal``
        aligns the new queries to the end of the cache). float16/int8 caches are read in place
        with float32 ``q``; with a float32/float64 cache, ``q`` has the cache's dtype."""
        k, v, scales = self.view(layer)
        return _attention(q, k, v, **scales, **options)

    def reset(self):
        """Forget every token (the storage is kept)."""
        self.lengths[:] = 0
