"""Helpers and the kernels' parallel loops kept as optimized LLVM IR, without machine code
of their own.

Numba compiles every jitted function into a library of its own and finalizes it: it links in
the IR of the functions it calls, optimizes the module and turns it into machine code. A
kernel then links its helpers' optimized IR into its own module, optimizes and compiles that,
inlining them. The helpers' own machine code is never run: they have no wrapper for Python or
C (``_jit.Helper``), and a kernel runs the copies in its own module. So a helper's library is
finalized here without it (``finalize_as_ir``): linked and optimized as Numba does, which
gives the kernels the same IR to link, and so the same kernels, bit for bit. In Numba's disk
cache such a library is saved as that IR (``IR_KIND``), and loaded as it was saved.

Measured at stop 53 (Intel Xeon, empty caches, pairs of processes run at once on the two
cores, against the same code with helpers compiled to machine code): the first forward call
at N=2048 14.5-17.7 s against 17.0-18.3 s, faster in 6 of 6 pairs by 1.7 s on average; a
backward compiled in a second process that finds the forward's helpers in the disk cache
20.7-23.5 s against 21.1-25.5 s (3 of 3).

A kernel's parallel loop goes the same way (``parfors_as_ir``). Numba compiles a ``prange``
body into a function of its own, wraps it twice (a gufunc wrapper, then the wrapper that hands
it to the thread pool), each in a library of its own that links in the one before, and the
kernel links in the last: each of the four libraries was optimized and turned into machine
code with its own copy of the loop body (which holds nearly all of a kernel's code, its
helpers inlined), and only the kernel's copy ever ran. The three in between are finalized as
IR while ``Kernel`` compiles a kernel on this thread. Unlike the helpers' case, the kernel's
machine code is not the same as before (as we read it: MCJIT runs the code generator's IR
passes, loop strength reduction among them, on a module in place, and Numba linked those
rewritten modules upward; now the kernel's optimizer gets them as optimized, unrewritten).
The two wrappers are not optimized on their own either (``OPTIMIZE_WRAPPERS``): each such
pass ran LLVM's module optimization over the whole, already optimized loop body again (13.1 s
of 64 for the first forward, decode and backward calls together), and the kernel's own
optimization inlines and optimizes them anyway. Measured at stop 56 (Intel Xeon, empty
caches, alternating processes): first calls at N=2048 with the loops as IR, against Numba's
way (7 pairs; medians): forward 14.0 s against 16.8 (faster in 6 of 7 pairs), decode 22.7
against 31.7, backward 22.3 against 27.0 (7 of 7 each); then the wrappers unoptimized against
optimized (3 pairs): forward 11.1-13.6 s against 15.3-16.1, decode 17.8-21.9 against
23.7-27.1, backward 17.3-18.8 against 18.9-23.1 (3 of 3 each); the final code against
Numba's way (3 pairs): forward 10.0-10.5 s against 14.3-16.6, decode 15.3-16.3 against
24.8-27.7, backward 15.5-15.9 against 21.5-25.9 (3 of 3 each). The same bits in every output
compared (60 arrays: forward, backward and decode under 10 option sets, and the benchmark
shapes), and the same speed: both ways against Numba's in one process, 60 rounds alternating,
medians of the ratios 0.992-1.016 over the forward (N=2048, causal, N=512 D=128), the
backward and four decode steps.

Only the helpers registered here (``register``: by module and qualified name), and the
parallel loops of kernels compiled within ``parfors_as_ir``, are finalized this way;
everything else Numba compiles is untouched. The hooks replace three Numba internals
(``CPUContext.get_executable``, ``CPUCodeLibrary._unserialize``, ``JITCPUCodegen.set_env``),
wrap two (``build_gufunc_wrapper`` of ``numba.np.ufunc.parallel`` and of ``ufuncbuilder``) and
use a library's link list and final module; where a Numba version lacks them, none is
installed (``INSTALLED``) and helpers and loops are compiled as before. The helpers' hooks
were checked with the kernels' tests on numba 0.59.1, 0.64.0 and 0.68.1, the loops' on 0.59.1
and 0.68.1 (``.ci/run`` runs the oldest and the newest). Until stop 54 ``finalize_as_ir`` also
assumed ``_reload_init``, which libraries have only since numba 0.60: on 0.59 every first
compile failed.
"""
import contextlib
import threading

import llvmlite.binding as ll
from numba import _dynfunc
from numba.core import codegen, cpu
from numba.core.compiler_lock import require_global_compiler_lock
from numba.np.ufunc import parallel, ufuncbuilder

_REGISTERED = set()  # (module name, qualified name) of the helpers kept as IR
IR_KIND = "cpuflash-ir"  # how such a library is saved in Numba's disk cache
PARFOR_BODY = "__numba_parfor_gufunc_"  # how Numba names a prange body's function
PARFORS = True  # whether ``parfors_as_ir`` does anything (a switch for comparisons)
OPTIMIZE_WRAPPERS = False  # the loops' wrappers optimized before a kernel links them (a switch)
_compiling = threading.local()  # ``depth``: this thread's ``parfors_as_ir`` blocks


def register(fn):
    """Keep the helper ``fn``'s libraries as IR only (if ``INSTALLED``)."""
    _REGISTERED.add((fn.__module__, fn.__qualname__))


@contextlib.contextmanager
def parfors_as_ir():
    """Within this block, the libraries of the parallel loops this thread compiles are
    finalized as IR only (``Kernel``'s compilations of cpuflash's kernels; a user's own
    ``prange`` code, compiled elsewhere, is untouched)."""
    _compiling.depth = getattr(_compiling, "depth", 0) + 1
    try:
        yield
    finally:
        _compiling.depth -= 1


