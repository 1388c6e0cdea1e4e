"""The attention sinks' fold, one pass over the rows (``cpuflash/sinks.py`` has the math), after
the tiled kernels (the decode kernel merges the sinks itself).

Each numpy call on a few rows costs microseconds, more right after a kernel has swept K/V
through every cache: the fold as a dozen numpy calls (logaddexp, exp, the -inf cases) added
31 us to a 24 us decode step (Hq=8, Nk=64) and 100-150 us to steps from a long cache (stop
57, before decode steps merged their sinks in the kernel). Here it is one call.
"""
import numpy as np

from ._jit import kernel


@kernel(parallel=False, strided=("lse", "sink"))
def fold_rows(out, lse, sink, lse_new):
    """Rows ``(B, H, N)`` of ``lse`` and their sinks ``sink`` (each axis of ``sink`` of
    ``lse``'s length or 1, broadcast) give ``lse_new = logaddexp(lse, sink)`` (C-contiguous,
    ``lse``'s dtype), and each row of ``out`` (B, H, N, Dv; C-contiguous float32 or float64)
    is scaled in place by ``e^(lse - lse_new)``, both in float64, each element rounded once. A
    sink of -inf leaves the row as it is (the same ``lse``, ``out`` untouched); a row that saw
    no key (``lse = -inf``) gets ``lse_new = sink`` and its output times 0; NaN stays NaN."""
    n_b, n_h, n = lse.shape
    s_b, s_h, s_n = sink.shape
    for b in range(n_b):
        for h in range(n_h):
            for i in range(n):
                x = np.float64(lse[b, h, i])
                c = np.float64(sink[b if s_b > 1 else 0, h if s_h > 1 else 0,
                                    i if s_n > 1 else 0])
                if c == -np.inf:
                    lse_new[b, h, i] = x
                    continue
                if x == -np.inf:
                    new, factor = c, 0.0
                else:
                    new = max(x, c) + np.log1p(np.exp(-abs(x - c)))
                    factor = np.exp(x - new)
                lse_new[b, h, i] = new
                for j in range(out.shape[3]):
                    out[b, h, i, j] = out[b, h, i, j] * factor
