"""Kernel source with the register tiles written out as scalars.

numba.cuda has no ``#pragma unroll``, and NVVM leaves loops over a ``cuda.local.array`` rolled
once their body grows past its threshold: the tile then lives in local memory (measured in the
PTX of a first version: 37-77 ``ld/st.local``). So each kernel is a template whose register-
tile statements are written once per element (``s_0_0 = ...; s_0_1 = ...``) for its tile
shape, and compiled from that text. ``rep`` writes such a block, ``expand`` puts blocks into a
template at lines ``@name``, and ``build`` turns the text into a Python function (kept in
``linecache`` so tracebacks and the simulator show the generated lines).
"""
import itertools
import linecache
import os


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


_count = itertools.count()


def build(source, name, namespace):
    """The function ``name`` defined by ``source``, with globals ``namespace``."""
    filename = f"<cpuflash-cuda-{name}-{next(_count)}>"
    if os.environ.get("CPUFLASH_CUDA_SOURCE_DIR"):  # to debug: write the text where Numba
        filename = os.path.join(os.environ["CPUFLASH_CUDA_SOURCE_DIR"], filename[1:-1] + ".py")
        with open(filename, "w") as f:  # and tracebacks can read it
            f.write(source)
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    glb = dict(namespace)
    exec(compile(source, filename, "exec"), glb)  # noqa: S102 - our own generated text
    fn = glb[name]
    fn.source = source
    return fn
