"""How the forward and backward kernels' workers share their tasks out (``tasks.next_task``):
every task once, each worker's own share from the front, the others' from the back."""
import numba
import numpy as np
import pytest

from cpuflash._cpu import tasks


def claim_all(n_tasks, n_workers, seed):
    """Every worker's claims, in a random interleaving of the workers (seeded): a list of
    tasks per worker, up to its -1."""
    rng = np.random.default_rng(seed)
    claims = tasks.new_claims(n_workers)
    got = [[] for _ in range(n_workers)]
    active = list(range(n_workers))
    while active:
        worker = active[rng.integers(len(active))]
        task = tasks.next_task(claims, worker, n_workers, n_tasks)
        if task < 0:
            active.remove(worker)
        else:
            got[worker].append(int(task))
    return got


@pytest.mark.parametrize("n_tasks", [0, 1, 2, 5, 7, 128])
@pytest.mark.parametrize("n_workers", [1, 2, 3, 5])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_each_task_once_own_share_first(n_tasks, n_workers, seed):
    got = claim_all(n_tasks, n_workers, seed)
    assert sorted(t for worker in got for t in worker) == list(range(n_tasks))
    for w, taken in enumerate(got):
        lo, hi = w * n_tasks // n_workers, (w + 1) * n_tasks // n_workers
        own = [t for t in taken if lo <= t < hi]
        assert taken[:len(own)] == own == list(range(lo, lo + len(own)))  # own ones first
        for v in range(n_workers):  # another share's tasks: from its back, one by one
            v_lo, v_hi = v * n_tasks // n_workers, (v + 1) * n_tasks // n_workers
            stolen = [t for t in taken if v != w and v_lo <= t < v_hi]
            assert stolen == sorted(stolen, reverse=True)


def test_a_worker_alone_takes_every_share_in_order():
    """One worker with its peers never started (a thread that runs several workers in turn):
    its own share front to back, then each other share back to front."""
    claims = tasks.new_claims(3)
    taken = []
    while (task := tasks.next_task(claims, 1, 3, 9)) >= 0:
        taken.append(int(task))
    assert taken == [3, 4, 5, 8, 7, 6, 2, 1, 0]
    assert tasks.next_task(claims, 0, 3, 9) == -1 and tasks.next_task(claims, 2, 3, 9) == -1


def test_claim_words_on_lines_of_their_own():
    claims = tasks.new_claims(4)
    assert claims.shape == (4 * tasks.CLAIM_STRIDE,) and claims.dtype == np.int64
    assert tasks.CLAIM_STRIDE * claims.itemsize >= 64 and not claims.any()


def test_num_threads_follows_set_num_threads():
    """``tasks.num_threads`` (the threading layer's own function, without Numba's lock) is
    ``numba.get_num_threads()``, also after ``set_num_threads``."""
    before = numba.get_num_threads()
    try:
        for n in sorted({1, before}):
            numba.set_num_threads(n)
            assert tasks.num_threads() == numba.get_num_threads() == n
    finally:
        numba.set_num_threads(before)


@pytest.mark.parametrize("chunk", [0, 1, 2, 7])
def test_run_shared_one_worker_a_thread_whatever_the_chunk_size(chunk):
    """The kernel gets the thread count as its last argument and runs with a chunk size of
    0 or 1 (one worker dealt to each thread): the caller's own 0 or 1 is left alone, a larger
    one is 1 for the call and restored after it, also when the kernel raises."""
    seen = []

    def kernel(a, b, n_threads):
        seen.append((a, b, n_threads, numba.get_parallel_chunksize()))
        if a == "raise":
            raise RuntimeError("in the kernel")
        return n_threads

    old = numba.set_parallel_chunksize(chunk)
    try:
        assert tasks.run_shared(kernel, "x", 3) == numba.get_num_threads()
        assert numba.get_parallel_chunksize() == chunk
        with pytest.raises(RuntimeError, match="in the kernel"):
            tasks.run_shared(kernel, "raise", 0)
        assert numba.get_parallel_chunksize() == chunk
    finally:
        numba.set_parallel_chunksize(old)
    expected = chunk if chunk <= 1 else 1
    assert seen == [("x", 3, numba.get_num_threads(), expected),
                    ("raise", 0, numba.get_num_threads(), expected)]
