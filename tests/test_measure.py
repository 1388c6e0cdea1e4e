"""The bench's measuring helpers: one reference for several outputs, memory probes side by
side in the order asked, and the default/long case lists of `cpuflash bench`; the streaming read
the decode benchmarks hold a step to."""
import numpy as np
import pytest

from cpuflash import _measure, cli, reference
from conftest import on_threads


def test_one_reference_judges_each_output_alone():
    q, k, v = _measure.make_qkv(1, 2, 40, 8, np.float64, seed=3)
    exact = reference.attention(q, k, v, causal=True)
    off = exact.copy()
    off[0, 0, 7, 3] += 1e-3
    both = _measure.max_errors_vs_reference([exact, off], q, k, v, True)
    assert both == [_measure.max_error_vs_reference(x, q, k, v, True) for x in (exact, off)]
    assert both[0] == 0.0 and both[1] == pytest.approx(1e-3, rel=1e-9)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("n_q,n_k", [(40, 40), (23, 40), (40, 23)])
def test_reference_in_row_blocks_is_the_whole_reference(causal, n_q, n_k, monkeypatch):
    """``max_errors_vs_reference`` takes the reference ``REFERENCE_ROWS`` query rows at a time
    (causal as a mask aligned to the end): its errors are those against one whole call, the
    row that differs in any block (rows that see no key with Nq > Nk included)."""
    monkeypatch.setattr(_measure, "REFERENCE_ROWS", 7)
    rng = np.random.default_rng(n_q + n_k)
    q = rng.standard_normal((1, 2, n_q, 8))
    k, v = (rng.standard_normal((1, 2, n_k, 8)) for _ in range(2))
    whole = reference.attention(q, k, v, causal=causal)
    for row in (0, 6, 7, n_q - 1):
        off = whole.copy()
        off[0, 0, row, 1] += 1e-3
        got = _measure.max_errors_vs_reference([whole, off], q, k, v, causal)
        assert got[0] < 1e-15 and got[1] == pytest.approx(1e-3, rel=1e-9)
    worse = whole + rng.standard_normal(whole.shape) * 1e-4
    assert _measure.max_error_vs_reference(worse, q, k, v, causal) == pytest.approx(
        float(np.max(np.abs(worse[:1, :1] - whole[:1, :1]))), rel=1e-9)


@pytest.mark.parametrize("h_kv", [8, 2, 1])
def test_decode_reference_is_the_reference(h_kv):
    """``decode_reference``: a decode step's reference with each GQA group as rows of one
    call, equal to ``reference.attention`` on the step (which repeats K/V per query head)."""
    q, k, v = _measure.make_qkv(2, 8, 300, 16, n_q=1, h_kv=h_kv, seed=h_kv)
    np.testing.assert_allclose(_measure.decode_reference(q, k, v),
                               reference.attention(q, k, v), rtol=1e-13, atol=1e-15)
    with pytest.raises(ValueError, match="q: expected one query row"):
        _measure.decode_reference(np.concatenate([q, q], axis=2), k, v)


def test_one_reference_backward_judges_each_gradient_set_alone():
    q, k, v = _measure.make_qkv(1, 4, 24, 8, np.float64, seed=4, h_kv=2)
    dout = _measure.make_qkv(1, 4, 24, 8, np.float64, seed=5)[0]
    exact = reference.attention_backward(dout, q, k, v, causal=True)
    off = [g.copy() for g in exact]
    off[1][0, 0, 5, 2] -= 2e-3  # dk of kv head 0: within the heads judged
    both = _measure.max_grad_errors_vs_reference([exact, off], q, k, v, dout, True)
    assert both[0] == 0.0 and both[1] == pytest.approx(2e-3, rel=1e-9)


def test_memory_probes_side_by_side_keep_their_order():
    """naive's (N, N) float32 scores (16 MiB at N=2048) against cpuflash's tiles at N=64."""
    probes = [{"b": 1, "h": 1, "n": 2048, "d": 16, "impl": "naive"},
              {"b": 1, "h": 1, "n": 64, "d": 16}]
    naive, flash = _measure.peak_memory_growths(probes, processes=2)
    assert naive > 16 * 2**20 > 8 * 2**20 > flash >= 0  # flash: ~4 MiB of first-call state


@pytest.mark.parametrize("argv, sizes", [
    ([], (len(cli.DEFAULT_SHAPES), len(cli.BACKWARD_SHAPES), len(cli.DECODE_CASES))),
    (["--long"], (len(cli.LONG_SHAPES), len(cli.LONG_BACKWARD_SHAPES),
                  len(cli.LONG_DECODE_CASES))),
    (["--section", "decode"], (0, 0, len(cli.DECODE_CASES))),
    (["--section", "forward", "--shape", "1,2,64,16,1"], (1, 0, 0)),
])
def test_bench_cases(argv, sizes, monkeypatch):
    seen = {}
    monkeypatch.setattr(cli, "bench", lambda args: seen.setdefault("args", args))
    cli.main(["bench", *argv])
    assert tuple(len(c) for c in cli._bench_cases(seen["args"])) == sizes


def test_long_sweep_holds_the_defaults():
    assert set(cli.DEFAULT_SHAPES) <= set(cli.LONG_SHAPES)
    assert set(cli.BACKWARD_SHAPES) <= set(cli.LONG_BACKWARD_SHAPES)
    assert set(cli.DECODE_CASES) <= set(cli.LONG_DECODE_CASES)


@pytest.mark.parametrize("n", [0, 1, 63, 64, 2 * 64 + 5, 10_000 + 17])
def test_stream_sum_reads_every_element(n):
    # Small integers: every partial sum is exact in float32, so any split over the threads
    # gives numpy's sum; a skipped or twice-read element, or a lost tail, would not.
    from cpuflash._cpu.stream import stream_sum
    x = np.arange(n, dtype=np.float32) % 7 + 1
    expected = float(x.astype(np.float64).sum())
    assert on_threads(lambda: stream_sum(x), (1, 2)) == [expected, expected]


def test_stream_reader_reads_the_bytes_it_reports():
    read, n_read = _measure.stream_reader(1 << 20)
    assert n_read == 1 << 20
    assert read() == n_read // 4  # a buffer of ones


def test_decode_steps_run_every_layer(monkeypatch):
    """``decode_step`` and ``torch_decode_step``: cold runs a model's worth of layers
    (``COLD_BYTES`` together), hot one; each layer of the cache holds the same K/V, so every
    layer's step is the attention of q over them."""
    q, k, v = _measure.make_qkv(1, 4, 64, 16, n_q=1, h_kv=2, seed=6)
    layer_bytes = _measure.step_bytes(k.shape, 16, "float32")
    monkeypatch.setattr(_measure, "COLD_BYTES", 3 * layer_bytes - 1)
    assert _measure.layers_for(layer_bytes, cold=True) == 3
    assert _measure.layers_for(layer_bytes, cold=False) == 1
    step, layers, nbytes, cache = _measure.decode_step(q, k, v, "float32", cold=True)
    assert (layers, nbytes) == (3, layer_bytes)
    step()
    want = reference.attention(q, k, v)
    for layer in range(layers):
        np.testing.assert_allclose(cache.attention(layer, q), want, atol=1e-6)
    calls = []
    t_step, t_layers = _measure.torch_decode_step(lambda *a: calls.append(a), q, k, v, True)
    t_step()
    assert t_layers == 3 and len(calls) == 3
    assert all(np.array_equal(c[1], k) and np.array_equal(c[2], v) for c in calls)
