"""How glibc's malloc keeps the memory an engine on the CPU frees, set once as the engine loads.

An object's geometry allocates and frees tens of megabytes of tensors on the scheduler's thread,
whose blocks come from a heap (an "arena") of that thread. glibc hands the top of such a heap
back to the kernel (madvise MADV_DONTNEED) once more than its trim threshold lies free there, and
the next object faults every page of it in again, a fault and a zeroed page each 4 KiB. The
threshold is twice the mmap threshold, which starts at 128 KiB and rises with what the process
happened to free before: the same engine, in a Triton stub, handed back 27.5 MB an object and
faulted 24,900 pages an object against 18,300 in a process that had freed larger blocks first
(tiny config, resolution 5, strace and /proc; issue 53, BENCHMARKS.md "Server overhead"). Fixed
here, what the engine frees stays mapped for its next objects, in every process that hosts it.
Blocks past 32 MB are mapped and unmapped whatever is set: geometry's queries keep theirs under
MMAP_THRESHOLD (`geometry.chunk_points`).

Process-wide, as the thresholds are. Without glibc (no `mallopt`) it does nothing.
"""

from __future__ import annotations

import ctypes
import logging

log = logging.getLogger(__name__)

# glibc's malloc.h
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD = 32 << 20  # the largest glibc takes on 64-bit (HEAP_MAX_SIZE / 2): larger blocks are always mapped
TRIM_THRESHOLD = 256 << 20  # free memory a heap keeps at its top: more than an object's geometry frees at once


def keep_freed_memory() -> bool:
    """Set both thresholds; True when glibc took them."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    taken = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    if not taken:
        log.warning("glibc refused the malloc thresholds (mallopt): freed memory is handed back as it decides")
    return taken
