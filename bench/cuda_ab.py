"""A/B of the float32 tensor-core forward on the GPU: a module constant of
``cpuflash._cuda.forward_mma`` (such as ``PV_GROUP``) set to each value in turn, each variant
compiled once, timed in rounds side by side with torch's efficient kernel (B=4, H=16; min of 2
rounds of medians, ``--calls`` calls between the CUDA events); the last column says whether
every variant gave the first one's bits. Not collected by pytest.

    python bench/cuda_ab.py NAME V1,V2,... [--calls 10] [--d 128,64] [--causal 0] [--n 4096]
    e.g. python bench/cuda_ab.py PV_GROUP 1,2,4 --calls 10 --d 128,64 --n 4096,16384
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from arg_types import int_list  # noqa: E402  (after its folder is on the path)


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("name", help="a module constant of cpuflash._cuda.forward_mma")
    p.add_argument("values", type=lambda t: int_list(t, at_least=-2**31),
                   help="comma-separated integer values to try, the first the reference")
    p.add_argument("--calls", type=int, default=10, help="calls between the events")
    p.add_argument("--d", type=int_list, default=[128, 64])
    p.add_argument("--causal", default="0", choices=("0", "1", "0,1"))
    p.add_argument("--n", type=int_list, default=[4096, 16384])
    a = p.parse_args(argv)
    if a.calls < 1:
        p.error(f"--calls must be at least 1, got {a.calls}")
    from cpuflash._cuda import forward_mma
    if not (a.name.isupper() and isinstance(getattr(forward_mma, a.name, None), int)):
        p.error(f"argument name: {a.name!r} is not an integer constant of "
                "cpuflash._cuda.forward_mma (such as PV_GROUP)")
    return a


def main(a):
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from cuda_bench import timed
    import cpuflash
    from cpuflash._cuda import forward_mma

    orig = forward_mma.kernel.__wrapped__
    compiled = {}

    def kernel(*args):  # one compiled kernel per value of the constant
        key = (getattr(forward_mma, a.name),) + args
        if key not in compiled:
            forward_mma.make_forward.cache_clear()
            compiled[key] = orig(*args)
        return compiled[key]

    forward_mma.kernel = kernel
    print(f"{a.name} in {a.values}; ms (x torch); calls {a.calls}")
    for d in a.d:
        for causal in (c == "1" for c in a.causal.split(",")):
            for n in a.n:
                gen = torch.Generator(device="cuda").manual_seed(0)
                q, k, v = (torch.randn(4, 16, n, d, device="cuda", generator=gen)
                           for _ in range(3))

                def ours():
                    return cpuflash.attention(q, k, v, causal=causal)

                def theirs():
                    with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
                        F.scaled_dot_product_attention(q, k, v, is_causal=causal)

                outs, t = {}, {}
                for x in a.values:
                    setattr(forward_mma, a.name, x)
                    outs[x] = torch.as_tensor(ours(), device="cuda").clone()
                reps = 5 if n < 16384 else 3
                for _ in range(2):
                    for x in a.values:
                        setattr(forward_mma, a.name, x)
                        t.setdefault(x, []).append(timed(ours, reps, a.calls))
                    t.setdefault("torch", []).append(timed(theirs, reps, a.calls))
                tt = min(t["torch"]) * 1e3
                cells = " | ".join(f"{min(t[x]) * 1e3:.3f} ({tt / min(t[x]) / 1e3:.2f})"
                                   for x in a.values)
                same = all(torch.equal(outs[a.values[0]], outs[x]) for x in a.values)
                print(f"| {d} | {n} | {'yes' if causal else 'no'} | {cells} | torch {tt:.3f} | "
                      f"bitwise {same} |", flush=True)


if __name__ == "__main__":
    main(parse())
