"""The one place that builds every jitted kernel, with the same flags.

* ``fastmath``: contraction into FMA only. ``nnan``/``ninf`` stay off: masked scores are
  ``-inf`` and input NaNs must reach the output. ``arcp`` stays off: the final ``acc / l`` is
  a true division (measured: 15 % lower error than multiplying by ``1 / l``).
* One compilation per dtype combination of the arguments, not per array layout or flag
  (``Kernel``).
* ``cache=True``, with two repairs to Numba's cache:
  - Numba checks only the modification stamp of the file that defines a kernel, so a change in a
    helper module (``simd.py``, say) would leave a stale kernel in the cache. Every kernel here
    is stamped with a hash of all kernel sources, the tile configuration and Numba's version.
  - Numba keeps one stamp per kernel's index file, and a process with another stamp empties
    it: a process with other tile shapes (``CPUFLASH_SIMD``, another host sharing the cache
    directory) threw away the host's kernels, and the next process compiled them all again
    (measured after the test suite, whose AVX2-shapes test runs such a process: 22 s for the
    first call of ``cpuflash bench`` in place of 0.44). The files' names now carry a hash of
    the tile configuration (``CONFIG_TAG``): each configuration has its own, and a change of
    the sources still overwrites them.
  - Numba's save of a cache entry reads the index, takes the first free data-file number for
    a new signature and writes both files; two processes saving new signatures of one function
    at once (``cpuflash warmup``'s, or a user's worker processes) can both take number 1, and
    the index of one can then name the other's data: another signature's machine code, loaded
    the next time. Every save here holds an exclusive lock on one file of the cache directory
    (``_lock_saves``; POSIX ``flock``, where there is none saves stay unlocked and
    ``warmup`` runs one process at a time).
  - Where no cache location is writable, Numba raises at decoration time; we fall back to
    compiling in memory instead of breaking ``import cpuflash``.
"""
import hashlib
import inspect
import os
import pathlib
import threading
import types as pytypes
import warnings

import numba
import numpy as np
from numba.core import types
from numba.core.registry import CPUDispatcher

from .. import config
from . import _ir_only

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX
    fcntl = None

FASTMATH = {"contract"}
SAVES_LOCKED = fcntl is not None  # whether cache saves are serialized across processes
LOCK_NAME = "cpuflash-cache.lock"


def _sources_stamp():
    digest = hashlib.sha256()
    here = pathlib.Path(__file__).parent
    for path in sorted(here.glob("*.py")) + [here.parent / "config.py"]:
        digest.update(path.read_bytes())
    digest.update(repr(sorted(config.describe().items())).encode())
    digest.update(numba.__version__.encode())
    return ("cpuflash", digest.hexdigest())


SOURCES_STAMP = _sources_stamp()
CONFIG_TAG = hashlib.sha256(repr(sorted(config.describe().items())).encode()).hexdigest()[:8]
cache_fallbacks = []  # names of kernels compiled without a cache, for `cpuflash info`
_COMPILING = threading.Lock()  # Kernel's compilations


def _jit(fn, **flags):
    if config.CACHE_ENABLED:
        try:
            dispatcher = numba.njit(cache=True, **flags)(fn)
        except Exception as exc:  # no writable cache location: compile in memory
            if fn.__name__ not in cache_fallbacks:  # (a Kernel makes two dispatchers)
                cache_fallbacks.append(fn.__name__)
                warnings.warn(f"cpuflash: Numba cache unavailable ({exc}); kernels compile per "
                              "process", RuntimeWarning, stacklevel=3)
        else:
            cache = getattr(dispatcher, "_cache", None)
            cache_file = getattr(cache, "_cache_file", None)
            if cache_file is not None and hasattr(cache_file, "_source_stamp"):
                cache_file._source_stamp = SOURCES_STAMP
                _name_by_config(cache_file)
                _lock_saves(cache_file)
            return dispatcher
    return numba.njit(cache=False, **flags)(fn)


