"""GPU benchmark: cpuflash's numba.cuda kernels against torch SDPA on the same GPU.

    python bench/cuda_bench.py [--n 1024,4096,16384] [--d 64,128] [--dtype float32,float16]
                               [--section fwd,fwdbwd] [--calls 1] [--memory] [--json PATH]
                               [--mask none,padding,bias] [--dropout P]

B=4, H=16 by default. TFLOP/s count 4*B*H*N^2*D for the forward pass and 3.5x that for
forward+backward, halved for causal (useful work only). Times: CUDA events, median of
repeats after a warm-up call (which compiles the kernels). torch runs its "efficient" kernel
for float32 and its flash kernel for float16 (forced through ``sdpa_kernel``). Not collected
by pytest (the file name does not start with ``test_``).

``--mask padding``: a bool key-padding mask (B, 1, 1, N), batch ``b`` seeing the first
``N - b * N / 8`` keys; ``--mask bias``: a float32 (B, 1, 1, N) bias. Both sides take the same
mask (not with causal: torch takes a mask or ``is_causal``, not both), and torch runs its
"efficient" kernel for either dtype (its flash kernel takes no mask). ``--dropout P``: both
sides drop with probability P (different random masks: the time, not the values, compares);
the error column is then left empty.
"""
import argparse
import json
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import cpuflash


def timed(fn, reps, calls=1):
    """Median seconds per call: ``calls`` calls in a row between two CUDA events, ``reps``
    times. With one call the host's time of the call counts whenever the GPU waits for it;
    with several the host runs ahead, as in a model's loop."""
    fn()  # warm-up: compiles on the first call
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / calls)
    return float(np.median(times))


def backend(dtype):
    return SDPBackend.EFFICIENT_ATTENTION if dtype == torch.float32 else SDPBackend.FLASH_ATTENTION


def make_mask(kind, b, n, dtype):
    """The ``--mask`` of the docstring, or None."""
    if kind == "none":
        return None
    keys = torch.arange(n, device="cuda")
    if kind == "padding":
        return keys[None, :] < (n - torch.arange(b, device="cuda")[:, None] * (n // 8))
    gen = torch.Generator(device="cuda").manual_seed(1)
    return torch.randn(b, n, device="cuda", generator=gen, dtype=dtype)


def run_case(b, h, n, d, causal, dtype, section, reps, calls=1, mask_kind="none", dropout=0.0):
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, dout = (torch.randn(b, h, n, d, device="cuda", dtype=dtype, generator=gen)
                     for _ in range(4))
    flops = 4 * b * h * n * n * d / (2 if causal else 1) * (3.5 if section == "fwdbwd" else 1)
    mask = make_mask(mask_kind, b, n, dtype)
    if mask is not None:
        mask = mask[:, None, None, :]
    ours_opts = {"causal": causal, "mask": mask, "dropout_p": dropout, "seed": 5}
    theirs_opts = {"is_causal": causal, "attn_mask": mask, "dropout_p": dropout}
    kernel = backend(dtype) if mask is None else SDPBackend.EFFICIENT_ATTENTION
    with sdpa_kernel(kernel):
        ref = F.scaled_dot_product_attention(q, k, v, **theirs_opts)
    out = cpuflash.attention(q, k, v, **ours_opts)
    err = (out.float() - ref.float()).abs().max().item() if not dropout else float("nan")
    if section == "fwd":
        ours = timed(lambda: cpuflash.attention(q, k, v, **ours_opts), reps, calls)

        def theirs():
            with sdpa_kernel(kernel):
                F.scaled_dot_product_attention(q, k, v, **theirs_opts)
    else:
        def ours_fn():
            o, lse = cpuflash.attention(q, k, v, return_lse=True, **ours_opts)
            cpuflash.attention_backward(dout, q, k, v, o, lse, **ours_opts)
        ours = timed(ours_fn, reps, calls)
        qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))

        def theirs():
            with sdpa_kernel(kernel):
                o = F.scaled_dot_product_attention(qg, kg, vg, **theirs_opts)
            o.backward(dout)
    t_torch = timed(theirs, reps, calls)
    return {"B": b, "H": h, "N": n, "D": d, "causal": causal, "dtype": str(dtype).split(".")[-1],
                "mask": mask_kind, "dropout": dropout, "section": section, "ms": ours * 1e3,
                "tflops": flops / ours / 1e12,
                "torch_ms": t_torch * 1e3, "torch_tflops": flops / t_torch / 1e12,
                "ratio": t_torch / ours, "max_err_vs_torch": err}


def memory_check(n=65536, h=16, d=64):
    """GPU memory of one forward at B=1: free memory before and after (out and lse stay
    allocated; the kernels allocate nothing else), next to what an N x N score matrix of
    float32 per head would take."""
    from numba import cuda
    q, k, v = (torch.randn(1, h, n, d, device="cuda") for _ in range(3))
    torch.cuda.synchronize()
    ctx = cuda.current_context()
    free0 = ctx.get_memory_info()[0]
    out, lse = cpuflash.attention(q, k, v, causal=True, return_lse=True)
    torch.cuda.synchronize()
    used = free0 - ctx.get_memory_info()[0]
    return {"N": n, "H": h, "D": d, "used_MiB": used / 2**20,
                "out_plus_lse_MiB": (out.numel() * 4 + lse.numel() * 4) / 2**20,
                "scores_would_be_GiB": h * n * n * 4 / 2**30}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--b", type=int, default=4)
    p.add_argument("--h", type=int, default=16)
    p.add_argument("--n", default="1024,4096,16384")
    p.add_argument("--d", default="64,128")
    p.add_argument("--dtype", default="float32,float16")
    p.add_argument("--causal", default="0,1")
    p.add_argument("--section", default="fwd,fwdbwd")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--calls", type=int, default=1, help="calls in a row between the events")
    p.add_argument("--memory", action="store_true")
    p.add_argument("--mask", default="none", choices=("none", "padding", "bias"))
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--json")
    a = p.parse_args()
    for name in ("reps", "calls"):
        if getattr(a, name) < 1:
            p.error(f"--{name} must be at least 1, got {getattr(a, name)}")
    rows = []
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"{a.calls} call(s) between events, mask {a.mask}, dropout {a.dropout}")
    print("| section | dtype | N | D | causal | ms | TFLOP/s | torch ms | torch TFLOP/s | x torch "
          "| max err vs torch |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for section in a.section.split(","):
        for dt in a.dtype.split(","):
            for d in map(int, a.d.split(",")):
                for causal in (c == "1" for c in a.causal.split(",")):
                    for n in map(int, a.n.split(",")):
                        t0 = time.time()
                        r = run_case(a.b, a.h, n, d, causal, getattr(torch, dt), section,
                                     a.reps if n < 16384 else max(2, a.reps // 2), a.calls,
                                     a.mask, a.dropout)
                        rows.append(r)
                        print(f"| {section} | {r['dtype']} | {n} | {d} | "
                              f"{'yes' if causal else 'no'} | {r['ms']:.2f} | "
                              f"{r['tflops']:.1f} | {r['torch_ms']:.2f} | "
                              f"{r['torch_tflops']:.1f} | {r['ratio']:.2f} | "
                              f"{r['max_err_vs_torch']:.1e} |  ({time.time() - t0:.0f} s)",
                              flush=True)
    if a.memory:
        m = memory_check()
        rows.append(m)
        print("memory:", m)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
