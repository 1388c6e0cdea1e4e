"""Import numba.cuda on demand, with an error that says what to install."""
import functools

INSTALL_HINT = ('pip install "cpuflash[cuda]"  (NVIDIA\'s numba-cuda with the CUDA 12 '
                'toolkit wheels)')


_cuda = None  # numba.cuda once loaded (an attention call asks several times)


def load():
    """``numba.cuda`` from NVIDIA's numba-cuda package; ImportError with the install hint."""
    global _cuda
    if _cuda is not None:
        return _cuda
    import numpy as np
    if not hasattr(np, "row_stack"):
        # numba-cuda 0.30 registers an overload for np.row_stack when it first compiles;
        # numpy 2.5 removed that alias of vstack (seen on the H200 machine: AttributeError at
        # the first kernel compile). Restore the alias so the compile can proceed.
        np.row_stack = np.vstack
    try:
        import numba_cuda  # noqa: F401  (the maintained package, not Numba's deprecated copy)
        from numba import cuda
    except ImportError as e:
        raise ImportError(f"cpuflash: the CUDA path needs numba-cuda: {INSTALL_HINT}") from e
    _cuda = cuda
    return cuda


def require_device():
    """``numba.cuda`` with a usable GPU (or the simulator, ``NUMBA_ENABLE_CUDASIM=1``)."""
    cuda = load()
    if not cuda.is_available():
        raise RuntimeError("cpuflash: CUDA was asked for (a GPU array or device='cuda') but no "
                           "CUDA GPU is usable: check the NVIDIA driver; for tests without a "
                           f"GPU set NUMBA_ENABLE_CUDASIM=1. To install: {INSTALL_HINT}")
    return cuda


def simulated():
    """Whether numba-cuda's simulator runs the kernels (``NUMBA_ENABLE_CUDASIM=1``, read by
    numba's config at import)."""
    return bool(_numba_config().ENABLE_CUDASIM)


@functools.cache
def _numba_config():
    from numba.core import config  # an import statement per call is 2-3 us of import machinery
    return config


def context_handle():
    """The calling thread's current CUDA context as an int, read straight from the driver;
    made current through numba first where none is (0 only in the simulator). numba's
    ``current_context()``/``get_current_device()`` check and wrap it each time: 10-25 us a
    call on the H200 machine's host, three times per attention call before this."""
    if simulated():
        return 0
    driver = _driver()
    err, ctx = driver.cuCtxGetCurrent()
    handle = int(ctx) if err == driver.CUresult.CUDA_SUCCESS else 0
    if handle == 0:
        load().current_context()  # creates or pushes the device's primary context
        err, ctx = driver.cuCtxGetCurrent()
        handle = int(ctx)
    return handle


@functools.cache
def _driver():
    from cuda.bindings import driver
    return driver


_capabilities = {}


def device_capability():
    """``(major, minor)`` of the current CUDA device, looked up once per context."""
    key = context_handle()
    found = _capabilities.get(key)
    if found is None:
        found = _capabilities[key] = tuple(load().get_current_device().compute_capability)
    return found
