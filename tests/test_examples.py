"""The examples run and do what they claim, on tiny configurations."""
import importlib.util
import pathlib

import numpy as np
import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"


def load(name):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("kv_heads, sinks", [(4, False), (2, False), (2, True)])
def test_gpt2_decode_same_tokens_as_naive_attention(kv_heads, sinks, capsys):
    gpt2 = load("gpt2_decode")
    assert gpt2.main(["--layers", "2", "--heads", "4", "--kv-heads", str(kv_heads),
                      "--d-model", "64", "--vocab", "512", "--prompt", "40",
                      "--new", "12"] + (["--sinks"] if sinks else [])) == 0
    assert "same tokens as naive attention: True" in capsys.readouterr().out


def test_gpt2_cache_step_equals_full_forward():
    """The last position's logits after decoding token by token equal one full causal pass."""
    gpt2 = load("gpt2_decode")
    cfg = gpt2.Config(layers=2, heads=4, kv_heads=2, d_model=64, vocab=256, max_len=24)
    weights = gpt2.init_weights(cfg, seed=3)
    tokens = np.random.default_rng(4).integers(0, cfg.vocab, 20)
    full = gpt2.forward(cfg, weights, tokens, 0, gpt2.CpuflashAttention(cfg, "float32"))
    attend = gpt2.CpuflashAttention(cfg, "float32")
    for t in range(len(tokens)):
        stepped = gpt2.forward(cfg, weights, tokens[t:t + 1], t, attend)
    np.testing.assert_allclose(stepped, full, rtol=1e-4, atol=1e-5)
