"""GPU: the first forward and backward call of a process (the kernels compiled, or loaded from
numba-cuda's disk cache). Run it twice: the second process finds the first one's kernels.

    CPUFLASH_CUDA_CACHE_DIR=/tmp/cpuflash-cache python bench/cuda_first_call.py

Not collected by pytest.
"""
import time

import torch

import cpuflash


def main():
    q = torch.randn(1, 2, 256, 64, device="cuda")
    start = time.time()
    out, lse = cpuflash.attention(q, q, q, return_lse=True)
    torch.cuda.synchronize()
    forward_s = time.time() - start
    start = time.time()
    cpuflash.attention_backward(q, q, q, q, out, lse)
    torch.cuda.synchronize()
    print(f"first forward {forward_s:.2f} s, first backward {time.time() - start:.2f} s")


if __name__ == "__main__":
    main()
