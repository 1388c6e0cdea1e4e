"""Tile sizes and SIMD shape, derived from the host in this one place.

Everything compiled into a kernel is a pure function of the CPU (its SIMD width), so Numba's
on-disk cache, which is keyed on the CPU name and features, never serves a kernel built for
other tile sizes. The tiles' sizes themselves are run-time arguments: the forward's key tiles
also follow the L2's size (``L2_BYTES``, ``block_k``).

* ``VECTOR_BYTES``: bytes of one SIMD register (64 with AVX-512, 32 with AVX/AVX2, else 16,
  which LLVM lowers to SSE or NEON).
* ``MICRO_ROWS`` x ``MICRO_VECS``: the register tile of the tile products, rows of A times
  vectors of B. AVX-512 has 32 vector registers: 4 x 4 accumulators + 4 B vectors + 1 broadcast.
  AVX2 and NEON have 16 (32 on Arm, but narrower): 6 x 2 accumulators, at most 12, do not spill.
* ``BLOCK_Q`` x ``BLOCK_K``: the attention tile. A 64 x 64 float32 Q block (16 KiB) and K/V tiles
  of ``BLOCK_K`` keys (at D = 64, 32-64 KiB each) stay in L2 while a tile is reused; the score
  tile ``BLOCK_Q x BLOCK_K`` is the working set of the softmax. ``BACKWARD_BLOCK_K``: the
  backward pass's key tile (its tiles hold five products, and causal masks waste more of a
  wider diagonal tile).
"""
import os
import warnings

from llvmlite import binding as _llvm


def _host_features():
    try:
        return set(f[1:] for f in _llvm.get_host_cpu_features().flatten().split(",")
                   if f.startswith("+"))
    except Exception:  # pragma: no cover - platforms where LLVM cannot tell
        return set()


