"""How a ``prange`` task number maps to the work it owns, and how the threads share the tasks.

Every kernel's parallel loop runs over ``n_b * n_h * n_inner`` tasks, batch outermost: task
``t`` owns batch ``b``, head ``h`` and inner index ``i`` (a query block, key block, key chunk
or split). Numba's prange index is unsigned; dividing it by a signed count would give floats,
so it is made int64 here, once.

Sharing the tasks out (the forward and backward kernels). Numba's OpenMP layer runs a
``prange`` as an ``omp for`` without a schedule clause: static, one contiguous range of
iterations a thread. A chunk size (``numba.set_parallel_chunksize``) only cuts that range into
chunks that are dealt out the same static way: measured at stop 50 (a cycle counter read in
each task of a throwaway copy of the forward kernel, B=1, H=8, N=2048, 2 threads, 40 calls),
64 of the 128 tasks went to each thread in every call, and where one thread's tasks ran slower
than the other's (a neighbour on its core: this project's machines are shared virtual ones),
the other waited: 4-6 % of the loop in one run, 19-21 % in two others (medians of 40 calls).
So these kernels loop over one *worker* per thread, and each worker takes its tasks one at a
time (``next_task``): from the front of its own static share, then from the back of the other
workers' shares. While the threads keep pace that is the static split (each thread's K/V stay
in its own caches; handing every task out in order from one counter, tried first, was 2-6 %
slower than the static split in a quiet spell); a faster thread takes a slower one's last
tasks. The same trace with it, alternating with the static code: each thread waiting 0-1 % of
the loop, one taking 77-82 tasks and the other 46-51 where the other's ran at half speed. A
task writes only its own outputs from its own scratch, so which thread runs it changes no
bit.
"""
import numba
import numpy as np
from llvmlite import ir
from numba.core import types
from numba.extending import intrinsic

from ._jit import helper


@helper
def unravel(task, n_h, n_inner):
    """``(b, h, i)`` of task ``task`` over ``(B, n_h, n_inner)``."""
    bh, i = divmod(np.int64(task), n_inner)
    b, h = divmod(bh, n_h)
    return b, h, i


@intrinsic
def fetch_add(typingctx, counter, index, value):
    """``counter[index] += value`` as one atomic operation (an int64 array, C-contiguous);
    returns the value before. Monotonic ordering: the counter orders nothing else (each task's
    outputs are read only after the parallel loop, whose end synchronizes the threads)."""
    if not (isinstance(counter, types.Array) and counter.dtype == types.int64
            and counter.layout == "C"):
        return None

    def codegen(context, builder, sig, args):
        array = context.make_array(sig.args[0])(context, builder, args[0])
        at = builder.gep(array.data, [args[1]])
        return builder.atomic_rmw("add", at, args[2], "monotonic")

    return types.int64(counter, types.int64, types.int64), codegen


# A worker's claim on a share adds FRONT (its own tasks, from the front) or BACK (another's,
# from the back) to the share's word: both counts in one int64, so that one atomic add hands
# each task out once (fewer than 2**31 tasks a share). One cache line a word.
FRONT, BACK = 1, 1 << 32
CLAIM_STRIDE = 8


@helper
def new_claims(n_workers):
    """The claim words of ``n_workers`` shares, zero."""
    return np.zeros(max(n_workers, 1) * CLAIM_STRIDE, dtype=np.int64)


@helper
def next_task(claims, worker, n_workers, n_tasks):
    """The next of ``n_tasks`` tasks for ``worker`` of ``n_workers``, or -1 when none is left:
    the next one of its own share (tasks ``[lo, lo + size)`` of share ``w``, the static split),
    else the last one left of the next share that has any. A claim is one atomic add to the
    share's word (``FRONT`` or ``BACK``); the word before it says which task the claim got:
    ``front`` tasks taken from the front and ``back`` from the back, and the claim is good
    while ``front + back < size``. Every good claim raised that sum by one, atomically, so the
    good claims on a share are ``size`` in all, and a front claim at ``front = f`` and a back
    claim at ``back = c`` never name one task (``lo + f = lo + size - 1 - c`` needs ``f + c =
    size - 1``, but whichever of the two came later saw the other's count and a sum of at
    least ``size``)."""
    for i in range(n_workers):
        w = (worker + i) % n_workers
        lo = w * n_tasks // n_workers
        size = (w + 1) * n_tasks // n_workers - lo
        before = fetch_add(claims, w * CLAIM_STRIDE, FRONT if i == 0 else BACK)
        front, back = before & 0xFFFFFFFF, before >> 32
        if front + back < size:
            return lo + front if i == 0 else lo + size - 1 - back
    return -1


# The threading layer's own functions, for the calls' per-call questions. Numba's public
# ``get_num_threads`` and ``set_parallel_chunksize`` take a multiprocessing lock on every call
# (``_launch_threads``, which returns at once once the layer runs): 1.8 and 2.3 us here, the
# layer's functions themselves 0.26 and 0.66. A call asked for the thread count twice and set
# the chunk size twice: 8 us of a 50 us call at H=1, N=17.
_layer = None


def _threading_layer():
    """``(num_threads, get_chunksize, set_chunksize)``: the threading layer's functions once it
    runs (started here on the first call, as Numba's public functions would); Numba's public
    ones where this Numba lacks them."""
    global _layer
    if _layer is None:
        numba.get_num_threads()  # starts the layer, once
        from numba.np.ufunc import parallel
        raw = [getattr(parallel, name, None) for name in
               ("_get_num_threads", "_get_parallel_chunksize", "_set_parallel_chunksize")]
        _layer = tuple(raw) if all(callable(f) for f in raw) else (
            numba.get_num_threads, numba.get_parallel_chunksize, numba.set_parallel_chunksize)
    return _layer


def num_threads():
    """``numba.get_num_threads()`` (the threads this Python thread's kernels use), without its
    lock (``_threading_layer``)."""
    return _threading_layer()[0]()


def run_shared(kernel, *args):
    """``kernel(*args, n_threads)``, a kernel whose tasks its workers share out
    (``next_task``), one worker per thread. A static schedule with Numba's default chunk size
    (0) or 1 deals one worker to each thread; a larger one, which a caller may have set for
    its own parallel code, would deal two workers to one thread and serialize them: then the
    chunk size is 1 for the call (per thread, set and restored)."""
    n_threads, get_chunksize, set_chunksize = _threading_layer()
    if get_chunksize() <= 1:
        return kernel(*args, n_threads())
    old = set_chunksize(1)
    try:
        return kernel(*args, n_threads())
    finally:
        set_chunksize(old)
