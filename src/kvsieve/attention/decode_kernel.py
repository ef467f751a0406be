"""The CPU's decoding attention kernel (`decode_kernel.cpp`), built for this machine at its first use.

A decoding step's attention reads the whole cache once for one query per row. On a CPU, PyTorch's products
for it read the cache at a third to a half of the memory's speed (SmolLM2's 30 layers at 2K keys: 7.3 ms of
products against 2.9 ms to read the keys and values with `sum()`); the kernel reads each key and value once,
in chunks shared out among PyTorch's threads, and takes the logits of every query head of a KV head from each
key while it is in the registers (the C++ file says how). It serves float32 caches with head dimensions 16,
32, 64, 96, 128 or 256, one query per row, with or without each row's key count (the engine's padded batch).

The library is compiled from the C++ file by the machine's C++ compiler (`$CXX`, else `c++`; about 7 s) against
the installed torch's headers, with `-march=native`, into a cache (`$KVSIEVE_CACHE_DIR`, else
`~/.cache/kvsieve`) keyed by the source, torch's version, the compiler command and the CPU's features, and
loaded as the operator `torch.ops.kvsieve.decode_attention`, which a compiled graph calls as it is (it has a
fake implementation for tracing). Where it cannot be built (no compiler), `kernel_attention` warns once and
returns None and the caller runs PyTorch's attention. `KVSIEVE_ATTENTION_KERNEL=0` (or `set_enabled(False)`)
turns it off.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shlex
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import torch

log = logging.getLogger("kvsieve.attention")

SOURCE = Path(__file__).with_name("decode_kernel.cpp")
HEAD_DIMS = (16, 32, 64, 96, 128, 256)
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17")

_enabled = os.environ.get("KVSIEVE_ATTENTION_KERNEL", "1") != "0"
_lock = threading.Lock()
_loaded: bool | None = None  # whether the operator is registered; None until the first `load`


def set_enabled(enabled: bool) -> None:
    """Use the kernel for a CPU's decoding attention (the default) or PyTorch's attention."""
    global _enabled
    _enabled = enabled


def compile_command(output: Path) -> list[str]:
    """The compiler command that builds the kernel's library at `output`."""
    root = Path(torch.__file__).parent
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return [
        *shlex.split(os.environ.get("CXX", "c++")),
        *FLAGS,
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        f"-I{root / 'include'}",
        str(SOURCE),
        "-o",
        str(output),
        f"-L{root / 'lib'}",
        "-lc10",
        "-ltorch_cpu",
    ]


def _cpu_features() -> str:
    """The CPU's feature flags (a library built with -march=native may not run on another CPU)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def library_path() -> Path:
    """Where the library built from the current source for this torch, compiler and CPU is cached."""
    digest = hashlib.sha256()
    for part in (SOURCE.read_bytes(), torch.__version__.encode(), " ".join(compile_command(Path("x"))).encode()):
        digest.update(part)
    digest.update(_cpu_features().encode())
    cache = Path(os.environ.get("KVSIEVE_CACHE_DIR") or Path.home() / ".cache" / "kvsieve")
    return cache / "kernels" / f"decode_attention-{digest.hexdigest()[:16]}.so"


def build() -> Path:
    """Compile the library unless it is cached; its path. Concurrent builders (test workers) each write a file of
    their own and move it into place, so none loads a half-written library."""
    path = library_path()
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=path.parent) as scratch:
        output = Path(scratch) / path.name
        command = compile_command(output)
        try:
            done = subprocess.run(command, capture_output=True, text=True)
        except OSError as error:
            raise RuntimeError(f"no C++ compiler {command[0]!r} ({error}); set CXX to one") from error
        if done.returncode != 0:
            raise RuntimeError(f"compiling {SOURCE.name} failed: {done.stderr.strip()[-2000:]}")
        os.replace(output, path)
    log.info("decoding attention kernel: built in %.1f s (%s)", time.perf_counter() - start, path)
    return path


@torch.compiler.assume_constant_result  # a compiled graph asks once, while tracing, and calls the operator
def load() -> bool:
    """Build (where needed) and load the kernel once per process; False (with one warning) where that failed."""
    global _loaded
    if _loaded is not None:
        return _loaded
    with _lock:
        if _loaded is None:
            try:
                torch.ops.load_library(str(build()))
                torch.library.register_fake("kvsieve::decode_attention")(_fake)
                _loaded = True
            except Exception as error:  # no compiler, an unsupported platform: PyTorch's attention still works
                _loaded = False
                log.warning("decoding attention kernel unavailable (%s); using PyTorch's attention", error)
    return _loaded


def _fake(query, key, value, lengths, scale):
    return query.new_empty(query.shape)


def supports(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether the kernel serves these tensors: enabled, on a CPU, float32, one query per row, a head dimension it
    is built for, query heads a multiple of the KV heads, keys and values contiguous in the last dimension."""
    return (
        _enabled
        and query.device.type == "cpu"
        and query.dtype == key.dtype == value.dtype == torch.float32
        and query.shape[2] == 1
        and query.shape[-1] in HEAD_DIMS
        and query.shape[1] % key.shape[1] == 0
        and key.stride(-1) == 1
        and value.stride(-1) == 1
    )


def kernel_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scaling: float | None,
    lengths: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """A decoding step's attention through the kernel: query (b, h, 1, d), key/value (b, kv_heads, n, d), row b
    attending to its first `lengths[b]` keys (None: all n); (b, h, 1, d), or None where the kernel does not serve
    these tensors (`supports`) or could not be built."""
    if not supports(query, key, value) or not load():
        return None
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    return torch.ops.kvsieve.decode_attention(query, key, value, lengths, scale)
