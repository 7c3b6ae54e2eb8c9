"""One OpenMP thread team on the CPU: the decode thread's.

PyTorch's CPU kernels run on OpenMP, and libgomp keeps a pool of worker threads for every
thread that has ever run a parallel region. Once the pools hold more workers than there are
CPUs, every team's idle workers sleep between parallel regions instead of spinning, and each
region pays a wake-up. A decode step is a few dozen parallel products in a few ms, so on the
scheduler's thread it ran far slower than on the thread that built the engine (BENCHMARKS.md)
only because that other thread kept its idle pool. So the scheduler's decode thread keeps the only team: the thread that built the
engine hands its workers back when the scheduler starts, and the geometry thread runs its
kernels on one thread while objects are decoding (on all of them, releasing the pool after,
when nothing is).

Both calls go to the OpenMP runtime PyTorch loaded (its symbols are in the process's global
scope); where there is none, they do nothing.
"""

from __future__ import annotations

import ctypes
import logging

import torch

log = logging.getLogger(__name__)

_OMP_PAUSE_HARD = 2  # OpenMP 5.0 omp_pause_resource_t


def _openmp():
    try:
        lib = ctypes.CDLL(None)
    except (OSError, TypeError):
        return None
    needed = ("omp_pause_resource_all", "omp_set_num_threads")
    return lib if all(hasattr(lib, name) for name in needed) else None


def release_openmp_workers() -> bool:
    """Free the calling thread's OpenMP worker pool (it is rebuilt if this thread runs a
    parallel region again). Returns whether the runtime released it."""
    lib = _openmp()
    if lib is None:
        return False
    released = lib.omp_pause_resource_all(_OMP_PAUSE_HARD) == 0
    if not released:
        log.debug("the OpenMP runtime kept this thread's workers")
    return released


def set_thread_openmp_threads(n: int) -> None:
    """Run the calling thread's CPU kernels on n threads (1: on itself, with no worker pool),
    leaving every other thread's setting, and torch's process-wide default, as they are."""
    lib = _openmp()
    if lib is None:
        return
    torch.get_num_threads()  # torch sets a thread's OpenMP threads on first use: do that first
    lib.omp_set_num_threads(max(1, int(n)))
