"""Bad input raises ValueError/TypeError naming the argument, before any kernel runs."""
import numpy as np
import pytest

import cpuflash
from conftest import rand

Q, K, V = rand((1, 4, 8, 16)), rand((1, 2, 10, 16)), rand((1, 2, 10, 8))


@pytest.mark.parametrize("args,kwargs,exc,words", [
    ((Q.tolist(), K, V), {}, TypeError, "q: expected a numpy.ndarray"),
    ((Q, K.astype(np.int32), V), {}, TypeError, "k: expected dtype"),
    ((Q, K, V.astype(np.complex64)), {}, TypeError, "v: expected dtype"),
    ((Q, K, V.astype(object)), {}, TypeError, "v: expected dtype"),
    ((Q, K.astype(np.float64), V), {}, TypeError, "k=float64"),
    ((Q[0, 0, 0], K, V), {}, ValueError, "q: expected 2-D"),
    ((Q[None], K[None], V[None]), {}, ValueError, "got 5-D"),
    ((Q[0], K, V), {}, ValueError, "same rank"),
    ((Q, rand((2, 2, 10, 16)), rand((2, 2, 10, 8))), {}, ValueError, "batch"),
    ((Q, rand((1, 3, 10, 16)), rand((1, 3, 10, 8))), {}, ValueError, "multiple of key/value heads"),
    ((Q, rand((1, 2, 10, 15)), V), {}, ValueError, "k: expected head dim 16"),
    ((Q, K, rand((1, 2, 11, 8))), {}, ValueError, "v: expected (heads, keys)"),
    ((rand((1, 4, 8, 0)), rand((1, 2, 10, 0)), V), {}, ValueError, "at least 1"),
    ((Q, K, V), {"scale": float("nan")}, ValueError, "scale"),
    ((Q, K, V), {"scale": 0.0}, ValueError, "scale"),
    ((Q, K, V), {"scale": "1"}, TypeError, "scale"),
    ((Q, K, V), {"causal": 1}, TypeError, "causal"),
    ((Q, K, V), {"return_lse": None}, TypeError, "return_lse"),
    ((Q, K, V), {"out": np.empty((1, 4, 8, 16), np.float32)}, ValueError, "out: expected shape"),
    ((Q, K, V), {"out": np.empty((1, 4, 8, 8), np.float64)}, TypeError, "out: expected dtype"),
    ((Q, K, V), {"out": [0.0]}, TypeError, "out: expected a numpy.ndarray"),
    ((Q, K, V), {"device": "gpu"}, ValueError, "device: expected None, 'cpu' or 'cuda'"),
    ((Q, K.astype(np.int8), V.astype(np.int8)),
     {"k_scale": [1.0], "v_scale": np.ones((1, 2, 10), np.float32)}, TypeError,
     "k_scale: expected a numpy.ndarray"),
])
def test_bad_input(args, kwargs, exc, words):
    with pytest.raises(exc, match=words.replace("(", r"\(").replace(")", r"\)")):
        cpuflash.attention(*args, **kwargs)


def test_read_only_out():
    out = np.empty((1, 4, 8, 8), np.float32)
    out.flags.writeable = False
    with pytest.raises(ValueError, match="out: expected a writeable"):
        cpuflash.attention(Q, K, V, out=out)


@pytest.mark.parametrize("n,exc", [(0, ValueError), (10**6, ValueError), (1.5, TypeError),
                                   (True, TypeError)])
def test_bad_thread_count(n, exc):
    with pytest.raises(exc, match="n: expected"):
        cpuflash.set_num_threads(n)
