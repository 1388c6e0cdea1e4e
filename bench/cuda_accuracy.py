"""Max abs error against the float64 reference (torch's math SDPA on the inputs in float64) of
cpuflash's float32 GPU forward and of torch's efficient kernel, B=1, H=16, D 64 and 128, plus
a peaked case (q = k = v = 4 x randn). Not collected by pytest.

    python bench/cuda_accuracy.py
"""
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
import cpuflash
for d in (64, 128):
    for n, causal, peaked in ((4096, False, False), (4096, True, False), (1024, False, True)):
        gen = torch.Generator(device="cuda").manual_seed(1)
        q, k, v = (torch.randn(1, 16, n, d, device="cuda", generator=gen) for _ in range(3))
        if peaked:
            q = k = v = q * 4
        with sdpa_kernel(SDPBackend.MATH):
            ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(),
                                                 is_causal=causal)
        out = torch.as_tensor(cpuflash.attention(q, k, v, causal=causal), device="cuda")
        with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
            t = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        ours, theirs = ((x.double() - ref).abs().max().item() for x in (out, t))
        print(f"D={d} N={n} causal={causal} peaked (q=k=v x4)={peaked}: cpuflash {ours:.2e} "
              f"torch {theirs:.2e}", flush=True)
