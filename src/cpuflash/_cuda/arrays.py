"""GPU arrays in and out: anything with ``__cuda_array_interface__`` (numba device arrays, CuPy
arrays, torch CUDA tensors) is read in place, never copied; results go back as the caller's
kind where that costs no copy.

Inside, an array is a ``GpuArray``: its pointer, shape, strides, dtype and stream, read from
the interface, plus the object that owns the memory. No numba device array is made per call:
each costs 15-60 us of driver and context checks on the H200 machine's host, several per call.

Streams: an array keeps the stream its producer named (the interface's ``stream``: CuPy names
its current stream; for torch tensors, torch's current stream, which its interface does not
name), and the kernels are launched on it (``launch.Launcher``), so
they are ordered after the caller's earlier work and before its later work without any wait on
the host. Results and scratch come from the caller's own allocator (``empty``: torch's and
CuPy's caching allocators are stream-ordered on that same stream), not from ``cudaMalloc``/
``cudaFree``, whose free waits for the whole device.

Measured on the H200, B=4, H=16, N=1024, D=64, float32 torch tensors (kernel 0.65 ms): with
numba device arrays and a host sync per input, 1.42 ms per call and 1.18 ms of host time;
without the syncs, 0.97 ms and 0.29 ms; with ``GpuArray`` and ``launch.Launcher``, see the
README.
"""
import math

import numpy as np

from .runtime import context_handle, load, simulated


class GpuArray:
    """A GPU array as the kernels take it. ``strides`` in bytes; ``stream``: the raw handle
    its producer named (None: none named); ``owner``: keeps the memory alive; in the
    simulator, a numba array of this shape that the kernels are given instead."""
    __slots__ = ("ptr", "shape", "strides", "dtype", "stream", "owner")

    def __init__(self, ptr, shape, strides, dtype, stream, owner):
        self.ptr, self.shape, self.strides = ptr, shape, strides
        self.dtype, self.stream, self.owner = dtype, stream, owner

    @property
    def ndim(self):
        return len(self.shape)

    @property
    def size(self):
        return math.prod(self.shape)

    def copy_to_host(self):
        """A numpy copy (the result of a call with numpy inputs)."""
        return self.owner.copy_to_host()


def is_gpu_array(x):
    """Whether ``x`` lives on the GPU (the simulator's fake device arrays count)."""
    if getattr(x, "__cuda_ndarray__", False):
        return True
    if _is_torch(x):  # the interface would be built just to be tested; it refuses sparse ones
        return bool(x.is_cuda) and not x.is_sparse
    try:
        return hasattr(_detached(x), "__cuda_array_interface__")
    except (AttributeError, RuntimeError, TypeError):  # a CPU tensor's property raising
        return False


def _is_torch(x):
    return type(x).__module__.startswith("torch") and hasattr(x, "data_ptr")


def _detached(x):
    # torch refuses __cuda_array_interface__ on tensors that require grad; the kernels only
    # read them (autograd is the caller's business: see attention_backward).
    if type(x).__module__.startswith("torch") and getattr(x, "requires_grad", False):
        return x.detach()
    return x


def _c_strides(shape, itemsize):
    strides, step = [], itemsize
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def view(x):
    """``x`` (a GPU array of any kind) as a ``GpuArray``, in place, with no host sync."""
    if getattr(x, "__cuda_ndarray__", False) and simulated():
        return GpuArray(0, tuple(x.shape), tuple(x.strides), np.dtype(x.dtype), None, x)
    if _is_torch(x) and not simulated() and x.is_cuda:
        found = _torch_view(x)
        if found is not None:
            return found
    desc = _detached(x).__cuda_array_interface__
    if desc.get("mask") is not None:
        raise NotImplementedError("masked GPU arrays (a __cuda_array_interface__ mask) are not "
                                  "supported")
    if simulated():
        dev = load().as_cuda_array(x)
        return GpuArray(0, tuple(dev.shape), tuple(dev.strides), np.dtype(dev.dtype), None, dev)
    shape = tuple(desc["shape"])
    dtype = np.dtype(desc["typestr"])
    strides = desc.get("strides")
    strides = tuple(strides) if strides is not None else _c_strides(shape, dtype.itemsize)
    return GpuArray(desc["data"][0], shape, strides, dtype, desc.get("stream"), x)


