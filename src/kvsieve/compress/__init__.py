"""The `compress` stage and per-step eviction: shrink the KV cache by a policy and a budget.

- `policy.py`: the interface of a KV policy (scores per KV head and token, protected positions);
- `policies/`: one module per policy: SnapKV, PyramidKV, H2O, A2SF, StreamingLLM, local window, TOVA, KNorm,
  Collie (IMDC's authors' pruner);
- `scorers.py`: the shared scoring functions (window attention, accumulated attention with a
  forgetting factor, top-k with protected positions), used by compress, eviction and chunked feeds;
- `stages.py`: `Compress` (once, after prefill) and `Evict` (while decoding), each with a per-run state.

Where the entries live and how they move (buffers, tables, in-place eviction, re-encoded positions) is `kvsieve.kv`.
"""
