"""``cpuflash demo``: all-MiniLM-L6-v2 sentence embeddings with cpuflash attention, a cosine
similarity matrix, and the time of a 32-sentence batch against the same numpy model with naive
attention."""
import os
import subprocess
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


# Idle threads of the two thread pools the model alternates between sleep instead of spin.
# OpenMP (Numba's threads): libgomp spins for a while after each parallel call and steals a
# core from the next matmul (on 2 cores the whole model ran 1.5x slower, 0.46 s in place of
# 0.28-0.31 s). OpenBLAS (numpy's matmuls): after each matmul its worker spins for 2^28 cycles
# (``OPENBLAS_THREAD_TIMEOUT``, default 28), about 0.1 s, which covers the attention call that
# follows: cpuflash's attention took 17 ms a layer inside the model against 9 ms alone
# (Zen 4, stop 30; naive attention, mostly one thread, lost less). 2^4 cycles instead.
QUIET_THREADS = {"OMP_WAIT_POLICY": "PASSIVE", "OPENBLAS_THREAD_TIMEOUT": "4"}


def quiet_openmp():
    """Let idle OpenMP threads sleep, if the OpenMP runtime has not started: libgomp reads
    ``OMP_WAIT_POLICY`` once, when Numba first starts its thread pool, so this must run before
    any cpuflash call. (OpenBLAS reads its setting when numpy is imported: the timing runs in
    a child process, ``time_in_child``.)"""
    os.environ.setdefault("OMP_WAIT_POLICY", QUIET_THREADS["OMP_WAIT_POLICY"])


def quiet_environment():
    """This process's environment with ``QUIET_THREADS`` where the caller set nothing else."""
    return {**QUIET_THREADS, **os.environ}


def time_in_child(n_sentences, repeats):
    """``report_times`` in a fresh process whose idle threads sleep (``QUIET_THREADS``, a
    setting the caller has made wins); returns its report."""
    done = subprocess.run([sys.executable, "-m", "cpuflash.models.demo", str(n_sentences),
                           str(repeats)], env=quiet_environment(), capture_output=True,
                          text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"the timing process failed:\n{done.stderr}")
    return done.stdout


def report_times(n_sentences, repeats):
    """Times the model on a batch of ``n_sentences`` with each (attention, layout), prints a
    table."""
    from .minilm import MiniLM, sentences_of_lengths

    model = MiniLM()
    lengths = batch_lengths(n_sentences)
    ids = sentences_of_lengths(model, lengths)
    best = time_runs(model, ids, repeats)
    threads = " ".join(f"{k}={os.environ.get(k, '(unset)')}" for k in QUIET_THREADS)
    print(f"\n{n_sentences} sentences of {lengths.min()}..{lengths.max()} tokens "
          f"({lengths.sum()} in all), best of {repeats}, whole model ({threads}):")
    base = best[("naive", "padded")]
    for (attention, layout), t in best.items():
        print(f"  {attention:>8} attention, {layout:>6}: {t * 1e3:8.1f} ms  "
              f"({base / t:.2f}x naive padded)")


def main(args):
    quiet_openmp()
    from .minilm import MiniLM, MissingWeights

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
        print(time_in_child(args.batch, args.repeats), end="")
    return 0


if __name__ == "__main__":  # the timing process of ``time_in_child``
    report_times(int(sys.argv[1]), int(sys.argv[2]))
