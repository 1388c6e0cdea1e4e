"""GPU: the time of one ``cpuflash.attention`` call on torch tensors, its kernel, and torch's.

    python bench/cuda_call.py

Per shape (B=4, H=16, float32), in ms: ``call``, one call between CUDA events (its host time
included, as cuda_bench.py measures it); ``call_x10``, ten calls in a row, per call (the
kernel, once the host runs ahead of the GPU); ``torch`` and ``torch_x10``, the same for
torch's "efficient" SDPA kernel; ``cpu_call``, the host time of one call. Not collected by
pytest.
"""
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import cpuflash

B, H = 4, 16
CASES = [(1024, 64, False), (1024, 64, True), (4096, 64, False), (1024, 128, False)]


def event_ms(fn, reps=20, inner=1):
    """Median over ``reps`` of the CUDA-event time of ``inner`` calls, per call."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / inner)
    return float(np.median(times))


def host_ms(fn, calls=50):
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = (time.perf_counter() - start) / calls * 1e3
    torch.cuda.synchronize()
    return elapsed


def main():
    for n, d, causal in CASES:
        q, k, v = (torch.randn(B, H, n, d, device="cuda") for _ in range(3))
        t0 = time.time()
        cpuflash.attention(q, k, v, causal=causal)
        torch.cuda.synchronize()
        first = time.time() - t0

        def call():
            return cpuflash.attention(q, k, v, causal=causal)

        def theirs():
            with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

        res = {"call": event_ms(call), "call_x10": event_ms(call, 5, 10),
               "torch": event_ms(theirs), "torch_x10": event_ms(theirs, 5, 10),
               "cpu_call": host_ms(call)}
        print(n, d, causal, f"first {first:.0f}s", {key: round(x, 3) for key, x in res.items()},
              "ms", flush=True)


if __name__ == "__main__":
    main()
