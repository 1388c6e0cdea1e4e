"""Compile times of the CPU kernels: the first forward, decode and backward calls of a new
process, float32, B=1, H=8, N=2048, D=64. Run it with an empty cache directory for a cold
compile, and again for the cached first calls. Not collected by pytest.

    NUMBA_CACHE_DIR=$(mktemp -d) python bench/cpu_cold_compile.py
"""
import time

start = time.perf_counter()
import numpy as np  # noqa: E402  (timed with the import of cpuflash)

import cpuflash  # noqa: E402

imported = time.perf_counter()


def timed(fn):
    t = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - t


rng = np.random.default_rng(0)
q, k, v = (rng.standard_normal((1, 8, 2048, 64)).astype(np.float32) for _ in range(3))
(out, lse), forward_s = timed(lambda: cpuflash.attention(q, k, v, return_lse=True))
_, decode_s = timed(lambda: cpuflash.attention(q[:, :, :1], k, v))
_, backward_s = timed(lambda: cpuflash.attention_backward(out, q, k, v, out, lse))
print(f"import {imported - start:.2f} s, forward {forward_s:.1f} s, decode {decode_s:.1f} s, "
      f"backward {backward_s:.1f} s")