def _name_by_config(cache_file):
    """Numba's index and data file names of a kernel (``<base>.nbi``, ``<base>.<n>.nbc``) with
    ``CONFIG_TAG`` in ``<base>``; left as they are where Numba names them otherwise."""
    index = getattr(cache_file, "_index_name", None)
    pattern = getattr(cache_file, "_data_name_pattern", None)
    if not (isinstance(index, str) and index.endswith(".nbi") and isinstance(pattern, str)
            and pattern.startswith(index[:-4])):
        return
    base = f"{index[:-4]}.{CONFIG_TAG}"
    cache_file._index_name = f"{base}.nbi"
    cache_file._index_path = str(pathlib.Path(cache_file._cache_path) / cache_file._index_name)
    cache_file._data_name_pattern = base + pattern[len(index) - 4:]


def lock_path(cache_file):
    """The lock file of ``cache_file``'s directory (see ``_lock_saves``)."""
    return os.path.join(cache_file._cache_path, LOCK_NAME)


def _lock_saves(cache_file):
    """``cache_file.save`` (Numba's read of the index, choice of a data file, writes) made
    whole across processes: it runs holding an exclusive ``flock`` on ``lock_path``."""
    if not SAVES_LOCKED or not hasattr(cache_file, "save"):
        return
    save = cache_file.save

    def locked_save(key, data):
        with open(lock_path(cache_file), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                return save(key, data)
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    cache_file.save = locked_save


class Kernel:
    """A jitted function called from Python, compiled once per dtype combination of its
    arguments. Numba specializes on each argument's exact type: a C-contiguous array and a
    strided view of it are two types, and so are a writeable and a read-only array, or an
    int64 and a uint64; every new combination is a compilation of the whole kernel, 4-25 s
    each for the kernels here (measured in the test suite: the forward kernel compiled six
    times, the backward and decode kernels five times each, mostly for the layouts and
    dtypes of masks and of the caller's q). So the dispatcher's own compilation is off; for a
    call that matches no specialization a second dispatcher of the same function (the same
    cache files) compiles the canonical signature of its arguments (those
    named in ``strided`` as arrays of any layout, those in ``strided`` or ``read_only`` as
    read-only, integers as int64, floats as float64), and Numba converts every later call's
    arguments to the specialization they match (a C array passes as one of any layout, a
    writeable one as read-only: safe conversions, no copy; a dispatch costs 0.36 us either
    way). Arrays of different dtypes never convert, so each dtype combination still gets its
    own machine code. With compilation off Numba would also convert a float to an integer
    argument (truncating it), so a float where every specialization takes an integer raises
    TypeError instead."""

    def __init__(self, dispatcher, compiler, strided=(), read_only=(), parallel=True):
        self.dispatcher = dispatcher
        self.options = dict(strided=strided, read_only=read_only, parallel=parallel)
        self.compiler = compiler  # compiles (and caches) for ``dispatcher``, which does not
        self.py_func = dispatcher.py_func
        self.__name__, self.__doc__ = self.py_func.__name__, self.py_func.__doc__
        names = list(inspect.signature(self.py_func).parameters)
        unknown = (set(strided) | set(read_only)) - set(names)
        assert not unknown, f"{self.__name__}: no arguments {sorted(unknown)}"
        self._strided = {names.index(n) for n in strided}
        self._read_only = {names.index(n) for n in read_only} | self._strided
        self._names = names
        self._integers = ()  # positions where every specialization takes an integer
        # Off for good: this dispatcher runs only what ``compiler`` compiled. (Switched on
        # around a compilation, it raced: another thread's call in that window compiled too
        # and found it off again, RuntimeError "compilation disabled", seen with four threads'
        # first calls. numba's disable_compile() wants a signature first.)
        dispatcher._can_compile = False

    def canonical(self, args):
        """The signature compiled for a call with ``args``."""
        sig = []
        for i, arg in enumerate(args):
            ty = numba.typeof(arg)
            if isinstance(ty, types.Array):
                if i in self._strided:
                    ty = ty.copy(layout="A")
                if i in self._read_only:
                    ty = ty.copy(readonly=True)
            elif isinstance(ty, types.Integer):
                ty = types.int64
            elif isinstance(ty, types.Float):
                ty = types.float64
            sig.append(ty)
        return tuple(sig)

    def _check_integers(self, args):
        for i in self._integers:
            # ``type is int`` first: the kernels' integers are Python ints but for a few numpy
            # ones, and the isinstance test costs 0.2 us an argument (the decode kernel has 20)
            if type(args[i]) is not int and isinstance(args[i], (float, np.floating)):
                raise TypeError(f"{self.__name__}: argument {self._names[i]!r} is a float, "
                                "where the kernel takes an integer")

    def __call__(self, *args):
        self._check_integers(args)
        return self.call_built(args)

    def call_built(self, args):
        """``self(*args)`` for an argument list the package built itself, whose integers are
        ints already (``decode.StepPlan``'s): without the check of every integer argument
        (about 1 us of a 15 us decode step at Nk=64)."""
        try:
            return self.dispatcher(*args)
        except TypeError as exc:
            if not str(exc).startswith("No matching definition"):
                raise
        return self._compile_and_call(args)

    def _compile_and_call(self, args):
        sig = self.canonical(args)
        with _COMPILING:  # threads' first calls at once: compiled once
            if sig not in self.dispatcher.overloads:
                with _ir_only.parfors_as_ir():  # its parallel loops kept as IR (_ir_only)
                    self.compiler.compile(sig)  # or loaded from the cache
                self.dispatcher.add_overload(self.compiler.overloads[sig])
        compiled = self.dispatcher.signatures
        self._integers = tuple(i for i in range(len(args))
                               if all(isinstance(types_[i], types.Integer) for types_ in compiled))
        self._check_integers(args)
        return self.dispatcher(*args)


def kernel(fn=None, *, strided=(), read_only=(), parallel=True):
    """A kernel called from Python (``Kernel``): ``prange`` inside unless ``parallel=False``;
    ``strided``, ``read_only``: names of array arguments it takes in any layout, and only
    reads."""
    if fn is None:
        return lambda f: kernel(f, strided=strided, read_only=read_only, parallel=parallel)
    # No C-callable (cfunc) wrapper: nothing takes a kernel's address (see ``helper``).
    flags = dict(parallel=True, nogil=True, fastmath=FASTMATH, error_model="numpy",
                 no_cfunc_wrapper=True)
    if not parallel:
        del flags["parallel"]
    return Kernel(_jit(fn, **flags), _jit(fn, **flags), strided, read_only, parallel)


def renamed(fn, suffix, **globals_):
    """The function ``fn`` once more, as ``<name>_<suffix>`` (its own cache files), the same code
    object with a copy of its module's globals updated by ``globals_``: make it after everything
    ``fn`` calls is defined."""
    twin = pytypes.FunctionType(fn.__code__, dict(fn.__globals__, **globals_),
                                f"{fn.__name__}_{suffix}", fn.__defaults__, fn.__closure__)
    twin.__qualname__ = f"{fn.__qualname__}_{suffix}"
    twin.__doc__, twin.__module__ = fn.__doc__, fn.__module__
    return twin


def portable_twin(kern):
    """The kernel ``kern`` once more, with its module's global ``PORTABLE`` (False in the
    module) True: the portable pure-Numba fallback as a kernel of its own.

    A kernel reads ``PORTABLE`` as a compile-time constant: Numba prunes ``if PORTABLE:``
    branches before typing, and the helpers it calls get the flag as a constant that LLVM folds
    once they are inlined, so each kernel holds one path's code only. (As a run-time argument
    both paths were compiled into every kernel: the first SIMD forward call compiled in
    19-22 s against 16.5-18.5 s this way, alternating processes on empty caches, stop 29, both
    sides then without the helpers' Python wrappers; the final code: 18.0-19.2 s, against
    24.4 s before this and the dropped cfunc wrappers.) The twin is ``renamed``: the same code
    object under ``<name>_portable``."""
    return kernel(renamed(kern.py_func, "portable", PORTABLE=True), **kern.options)


# The flags of every serial helper (``helper``, ``micro_helper``): compiled without the
# wrappers that make a function callable from C or from Python (``Helper``).
HELPER_FLAGS = dict(nogil=True, fastmath=FASTMATH, error_model="numpy", no_cfunc_wrapper=True,
                    no_cpython_wrapper=True)


class Helper(CPUDispatcher):
    """The dispatcher of a helper: compiled for the kernels that call it, without the wrapper
    that converts Python objects to its arguments and back, which nothing of the kernels calls.
    Numba compiles a helper once per combination of literal arguments (see ``helper``), 72
    libraries for the first forward call, and each wrapper cost its share of LLVM's work:
    measured at stop 53 (Intel Xeon, cold forward N=2048 compiles, pairs run at once on the two
    cores, 11 pairs), 14.7-18.7 s without the wrappers against 15.9-20.0 s with them, faster
    in 10 of 11 pairs by 1.3 s on average.

    A call from Python would run the missing wrapper (a crash); here it goes to a twin made on
    the first such call (``renamed``: ``<name>_py``, its own cache files, compiled with the
    wrapper), so that tests and benchmarks can call helpers as before."""

    def __call__(self, *args, **kwargs):
        twin = self.__dict__.get("_python_twin")
        if twin is None:
            flags = {k: v for k, v in HELPER_FLAGS.items() if k != "no_cpython_wrapper"}
            if self.targetoptions.get("inline") is not None:
                flags["inline"] = self.targetoptions["inline"]
            twin = self.__dict__.setdefault("_python_twin",
                                            _jit(renamed(self.py_func, "py"), **flags))
        return twin(*args, **kwargs)


def _helper_jit(fn, **flags):
    if _ir_only.INSTALLED:
        _ir_only.register(fn)
    dispatcher = _jit(fn, **flags)
    dispatcher.__class__ = Helper  # the same object and layout; calls from Python go to a twin
    return dispatcher


def helper(fn):
    """A serial helper called from kernels. Numba types a constant argument as a literal
    (``f(s, 0, True)`` as ``Literal[int](0)``, ``Literal[bool](True)``) and compiles a helper
    once per combination of literal values. That costs compilations (126 instead of 102 for
    the first forward, decode and backward calls), but typing the calls with the plain types
    instead made the kernels 10-20 % slower (stop 27, alternating processes, forward N=2048
    D=64 67-75 ms against 80-90 ms, float32 decode 1.8-2.9 against 2.6-3.3 ms): the constant
    ``portable``/``accumulate`` flags then no longer specialize the helpers. Kept as it is.

    Helpers are compiled without the wrapper that makes a function callable from C (nothing
    takes their address), nor the one for Python (``Helper``: a call from Python, as the tests
    make, goes to a twin compiled with it)."""
    return _helper_jit(fn, **HELPER_FLAGS)


def inlined_helper(fn):
    """A helper inlined into every caller by Numba itself (``inline="always"``). A view that a
    kernel makes and passes to a helper (a row of Q, ``q[b, h, row]``) costs two atomic
    operations on its reference count, the view's own; once the helper's body is the
    caller's, Numba's reference-count pass drops them. A helper that is called takes its own
    reference to each array argument on entry and gives it back on return, two more atomic
    operations an array a call, which stay wherever its body calls another function.
    ``tiles.scale_row``, called for each query row: a 16-token prompt's task (16 rows, one
    tile) spent about 0.4 us of its 2.8 in such operations (stop 65, ``bench/cpu_profile.py``).
    ``forward.band_scores`` and ``tiles.tile_product_max``, called for each tile, took 22 a
    tile: inlined, the forward at N=2048, causal N=2048 and N=512 D=128 took 0.981-0.992x the
    time (stop 65, four blocks of 60 calls alternating in one process, the order reversed
    every other block). The products they call stay functions of their own."""
    return _helper_jit(fn, inline="always", **HELPER_FLAGS)


def micro_helper(fn):
    """A helper that only picks and calls a register-blocked micro-kernel (``tiles.py``'s
    dispatches): inlined into every caller by Numba itself (``inline="always"``), so the tile
    loop that calls it once per micro-tile holds the micro-kernel's code. Left to LLVM, a
    micro-kernel that sums in partial sums was too large to inline: each micro-tile became a
    call with some 20 arguments passed on the stack, and the tile products lost 2-6 %
    (stop 43, Zen 4, one core, a hot 128 x 128 tile at D=64, ``bench/cpu_tile_products.py``:
    S = Q K^T 19.72 -> 18.63 us, P V 18.62 -> 18.24 us)."""
    return inlined_helper(fn)
