"""The fast paths' one seam: for each operator a decoding step spends its time in, one dispatch that chooses kvsieve's
C++ kernel where it serves the tensors and PyTorch's operators everywhere else. Nothing outside this package calls a
kernel or holds a fallback.

    operator                 dispatch                                   C++ (a CPU's)    PyTorch (any device)
    a step's attention       `attention.decode_attention`, `_probs`     `attention.cpp`  grouped product, SDPA
    a step's linear products `products.linear` (`FusedLinear`)          `products.cpp`   `F.linear` (bfloat16 widened
                                                                                         where the CPU lacks it), a
                                                                                         traced row
    a steady row's eviction  `eviction.steady_eviction`                 `eviction.cpp`   the same function's tensors

One prefill operator has a fused kernel on CUDA: block-sparse attention (`block_sparse.segment_block_attention`,
PyTorch's FlexAttention over a BlockMask), which `block_sparse.serves` chooses for CritiPrefill's sparse layers; where
it does not serve, CritiPrefill gathers the selected keys for SDPA (`kvsieve.attention.critiprefill.sparse_attention`).

`native` builds the C++ operators into one library at their first use (`native.load`; `native.build_kernels` before a
server answers). The switches that turn the kernels off are settings (`kvsieve.fast_paths`), read by the dispatches;
the compiled and CUDA-captured decoding steps, which run these same operators inside one graph, are the engine's
(`kvsieve.engine.static_step`). To add a kernel: its C++ file here (listed in `native.SOURCES`, with a fake for
`torch.compile`), and its choice inside the operator's dispatch, never at a caller. docs/PERFORMANCE.md gives what
each path measured.
"""
