"""A function compiled by inductor at its first call, with the fallback and limits every such use needs.

kvsieve compiles, where asked, the whole decoding step of the engine's batch (`engine.static_step`,
`--compile-steps`): lazily, with dynamic shapes (one graph serves every cache capacity; inductor also
caches it on disk for later processes), logging the compile time, and where compiling fails (no C++
compiler, an unsupported platform) saying so once and letting the caller run the eager step instead.

A call through `torch.compile` first checks dynamo's guards: that the arguments are still of the kind the
graph was compiled for (a tensor guard per model weight, the shapes' relations, the Python values the trace
read). For SmolLM2's step that is about 1 ms of a 19-24 ms step on the CPU. A caller that knows its next calls
pass arguments the same guards would accept again (the same objects, shapes and Python values: a `StaticStep`
from its second step to its last) takes `bound`: the compiled code that dynamo would run for those arguments, as
a plain function, called without the check.
"""

from __future__ import annotations

import inspect
import logging
import threading
import time
import types
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
    """`function` compiled by inductor (`dynamic`, `options`) at its first call; `__call__` returns None once
    compiling has failed (the caller then runs the eager code)."""

    def __init__(
        self, name: str, function: Callable[..., Any], options: dict[str, Any] | None = None, dynamic: bool = True
    ):
        self.name = name
        self.dynamic = dynamic
        # Dynamo keeps compiled code per code object: a copy of `function`'s keeps this instance's apart from any
        # other compilation of the same function (another options set, a test's own), so `bound` finds its own.
        self.function = _with_code(function, function.__code__.replace())
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

    def bound(self, *args: Any) -> Callable[..., Any] | None:
        """The compiled code that a call with `args` runs now, as a function that runs it without dynamo's guard
        check; None where there is none (not compiled, no compiled code accepts `args`, code with a graph break,
        a torch without dynamo's cache-entry list). The caller must pass it only arguments that the guards
        `args` passed would pass again; it runs the graph chosen now even if a switch the trace read changes."""
        entries = getattr(torch._C._dynamo.eval_frame, "_debug_get_cache_entry_list", None)
        if self.compiled is None or entries is None:
            return None
        call = inspect.signature(self.function).bind(*args)
        call.apply_defaults()
        code, cells = self.function.__code__, self.function.__closure__ or ()
        frame = dict(call.arguments) | {
            name: cell.cell_contents for name, cell in zip(code.co_freevars, cells, strict=True)
        }
        for entry in entries(code):  # dynamo's own order: the first that accepts is what it runs
            if entry.guard_manager.check(frame):
                if any(name.startswith("__resume_at") for name in entry.code.co_names):
                    return None  # a graph break: the code after it would run uncompiled
                return _with_code(self.function, entry.code)
        return None

    def _compile(self, *args: Any) -> Any:
        start = time.perf_counter()
        try:
            with warnings.catch_warnings():  # inductor's own use of APIs torch deprecates is not the caller's concern
                warnings.simplefilter("ignore", DeprecationWarning)
                compiled = torch.compile(self.function, dynamic=self.dynamic, options=self.options)
                out = compiled(*args)
        except Exception as error:  # no C++ compiler, an unsupported platform: the eager code still works
            self.failed = True
            log.warning("%s: compiling failed (%s); running it eagerly", self.name, error)
            return None
        self.compiled = compiled
        log.info("%s: compiled in %.1f s", self.name, time.perf_counter() - start)
        return out


def _with_code(function: Callable[..., Any], code: types.CodeType) -> Callable[..., Any]:
    """`function` (its globals, name, defaults and closure) running `code`."""
    return types.FunctionType(
        code, function.__globals__, function.__name__, function.__defaults__, function.__closure__
    )
