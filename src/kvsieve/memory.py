"""The process's memory: its resident size, the peak of a stretch of work, and giving freed memory back.

One place for what the server's `/metrics`, `kvsieve bench`'s peak memory and the int8 loader read
or do. On a CPU the resident size and a stretch's peak come from Linux's /proc (`VmRSS`, and `VmHWM` after
resetting it through /proc/self/clear_refs); on CUDA from PyTorch's allocator (bytes allocated, and the peak
since the stretch began).

What glibc's allocator keeps: tensors a prefill frees go back to its heaps, not to the system, and the heaps
of a long-running process fragment, so its resident size climbs towards the sum of every peak it has seen
(measured in the server's soak, docs/SERVING.md#memory-what-the-server-holds). `release_freed()`
(`malloc_trim(0)`) returns the free pages of every heap to the system. It is called where a large working set
has just been freed (a prefill done, a request gone), not between the slices of one prefill, whose next slice
would fault the same pages in again.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from functools import cache
from pathlib import Path

import torch

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def status_bytes(field: str) -> int | None:
    """A `kB` line of /proc/self/status (`VmRSS`, `VmHWM`) in bytes; None where there is no such file or line."""
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def resident_bytes() -> int:
    """The process's resident set size now (Linux), in bytes; 0 where it cannot be read."""
    return status_bytes("VmRSS") or 0


def model_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters and buffers (a tied weight counted once)."""
    tensors = {id(t): t for t in (*model.parameters(), *model.buffers())}
    return sum(t.numel() * t.element_size() for t in tensors.values())


@cache
def _malloc_trim():
    """glibc's `malloc_trim`, or None (another C library, another system)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    return getattr(ctypes.CDLL(name), "malloc_trim", None)


def release_freed() -> bool:
    """Give the free pages of the C allocator's heaps back to the system (glibc's `malloc_trim(0)`); True when
    it released some. Where the C library has no such call, nothing happens (False)."""
    trim = _malloc_trim()
    return bool(trim(0)) if trim is not None else False


class PeakWatch:
    """The most memory above its starting point that a stretch of work used: `start()`, the work, `peak()`.

    On CUDA the allocator's peak since `start` (`torch.cuda.reset_peak_memory_stats`); on a CPU the resident
    set's high-water mark since `start` (written as 5 to /proc/self/clear_refs, which resets it to the current
    size), which counts what the allocator had to take from the system, not what it reused. `base` is the
    memory at `start`; `measures` says whether this device and system can tell (else `peak()` is 0)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.measures = device.type == "cuda" or (device.type == "cpu" and os.access(_CLEAR_REFS, os.W_OK))
        self.base = 0

    def start(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
        elif self.measures:
            try:
                _CLEAR_REFS.write_text("5")
            except OSError:
                self.measures = False
            self.base = resident_bytes()

    def peak(self) -> int:
        """Bytes above the starting point at the stretch's peak (0 where this device cannot say)."""
        if self.device.type == "cuda":
            return max(torch.cuda.max_memory_allocated(self.device) - self.base, 0)
        if self.measures:
            return max((status_bytes("VmHWM") or 0) - self.base, 0)
        return 0
