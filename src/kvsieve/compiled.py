"""A function compiled by inductor at its first call, with the fallback and limits every such use needs.

kvsieve compiles, where asked, the whole decoding step of the engine's batch (`engine.static_step`,
`--compile-steps`): lazily, with dynamic shapes (one graph serves every cache capacity; inductor also
caches it on disk for later processes), logging the compile time, and where compiling fails (no C++
compiler, an unsupported platform) saying so once and letting the caller run the eager step instead.
"""

from __future__ import annotations

import logging
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

log = logging.getLogger("kvsieve.compiled")

# Compilations a function may keep: one row or several, per model and per mix of eviction policies (dynamo
# specializes a size of 1 and sizes that happen to be equal). Past dynamo's default of 8 it runs the function
# eagerly. Dynamo's config is per thread (torch >= 2.12), so every thread that calls one raises its own limit.
RECOMPILES = 32


class Compiled:
    """`function` compiled by inductor (`dynamic=True`, `options`) at its first call; `__call__` returns None once
    compiling has failed (the caller then runs the eager code)."""

    def __init__(self, name: str, function: Callable[..., Any], options: dict[str, Any] | None = None):
        self.name = name
        self.function = function
        self.options = options
        self.compiled: Callable[..., Any] | None = None
        self.failed = False
        self._lock = threading.Lock()  # the server's engine thread and a caller's thread may both reach it first
        self._threads = threading.local()  # which threads have raised their own recompile limit

    def __call__(self, *args: Any) -> Any:
        if self.failed:
            return None
        if not getattr(self._threads, "limit_raised", False):
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILES)
            self._threads.limit_raised = True
        if self.compiled is not None:
            return self.compiled(*args)
        with self._lock:
            if self.compiled is None and not self.failed:
                return self._compile(*args)
        return self(*args)

    def _compile(self, *args: Any) -> Any:
        start = time.perf_counter()
        try:
            with warnings.catch_warnings():  # inductor's own use of APIs torch deprecates is not the caller's concern
                warnings.simplefilter("ignore", DeprecationWarning)
                compiled = torch.compile(self.function, dynamic=True, options=self.options)
                out = compiled(*args)
        except Exception as error:  # no C++ compiler, an unsupported platform: the eager code still works
            self.failed = True
            log.warning("%s: compiling failed (%s); running it eagerly", self.name, error)
            return None
        self.compiled = compiled
        log.info("%s: compiled in %.1f s", self.name, time.perf_counter() - start)
        return out
