"""Where cached keys and values live, and how entries move: the one home of KV storage.

    cache.py       a transformers cache's entries per layer and KV head: budgets, the gather that frees memory after
                   a one-shot compression, re-rotating keys to new positions, and the buffers decoding writes into
                   (`DecodeBuffer`, a sliding layer's ring `WindowBuffer`) with their eviction moves (`EntryTables`)
    tables.py      the decoding batch's shared tables: every running row's buffers are slices of them, and a static
                   step writes into them at columns held in tensors (`ScatterLayer`)
    in_place.py    an evicting run inside those buffers: at most the evicted entries move, in every layer at once
    reencoding.py  StreamingLLM's positions by place in the cache, for one evicting run

What to keep is decided elsewhere: the policies and their scores in `compress/`, the batch and its steps in `engine/`.
"""
