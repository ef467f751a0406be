"""Where a server's resident memory goes under the soak's mixed load, seen from inside its process.

    python benchmarks/serve_memory_probe.py --minutes 10 --clients 3

Runs `kvsieve serve`'s app in this process (on 127.0.0.1, the default model, --cache-memory 2GB) and sends
it `serve_bench.py soak`'s load. Every 30 s, and at the end, it prints one JSON line: the resident size, glibc's
heap (`mallinfo2`: bytes in the arenas, in use, free) and the bytes of CPU tensors Python can reach (model
included). At the end it runs `gc.collect()` and then `malloc_trim(0)` and prints both again: tensors the
collector frees were held by reference cycles; what `malloc_trim` returns, the allocator kept. With the engine's
fixes (docs/SERVING.md#memory-what-the-server-holds) both should free little. Also prints the engine's
memory-release counters. glibc only (Linux).
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import gc
import json
import random
import sys
import threading
import time
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).parent))
import serve_bench  # noqa: E402  (the soak's load and gauges)

from kvsieve.memory import release_freed, resident_bytes  # noqa: E402
from kvsieve.models import load_model  # noqa: E402
from kvsieve.registry import REGISTRY  # noqa: E402
from kvsieve.serve import ServerThread, create_server  # noqa: E402


class MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()
    ]


def heap() -> dict[str, float]:
    """glibc's heap in GB: arenas (`arena`), mapped chunks (`hblkhd`), in use (`uordblks`), free (`fordblks`)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.mallinfo2.restype = MallInfo2
    info = libc.mallinfo2()
    return {"arena": info.arena / 1e9, "mapped": info.hblkhd / 1e9, "in_use": info.uordblks / 1e9,
            "free": info.fordblks / 1e9}  # fmt: skip


def reachable_tensor_bytes() -> int:
    """Bytes of the CPU storages behind every tensor Python can reach (each storage once)."""
    storages = {}
    for item in gc.get_objects():
        if issubclass(type(item), torch.Tensor) and item.device.type == "cpu":  # type(): no proxy's __class__
            storage = item.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def sample(tag: str, answered: int) -> None:
    print(json.dumps({"tag": tag, "answered": answered, "resident": resident_bytes() / 1e9, **heap(),
                      "tensors": reachable_tensor_bytes() / 1e9}), flush=True)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=10)
    parser.add_argument("--clients", type=int, default=3)
    args = parser.parse_args()
    loaded = {}
    loader = threading.Thread(target=lambda: loaded.update(pair=load_model()))  # as `kvsieve serve` loads
    loader.start()
    loader.join()
    model, tokenizer = loaded["pair"]
    app = create_server(model, tokenizer, model_name=serve_bench.MODEL, cache_bytes=2_000_000_000)
    methods, answered = list(REGISTRY), []
    with ServerThread(app) as server:
        sample("start", 0)
        deadline = time.perf_counter() + 60 * args.minutes

        def client(index: int) -> None:
            rng, serial = random.Random(1000 + index), 0
            while time.perf_counter() < deadline:
                answered.append(serve_bench.soak_request(server.url, rng, methods, serial))
                serial += 1

        clients = [threading.Thread(target=client, args=(i,)) for i in range(args.clients)]
        for thread in clients:
            thread.start()
        while any(thread.is_alive() for thread in clients):
            time.sleep(30)
            sample("load", len(answered))
        sample("end", len(answered))
        gc.collect()
        sample("after gc.collect", len(answered))
        release_freed()
        sample("after malloc_trim", len(answered))
        counters = httpx.get(f"{server.url}/metrics").text.splitlines()
        print("\n".join(line for line in counters if line.startswith("kvsieve_memory_release")))


if __name__ == "__main__":
    main()
