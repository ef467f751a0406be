"""kvsieve's C++ kernels for a CPU's decoding steps: one library, built for this machine at its first use.

Three kinds of operators, each in a C++ file of its own beside this one, each called by the dispatch of the same
name (`kvsieve.kernels`):
- `torch.ops.kvsieve.decode_attention` (`attention.cpp`): a decoding step's attention in one pass over the cache
  (`kvsieve.kernels.attention`), and `segment_attention`, the same over a cache whose KV heads hold their own counts;
- `torch.ops.kvsieve.decode_product` (`products.cpp`): a step's few rows times a float32, bfloat16 or int8 weight,
  each weight read once (`kvsieve.kernels.products`);
- `torch.ops.kvsieve.evict_lowest` (`eviction.cpp`): a steady evicting row's eviction of one entry per KV head
  after a decoding step (`kvsieve.kernels.eviction`).

The library is compiled from those files by the machine's C++ compiler (`$CXX`, else `c++`) against the installed
torch's headers, as one translation unit (`unity_source`): most of a file's compile is parsing those headers, which
one unit parses once (10.5-12.3 s on one core, against 11.1-12.2 s for the three files compiled side by side on
two, about 21 s of CPU time: on a fresh machine the build runs beside the default model's conversion). Flags:
`-march=native` and `-ffp-contract=fast` (the kernels' sums are chains of multiply-adds: fused, the attention over
SmolLM2's 30 layers at 2K keys took 4.3-6.2 ms instead of 7.0-7.4, docs/STUDIES.md). The library goes into
kvsieve's cache folder (`kvsieve.paths.cache_dir()`), keyed by the sources, torch's version, the compiler commands
and the CPU's features. Each operator has a fake implementation, so a compiled graph calls it as it is. Where the
library cannot be built (no compiler), `load` warns once and returns False, and the callers run PyTorch's
attention, products and eviction.
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

from kvsieve import fast_paths
from kvsieve.paths import cache_dir

log = logging.getLogger("kvsieve.kernels")

SOURCES = tuple(Path(__file__).with_name(name) for name in ("attention.cpp", "products.cpp", "eviction.cpp"))
HEADERS = (Path(__file__).with_name("vectors.h"),)  # what the sources share (the vectors they compute with)
FLAGS = ("-O3", "-march=native", "-ffp-contract=fast", "-fopenmp", "-fPIC", "-std=c++17")

_lock = threading.Lock()
_loaded: bool | None = None  # whether the operators are registered; None until the first `load`


def _compiler() -> list[str]:
    return shlex.split(os.environ.get("CXX", "c++"))


def compile_command(source: Path, output: Path) -> list[str]:
    """The command that compiles one C++ file into the object `output`."""
    root = Path(torch.__file__).parent
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return [*_compiler(), *FLAGS, f"-D_GLIBCXX_USE_CXX11_ABI={abi}", f"-I{root / 'include'}", "-c", str(source),
            "-o", str(output)]  # fmt: skip


def link_command(objects: list[Path], output: Path) -> list[str]:
    """The command that links the objects into the shared library `output`."""
    lib = Path(torch.__file__).parent / "lib"
    return [*_compiler(), "-shared", "-fopenmp", *map(str, objects), "-o", str(output), f"-L{lib}", "-lc10",
            "-ltorch_cpu"]  # fmt: skip


def _cpu_features() -> str:
    """The CPU's feature flags (a library built with -march=native may not run on another CPU)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def unity_source() -> str:
    """The one translation unit the library is compiled from: every source, included by its absolute path."""
    return "".join(f'#include "{source.resolve()}"\n' for source in SOURCES)


def library_path() -> Path:
    """Where the library built from the current sources for this torch, compiler and CPU is cached."""
    digest = hashlib.sha256()
    for source in (*SOURCES, *HEADERS):
        digest.update(source.read_bytes())
    digest.update(unity_source().encode())
    digest.update(" ".join(compile_command(Path("x"), Path("x"))).encode())
    digest.update(" ".join(link_command([Path("x")], Path("x"))).encode())
    digest.update(torch.__version__.encode())
    digest.update(_cpu_features().encode())
    return cache_dir() / "kernels" / f"kvsieve-{digest.hexdigest()[:16]}.so"


def _run(command: list[str], what: str) -> None:
    """Run the compiler or the linker (`what` it does, for the message); raise with its output where it failed."""
    try:
        done = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    except OSError as error:
        raise RuntimeError(f"no C++ compiler {command[0]!r} ({error}); set CXX to one") from error
    if done.returncode != 0:
        raise RuntimeError(f"{what} failed: {done.stderr.strip()[-2000:]}")


def build() -> Path:
    """Compile the library unless it is cached; its path. Concurrent builders (test workers) each write a file of
    their own and move it into place, so none loads a half-written library."""
    path = library_path()
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=path.parent) as scratch:
        unity, kernels, output = Path(scratch) / "kernels.cpp", Path(scratch) / "kernels.o", Path(scratch) / path.name
        unity.write_text(unity_source())
        _run(compile_command(unity, kernels), "compiling " + ", ".join(source.name for source in SOURCES))
        _run(link_command([kernels], output), "linking the kernels' library")
        os.replace(output, path)
    log.info("CPU kernels: built in %.1f s (%s)", time.perf_counter() - start, path)
    return path


def _fake_attention(query, key, value, lengths, scale):
    return query.new_empty(query.shape)


def _fake_attention_probs(query, key, value, lengths, scale):  # the probabilities are float32 whatever the cache
    probs = query.new_empty((query.shape[0], query.shape[1], key.shape[2]), dtype=torch.float32)
    return query.new_empty(query.shape), probs


def _fake_segment_attention(query, key, value, starts, lengths, scale):
    return query.new_empty(query.shape)


def _fake_product(x, weight, scale):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _fake_eviction(keys, values, row, scores, carried, stamp_table, clock, budget, sinks, recent):
    return stamp_table.new_empty(stamp_table.shape[:2])


@torch.compiler.assume_constant_result  # a compiled graph asks once, while tracing, and calls the operators
def load() -> bool:
    """Build (where needed) and load the library once per process; False (with one warning) where that failed."""
    global _loaded
    if _loaded is not None:
        return _loaded
    with _lock:
        if _loaded is None:
            try:
                torch.ops.load_library(str(build()))
                torch.library.register_fake("kvsieve::decode_attention")(_fake_attention)
                torch.library.register_fake("kvsieve::decode_attention_probs")(_fake_attention_probs)
                torch.library.register_fake("kvsieve::segment_attention")(_fake_segment_attention)
                torch.library.register_fake("kvsieve::decode_product")(_fake_product)
                torch.library.register_fake("kvsieve::evict_lowest")(_fake_eviction)
                _loaded = True
            except Exception as error:  # no compiler, an unsupported platform: PyTorch's operators still work
                _loaded = False
                log.warning("CPU kernels unavailable (%s); using PyTorch's attention and products", error)
    return _loaded


def build_kernels(model: torch.nn.Module) -> float:
    """Build and load now the C++ kernels that `model`'s decoding steps on a CPU call; seconds spent. A server calls
    it before serving, so that no request waits for the compiler (about 8 s on a machine that has not built them,
    nothing after). Nothing is built where they are not used (a GPU, both kernels off)."""
    device = next(model.parameters()).device
    switches = fast_paths.current()
    if device.type != "cpu" or not (switches.fused_products or switches.attention_kernel):
        return 0.0
    start = time.perf_counter()
    load()
    return time.perf_counter() - start
