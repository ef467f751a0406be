"""`kvsieve.memory`: what the process holds, and giving freed heap memory back (issue 48)."""

from __future__ import annotations

import ctypes
import ctypes.util

from kvsieve.memory import release_freed, resident_bytes

BLOCK = 64 * 1024  # below glibc's mmap threshold however it has moved: every block comes from a heap


def test_release_freed_returns_free_pages_that_free_alone_keeps():
    """128 MB of heap blocks written and freed, with the last block still held: the freed ones lie below the
    heap's top, so glibc keeps them resident after `free`, and only `release_freed` (malloc_trim) returns
    them. The server calls it after a step in which a prefill or an answer ended."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    blocks = [libc.malloc(BLOCK) for _ in range(2048)]
    for block in blocks:
        ctypes.memset(block, 1, BLOCK)
    for block in blocks[:-1]:
        libc.free(block)
    kept = resident_bytes()
    assert release_freed()
    assert kept - resident_bytes() > 100 * 2**20
    libc.free(blocks[-1])
