"""The mask description: ``causal``, ``window`` and ``kv_lens`` checked and reduced to the band
``(left, right, kv_lens)`` that the kernels take (see ``_cpu/masking.py``); ``softcap`` and
``alibi_slopes`` checked and reduced to the score modifiers ``(softcap, slopes (B, Hq))``
(see ``_cpu/scores.py``).

Query ``i`` of batch ``b`` sees key ``j`` iff ``j < kv_len[b]`` and

    i + off - left <= j <= i + off + right,     off = kv_len[b] - Nq

(bottom-right alignment to the keys that exist), where ``window = (left, right)`` with ``None``
or ``-1`` for an unbounded side, and ``causal`` caps ``right`` at 0. Without ``kv_lens``,
``kv_len[b] = Nk``: exactly the alignment of API.md.
"""
import functools
import math

import numpy as np

from ._checks import is_integer, is_real
from ._cpu.dropout import threshold
from ._cpu.masking import CLEAR, UNBOUNDED, tile_state_table


def window_sides(window):
    """``(left, right)`` as ints, ``UNBOUNDED`` for a side without a limit."""
    if window is None:
        return UNBOUNDED, UNBOUNDED
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise TypeError(f"window: expected (left, right), got {window!r}")
    sides = []
    for name, x in zip(("left", "right"), window):
        if x is None:
            sides.append(UNBOUNDED)
            continue
        if not is_integer(x):
            raise TypeError(f"window: {name} side must be an int or None, got {x!r}")
        if x < -1:
            raise ValueError(f"window: {name} side must be >= -1 (-1 = unbounded), got {x}")
        sides.append(UNBOUNDED if x == -1 else int(x))
    return tuple(sides)


def key_lengths(kv_lens, n_b, n_k):
    """``kv_lens`` as a contiguous int64 array (B,), each in [0, Nk]; ``Nk`` everywhere if None."""
    if kv_lens is None:
        return _all_keys(n_b, n_k)
    if not isinstance(kv_lens, np.ndarray) or not np.issubdtype(kv_lens.dtype, np.integer):
        got = kv_lens.dtype if isinstance(kv_lens, np.ndarray) else type(kv_lens).__name__
        raise TypeError(f"kv_lens: expected an integer numpy array of shape ({n_b},), got {got}")
    if kv_lens.shape != (n_b,):
        raise ValueError(f"kv_lens: expected shape ({n_b},) (one length per batch), "
                         f"got {kv_lens.shape}")
    if n_b and (kv_lens.min() < 0 or kv_lens.max() > n_k):
        raise ValueError(f"kv_lens: expected lengths in [0, {n_k}] (Nk), "
                         f"got values in [{kv_lens.min()}, {kv_lens.max()}]")
    return np.ascontiguousarray(kv_lens, dtype=np.int64)


def band(causal, window, kv_lens, n_b, n_k):
    """The kernels' ``(left, right, kv_lens)``."""
    left, right = window_sides(window)
    if causal:
        right = min(right, 0)
    return left, right, key_lengths(kv_lens, n_b, n_k)


def modifiers(softcap, alibi_slopes, n_b, n_hq):
    """``(softcap, slopes)``: a float (0.0 = off) and a float64 (B, Hq) array (zeros = off)."""
    if softcap is None:
        cap = 0.0
    elif not is_real(softcap):
        raise TypeError(f"softcap: expected a positive number or None, got {softcap!r}")
    else:
        cap = float(softcap)
        if not math.isfinite(cap) or cap < 0:
            raise ValueError(f"softcap: expected a finite number > 0 (0 or None = off), got {cap}")
    if alibi_slopes is None:
        return cap, _no_slopes(n_b, n_hq)
    if not isinstance(alibi_slopes, np.ndarray) or alibi_slopes.dtype.kind not in "fiu":
        got = (alibi_slopes.dtype if isinstance(alibi_slopes, np.ndarray)
               else type(alibi_slopes).__name__)
        raise TypeError(f"alibi_slopes: expected a real numpy array of shape ({n_hq},) or "
                        f"({n_b}, {n_hq}), got {got}")
    if alibi_slopes.shape not in ((n_hq,), (n_b, n_hq)):
        raise ValueError(f"alibi_slopes: expected shape ({n_hq},) or ({n_b}, {n_hq}), "
                         f"got {alibi_slopes.shape}")
    slopes = np.broadcast_to(alibi_slopes.astype(np.float64), (n_b, n_hq))
    if not np.all(np.isfinite(slopes)):
        raise ValueError("alibi_slopes: expected finite slopes, got NaN or Inf")
    return cap, np.ascontiguousarray(slopes)


