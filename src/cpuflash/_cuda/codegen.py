"""Kernel source with the register tiles written out as scalars.

numba.cuda has no ``#pragma unroll``, and NVVM leaves loops over a ``cuda.local.array`` rolled
once their body grows past its threshold: the tile then lives in local memory (measured in the
PTX of a first version: 37-77 ``ld/st.local``). So each kernel is a template whose register-
tile statements are written once per element (``s_0_0 = ...; s_0_1 = ...``) for its tile
shape, and compiled from that text. ``rep`` writes such a block, ``expand`` puts blocks into a
template at lines ``@name``, and ``build`` turns the text into a Python function (kept in
``linecache`` so tracebacks and the simulator show the generated lines).
"""
import hashlib
import itertools
import linecache
import os

import numpy as np


def rep(fmt, **ranges):
    """One line per point of the product of ``ranges`` (name -> count), in the given order;
    each name's value, and ``name8 = 8 * value``, fill ``fmt``."""
    names = list(ranges)
    lines = []
    for point in itertools.product(*(range(ranges[n]) for n in names)):
        values = dict(zip(names, point))
        values.update({f"{n}8": 8 * x for n, x in values.items()})
        lines.append(fmt.format(**values))
    return lines


def join(*blocks):
    return [line for block in blocks for line in block]


def expand(template, **blocks):
    """Replace each line ``<indent>@name`` of ``template`` by ``blocks[name]``, indented."""
    out = []
    for line in template.splitlines():
        stripped = line.strip()
        if stripped.startswith("@") and stripped[1:] in blocks:
            indent = line[:len(line) - len(line.lstrip())]
            out.extend(indent + b for b in blocks[stripped[1:]])
        else:
            out.append(line)
    return "\n".join(out) + "\n"


def cache_location():
    """Where the generated kernel sources go (see ``cache_dir``): the
    ``CPUFLASH_CUDA_CACHE_DIR`` directory, else ``~/.cache/cpuflash/cuda`` (``$XDG_CACHE_HOME``
    honoured); None for ``CPUFLASH_CUDA_CACHE_DIR=0``. Nothing is created here."""
    setting = os.environ.get("CPUFLASH_CUDA_CACHE_DIR", "")
    if setting == "0":
        return None
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return setting or os.path.join(base, "cpuflash", "cuda")


def cache_dir():
    """``cache_location()``, created: where the generated kernel sources are written, so that
    numba-cuda can keep their compiled code on disk (``cuda.jit(cache=True)`` needs a real
    source file); None (compile in every process) when it is off or cannot be written."""
    path = cache_location()
    if path is None:
        return None
    try:
        os.makedirs(path, exist_ok=True)
    except OSError:
        return None
    return path if os.access(path, os.W_OK) else None


def _digest(source, namespace):
    """A name for the kernel that the source text and the constants it reads decide: numba's
    cache index keys a kernel on its file, bytecode and signature, not on the values of the
    globals it reads (tile sizes), so those go into the file's name."""
    import numba_cuda
    constants = sorted((key, repr(value)) for key, value in namespace.items()
                       if isinstance(value, (bool, int, float, np.integer, np.floating)))
    text = "\n".join([source, repr(constants), numba_cuda.__version__])
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def build(source, name, namespace):
    """The function ``name`` defined by ``source``, with globals ``namespace``. The text is
    written to a file named by its digest in ``cache_dir()`` (once: the name never changes
    meaning), so tracebacks show the generated lines and numba-cuda can cache the compiled
    kernel; ``fn.cacheable`` says whether it can."""
    directory = cache_dir()
    digest = _digest(source, namespace)
    filename = f"<cpuflash-cuda-{name}-{digest}>"
    if directory is not None:
        path = os.path.join(directory, f"{name}_{digest}.py")
        try:
            if not os.path.exists(path):
                partial = f"{path}.{os.getpid()}.tmp"
                with open(partial, "w") as f:
                    f.write(source)
                os.replace(partial, path)  # whole or not at all, for processes side by side
            filename = path
        except OSError:
            directory = None
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    glb = dict(namespace, __name__=f"cpuflash_cuda_{name}")
    exec(compile(source, filename, "exec"), glb)  # noqa: S102 - our own generated text
    fn = glb[name]
    fn.source = source
    fn.cacheable = directory is not None
    return fn
