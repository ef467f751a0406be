"""Where a server's memory goes: the process's resident size and the parts kvsieve can name (issue 48).

`/metrics` reports these beside each other so that the gap between the resident size and the sum of the
named parts (the model, the prefix cache, the running batch's tables, the largest engine step's working set)
is visible rather than guessed. On a CPU the resident size and a step's peak come from Linux's /proc
(`VmRSS`, and `VmHWM` after resetting it through /proc/self/clear_refs); on CUDA from PyTorch's allocator
(bytes allocated, and the peak since the step began). Elsewhere they read 0.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def _status_bytes(field: str) -> int:
    """A `kB` line of /proc/self/status (`VmRSS`, `VmHWM`) in bytes; 0 where there is no such file."""
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def resident_bytes() -> int:
    """The process's resident set size now (Linux), in bytes; 0 where it cannot be read."""
    return _status_bytes("VmRSS")


def model_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters and buffers (a tied weight counted once)."""
    tensors = {id(t): t for t in (*model.parameters(), *model.buffers())}
    return sum(t.numel() * t.element_size() for t in tensors.values())


class PeakWatch:
    """The most memory above its starting point that a stretch of work used: `start()`, the work, `peak()`.

    On CUDA the allocator's peak since `start` (`torch.cuda.reset_peak_memory_stats`); on a CPU the resident
    set's high-water mark since `start` (written as 5 to /proc/self/clear_refs, which resets it to the current
    size), which counts what the allocator had to take from the system, not what it reused."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cpu = device.type == "cpu" and os.access(_CLEAR_REFS, os.W_OK)
        self.base = 0

    def start(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
        elif self.cpu:
            try:
                _CLEAR_REFS.write_text("5")
            except OSError:
                self.cpu = False
            self.base = resident_bytes()

    def peak(self) -> int:
        """Bytes above the starting point at the stretch's peak (0 where this device cannot say)."""
        if self.device.type == "cuda":
            return max(torch.cuda.max_memory_allocated(self.device) - self.base, 0)
        if self.cpu:
            return max(_status_bytes("VmHWM") - self.base, 0)
        return 0
