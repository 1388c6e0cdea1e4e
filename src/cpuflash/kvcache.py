"""A preallocated K/V cache for incremental decoding, in float32/float64, float16, bfloat16 or
int8.

Storage is allocated once, in blocks of ``KEY_BLOCK`` (64) keys per layer, batch and head,
each block one contiguous piece: K as ``(layers, B, Hkv, blocks, KEY_BLOCK // w, D, w)``, the
block's K^T in panels of ``w`` keys, and V as ``(layers, B, Hkv, blocks, Dv // u, KEY_BLOCK,
u)``, the block's values in panels of ``u`` columns. ``w`` and ``u`` are the decode kernel's
micro-kernel width in the compute dtype (``config.panel_width``: 16 float32 on AVX2, 64 on
AVX-512, so that there a block is one panel: K^T whole, V by rows), ``u`` the whole row where
that width does not divide Dv (``_cpu.decode.key_panel_width``, ``value_panel_width``). Each
micro-kernel call then reads one panel from its first byte to its last, as the hardware
prefetcher likes it; with 64-key blocks of whole rows, AVX2's 16-column calls read one 64-byte
line of every 256-byte row, four passes over each block of K^T and over each chunk of V (stops
37-38). Measured on the Zen 3 (stop 39, ``bench/cpu_kv_layout.py``; see the README). Up to
stop 36, K^T had rows of ``max_len`` keys (``(D, max_len)``, padded so that the rows fell in
different cache sets): a chunk read 512 bytes of float32 from each of 64 rows, 64 short
streams; blocks of one panel were faster on the Zen 4 in every round (stop 37, Hkv=2,
Nk=32768, K/V from DRAM, ms a step with blocks against rows: float32 1.06-1.25 against
1.18-1.50, float16 0.53-0.66 against 0.69-0.86, int8 0.63-0.69 against 0.73-0.80).

``append`` writes new tokens in place and ``attention`` reads the blocks in place, so a decode
step allocates nothing that grows with the cache; ``view`` gives K and V as arrays, copies
where no strided view can show the blocks (K always, V where its panels are not whole rows).
float16, bfloat16 and int8 caches are read in place and computed in float32 (the decode path of
``cpuflash.attention``).

bfloat16 (``dtype="bfloat16"``; numpy has no such dtype) is stored as its int16 bits, each
appended value rounded to the nearest bfloat16 of its float32 (ties to even, as torch's
``.to(torch.bfloat16)``; float64 is rounded to float32 first). Half the bytes of float32, as
float16, with float32's range (float16 overflows past 65504) and 8 significant bits to
float16's 11. ``view`` gives its K and V as float32 (exact); its queries are float32.

int8 is symmetric, one scale per token and head (``quantize_int8``): ``x ~= x8 * scale`` with
``scale = max|x| / 127`` over the head dim, so the rounding error of an element is at most
``max|x| / 254`` of its own row.
"""

import numpy as np

from . import _checks
from ._cpu import bfloat16
from ._cpu.decode import (KEY_BLOCK, arrays_of_blocks, key_panel_width, layer_blocks,
                          value_panel_width)
from ._cpu.pack import aligned, on_line
from ._cpu.quantize import quantize_rows
from .api import attention_on_blocks, compute_dtype, step_plan
from .sinks import check_for_queries

STORAGE_DTYPES = (np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.float16),
                  np.dtype(np.int8))
# A bfloat16 cache's ``dtype`` (numpy has none): stored as its int16 bits (``_cpu/bfloat16.py``)
BFLOAT16 = "bfloat16"
_DTYPE_NAMES = "float32, float64, float16, 'bfloat16', int8"
_STEP_OPTIONS = frozenset(("causal", "scale", "return_lse"))
# A cache's step plans are kept until there are this many, then all dropped: room for every
# layer of a deep model times the few kinds of step it runs (a plan is a list of the kernel's
# arguments, most of them shared with the cache: about a kilobyte of its own).
MAX_PLANS = 4096


