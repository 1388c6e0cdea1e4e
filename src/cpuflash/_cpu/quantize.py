"""int8 quantization of K/V rows for ``KVCache`` (``kvcache.quantize_int8``), one pass a row.

Symmetric, one scale per row: ``scale = max|x| / 127`` in float32, ``x8 = rint(x / scale)``
(ties to even), clipped to [-127, 127]; a row of zeros gets scale 0 (and is divided by 1).
The same float32 operations, in the same order, as the numpy expression this replaced
(``kvcache.quantize_int8`` up to stop 48), so the same bits: there a token's append into an
int8 cache ran a dozen numpy calls on a few hundred bytes, 26 us for a (1, 2, 1, 64) K on the
Xeon of stop 49, against a decode step of about 95 us.
"""
import numpy as np

from ._jit import kernel


@kernel(parallel=False, strided=("x",), read_only=("x",))
def quantize_rows(x, x8, scale):
    """``x``: (rows, D) float32, any strides; writes ``x8`` (rows, D) int8 and ``scale``
    (rows,) float32. Returns False, with ``x8`` and ``scale`` unspecified, where ``x`` holds
    a NaN or an infinity (int8 cannot hold them; the caller raises)."""
    n_rows, d = x.shape
    big = np.float32(np.inf)
    for r in range(n_rows):
        amax = np.float32(0.0)
        for c in range(d):
            a = abs(x[r, c])
            if not a < big:  # NaN or infinite
                return False
            if a > amax:
                amax = a
        s = amax / np.float32(127.0)
        scale[r] = s
        safe = s if s > 0 else np.float32(1.0)
        for c in range(d):
            x8[r, c] = min(max(np.rint(x[r, c] / safe), np.float32(-127.0)), np.float32(127.0))
    return True
