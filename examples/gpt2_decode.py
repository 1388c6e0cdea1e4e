"""Text generation with a KV cache: a GPT-2-small-shaped decoder in numpy, attention by cpuflash.

    python examples/gpt2_decode.py                      # 12 layers, 12 heads, d_model 768
    python examples/gpt2_decode.py --prompt 2048 --new 32 --cache float16 --kv-heads 4
    python examples/gpt2_decode.py --sinks               # gpt-oss's attention sinks too

Random weights with a fixed seed (the shapes of GPT-2 small, vocabulary cut to 8192 to keep the
example light); the point is the generation loop, not the text. The prompt is run in one causal
pass (prefill), then one token at a time against the cache (decode). The same model is run
again with naive numpy attention over a plain growing K/V array, and the two must produce the
same tokens; the script prints tokens per second for both and exits non-zero if they differ.
``--sinks`` gives every layer gpt-oss's attention sinks (a learned logit per head in each row's
softmax, here drawn at random); the naive side appends them as a score column.
"""
import argparse
import os
import sys
import time

# numpy matmuls and cpuflash calls alternate: idle OpenMP threads (Numba's pool) should sleep,
# not spin on a core the next matmul needs (read once, when Numba starts its threads)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402

import cpuflash  # noqa: E402


class Config:
    def __init__(self, layers=12, heads=12, kv_heads=12, d_model=768, vocab=8192, max_len=1024):
        self.layers, self.heads, self.kv_heads = layers, heads, kv_heads
        self.d_model, self.vocab, self.max_len = d_model, vocab, max_len
        self.head_dim = d_model // heads


def init_weights(cfg, seed=0, sinks=False):
    """GPT-2's initialization: normal(0, 0.02), residual projections scaled by 1/sqrt(2L);
    ``sinks``: each layer's attention sinks too, a logit per head, normal(0, 1)."""
    rng = np.random.default_rng(seed)

    def normal(*shape, std=0.02):
        return (rng.standard_normal(shape, dtype=np.float32) * np.float32(std))

    d, kv_width = cfg.d_model, cfg.kv_heads * cfg.head_dim
    proj_std = 0.02 / np.sqrt(2 * cfg.layers)
    layers = [{
        "ln1": (np.ones(d, np.float32), np.zeros(d, np.float32)),
        "w_q": normal(d, d), "w_k": normal(d, kv_width), "w_v": normal(d, kv_width),
        "w_o": normal(d, d, std=proj_std),
        "ln2": (np.ones(d, np.float32), np.zeros(d, np.float32)),
        "w_fc": normal(d, 4 * d), "w_proj": normal(4 * d, d, std=proj_std),
        "sinks": normal(cfg.heads, std=1.0) if sinks else None,
    } for _ in range(cfg.layers)]
    return {"wte": normal(cfg.vocab, d), "wpe": normal(cfg.max_len, d, std=0.01),
            "layers": layers, "ln_f": (np.ones(d, np.float32), np.zeros(d, np.float32))}


def layer_norm(x, gain_bias, eps=1e-5):
    gain, bias = gain_bias
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * gain + bias


def gelu(x):  # GPT-2's tanh approximation
    return 0.5 * x * (1.0 + np.tanh(np.float32(0.7978845608) * (x + np.float32(0.044715) * x**3)))


def naive_attention(q, k, v, sinks=None):
    """softmax(q k^T / sqrt(D)) v with bottom-right causal masking, the (Nq, Nk) scores in full;
    GQA by repeating the kv heads; ``sinks`` (H,): one more score column per head, dropped
    after the softmax (transformers' gpt-oss eager attention)."""
    group = q.shape[0] // k.shape[0]
    k, v = np.repeat(k, group, axis=0), np.repeat(v, group, axis=0)
    s = q @ k.transpose(0, 2, 1) / np.float32(np.sqrt(q.shape[-1]))
    n_q, n_k = s.shape[-2:]
    s = np.where(np.tril(np.ones((n_q, n_k), bool), n_k - n_q), s, -np.inf)
    if sinks is not None:
        s = np.concatenate([s, np.broadcast_to(sinks[:, None, None], (len(sinks), n_q, 1))], -1)
    p = np.exp(s - s.max(-1, keepdims=True))
    p = p / p.sum(-1, keepdims=True)
    return (p if sinks is None else p[..., :-1]) @ v


class CpuflashAttention:
    """Attention over a cpuflash.KVCache: append the new keys/values, attend causally."""

    def __init__(self, cfg, cache_dtype):
        self.cache = cpuflash.KVCache(cfg.layers, 1, cfg.kv_heads, cfg.max_len, cfg.head_dim,
                                      dtype=cache_dtype)

    def __call__(self, layer, q, k, v, sinks=None):  # (H, n, D) each; sinks (H,) or None
        self.cache.append(layer, k[None], v[None])
        return self.cache.attention(layer, q[None], causal=True, sinks=sinks)[0]