class UserMask:
    """A caller's bool or float ``mask``, broadcastable to (B, Hq, Nq, Nk), as the kernels take
    it: ``bools`` and ``adds``, (B, Hq, Nq, Nk) views by stride-0 broadcasting (never a dense
    copy): a bool mask as its uint8 bytes (0/1) in ``bools``, a float mask in the compute
    dtype in ``adds``, the other a 1-element stand-in; ``is_bool`` says which one holds it;
    and ``tile_states(block_q, block_k)``. With no mask: 1-element stand-ins (an all-True
    ``bools``), whatever the shape, and every tile CLEAR: no kernel reads a mask array, nor its
    shape, outside a MIXED tile (two new full-shape views for every length of a growing KV cache
    cost a decode step about 60 us of Python from cold caches, stop 36). Two arrays of fixed
    dtypes, so that the kernels are compiled once for either kind of mask
    (``_cpu/_jit.Kernel``)."""

    def __init__(self, mask, n_b, n_hq, n_q, n_k, compute_dtype):
        self.shape = (n_b, n_hq, n_q, n_k)
        self.given = mask is not None
        self._clear = {}  # without a mask: tile_states' answers, by (block_q, block_k)
        if not self.given:  # the same read-only stand-ins for every call
            self.raw, self.is_bool, self.bools = _NO_MASK, True, _NO_MASK_BYTES
            self.adds = _no_adds((1, 1, 1, 1), np.dtype(compute_dtype))
            return
        self.raw = _mask_4d(mask, self.shape, compute_dtype)
        self.is_bool = self.raw.dtype == np.bool_
        if self.is_bool:  # as its bytes (0/1): the kernels load a row of them as one vector
            self.bools = np.broadcast_to(self.raw.view(np.uint8), self.shape)
            self.adds = _no_adds(self.shape, np.dtype(compute_dtype))
        else:
            self.bools = _no_mask_view(self.shape)
            self.adds = np.broadcast_to(self.raw, self.shape)

    def kernel_args(self):
        """``(bools, adds, is_bool)``, the kernels' mask arguments."""
        return self.bools, self.adds, self.is_bool

    def _table_shape(self, block_q, block_k):
        """``(B, Hq, n_qb, n_kb)``: the tiles of ``block_q`` rows and ``block_k`` keys (one of
        each at least)."""
        n_b, n_hq, n_q, n_k = self.shape
        return n_b, n_hq, max(1, -(-n_q // block_q)), max(1, -(-n_k // block_k))

    def tile_states(self, block_q, block_k):
        """int8 (B, Hq, n_qb, n_kb) view: HIDDEN, MIXED or CLEAR for each tile. Without a mask
        every tile is CLEAR, and the answer is kept: the plain call's ``UserMask`` is kept per
        shape (``api._no_options``), and working the table's shape out again was about 0.6 us
        of a 16-token prompt's call."""
        if not self.given:
            states = self._clear.get((block_q, block_k))
            if states is None:
                states = self._clear[block_q, block_k] = _all_clear(
                    self._table_shape(block_q, block_k))
            return states
        n_b, n_hq, n_qb, n_kb = self._table_shape(block_q, block_k)
        if self.shape[2] == 0 or self.shape[3] == 0:
            return _all_clear((n_b, n_hq, n_qb, n_kb))
        m = self.raw
        n_qb_raw = n_qb if m.shape[2] > 1 else 1
        states = np.empty(m.shape[:2] + (n_qb_raw, n_kb), dtype=np.int8)
        like = np.empty(0, dtype=np.float32 if self.is_bool else m.dtype)  # vector type
        tile_state_table(m.view(np.uint8) if self.is_bool else m, self.is_bool, like,
                         float(-np.finfo(like.dtype).max), block_q if m.shape[2] > 1 else 1,
                         block_k, n_kb, states)
        return np.broadcast_to(states, (n_b, n_hq, n_qb, n_kb))


_NO_MASK = np.ones((1, 1, 1, 1), dtype=bool)
_NO_MASK.flags.writeable = False
_NO_MASK_BYTES = _NO_MASK.view(np.uint8)


# Read-only arrays that depend on the shape only, made once per shape: a decode step runs
# right after its kernel has streamed K/V through the caches, where each numpy call costs
# 2-5 us (np.broadcast_to, np.full, np.zeros), and the Python work of a step was 10-12 % of it.
@functools.lru_cache(maxsize=64)
def _no_mask_view(shape):
    return np.broadcast_to(_NO_MASK.view(np.uint8), shape)


@functools.lru_cache(maxsize=64)
def _no_adds(shape, dtype):
    return np.broadcast_to(np.zeros((1, 1, 1, 1), dtype=dtype), shape)


# (Shared between calls and only ever read: the kernels take kv_lens and slopes as read-only
# arrays, whatever their flags, since stop 24's _cpu/_jit.Kernel.)
@functools.lru_cache(maxsize=64)
def _all_keys(n_b, n_k):
    return np.full(n_b, n_k, dtype=np.int64)


@functools.lru_cache(maxsize=64)
def _no_slopes(n_b, n_hq):
    return np.zeros((n_b, n_hq))


@functools.lru_cache(maxsize=64)
def _all_clear(shape):
    return np.broadcast_to(np.int8(CLEAR), shape)


def _mask_4d(mask, shape, compute_dtype):
    if not isinstance(mask, np.ndarray):
        raise TypeError(f"mask: expected a numpy array (bool: True = attend; float: added), "
                        f"got {type(mask).__name__}")
    if mask.dtype != np.bool_ and mask.dtype.kind != "f":
        raise TypeError(f"mask: expected a bool or float array, got {mask.dtype}")
    m4 = mask.reshape(broadcast_shape(mask.shape, shape))
    if m4.dtype.kind == "f" and m4.dtype != compute_dtype:
        # One copy at the mask's own size (float16, or float64 with float32 inputs; torch
        # asks for the query's dtype), so that the kernels take one float mask type.
        m4 = m4.astype(compute_dtype)
    return m4


def broadcast_shape(mask_shape, shape):
    """``mask_shape`` with leading 1s to 4-D, checked to broadcast to ``shape`` =
    (B, Hq, Nq, Nk) the way the kernels read it: each axis 1 or equal."""
    if len(mask_shape) > 4:
        raise ValueError(f"mask: expected at most 4 dimensions, got shape {mask_shape}")
    m4 = (1,) * (4 - len(mask_shape)) + tuple(mask_shape)
    for have, want in zip(m4, shape):
        if have not in (1, want):
            raise ValueError(f"mask: shape {tuple(mask_shape)} does not broadcast to "
                             f"(B, Hq, Nq, Nk) = {shape}")
    return m4


NO_DROPOUT = (0, 0, 1.0)  # ``dropout``'s answer for p = 0


def dropout(dropout_p, seed):
    """``(drop_below, seed, inv_keep)`` for the kernels: a key is dropped where its 32-bit hash
    is below ``drop_below`` (dropout.py), and a kept probability is multiplied by ``inv_keep =
    1 / (1 - p)``, the scale of the API's contract (not the inverse of the hash's exact keep
    rate, ``2^32 / (2^32 - drop_below)``, which differs from it by up to 1e-10 relative: a
    difference float64 results show); ``NO_DROPOUT`` without dropout."""
    if not is_real(dropout_p):
        raise TypeError(f"dropout_p: expected a number in [0, 1), got {dropout_p!r}")
    p = float(dropout_p)
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout_p: expected a number in [0, 1), got {p}")
    if p == 0.0:
        return NO_DROPOUT
    if seed is None:
        raise ValueError("seed: required with dropout_p > 0 (the backward pass regenerates "
                         "the dropout mask from it)")
    if not is_integer(seed):
        raise TypeError(f"seed: expected an int, got {seed!r}")
    if not 0 <= seed < 2**63:
        raise ValueError(f"seed: expected 0 <= seed < 2**63, got {seed}")
    return threshold(p), int(seed), 1.0 / (1.0 - p)
