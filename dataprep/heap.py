"""Freed memory kept for reuse while a bucketed build runs (glibc malloc; elsewhere nothing).

A page a process touches for the first time costs a page fault: ~5-12 us a page on the
Firecracker VMs ftrec is measured on. The build allocates and frees about the same arrays
bucket after bucket, and glibc gives freed memory back to the system (above its trim
threshold) and takes large arrays from fresh mappings (above its mmap threshold), so each
bucket faulted its pages in again: 10M events, 157K faults, ~3.5 s of system time. keep()
raises both thresholds; release() puts glibc's documented defaults back and trims."""

import ctypes
import ctypes.util
from functools import cache

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt parameters (malloc.h)
TRIM_KEPT = 1 << 30  # free memory at the heap's top kept, up to this
MMAP_KEPT = 32 << 20  # arrays from the heap up to this size (glibc's largest mmap threshold)
DEFAULT = 128 << 10  # glibc's initial trim and mmap thresholds


@cache
def _libc() -> "ctypes.CDLL | None":
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return libc if libc is not None and hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None


def keep() -> bool:
    """Keep freed memory for reuse in this process; False where the C library is not glibc."""
    libc = _libc()
    if libc is None:
        return False
    return bool(libc.mallopt(M_TRIM_THRESHOLD, TRIM_KEPT) and libc.mallopt(M_MMAP_THRESHOLD, MMAP_KEPT))


def release() -> None:
    """glibc's initial thresholds again (fixed from now on), and the kept memory given back."""
    libc = _libc()
    if libc is not None:
        libc.mallopt(M_MMAP_THRESHOLD, DEFAULT)
        libc.mallopt(M_TRIM_THRESHOLD, DEFAULT)
        libc.malloc_trim(0)