def _step_key(layer, q, options):
    """The key of ``KVCache.attention``'s step plans for a call, or None for a call that no plan
    may take: a plan is made only after a call of that key has passed every check, so the key
    holds exactly what those checks looked at (``api._plain_decode``): the layer (an int),
    ``q``'s shape and dtype (a numpy array; any strides), ``causal`` (a bool) and ``scale``
    (None or a float). Exact types: ``True == 1`` and ``1.0 == 1`` would share a key, and
    ``causal=1`` must still meet the check that refuses it. ``return_lse`` (a bool, checked
    here as the general path would) is not in the key: a plan's step returns the lse or not
    (``StepPlan.run``)."""
    if type(layer) is not int or type(q) is not np.ndarray or not options.keys() <= _STEP_OPTIONS:
        return None
    causal, scale = options.get("causal", False), options.get("scale")
    return_lse = options.get("return_lse", False)
    if not (causal is True or causal is False) or not (scale is None or type(scale) is float) \
            or not (return_lse is False or return_lse is True):
        return None
    return layer, q.shape, q.dtype, causal, scale


def quantize_int8(x, *, name="x"):
    """``(x8, scale)`` with ``x8`` int8 and ``scale`` float32 of shape ``x.shape[:-1]``, such that
    ``x8 * scale[..., None]`` approximates ``x``: symmetric, ``scale = max|x| / 127`` over the
    last axis (a row of zeros gets scale 0). NaN or Inf in ``x`` raise ValueError: int8 cannot
    hold them. ``name``: the argument named in errors. (One pass a row, ``quantize.py``.)"""
    x = np.asarray(x)
    if x.dtype not in _checks.FLOAT_DTYPES:
        raise TypeError(f"{name}: expected a float array, got {x.dtype}")
    if x.ndim == 0:
        raise ValueError(f"{name}: expected at least one axis (the head dim), got a scalar")
    d = x.shape[-1]
    x8 = np.empty(x.shape, np.int8)
    scale = np.zeros(x.shape[:-1], np.float32)  # stays 0 where D = 0
    if x.size and not quantize_rows(x.astype(np.float32, copy=False).reshape(-1, d),
                                    x8.reshape(-1, d), scale.reshape(-1)):
        raise ValueError(f"{name}: int8 quantization needs finite values, got NaN or Inf")
    return x8, scale


def _on_a_line(x):
    """``x``, or a copy of it starting on a cache line where it does not (an unpickled or
    deep-copied storage starts where numpy put it)."""
    if aligned(x):
        return x
    y = on_line(x.shape, x.dtype)
    y[...] = x
    return y


