"""Import numba.cuda on demand, with an error that says what to install."""

INSTALL_HINT = ('pip install "cpuflash[cuda]"  (NVIDIA\'s numba-cuda with the CUDA 12 '
                'toolkit wheels)')


def load():
    """``numba.cuda`` from NVIDIA's numba-cuda package; ImportError with the install hint."""
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
    from numba import config
    return bool(config.ENABLE_CUDASIM)


_capabilities = {}


def device_capability():
    """``(major, minor)`` of the current CUDA device, looked up once per device."""
    cuda = load()
    device = cuda.get_current_device()
    found = _capabilities.get(device.id)
    if found is None:
        found = _capabilities[device.id] = tuple(device.compute_capability)
    return found
