"""Where a CPU kernel's time goes, function by function: Linux ``perf record`` (software clock
samples, which a virtual machine without hardware counters still has) of a process that calls
one case again and again; each sample's address is matched to the functions Numba compiled for
cpuflash's kernels (their addresses from each kernel's code library), and the shares are printed.
Only samples taken while the case runs count (the compile before it is left out).

The child process compiles the kernels itself (``CPUFLASH_DISABLE_CACHE=1``: code that Numba
loads from its cache comes without the IR that lists its functions): 20-60 s before the timed
part. A function's address comes from the JIT, its size from the symbol table of the same
optimized module emitted once more by Numba's target machine. Needs ``perf``. Not collected by
pytest.

    python bench/cpu_profile.py forward [--n 2048] [--d 64] [--h 8] [--causal]
                                        [--threads 1] [--seconds 8]
    python bench/cpu_profile.py decode [--nk 32768] [--hkv 2] [--layers 1] [--threads 1]
                                       [--cache float32] [--seconds 8]

A function's share is of the samples in the timed part; "outside the kernels" is everything
else in that time (Python, numpy, the thread pool's waits, the OS).
"""
import argparse
import bisect
import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

CASES = ("forward", "decode")


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("case", choices=CASES)
    p.add_argument("--n", type=int, default=2048, help="forward: queries and keys")
    p.add_argument("--d", type=int, default=64, help="head dim")
    p.add_argument("--h", type=int, default=8, help="query heads")
    p.add_argument("--causal", action="store_true", help="forward: causal")
    p.add_argument("--nk", type=int, default=32768, help="decode: keys in the cache")
    p.add_argument("--hkv", type=int, default=2, help="decode: key/value heads")
    p.add_argument("--cache", default="float32", choices=("float32", "float16", "int8"),
                   help="decode: the KVCache's dtype")
    p.add_argument("--layers", type=int, default=1,
                   help="decode: layers of cache called in turn (19: K/V from DRAM, as the "
                        "decode benchmark's cold steps)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seconds", type=float, default=8.0, help="length of the timed part")
    p.add_argument("--child", help=argparse.SUPPRESS)  # the profiled process: symbols file
    a = p.parse_args(argv)
    for name in ("n", "d", "h", "nk", "hkv", "layers", "threads"):
        if getattr(a, name) < 1:
            p.error(f"--{name} must be at least 1, got {getattr(a, name)}")
    if not a.seconds > 0:
        p.error(f"--seconds must be positive, got {a.seconds}")
    if a.case == "decode" and a.h % a.hkv:
        p.error(f"--h ({a.h}) must be a multiple of --hkv ({a.hkv})")
    return a


def python_name(symbol):
    """A readable name for a Numba symbol: ``_ZN8cpuflash4_cpu5tiles14online_softmaxB3v50...``
    -> ``cpuflash._cpu.tiles.online_softmax``; a prange body -> ``<prange body>``; a wrapper
    keeps its prefix (``cpython.``); anything else (``NRT_decref``) as it is."""
    prefix, found, mangled = symbol.rpartition("_ZN")
    if not found:
        return symbol
    parts, i = [], 0
    while i < len(mangled) and mangled[i].isdigit():
        j = i
        while mangled[j].isdigit():
            j += 1
        n = int(mangled[i:j])
        parts.append(mangled[j:j + n])
        i = j + n
    name = re.sub(r"_([0-9a-f]{2})", lambda m: chr(int(m.group(1), 16)), ".".join(parts))
    if "__numba_parfor_gufunc" in name:
        name = "<prange body>"
    return prefix.rstrip(".") + ("." if prefix.rstrip(".") else "") + name


def function_at(ip, symbols):
    """The name of the function of ``symbols`` (sorted ``(start, size, name)``) that holds the
    address ``ip``, or None."""
    i = bisect.bisect_right(symbols, (ip, float("inf"), "")) - 1
    return symbols[i][2] if i >= 0 and ip < symbols[i][0] + symbols[i][1] else None


def share_table(samples, symbols):
    """``{readable name: count}`` of the ``samples`` (addresses) inside one of ``symbols``
    (``(start, size, name)``, any order), and the list of those outside all of them."""
    symbols = sorted(symbols)
    counts, outside = collections.Counter(), []
    for ip in samples:
        name = function_at(ip, symbols)
        if name is None:
            outside.append(ip)
        else:
            counts[python_name(name)] += 1
    return counts, outside


def _case(a):
    """The zero-argument call to profile."""
    import numpy as np

    import cpuflash
    rng = np.random.default_rng(0)
    if a.case == "forward":
        q, k, v = (rng.standard_normal((1, a.h, a.n, a.d), dtype=np.float32) for _ in range(3))
        return lambda: cpuflash.attention(q, k, v, causal=a.causal)
    cache = cpuflash.KVCache(a.layers, 1, a.hkv, a.nk, a.d, dtype=a.cache)
    kv = [rng.standard_normal((1, a.hkv, a.nk, a.d), dtype=np.float32) for _ in range(2)]
    for layer in range(a.layers):
        cache.append(layer, *kv)
    q = rng.standard_normal((1, a.h, 1, a.d), dtype=np.float32)

    def step():
        for layer in range(a.layers):
            cache.attention(layer, q)
    return step


