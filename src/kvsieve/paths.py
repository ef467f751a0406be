"""Where kvsieve keeps what it converts and builds on this machine: one folder for every part of the library."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """kvsieve's folder for converted weights, calibration results and the CPU kernels' library:
    `$KVSIEVE_CACHE_DIR`, else `kvsieve` under `$XDG_CACHE_HOME` (`~/.cache` when unset)."""
    root = os.environ.get("KVSIEVE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kvsieve"
    )
    return Path(root)