def _torch_view(x):
    """The ``GpuArray`` that torch's ``__cuda_array_interface__`` describes, read from the
    tensor's own attributes (the interface is a dict built in Python: about 10 us a call,
    ten calls per attention call before this), with torch's current stream on the tensor's
    device, where a torch op would run (torch's interface, version 2, names no stream); None
    for dtypes the kernels never take."""
    dtype = _TORCH_DTYPES.get(str(x.dtype))
    if dtype is None or x.is_sparse:
        return None
    shape = tuple(x.shape)
    if x.is_contiguous():  # the interface omits the strides then
        strides = _c_strides(shape, dtype.itemsize)
    else:
        strides = tuple(s * dtype.itemsize for s in x.stride())
    return GpuArray(x.data_ptr() if x.numel() else 0, shape, strides, dtype,
                    torch_stream(x.get_device()), x)


def torch_stream(index):
    """The raw handle of torch's current stream on CUDA device ``index``. Through torch's own
    raw-handle accessor where there is one (what torch's compiled code calls): about 1 us,
    against 12 us for ``torch.cuda.current_stream(device).cuda_stream``, which an attention
    call made five times (measured on the H200 machine's host)."""
    import torch
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return raw(index)
    return torch.cuda.current_stream(index).cuda_stream


_TORCH_DTYPES = {f"torch.{name}": np.dtype(name)
                 for name in ("float16", "float32", "float64", "bool")}
_NAMES = {x.char: x.name for x in _TORCH_DTYPES.values()}  # numpy's dtype.name is slow Python


def as_4d(x):
    """(N, D) -> (1, 1, N, D), (H, N, D) -> (1, H, N, D): views, any strides."""
    return as_nd(x, 4)


def as_nd(x, ndim):
    """The ``GpuArray`` ``x`` with leading axes of length 1 up to ``ndim`` axes, as a view."""
    if x.ndim == ndim:
        return x
    lead = (1,) * (ndim - x.ndim)
    outer = x.strides[0] * x.shape[0] if x.ndim else x.dtype.itemsize
    owner = x.owner
    if simulated():
        owner = type(owner)(owner._ary.reshape(lead + x.shape))
    return GpuArray(x.ptr, lead + x.shape, (outer,) * len(lead) + x.strides, x.dtype, x.stream,
                    owner)


def kind_of(x):
    """'torch', 'cupy', 'numba' or 'numpy': what results are returned as."""
    module = type(x).__module__
    if isinstance(x, np.ndarray):
        return "numpy"
    if module.startswith("torch"):
        return "torch"
    if module.startswith("cupy"):
        return "cupy"
    return "numba"


def empty(shape, dtype, like):
    """A new GPU array of ``shape`` and ``dtype`` on the device of ``like`` (the caller's
    first input): ``(as the caller gets it, GpuArray)``. From torch's or CuPy's caching
    allocator for their arrays (no ``cudaMalloc``, and no ``cudaFree`` later that waits for
    the device), else numba's."""
    kind = kind_of(like)
    dtype = np.dtype(dtype)
    if kind == "torch" and not simulated():
        import torch
        made = torch.empty(shape, dtype=getattr(torch, _NAMES[dtype.char]), device=like.device)
        # new, so C-contiguous: described here, as ``_torch_view`` would from the tensor
        return made, GpuArray(made.data_ptr() if made.numel() else 0, tuple(shape),
                              _c_strides(tuple(shape), dtype.itemsize), dtype,
                              torch_stream(made.get_device()), made)
    elif kind == "cupy" and not simulated():
        import cupy
        with like.device:
            made = cupy.empty(shape, dtype=dtype)
    else:
        made = load().device_array(shape, dtype=dtype)
    return made, view(made)


_uploaded = {}
MAX_UPLOADED = 64


def uploaded(x):
    """A device copy of the small host array ``x`` (kv_lens, ALiBi slopes: B or B*H values),
    as a ``GpuArray``, made once per content and context and kept: the kernels only read it,
    and a copy per call is a synchronous upload that waits for the GPU."""
    cuda = load()
    key = (x.dtype.str, x.shape, x.tobytes(), context_handle())
    found = _uploaded.get(key)
    if found is None:
        if len(_uploaded) >= MAX_UPLOADED:
            _uploaded.pop(next(iter(_uploaded)))
        found = _uploaded[key] = view(cuda.to_device(np.ascontiguousarray(x)))
    return found

