"""Kernel launches straight to the driver, on the caller's stream.

A numba kernel launch (``kernel[grid, block, stream](*args)``) types and wraps every argument
on each call: 0.30 ms of host time per forward call on the H200 machine with eleven
arguments, half of a 0.65 ms kernel at N=1024. The kernels here are compiled once for one
signature each (``tiles.signature``), so the argument words can be laid out directly, the way
numba lays them out (``numba.cuda.dispatcher._Kernel._prepare_args``): an array of any layout
is ``meminfo, parent, size, itemsize, data, shape..., strides...`` (strides in bytes), an
int64 or float32 scalar one word of its C type.

The simulator runs the numba launch instead (its kernels are Python).
"""
import ctypes

import numpy as np

from .arrays import GpuArray
from .runtime import load, simulated


class Launcher:
    """``Launcher(kernel, dynamic_bytes)(grid, block, stream, *args)``: launch the compiled
    numba ``kernel`` (one signature) on the raw ``stream`` handle (None: the default stream)
    with ``GpuArray``s and Python scalars, and ``dynamic_bytes`` of dynamic shared memory (its
    ``cuda.shared.array(0, ...)``)."""

    def __init__(self, kernel, dynamic_bytes=0):
        self.dispatcher = kernel
        self.dynamic_bytes = dynamic_bytes
        self._compiled = None
        self._configs = {}  # (grid, block) -> LaunchConfig: made once, not per call

    def _kernel(self):
        if self._compiled is None:
            from numba.core import types
            (compiled,) = self.dispatcher.overloads.values()
            kinds = []
            for ty in compiled.argument_types:
                if isinstance(ty, types.Array):
                    kinds.append((ty.ndim, np.dtype(str(ty.dtype))))
                elif ty == types.float32:
                    kinds.append(ctypes.c_float)
                elif ty == types.int64:
                    kinds.append(ctypes.c_int64)
                else:  # pragma: no cover - the kernels take no other kinds
                    raise TypeError(f"no direct launch for arguments of type {ty}")
            from cuda.core import LaunchConfig, launch
            function = compiled._codelibrary.get_cufunc()
            if self.dynamic_bytes > 48 * 1024:  # past the default limit: raise it, once
                from numba.cuda.cudadrv.driver import binding, driver
                attr = binding.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
                driver.cuKernelSetAttribute(attr, self.dynamic_bytes, function.handle,
                                            function.device.id)
            self._compiled = function.kernel, kinds, (LaunchConfig, launch)
        return self._compiled

    def __call__(self, grid, block, stream, *args):
        if simulated():
            launch = self.dispatcher[grid, block, 0, self.dynamic_bytes]
            launch(*(a.owner if isinstance(a, GpuArray) else a for a in args))
            return
        kernel, kinds, (make_config, launch) = self._kernel()
        if len(args) != len(kinds):
            raise TypeError(f"kernel takes {len(kinds)} arguments, got {len(args)}")
        words = []
        for arg, kind in zip(args, kinds):
            if isinstance(kind, tuple):  # an array: checked, since nothing else checks it here
                if arg.ndim != kind[0] or arg.dtype != kind[1]:
                    raise TypeError(f"kernel argument: expected a {kind[0]}-D {kind[1]} array, "
                                    f"got {arg.ndim}-D {arg.dtype}")
                words += [0, 0, arg.size, arg.dtype.itemsize, arg.ptr, *arg.shape,
                          *arg.strides]
            else:
                words.append(kind(arg))
        grid = tuple(grid) if isinstance(grid, tuple) else (grid,)
        config = self._configs.get((grid, block))
        if config is None:
            if len(self._configs) >= 256:
                self._configs.clear()
            config = self._configs[grid, block] = make_config(grid=grid, block=block,
                                                              shmem_size=self.dynamic_bytes)
        launch(core_stream(stream), config, kernel, *words)


def compiled(fn, signature, dynamic_bytes=0):
    """A ``Launcher`` of ``fn`` compiled for ``signature`` (``dynamic_bytes`` of dynamic shared
    memory a launch); kept in numba-cuda's disk cache
    where ``fn`` has a source file for it (``codegen.build``), so a new process loads the
    kernel instead of compiling it again (about 20 s per kernel on the H200 machine)."""
    cache = bool(getattr(fn, "cacheable", False)) and not simulated()
    return Launcher(load().jit(signature, cache=cache)(fn), dynamic_bytes)


_streams = {}


def core_stream(handle):
    """The cuda.core stream for a raw handle (None or 0: the default stream), made once."""
    handle = handle or 0
    found = _streams.get(handle)
    if found is None:
        load()
        from numba.cuda.cudadrv.driver import ExperimentalStream
        found = _streams[handle] = ExperimentalStream.from_handle(handle)
    return found
