"""The request lifecycle every entry point shares (vLLM's engine core, in small).

    slices.py        prefill that pauses between decoder layers once it has spent a token budget
    request.py       one request: prefill in slices, then decoding steps; its events and result
    batch.py         the running requests' caches in shared tables, one step for every batch size, in place
    scheduler.py     each step: a decoding token for every running request plus budgeted prefill
    prefix_cache.py  stored prompt prefixes that later requests continue (exact context reuse)
    offline.py       `run` / `generate`: the library drives its requests to the end

`kvsieve serve` (serve/) is only the HTTP front of a `Scheduler`; it has no prefill or decoding
of its own.
"""