def _parfors_as_ir_here():
    return INSTALLED and PARFORS and getattr(_compiling, "depth", 0) > 0


def finalize_as_ir(library, optimize=True):
    """What ``CPUCodeLibrary.finalize`` does, less the machine code: link the libraries of the
    functions it calls into its module and, if ``optimize``, optimize it (the loops' wrappers
    are left unoptimized: ``OPTIMIZE_WRAPPERS``), for the kernels that link it in turn
    (``_get_module_for_linking``: for a helper the same IR as Numba's own finalization gives
    them, so the same kernels)."""
    require_global_compiler_lock()
    library._raise_if_finalized()
    seen = set()
    for linked in library._linking_libraries:
        if linked not in seen:
            seen.add(linked)
            if hasattr(library, "_reload_init"):  # Numba >= 0.60: the parent inherits it
                library._reload_init.update(linked._reload_init)
            library._final_module.link_in(linked._get_module_for_linking(), preserve=True)
    if optimize:
        library._optimize_final_module()
    library._finalized = True
    _cache_as_ir(library)


def _cache_as_ir(library):
    """Numba's disk cache saves a library as its object code; this one has none, and is saved
    as its optimized IR (``IR_KIND``; loaded by ``_unserialize``)."""
    library.serialize_using_object_code = lambda: (library.name, IR_KIND,
                                                   library._final_module.as_bitcode())


def _install():
    library_ok = all(hasattr(codegen.CPUCodeLibrary, name)
                     for name in ("_raise_if_finalized", "_get_module_for_linking",
                                  "_optimize_final_module", "_unserialize",
                                  "serialize_using_object_code"))
    if not (library_ok and hasattr(cpu.CPUContext, "get_executable")
            and hasattr(getattr(codegen, "JITCPUCodegen", None), "set_env")
            and hasattr(_dynfunc, "make_function")
            and callable(getattr(parallel, "build_gufunc_wrapper", None))
            and callable(getattr(ufuncbuilder, "build_gufunc_wrapper", None))):
        return False
    get_executable = cpu.CPUContext.get_executable
    unserialize = codegen.CPUCodeLibrary._unserialize.__func__

    def get_executable_or_ir(self, library, fndesc, env):
        """Numba's entry point to a compiled function (its Python wrapper), or, for a
        registered helper or a kernel's parallel loop body (``parfors_as_ir``), its library
        kept as IR (``finalize_as_ir``; a helper's already, if loaded from the disk cache) and
        an entry point with no code behind it (as any function without a Python wrapper has:
        ``_jit.Helper`` sends calls from Python elsewhere; nothing calls a loop body but its
        wrapper, linked into the kernel).
        Numba keys the function's implementation for its callers on that object, so each
        compilation gets one of its own."""
        if not ((fndesc.modname, fndesc.qualname) in _REGISTERED
                or fndesc.qualname.startswith(PARFOR_BODY) and _parfors_as_ir_here()):
            return get_executable(self, library, fndesc, env)
        if not library._finalized:
            finalize_as_ir(library)
        return _dynfunc.make_function(fndesc.lookup_module(), fndesc.qualname.split(".")[-1],
                                      f"IR-only helper {fndesc.qualname!r}", 0, env, (library,))

    def unserialize_ir(cls, codegen_, state):
        """A library from Numba's disk cache; one saved as IR (``_cache_as_ir``) is loaded as
        it was saved, finalized, without machine code."""
        name, kind, data = state
        if kind != IR_KIND:
            return unserialize(cls, codegen_, state)
        library = codegen_.create_library(name)
        library._final_module = ll.parse_bitcode(data)
        library._finalized = True
        _cache_as_ir(library)
        return library

    set_env = codegen.JITCPUCodegen.set_env

    def set_env_where_held(self, env_name, env):
        """Numba's pointer from a function's environment global to its environment object,
        written into the global's machine code; a helper kept as IR has none (its copies in
        the kernels get theirs when each kernel is compiled or loaded). Numba would write to
        address 0."""
        if self._engine.get_global_value_address(env_name):
            set_env(self, env_name, env)

    def as_ir(build):
        """Numba's ``build`` of a wrapper around a parallel loop's body, for a loop of a kernel
        compiled in ``parfors_as_ir``: the wrapper's library finalized as IR, unoptimized
        (``OPTIMIZE_WRAPPERS``), before anything links it in (Numba's
        ``add_linking_library`` would finalize it with machine code; it also finalizes what
        the wrapper links, so the inner wrapper is done by its own hook first). The body's
        own library is kept as IR by ``get_executable_or_ir``. Nothing takes these wrappers'
        addresses: the thread pool's wrapper calls the gufunc wrapper by name, and the kernel
        the thread pool's wrapper, each in its own module."""
        def build_as_ir(py_func, cres, sin, sout, cache, is_parfors):
            info = build(py_func, cres, sin, sout, cache, is_parfors)
            if is_parfors and _parfors_as_ir_here() and not info.library._finalized:
                finalize_as_ir(info.library, OPTIMIZE_WRAPPERS)
            return info

        return build_as_ir

    cpu.CPUContext.get_executable = get_executable_or_ir
    # the gufunc wrapper (inner), then the thread pool's wrapper, which calls the inner one
    ufuncbuilder.build_gufunc_wrapper = as_ir(ufuncbuilder.build_gufunc_wrapper)
    parallel.build_gufunc_wrapper = as_ir(parallel.build_gufunc_wrapper)
    codegen.CPUCodeLibrary._unserialize = classmethod(unserialize_ir)
    codegen.JITCPUCodegen.set_env = set_env_where_held
    return True


INSTALLED = _install()