def elf_functions(obj):
    """``(name, size)`` of the functions in the symbol table of an ELF64 little-endian object
    file (the machine code Numba keeps of a library it compiled or loaded from its cache)."""
    import struct
    shoff, = struct.unpack_from("<Q", obj, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", obj, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", obj, shoff + i * shentsize)
                for i in range(shnum)]
    out = []
    for sh in sections:
        if sh[1] != 2:  # SHT_SYMTAB
            continue
        strtab = sections[sh[6]]
        for off in range(sh[4], sh[4] + sh[5], 24):
            st_name, st_info, _, _, _, st_size = struct.unpack_from("<IBBHQQ", obj, off)
            if st_info & 0xF == 2 and st_size:  # STT_FUNC
                start = strtab[4] + st_name
                out.append((obj[start:obj.index(b"\0", start)].decode(), st_size))
    return out


def _kernel_symbols():
    """``(start, size, name)`` of every function in the machine code of the kernels compiled
    in this process: the address from the JIT, the size from the symbol table of the same
    optimized module emitted once more by Numba's own target machine."""
    import llvmlite.binding as llvm

    from cpuflash._cpu import _jit
    symbols = set()
    for module in [m for name, m in sys.modules.items() if name.startswith("cpuflash._cpu")]:
        for obj in vars(module).values():
            if not isinstance(obj, _jit.Kernel):
                continue
            for overload in obj.compiler.overloads.values():
                library = overload.library
                ir = llvm.parse_assembly(str(library.get_llvm_str()))
                for name, size in elf_functions(library.codegen._tm.emit_object(ir)):
                    address = library.get_pointer_to_function(name)
                    if address:
                        symbols.add((address, size, name))
    return sorted(symbols)


def child(a):
    import numba
    numba.set_num_threads(a.threads)
    call = _case(a)
    call()  # compiles
    with open(a.child, "w") as out:
        for start, size, name in _kernel_symbols():
            out.write(f"{start:x} {size} {name}\n")
        out.write(f"# start {time.clock_gettime(time.CLOCK_MONOTONIC)}\n")
        calls, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < a.seconds:
            call()
            calls += 1
        out.write(f"# stop {time.clock_gettime(time.CLOCK_MONOTONIC)}\n")
    print(f"{calls} calls, {(time.perf_counter() - t0) / calls * 1e3:.3f} ms a call")


def main(argv=None):
    a = parse(argv)
    if a.child:
        return child(a)
    if shutil.which("perf") is None:
        sys.exit("cpu_profile: needs Linux perf (not found on PATH)")
    with tempfile.TemporaryDirectory() as tmp:
        syms, data = os.path.join(tmp, "symbols.txt"), os.path.join(tmp, "perf.data")
        args = list(argv if argv is not None else sys.argv[1:])
        env = dict(os.environ, CPUFLASH_DISABLE_CACHE="1")  # code loaded from it has no IR
        subprocess.run(["perf", "record", "-q", "-k", "CLOCK_MONOTONIC", "-e", "cpu-clock",
                        "-F", "4000", "-o", data, "--", sys.executable, __file__, *args,
                        "--child", syms], env=env, check=True)
        symbols, window = [], {}
        for line in open(syms):
            if line.startswith("# "):
                key, value = line[2:].split()
                window[key] = float(value)
            else:
                start, size, name = line.split(maxsplit=2)
                symbols.append((int(start, 16), int(size), name.strip()))
        script = subprocess.run(["perf", "script", "-i", data, "-F", "time,ip,dso"],
                                capture_output=True, text=True, check=True).stdout
    samples, objects = [], {}
    for line in script.splitlines():
        fields = line.replace(":", " ").split()
        if len(fields) >= 2 and window["start"] <= float(fields[0]) <= window["stop"]:
            samples.append(int(fields[1], 16))
            objects[samples[-1]] = os.path.basename(fields[-1].strip("()"))
    counts, outside = share_table(samples, symbols)
    elsewhere = collections.Counter(objects[ip] for ip in outside)
    total = max(1, len(samples))
    print(f"{len(samples)} samples in the timed part")
    for name, n in counts.most_common():
        if n / total >= 0.001:
            print(f"{100 * n / total:6.1f} %  {name}")
    print(f"{100 * len(outside) / total:6.1f} %  outside the kernels, in:")
    for name, n in elsewhere.most_common(6):
        print(f"{100 * n / total:14.1f} %  {name}")


if __name__ == "__main__":
    main()
