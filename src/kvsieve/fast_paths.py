"""Which fast paths the decoding steps and the prefill take: one set of switches, read once from the environment.

    attention_kernel  KVSIEVE_ATTENTION_KERNEL  on   the CPU's C++ decoding attention (`kernels.attention`)
    fused_products    KVSIEVE_FUSED_PRODUCTS    on   the CPU's C++ few-row products (`kernels.products`)
    widened_products  KVSIEVE_WIDENED_PRODUCTS  on   on a CPU without native bfloat16 products, a bfloat16 product of
                                                     more rows computed in float32 (`kernels.products`)
    compiled_steps    KVSIEVE_COMPILED_STEPS    off  decoding steps compiled by torch.compile (`engine.static_step`)
    cuda_graphs       KVSIEVE_CUDA_GRAPHS       on   on CUDA, the static decoding step captured as a CUDA graph
    flex_attention    KVSIEVE_FLEX_ATTENTION    on   on CUDA, CritiPrefill's block-sparse prefill as one FlexAttention
                                                     kernel (`kernels.block_sparse`)

The environment gives this process's defaults (`0`/`1`, `false`/`true`, `off`/`on`). `configure(...)` changes
them in the process (the CLI's `--compile-steps`) and `using(...)` for a block; neither writes the environment.
A worker process gets them explicitly: `environment()` is the current switches as the variables to pass
(`kvsieve bench` does). docs/PERFORMANCE.md says what each path measured.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, fields, replace

from kvsieve.errors import KvsieveError

_WORDS = {"1": True, "true": True, "on": True, "0": False, "false": False, "off": False}


@dataclass(frozen=True)
class FastPaths:
    """The switches; each field's variable is KVSIEVE_ + its name in capitals."""

    attention_kernel: bool = True
    fused_products: bool = True
    widened_products: bool = True
    compiled_steps: bool = False
    cuda_graphs: bool = True
    flex_attention: bool = True

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] = os.environ) -> FastPaths:
        """The defaults, changed where `environ` sets a switch's variable."""
        values = {}
        for item in fields(cls):
            variable = f"KVSIEVE_{item.name.upper()}"
            text = environ.get(variable)
            if text is None:
                continue
            if text.strip().lower() not in _WORDS:
                raise KvsieveError(f"{variable}={text!r}: use 1 or 0 (true/false, on/off).")
            values[item.name] = _WORDS[text.strip().lower()]
        return cls(**values)

    def environment(self) -> dict[str, str]:
        """These switches as the environment variables that give them to a worker process."""
        return {f"KVSIEVE_{item.name.upper()}": "1" if getattr(self, item.name) else "0" for item in fields(self)}


_current: FastPaths | None = None  # read from the environment at first use, where a bad value is reported


def current() -> FastPaths:
    """The switches in force in this process."""
    global _current
    if _current is None:
        _current = FastPaths.from_environment()
    return _current


def configure(**changes: bool) -> FastPaths:
    """Change switches for this process from now on (e.g. `configure(compiled_steps=True)`); returns the
    switches that were in force before."""
    global _current
    unknown = set(changes) - {item.name for item in fields(FastPaths)}
    if unknown:
        names = ", ".join(item.name for item in fields(FastPaths))
        raise KvsieveError(f"Unknown fast path {sorted(unknown)}: the switches are {names}.")
    before = current()
    _current = replace(before, **changes)
    return before


@contextlib.contextmanager
def using(**changes: bool) -> Iterator[FastPaths]:
    """The switches changed inside a `with` block, restored after it."""
    before = configure(**changes)
    try:
        yield current()
    finally:
        configure(**{item.name: getattr(before, item.name) for item in fields(FastPaths)})


def environment() -> dict[str, str]:
    """The switches in force, as environment variables for a worker process."""
    return current().environment()
