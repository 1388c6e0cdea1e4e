"""A/B of the float32 tensor-core forward on the GPU: a module constant of
``cpuflash._cuda.forward_mma`` (such as ``PV_GROUP``) set to each value in turn, each variant
compiled once, timed in rounds side by side with torch's efficient kernel (B=4, H=16; min of 2
rounds of medians, CALLS calls between the CUDA events); the last column says whether every
variant gave the first one's bits. Not collected by pytest.

    python bench/cuda_ab.py NAME V1,V2,... CALLS D1,D2 CAUSAL(0,1) N1,N2
    e.g. python bench/cuda_ab.py PV_GROUP 1,2,4 10 128,64 0 4096,16384
"""
import sys
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
sys.path.insert(0, "bench")
from cuda_bench import timed  # noqa: E402
import cpuflash  # noqa: E402
from cpuflash._cuda import forward_mma  # noqa: E402

attr = sys.argv[1]
values = [int(x) if x.lstrip("-").isdigit() else x for x in sys.argv[2].split(",")]
calls = int(sys.argv[3])
dims = [int(x) for x in sys.argv[4].split(",")]
causals = [x == "1" for x in sys.argv[5].split(",")]
ns = [int(x) for x in sys.argv[6].split(",")]
orig = forward_mma.kernel.__wrapped__
cache = {}


def kernel(*a):
    key = (getattr(forward_mma, attr),) + a
    if key not in cache:
        forward_mma.make_forward.cache_clear()
        cache[key] = orig(*a)
    return cache[key]


forward_mma.kernel = kernel
print(f"{attr} in {values}; ms (x torch); calls {calls}")
for d in dims:
    for causal in causals:
        for n in ns:
            gen = torch.Generator(device="cuda").manual_seed(0)
            q, k, v = (torch.randn(4, 16, n, d, device="cuda", generator=gen) for _ in range(3))
            outs, t = {}, {}
            for x in values:
                setattr(forward_mma, attr, x)
                outs[x] = torch.as_tensor(cpuflash.attention(q, k, v, causal=causal),
                                          device="cuda").clone()
            reps = 5 if n < 16384 else 3

            def theirs():
                with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
                    F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            for rnd in range(2):
                for x in values:
                    setattr(forward_mma, attr, x)
                    t.setdefault(x, []).append(
                        timed(lambda: cpuflash.attention(q, k, v, causal=causal), reps, calls))
                t.setdefault("torch", []).append(timed(theirs, reps, calls))
            tt = min(t["torch"]) * 1e3
            cells = " | ".join(f"{min(t[x]) * 1e3:.3f} ({tt / min(t[x]) / 1e3:.2f})"
                               for x in values)
            same = all(torch.equal(outs[values[0]], outs[x]) for x in values)
            print(f"| {d} | {n} | {'yes' if causal else 'no'} | {cells} | torch {tt:.3f} | "
                  f"bitwise {same} |", flush=True)
