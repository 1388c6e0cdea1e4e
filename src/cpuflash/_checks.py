"""Argument checks. Each raises before any kernel runs, naming the argument, what was expected
and what was given."""
import math
import numbers

import numpy as np

FLOAT_DTYPES = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64))


def array(name, x, int8=False):
    """A float (or, for a K/V cache, int8) array of rank 2, 3 or 4."""
    if not isinstance(x, np.ndarray):
        raise TypeError(f"{name}: expected a numpy.ndarray, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES and not (int8 and x.dtype == np.int8):
        allowed = "float16, float32, float64 or int8 (with a scale)" if int8 else \
            "float16, float32 or float64"
        raise TypeError(f"{name}: expected dtype {allowed}, got {x.dtype}")
    if x.ndim not in (2, 3, 4):
        raise ValueError(f"{name}: expected 2-D (N, D), 3-D (H, N, D) or 4-D (B, H, N, D), "
                         f"got {x.ndim}-D with shape {x.shape}")
    return x


def same_dtype(**arrays):
    dtypes = {name: a.dtype for name, a in arrays.items()}
    if len(set(dtypes.values())) > 1:
        given = ", ".join(f"{n}={d}" for n, d in dtypes.items())
        raise TypeError(f"{', '.join(dtypes)}: expected one dtype, got {given} "
                        "(cast explicitly; cpuflash does not cast silently)")


def kv_cache_format(q, k, v, k_scale, v_scale, array_type=np.ndarray):
    """The dtypes of q, k, v. Either all one dtype, or K/V hold a cache in a storage format:
    float16 K/V with float32 q, or int8 K/V (with q float32 or float16) and per-token scales
    ``k_scale``, ``v_scale`` of shape ``k.shape[:-1]``, ``v.shape[:-1]`` (float32). Returns
    ``(k_scale, v_scale)`` as 3-D (B, Hkv, Nk) views for int8 (numpy; other ``array_type``s,
    the CUDA path's, as given), else None."""
    if k.dtype != v.dtype:
        raise TypeError(f"k, v: expected one dtype, got k={k.dtype}, v={v.dtype} "
                        "(cast explicitly; cpuflash does not cast silently)")
    scales_given = k_scale is not None or v_scale is not None
    if k.dtype != np.int8:
        if scales_given:
            raise TypeError(f"k_scale, v_scale: only for int8 k and v, got k {k.dtype}")
        if k.dtype != q.dtype and not (k.dtype == np.float16 and q.dtype == np.float32):
            same_dtype(q=q, k=k, v=v)  # raises, naming the dtypes
        return None
    if q.dtype not in (np.float32, np.float16):
        raise TypeError(f"q: expected float32 or float16 with an int8 K/V cache, got {q.dtype}")
    scales = []
    for name, x_scale, x in (("k_scale", k_scale, k), ("v_scale", v_scale, v)):
        if x_scale is None:
            raise TypeError(f"{name}: required with int8 k and v (K = k * k_scale[..., None])")
        if not isinstance(x_scale, array_type):
            kind = "numpy.ndarray" if array_type is np.ndarray else "GPU array like k"
            raise TypeError(f"{name}: expected a {kind}, got {type(x_scale).__name__}")
        if x_scale.dtype != np.float32:
            raise TypeError(f"{name}: expected dtype float32, got {x_scale.dtype}")
        if tuple(x_scale.shape) != tuple(x.shape[:-1]):
            raise ValueError(f"{name}: expected shape {tuple(x.shape[:-1])} (one scale per "
                             f"token and head), got {tuple(x_scale.shape)}")
        scales.append(x_scale.reshape((1,) * (4 - x.ndim) + x_scale.shape)
                      if isinstance(x_scale, np.ndarray) else x_scale)
    return tuple(scales)


def same_rank(**arrays):
    ranks = {name: a.ndim for name, a in arrays.items()}
    if len(set(ranks.values())) > 1:
        given = ", ".join(f"{n} is {r}-D" for n, r in ranks.items())
        raise ValueError(f"{', '.join(ranks)}: expected the same rank, got {given}")


def as_4d(x):
    """(N, D) -> (1, 1, N, D) and (H, N, D) -> (1, H, N, D), as views."""
    return x.reshape((1,) * (4 - x.ndim) + x.shape) if x.ndim < 4 else x


def qkv_shapes(q, k, v):
    """Check 4-D q/k/v against each other; returns (B, Hq, Hkv, Nq, Nk, D, Dv)."""
    n_b, n_hq, n_q, d = q.shape
    if k.shape[0] != n_b or v.shape[0] != n_b:
        raise ValueError(f"k, v: expected batch {n_b} as q, got k {k.shape[0]}, v {v.shape[0]}")
    _, n_hkv, n_k, dk = k.shape
    if dk != d:
        raise ValueError(f"k: expected head dim {d} as q, got {dk} (q {q.shape}, k {k.shape})")
    if v.shape[1] != n_hkv or v.shape[2] != n_k:
        raise ValueError(f"v: expected (heads, keys) = ({n_hkv}, {n_k}) as k, "
                         f"got ({v.shape[1]}, {v.shape[2]})")
    if (n_hkv == 0 and n_hq != 0) or (n_hkv and n_hq % n_hkv):
        raise ValueError(f"k: query heads ({n_hq}) must be a multiple of key/value heads "
                         f"({n_hkv}) for GQA/MQA")
    if d == 0 or v.shape[3] == 0:
        raise ValueError(f"q, v: head dims must be at least 1, got D={d}, Dv={v.shape[3]}")
    return n_b, n_hq, n_hkv, n_q, n_k, d, v.shape[3]


def is_real(x):
    """A real number (int, float, numpy scalar), bools excluded. Python's own int and float
    answer without the ``numbers`` ABC check, which costs microseconds on every call."""
    return type(x) in (float, int) or (not isinstance(x, (bool, np.bool_))
                                       and isinstance(x, numbers.Real))


def is_integer(x):
    """An integer (Python or numpy), bools excluded."""
    return type(x) is int or (not isinstance(x, (bool, np.bool_))
                              and isinstance(x, numbers.Integral))


def flag(name, x):
    if not isinstance(x, (bool, np.bool_)):
        raise TypeError(f"{name}: expected True or False, got {x!r}")
    return bool(x)


def scale(x, d):
    if x is None:
        return 1.0 / math.sqrt(d)
    if not is_real(x):
        raise TypeError(f"scale: expected a real number or None, got {type(x).__name__}")
    x = float(x)
    if not math.isfinite(x) or x == 0.0:
        raise ValueError(f"scale: expected a finite, nonzero number, got {x}")
    return x


def out_array(out, shape, dtype):
    if out is None:
        return None
    if not isinstance(out, np.ndarray):
        raise TypeError(f"out: expected a numpy.ndarray, got {type(out).__name__}")
    if out.shape != shape:
        raise ValueError(f"out: expected shape {shape}, got {out.shape}")
    if out.dtype != dtype:
        raise TypeError(f"out: expected dtype {dtype} (the dtype of q), got {out.dtype}")
    if not out.flags.writeable:
        raise ValueError("out: expected a writeable array, got a read-only one")
    return out


def matches(name, x, shape, dtype):
    """A saved or companion array must have exactly this shape and dtype."""
    if not isinstance(x, np.ndarray):
        raise TypeError(f"{name}: expected a numpy.ndarray, got {type(x).__name__}")
    if x.shape != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {x.shape}")
    if x.dtype != dtype:
        raise TypeError(f"{name}: expected dtype {np.dtype(dtype)}, got {x.dtype}")