class NaiveAttention:
    """The same over preallocated float32 arrays, with naive_attention."""

    def __init__(self, cfg):
        self.k = np.zeros((cfg.layers, cfg.kv_heads, cfg.max_len, cfg.head_dim), np.float32)
        self.v = np.zeros_like(self.k)
        self.lengths = [0] * cfg.layers

    def __call__(self, layer, q, k, v, sinks=None):
        start, stop = self.lengths[layer], self.lengths[layer] + k.shape[1]
        self.k[layer, :, start:stop], self.v[layer, :, start:stop] = k, v
        self.lengths[layer] = stop
        return naive_attention(q, self.k[layer, :, :stop], self.v[layer, :, :stop], sinks)


def forward(cfg, weights, tokens, start, attend):
    """Logits of the last position for ``tokens`` at positions ``start..``; ``attend`` keeps
    the K/V of earlier positions."""
    n = len(tokens)
    x = weights["wte"][tokens] + weights["wpe"][start:start + n]
    for i, w in enumerate(weights["layers"]):
        h = layer_norm(x, w["ln1"])
        q = (h @ w["w_q"]).reshape(n, cfg.heads, cfg.head_dim).transpose(1, 0, 2)
        k = (h @ w["w_k"]).reshape(n, cfg.kv_heads, cfg.head_dim).transpose(1, 0, 2)
        v = (h @ w["w_v"]).reshape(n, cfg.kv_heads, cfg.head_dim).transpose(1, 0, 2)
        a = attend(i, q, k, v, w["sinks"]).transpose(1, 0, 2).reshape(n, cfg.d_model)
        x = x + a @ w["w_o"]
        x = x + gelu(layer_norm(x, w["ln2"]) @ w["w_fc"]) @ w["w_proj"]
    return layer_norm(x[-1], weights["ln_f"]) @ weights["wte"].T


def generate(cfg, weights, prompt, n_new, attend):
    """Greedy decoding: returns the new tokens and (prefill seconds, decode seconds)."""
    t0 = time.perf_counter()
    logits = forward(cfg, weights, prompt, 0, attend)
    t_prefill = time.perf_counter() - t0
    out = [int(np.argmax(logits))]
    t0 = time.perf_counter()
    for step in range(n_new - 1):
        logits = forward(cfg, weights, np.array([out[-1]]), len(prompt) + step, attend)
        out.append(int(np.argmax(logits)))
    return out, (t_prefill, time.perf_counter() - t0)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--kv-heads", type=int, default=12, help="fewer than --heads: GQA")
    parser.add_argument("--d-model", type=int, default=768)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--prompt", type=int, default=512, help="prompt tokens")
    parser.add_argument("--new", type=int, default=32, help="tokens to generate")
    parser.add_argument("--cache", default="float32",
                        choices=["float32", "float16", "bfloat16", "int8"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sinks", action="store_true", help="attention sinks, as gpt-oss's")
    args = parser.parse_args(argv)
    cfg = Config(args.layers, args.heads, args.kv_heads, args.d_model, args.vocab,
                 max_len=args.prompt + args.new)
    weights = init_weights(cfg, args.seed, args.sinks)
    prompt = np.random.default_rng(args.seed + 1).integers(0, cfg.vocab, args.prompt)

    flash = CpuflashAttention(cfg, args.cache)
    # compile/load both kernels before the timing: a prefill of more than 16 queries takes the
    # tiled forward, a step the decode path (a 2-token warm-up took only the second, and the
    # first prefill paid 0.2-0.3 s of loading the forward from Numba's cache)
    warm, n_warm = CpuflashAttention(cfg, args.cache), min(len(prompt), 64)
    forward(cfg, weights, prompt[:n_warm], 0, warm)
    forward(cfg, weights, prompt[:1], n_warm, warm)  # a step at the next position
    tokens, (pre, dec) = generate(cfg, weights, prompt, args.new, flash)
    naive_tokens, (naive_pre, naive_dec) = generate(cfg, weights, prompt, args.new,
                                                    NaiveAttention(cfg))
    print(f"model: {cfg.layers} layers, {cfg.heads} heads ({cfg.kv_heads} kv), d_model "
          f"{cfg.d_model}, vocab {cfg.vocab}; prompt {args.prompt}, {args.new} new tokens; "
          f"cpuflash cache {args.cache} ({flash.cache.nbytes / 2**20:.1f} MiB)"
          + ("; attention sinks" if args.sinks else ""))
    for name, p, d in (("cpuflash", pre, dec), ("naive numpy", naive_pre, naive_dec)):
        print(f"{name:>12}: prefill {p * 1e3:8.1f} ms, decode {(args.new - 1) / d:7.1f} tokens/s")
    same = tokens == naive_tokens
    print("tokens:", tokens[:16], "..." if len(tokens) > 16 else "")
    print("same tokens as naive attention:", same)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
