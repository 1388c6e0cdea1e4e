"""Dropout on the probabilities from a counter-based hash: no state, no stream.

Whether key ``j`` survives for query row ``row = (b * Hq + h) * Nq + i`` is a pure function of
``(seed, row, j)``: murmur3's 32-bit finalizer of a mix of the three, compared with
``p * 2^32``. The forward pass, the backward pass, reruns and any thread count regenerate
the same decision for every element; survivors are scaled by ``1 / (1 - p)``, so the expected
output is the output without dropout. ``keep_mask`` is the same function in numpy, for the
reference.
"""
import numpy as np

from . import simd
from ._jit import helper

MASK32 = 0xFFFFFFFF


def threshold(p):
    """Drop where the 32-bit hash is below this."""
    return min(MASK32, round(p * 2.0**32))


def row_key(seed, row):
    """The per-row part of the hash input, folded to 32 bits (seed and row of any size)."""
    x = (int(seed) * 0x9E3779B1 + int(row) * 0x85EBCA77 + (int(row) >> 32) * 0x27D4EB2F)
    return x & MASK32


@helper
def hash_bits(row_mix, j):
    """murmur3's 32-bit finalizer of ``row_mix + j * 0xC2B2AE3D`` (mod 2^32). Numba widens
    integer products to 64 bits, so every product is masked back to 32."""
    m = np.uint64(MASK32)
    x = (np.uint64(row_mix) + np.uint64(j) * np.uint64(0xC2B2AE3D)) & m
    x ^= x >> np.uint64(16)
    x = (x * np.uint64(0x85EBCA6B)) & m
    x ^= x >> np.uint64(13)
    x = (x * np.uint64(0xC2B2AE35)) & m
    x ^= x >> np.uint64(16)
    return x


@helper
def row_mix(seed, row):
    """``row_key`` inside kernels: the same value for the same seed and row."""
    x = (np.uint64(seed) * np.uint64(0x9E3779B1) + np.uint64(row) * np.uint64(0x85EBCA77)
         + (np.uint64(row) >> np.uint64(32)) * np.uint64(0x27D4EB2F))
    return x & np.uint64(MASK32)


@helper
def dropout_row(s, off, n, seed, row, j0, drop_below, inv_keep):
    """``s[off + jj] *= (0 if dropped else 1 / (1 - p))`` for keys ``j0 + jj``, ``jj < n``:
    whole vectors through ``simd.vdropout`` (32-bit integer lanes), the rest one by one."""
    mix = row_mix(seed, row)
    below = np.uint64(drop_below)
    lanes = simd.lanes_of(s)
    n_vec = n // lanes * lanes
    for jj in range(0, n_vec, lanes):
        simd.vstore(s, off + jj, simd.vdropout(simd.vload(s, off + jj), mix, j0 + jj, below,
                                               inv_keep))
    for jj in range(n_vec, n):
        keep = hash_bits(mix, j0 + jj) >= below
        s[off + jj] *= inv_keep if keep else 0.0


def keep_mask(seed, rows, keys, p):
    """numpy: bool (len(rows), len(keys)), True where the element survives; the kernels'
    decisions exactly (for the reference and the tests)."""
    m = np.uint64(MASK32)
    mix = np.array([row_key(seed, r) for r in rows], dtype=np.uint64)[:, None]
    x = (mix + np.asarray(keys, dtype=np.uint64)[None, :] * np.uint64(0xC2B2AE3D)) & m
    x ^= x >> np.uint64(16)
    x = (x * np.uint64(0x85EBCA6B)) & m
    x ^= x >> np.uint64(13)
    x = (x * np.uint64(0xC2B2AE35)) & m
    x ^= x >> np.uint64(16)
    return x >= np.uint64(threshold(p))