def _batch_indices(indices, n_b):
    """``reorder``'s ``indices`` checked: ``n_b`` integers in ``0..n_b - 1`` (no negative ones:
    ``-1`` is more likely a bug than the last beam), as an intp array."""
    try:
        x = np.asarray(indices)
    except (TypeError, ValueError) as exc:  # a ragged list, say
        raise TypeError(f"indices: expected {n_b} integers, got {indices!r}") from exc
    if x.dtype == np.bool_ or not np.issubdtype(x.dtype, np.integer):
        raise TypeError(f"indices: expected integers, got dtype {x.dtype}")
    if x.shape != (n_b,):
        raise ValueError(f"indices: expected shape ({n_b},) (one per sequence of the batch), "
                         f"got {x.shape}")
    low, high = int(x.min()), int(x.max())
    if low < 0 or high >= n_b:
        raise ValueError(f"indices: expected values in 0..{n_b - 1}, got {low}..{high}")
    return x.astype(np.intp, copy=False)


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

    ``dtype``: float32 or float64 (as the queries), float16 or ``"bfloat16"`` (half the bytes;
    ``dtype`` is then that string) or int8 (a quarter, plus a float32 scale per token and
    head). Every layer has its own length: a layer's ``append`` adds to that layer only, as a
    model's layers append one after another.
    """

    def __init__(self, layers, batch, kv_heads, max_len, head_dim, *, v_head_dim=None,
                 dtype=np.float32):
        layers, batch = _count("layers", layers), _count("batch", batch)
        kv_heads, max_len = _count("kv_heads", kv_heads), _count("max_len", max_len)
        head_dim = _count("head_dim", head_dim)
        v_head_dim = head_dim if v_head_dim is None else _count("v_head_dim", v_head_dim)
        if isinstance(dtype, str) and dtype == BFLOAT16:
            storage = bfloat16.BITS
        else:
            try:
                dtype = storage = np.dtype(dtype)
            except TypeError as exc:
                raise TypeError(f"dtype: expected one of {_DTYPE_NAMES}, got {dtype!r}") from exc
            if dtype not in STORAGE_DTYPES:
                raise TypeError(f"dtype: expected one of {_DTYPE_NAMES}, got {dtype}")
        self.dtype = dtype  # a numpy dtype, or BFLOAT16
        self.max_len = max_len
        # On a cache line (pack.on_line): a large numpy array starts 16 bytes past one, and
        # every AVX-512 load of a K/V row would straddle two (measured: the chunk loop of a
        # float32 decode step about 5 % slower on one thread).
        n_blocks = -(-max_len // KEY_BLOCK)
        compute = compute_dtype(storage)
        w, u = key_panel_width(compute), value_panel_width(compute, v_head_dim)
        self.k_blocks = on_line((layers, batch, kv_heads, n_blocks, KEY_BLOCK // w, head_dim, w),
                                storage, zeroed=True)
        self.v_blocks = on_line((layers, batch, kv_heads, n_blocks, v_head_dim // u, KEY_BLOCK,
                                 u), storage, zeroed=True)
        self._layers = self._layer_blocks()  # made once
        self.lengths = np.zeros(layers, dtype=np.int64)  # tokens held by each layer
        if dtype == np.int8:
            self.k_scale = np.zeros((layers, batch, kv_heads, max_len), np.float32)
            self.v_scale = np.zeros((layers, batch, kv_heads, max_len), np.float32)
        else:
            self.k_scale = self.v_scale = None
        self._plans = {}  # decode.StepPlan by _step_key

    @property
    def nbytes(self):
        scales = 0 if self.k_scale is None else self.k_scale.nbytes + self.v_scale.nbytes
        return self.k_blocks.nbytes + self.v_blocks.nbytes + scales

    def _layer(self, layer):
        if not _checks.is_integer(layer):
            raise TypeError(f"layer: expected an int, got {type(layer).__name__}")
        if not 0 <= layer < len(self.lengths):
            raise ValueError(f"layer: expected 0..{len(self.lengths) - 1}, got {layer}")
        return int(layer)

    def _length(self, layer):
        """The tokens ``layer`` holds (``lengths`` is a public array: a value written there
        that the storage cannot back would have the kernels read past it)."""
        n = int(self.lengths[layer])
        if not 0 <= n <= self.max_len:
            raise ValueError(f"lengths[{layer}]: expected 0..{self.max_len} (max_len), got {n}")
        return n

    def append(self, layer, k, v):
        """Write ``k`` (B, Hkv, n, D) and ``v`` (B, Hkv, n, Dv) after the layer's tokens, in
        place (converted to the cache's dtype; bfloat16 rounded to nearest even; int8 quantized
        per token and head). Raises ValueError, writing nothing, if the cache would overflow
        ``max_len``."""
        layer = self._layer(layer)
        _, n_b, n_h, _, _, d, w = self.k_blocks.shape
        u = self.v_blocks.shape[6]
        for name, x, width in (("k", k, d), ("v", v, self.v_blocks.shape[4] * u)):
            _checks.array(name, x)
            if x.ndim != 4 or x.shape[:2] != (n_b, n_h) or x.shape[3] != width:
                raise ValueError(f"{name}: expected shape (B, Hkv, n, D) = ({n_b}, {n_h}, n, "
                                 f"{width}), got {x.shape}")
        if k.shape[2] != v.shape[2]:
            raise ValueError(f"k, v: expected the same number of new tokens, got "
                             f"{k.shape[2]} and {v.shape[2]}")
        start, n_new = self._length(layer), k.shape[2]
        if start + n_new > self.max_len:
            raise ValueError(f"cache overflow: layer {layer} holds {start} of max_len "
                             f"{self.max_len} tokens; appending {n_new} would exceed it")
        stop = start + n_new
        if isinstance(self.dtype, str):  # bfloat16: rounded to nearest even from float32
            k, v = (bfloat16.from_float32(x.astype(np.float32, copy=False)) for x in (k, v))
        elif self.dtype == np.int8:
            (k, k_scale), (v, v_scale) = quantize_int8(k, name="k"), quantize_int8(v, name="v")
            self.k_scale[layer, :, :, start:stop] = k_scale
            self.v_scale[layer, :, :, start:stop] = v_scale
        k_blocks, v_blocks = self._layers[layer].k, self._layers[layer].v
        # V's rows cut into their panels: (B, Hkv, n, panels, u) -> (B, Hkv, panels, n, u);
        # the panels counted, not inferred (-1), so that n = 0 reshapes too
        n_panels = self.v_blocks.shape[4]
        v_panels = v.reshape(n_b, n_h, n_new, n_panels, u).transpose(0, 1, 3, 2, 4)
        for block in range(start // KEY_BLOCK, -(-stop // KEY_BLOCK)):  # the blocks it spans
            first = max(start, block * KEY_BLOCK)  # its first new key, at ``at`` in the block
            at, n = first - block * KEY_BLOCK, min(stop, (block + 1) * KEY_BLOCK) - first
            src = first - start
            v_blocks[:, :, block, :, at:at + n] = v_panels[:, :, :, src:src + n]
            for panel in range(at // w, -(-(at + n) // w)):  # K^T's panels of w keys
                lo, hi = max(at, panel * w), min(at + n, (panel + 1) * w)  # its new keys
                k_blocks[:, :, block, panel, :, lo - panel * w:hi - panel * w] = \
                    k[:, :, src + lo - at:src + hi - at].transpose(0, 1, 3, 2)
        self.lengths[layer] = stop

    def view(self, layer):
        """The filled part of a layer as arguments for ``cpuflash.attention``: ``(k, v,
        scales)``, ``k`` (B, Hkv, length, D) a copy (K is stored in blocks of keys, which no
        strided view can show), ``v`` (B, Hkv, length, Dv) a view where V's blocks hold whole
        rows, else a copy, and, for int8, ``scales = {"k_scale": ..., "v_scale": ...}`` views
        (else ``{}``). A bfloat16 cache's ``k`` and ``v`` are float32 copies (numpy has no
        bfloat16). ``attention`` reads the cache in place."""
        layer = self._layer(layer)
        n = self._length(layer)
        k, v = arrays_of_blocks(self._layers[layer], n)
        if self.k_scale is None:
            return k, v, {}
        return k, v, {"k_scale": self.k_scale[layer, :, :, :n],
                      "v_scale": self.v_scale[layer, :, :, :n]}

    def attention(self, layer, q, **options):
        """``cpuflash.attention(q, k, v, **options)`` over the layer's tokens so far (``causal``
        aligns the new queries to the end of the cache), reading the cache in place on the
        decode path (``Nq <= 16``; else K is copied out of its blocks first). float16/int8
        caches are read with float32 ``q``, a bfloat16 cache only with float32 ``q``; with a
        float32/float64 cache, ``q`` has the cache's dtype.

        A decode step with no option but ``causal``, ``scale`` and ``return_lse`` makes a step
        plan the first time its layer and kind of query (shape, dtype, ``causal``, ``scale``)
        comes: the
        plain decode path's checks (``api.step_plan``) build the kernel's arguments once, and
        every step of that kind runs from them (``decode.StepPlan``): the same kernel and
        bits, without the checks' Python. Calls that path does not take meet the general
        checks, as before.

        ``sinks`` (as ``cpuflash.attention``'s) are checked, then passed to the step's kernel,
        so steps with them run from plans too (``StepPlan.run``)."""
        sinks = options.pop("sinks") if "sinks" in options else None  # a plain step: one lookup
        key = _step_key(layer, q, options)
        plan = self._plans.get(key) if key is not None else False  # None: a new kind of call
        if plan is None:
            plan = self._new_plan(key, q)
        if plan:
            n = int(self.lengths[layer])
            if 0 < n <= self.max_len:
                return_lse = options.get("return_lse", False)
                if sinks is None:
                    return plan.run(q, n, return_lse)
                return plan.run(q, n, return_lse, check_for_queries(sinks, q.shape))
        if sinks is not None:
            options["sinks"] = sinks
        layer = self._layer(layer)
        n = self._length(layer)
        if self.k_scale is not None:
            for name in ("k_scale", "v_scale"):
                if name in options:
                    raise TypeError(f"{name}: the cache's own; not an option here")
            options = {"k_scale": self.k_scale[layer, :, :, :n],
                       "v_scale": self.v_scale[layer, :, :, :n], **options}
        return attention_on_blocks(q, self._layers[layer], n, options)

    def _new_plan(self, key, q):
        """The step plan for a kind of call not seen yet (``_step_key``), kept: made by the
        plain decode path's own checks (``api.step_plan``), which raise what the general path
        would (a NaN ``scale``), or False where that path does not take such calls (17 or more
        queries, another dtype than the cache's: the general path decides, every time). None,
        not kept, while the layer is empty: a plan is made with a length to check."""
        layer = self._layer(key[0])
        n = self._length(layer)
        if not n:
            return None
        if len(self._plans) >= MAX_PLANS:
            self._plans.clear()
        scales = None if self.k_scale is None else (self.k_scale[layer], self.v_scale[layer])
        plan = step_plan(q, self._layers[layer], n, key[3], key[4], scales) or False
        self._plans[key] = plan
        return plan

    def reorder(self, indices):
        """Make sequence ``b`` of the batch a copy of sequence ``indices[b]``, in every layer,
        in place: beam search's reordering of its beams after a step (Hugging Face's
        ``Cache.reorder_cache(beam_idx)``). ``indices``: B integers in ``0..B-1``, repeats
        allowed (a beam that two continue). Copies only the blocks that hold tokens, one
        layer at a time (the temporary memory is one layer's filled part), and an int8
        cache's scales with them; lengths, step plans and ``view``'s views stay valid."""
        n_b = self.k_blocks.shape[1]
        indices = _batch_indices(indices, n_b)
        lengths = [self._length(layer) for layer in range(len(self.lengths))]  # checked first
        for layer, n in enumerate(lengths):
            blocks = -(-n // KEY_BLOCK)
            for x in (self.k_blocks, self.v_blocks):
                x[layer, :, :, :blocks] = x[layer, indices, :, :blocks]
            if self.k_scale is not None:
                for x in (self.k_scale, self.v_scale):
                    x[layer, :, :, :n] = x[layer, indices, :, :n]

    def __getstate__(self):
        """For ``pickle`` and ``copy``: the storage, lengths and scales, not the views of the
        storage (``_layers``, whose copies would no longer be views of the copied storage: a
        deep copy then appended to one copy of K and read another) nor the step plans (which
        hold such views)."""
        state = self.__dict__.copy()
        del state["_layers"], state["_plans"]
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self.k_blocks, self.v_blocks = (_on_a_line(x) for x in (self.k_blocks, self.v_blocks))
        self._layers = self._layer_blocks()
        self._plans = {}

    def _layer_blocks(self):
        """Each layer's blocks and the decode kernel's view of them (``layer_blocks``)."""
        compute = compute_dtype(self.k_blocks.dtype)
        return [layer_blocks(self.k_blocks[layer], self.v_blocks[layer], compute)
                for layer in range(self.k_blocks.shape[0])]

    def reset(self):
        """Forget every token (the storage is kept)."""
        self.lengths[:] = 0
