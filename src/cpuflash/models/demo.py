"""``cpuflash demo``: all-MiniLM-L6-v2 sentence embeddings with cpuflash attention, a cosine
similarity matrix, and the time of a 32-sentence batch against the same numpy model with naive
attention."""
import os
import sys
import time

import numpy as np

SENTENCES = [
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The girl is carrying a baby.",
    "A man is riding a horse.",
    "A woman is playing violin.",
    "Attention computed in tiles never builds the full score matrix.",
]
# (attention, layout) pairs timed, cpuflash first
RUNS = [("cpuflash", "varlen"), ("cpuflash", "padded"), ("naive", "padded"), ("naive", "varlen")]


def batch_lengths(n_sentences, seed=0, shortest=5, longest=128):
    """Token counts of the timed batch: ``shortest..longest`` with both ends present."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(shortest, longest + 1, size=n_sentences)
    lengths[0], lengths[-1] = shortest, longest
    return lengths


def time_runs(model, token_ids, repeats, runs=RUNS):
    """Best-of-``repeats`` seconds per (attention, layout), interleaved round by round."""
    for run in runs:
        model.embed_ids(token_ids, *run)  # warm-up: kernels load or compile
    best = {run: float("inf") for run in runs}
    for _ in range(repeats):
        for run in runs:
            t0 = time.perf_counter()
            model.embed_ids(token_ids, *run)
            best[run] = min(best[run], time.perf_counter() - t0)
    return best


def quiet_openmp():
    """Let idle OpenMP threads sleep instead of spin, if the OpenMP runtime has not started.

    The model alternates numpy matmuls (OpenBLAS's threads) with cpuflash calls (Numba's
    OpenMP threads). By default an OpenMP thread spins for a while after each parallel call and
    steals a core from the next matmul: on 2 cores the whole model ran 1.5x slower (0.46 s in
    place of 0.28-0.31 s for the 32-sentence batch). libgomp reads ``OMP_WAIT_POLICY`` once,
    when Numba first starts its thread pool, so this must run before any cpuflash call."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def main(args):
    quiet_openmp()
    from .minilm import MiniLM, MissingWeights, sentences_of_lengths

    try:
        model = MiniLM()
    except MissingWeights as exc:
        print(f"cpuflash demo: {exc}", file=sys.stderr)
        return 1
    sentences = args.sentence or SENTENCES
    emb = model.embed(sentences)
    ref = model.embed(sentences, attention="reference")
    print("all-MiniLM-L6-v2 in numpy, attention by cpuflash\n")
    for i, s in enumerate(sentences):
        print(f"  [{i}] {s}")
    print("\ncosine similarity:")
    print("     " + "".join(f"{f'[{j}]':>7}" for j in range(len(sentences))))
    for i, row in enumerate(emb @ emb.T):
        print(f"{f'[{i}]':>5}" + "".join(f"{c:7.3f}" for c in row))
    worst = float(np.min(np.sum(emb.astype(np.float64) * ref, axis=1)))
    print(f"\nlowest cosine vs the same model with float64 reference attention: {worst:.8f}")
    if args.batch:
        lengths = batch_lengths(args.batch)
        ids = sentences_of_lengths(model, lengths)
        best = time_runs(model, ids, args.repeats)
        print(f"\n{args.batch} sentences of {lengths.min()}..{lengths.max()} tokens "
              f"({lengths.sum()} in all), best of {args.repeats}, whole model:")
        base = best[("naive", "padded")]
        for (attention, layout), t in best.items():
            print(f"  {attention:>8} attention, {layout:>6}: {t * 1e3:8.1f} ms  "
                  f"({base / t:.2f}x naive padded)")
    return 0
