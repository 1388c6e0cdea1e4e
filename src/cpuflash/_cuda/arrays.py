"""GPU arrays in and out: anything with ``__cuda_array_interface__`` (numba device arrays, CuPy
arrays, torch CUDA tensors) is viewed in place as a numba device array, never copied; results
go back as the caller's kind where that costs no copy."""
import numpy as np

from .runtime import load, simulated


def is_gpu_array(x):
    """Whether ``x`` lives on the GPU (the simulator's fake device arrays count)."""
    if getattr(x, "__cuda_ndarray__", False):
        return True
    try:
        return hasattr(_detached(x), "__cuda_array_interface__")
    except (AttributeError, RuntimeError, TypeError):  # a CPU tensor's property raising
        return False


def _detached(x):
    # torch refuses __cuda_array_interface__ on tensors that require grad; the kernels only
    # read them (autograd is the caller's business: see attention_backward).
    if type(x).__module__.startswith("torch") and getattr(x, "requires_grad", False):
        return x.detach()
    return x


def device_view(x):
    """A numba device array over ``x``'s memory (no copy)."""
    if getattr(x, "__cuda_ndarray__", False):
        return x
    return load().as_cuda_array(_detached(x))


def as_4d(x):
    """(N, D) -> (1, 1, N, D), (H, N, D) -> (1, H, N, D): views of device arrays, any strides."""
    return as_nd(x, 4)


def as_nd(x, ndim):
    """``x`` with leading axes of length 1 up to ``ndim`` axes, as a view."""
    if x.ndim == ndim:
        return x
    lead = (1,) * (ndim - x.ndim)
    if simulated():
        return type(x)(x._ary.reshape(lead + x.shape))
    from numba.cuda.cudadrv.devicearray import DeviceNDArray
    outer = x.strides[0] * x.shape[0] if x.ndim else x.dtype.itemsize
    return DeviceNDArray(lead + x.shape, (outer,) * len(lead) + x.strides, x.dtype,
                         stream=x.stream, gpu_data=x.gpu_data)


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


def to_caller(x, kind):
    """A result (numba device array) as the caller's kind, zero-copy; numpy copies back."""
    if kind == "numpy":
        return x.copy_to_host()
    if kind == "torch" and not simulated():
        import torch
        return torch.as_tensor(x, device="cuda")
    if kind == "cupy" and not simulated():
        import cupy
        return cupy.asarray(x)
    return x