def cpuinfo_field(name):
    """The first ``name`` field of /proc/cpuinfo (``vendor_id``: ``GenuineIntel``,
    ``AuthenticAMD``; ``model name``), or '' where there is none (another OS or
    architecture)."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith(name):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def _read_text(path):
    with open(path) as f:
        return f.read().strip()


def host_caches(root="/sys/devices/system/cpu/cpu0/cache"):
    """CPU 0's caches as Linux's sysfs describes them: ``{"L1d": (bytes, CPUs sharing it),
    "L1i": ..., "L2": ..., "L3": ...}``; ``{}`` where there is no sysfs (another OS) or it
    cannot be read, and an entry that cannot be read is left out."""
    caches = {}
    try:
        entries = sorted(e for e in os.listdir(root) if e.startswith("index"))
    except OSError:
        return caches
    for entry in entries:
        try:  # read at import: nothing in it may raise
            level, kind, size, shared = (_read_text(os.path.join(root, entry, name)) for name in
                                         ("level", "type", "size", "shared_cpu_list"))
            unit = {"K": 1 << 10, "M": 1 << 20}[size[-1:]]
            n_cpus = sum(int(b) - int(a) + 1 for a, b in
                         (part.split("-") if "-" in part else (part, part)
                          for part in shared.split(",") if part))
            n_bytes = int(size[:-1]) * unit
        except (OSError, KeyError, ValueError):
            continue
        name = f"L{level}" + {"Data": "d", "Instruction": "i"}.get(kind, "")
        caches[name] = (n_bytes, max(1, n_cpus))
    return caches


HOST_FEATURES = _host_features()
HOST_CACHES = host_caches()
# One core's L2, where sysfs tells it (None elsewhere): the forward's key tiles are kept within
# half of it (``block_k``).
L2_BYTES = HOST_CACHES["L2"][0] if "L2" in HOST_CACHES else None
HOST_CPU = _llvm.get_host_cpu_name()
# Only the decode kernel's prefetch hints depend on it (``_cpu/decode.py``, ``HINT_VALUES``): a
# choice made per call in Python, not part of any compiled kernel or of ``describe()``.
HOST_VENDOR = cpuinfo_field("vendor_id")

# ``CPUFLASH_SIMD=avx2`` or ``128`` picks a narrower host's shapes on a wider one (LLVM lowers
# the narrower vectors to the wider host's instructions), so that one machine's tests run the
# tile loops of all three; unset or empty: the host's own. Another value is a typo: warned
# about, and the host's shapes are used (a stray setting must not break ``import cpuflash``).
SIMD_CHOICES = ("avx2", "128")
_FORCED = os.environ.get("CPUFLASH_SIMD", "")
if _FORCED and _FORCED not in SIMD_CHOICES:
    warnings.warn(f"CPUFLASH_SIMD={_FORCED!r}: expected one of {SIMD_CHOICES} or unset; "
                  "using this host's own tile shapes", RuntimeWarning, stacklevel=2)
if "avx512f" in HOST_FEATURES and _FORCED not in SIMD_CHOICES:
    VECTOR_BYTES, MICRO_ROWS, MICRO_VECS = 64, 4, 4
elif ("avx2" in HOST_FEATURES or "avx" in HOST_FEATURES) and _FORCED != "128":
    VECTOR_BYTES, MICRO_ROWS, MICRO_VECS = 32, 6, 2
else:
    VECTOR_BYTES, MICRO_ROWS, MICRO_VECS = 16, 6, 2

# float32 lanes of one vector; the key tile is a whole number of micro-tile widths.
LANES_F32 = VECTOR_BYTES // 4
# Keys per tile, measured per SIMD width, B=1, H=8, float32, 2 threads, side by side with
# torch in one process (``bench/cpu_block_ab.py --keys``). AVX-512 (Emerald Rapids): 128 beat
# 64 and 256 at D=64 and 128, N=512..8192 (at 256, rows 1 KiB apart aliased in L1 and cost
# 20 %). AVX2 (Zen 3, stop 25; log bench/results/cpu_block_k_zen3_stop25.txt), x torch with
# 64 / 128 / 256 keys, forward: N=2048 D=64 0.99 / 1.06 / 1.10, N=512 D=128 0.98 / 1.04 /
# 1.06, N=2048 D=128 0.97 / 1.02 / 1.05, N=512 D=64 0.96 / 1.05 / 1.09, causal N=2048 1.12 /
# 1.14 / 1.11, causal N=8192 1.05 / 1.11 / 1.12 (presumably a tile's fixed costs, the row
# maxima and sums reduced across lanes and the rescale of the output rows, paid less often);
# forward + backward with the backward's 64 / 128 / 256: N=2048 1.05 / 1.09 / 1.09, N=512
# 1.05 / 1.11 / 1.11, causal N=2048 1.10 / 1.13 / 1.09, causal N=8192 1.07 / 1.10 / 1.07.
# 128-bit hosts: 32, not measured.
if VECTOR_BYTES == 64:
    BLOCK_K, BACKWARD_BLOCK_K = 128, 128
elif VECTOR_BYTES == 32:
    BLOCK_K, BACKWARD_BLOCK_K = 256, 128
else:
    BLOCK_K, BACKWARD_BLOCK_K = 32, 32
BLOCK_Q = MICRO_ROWS * (64 // MICRO_ROWS) if MICRO_ROWS != 6 else 48


def _fit_keys(block, n_k):
    """``block`` keys, or fewer where there are fewer keys: the whole float32 panels that hold
    ``n_k``. A key tile is computed whole (its scores and their exponentials, masked past the
    last key), so a 256-key tile over a 20-token sentence would do 13 times the work (MiniLM's
    varlen batches, sentences of 5..128 tokens). A single tile's sums run over the same keys in
    the same order either way."""
    quantum = MICRO_VECS * LANES_F32
    return min(block, max(quantum, -(-n_k // quantum) * quantum))


def block_k(head_dim, n_k):
    """Keys per tile of the forward pass for ``n_k`` keys: ``BLOCK_K``, halved (in whole
    panels) while a K tile and a V tile (float32, Dv = D) would fill more than half of the L2
    (``L2_BYTES``, where it is known), the rest of the L2 left to the task's Q block, scores and
    output rows. It never binds on the hosts measured for D <= 128 (Zen 3: 512 KiB, 256 keys of
    D=128 in 256 KiB; Zen 4: 1 MiB; the Xeons: 2 MiB; there a 512-wide head's 128 keys take
    512 KiB on the Zen 4, 256 KiB on the Xeons), so the measured choices stand; with a smaller
    L2 (256 KiB on many laptops' cores) or wide heads on AVX2 (256 keys at D=256 on the Zen 3)
    the tile narrows. That narrowing is not measured: no such host was lent."""
    block, quantum = BLOCK_K, MICRO_VECS * LANES_F32
    while L2_BYTES and block > quantum and block * 2 * head_dim * 4 > L2_BYTES // 2:
        block //= 2
    return _fit_keys(block, n_k)


def backward_block_k(head_dim, n_k):
    """Keys per tile of the backward pass for ``n_k`` keys (see ``BACKWARD_BLOCK_K``)."""
    return _fit_keys(BACKWARD_BLOCK_K, n_k)


def block_q(n_q, head_dim, n_tasks_per_block, threads):
    """Query rows per block: twice ``BLOCK_Q`` for heads up to 128 wide when there are still at
    least four tasks per thread and, below 1024 rows, no more padding rows than with
    ``BLOCK_Q``, so each K/V tile read from L2/L3 serves more rows (measured at N=8192 causal:
    +5 %; at D=128, N=2048: +1 %; stop 23, side by side with torch in one process, B=1, 2
    threads, H=8 and H=2, N=256-512, D=64 and 128, causal and not: +2-8 %, by
    ``bench/cpu_block_ab.py``, log ``bench/results/cpu_block_q_stop23.txt``). The rows computed
    per query do not change with the block, so neither do the bits. Only on AVX-512: on Zen 3
    (AVX2, 256-key tiles, whose score tile would double to 100 KiB) ``BLOCK_Q`` was 1-4 %
    faster at N=2048 (D=64 and 128, causal and not) and N=8192 causal, the same at N=1024
    (stop 25, log ``bench/results/cpu_block_k_zen3_stop25.txt``)."""
    big = 2 * BLOCK_Q
    enough_tasks = n_tasks_per_block * (-(-n_q // big)) >= 4 * threads
    no_more_padding = n_q >= 1024 or -(-n_q // big) * big == -(-n_q // BLOCK_Q) * BLOCK_Q
    if VECTOR_BYTES == 64 and n_q >= big and head_dim <= 128 and enough_tasks and no_more_padding:
        return big
    if n_q < BLOCK_Q:  # few queries (decoding): whole micro-tiles only, not a padded block
        return max(MICRO_ROWS, -(-n_q // MICRO_ROWS) * MICRO_ROWS)
    return BLOCK_Q


def lanes(dtype):
    """Lanes of one vector for a numpy float dtype."""
    return VECTOR_BYTES // dtype.itemsize


def panel_width(dtype):
    """Columns of the packed B panels: the micro-tile width (see _cpu/tiles.py)."""
    return MICRO_VECS * lanes(dtype)


# Pure-Numba loops instead of the SIMD intrinsics (slower; for CPUs where LLVM vectors fail).
PORTABLE = os.environ.get("CPUFLASH_PORTABLE", "") not in ("", "0")

# Where a Numba cache may be written; see _cpu/_jit.py.
CACHE_ENABLED = os.environ.get("CPUFLASH_DISABLE_CACHE", "") in ("", "0")


def describe():
    """The chosen shapes, for ``cpuflash info`` and benchmark records."""
    return {
        "cpu": HOST_CPU,
        "simd": ("avx512f" if VECTOR_BYTES == 64 else "avx2" if VECTOR_BYTES == 32
                 else "128-bit"),
        "vector_bytes": VECTOR_BYTES,
        "micro_tile": f"{MICRO_ROWS}x{MICRO_VECS * LANES_F32} (float32)",
        "block_q": BLOCK_Q,
        "block_k": BLOCK_K,
        "backward_block_k": BACKWARD_BLOCK_K,
    }
