"""The CPU's decoding attention kernel (kvsieve.kernels.attention) against PyTorch's attention.

Inside a compiled graph (the CPU's compiled step) the operator is covered by test_compiled_step.py: the tiny
models' float32 steps take it, and a run compiles one graph (a graph break would make more)."""

from __future__ import annotations

import pytest
import torch

from kvsieve import fast_paths
from kvsieve.attention import dense_attention, grouped_attention
from kvsieve.kernels.attention import grouped_probs, kernel_attention, kernel_attention_probs, supports


def cache_views(rows: int, kv_heads: int, keys: int, dim: int, spare: int = 9, seed: int = 0):
    """Keys and values as the engine hands them over: views of wider tables (capacity past the keys)."""
    generator = torch.Generator().manual_seed(seed)
    keys_table = torch.randn(rows, kv_heads, keys + spare, dim, generator=generator)
    values_table = torch.randn(rows, kv_heads, keys + spare, dim, generator=generator)
    return keys_table[:, :, :keys], values_table[:, :, :keys]


@pytest.mark.parametrize(
    ("rows", "heads", "kv_heads", "dim", "keys"),
    [
        (1, 9, 3, 64, 2176),  # SmolLM2's shape
        (1, 4, 4, 16, 1),  # one key
        (2, 4, 2, 16, 255),
        (2, 8, 2, 32, 256),  # four query heads per KV head
        (3, 10, 2, 96, 257),  # five query heads per KV head: a group of four, then one
        (1, 12, 2, 128, 600),  # six per KV head: four, then two
        (2, 2, 1, 256, 300),
        (1, 2, 1, 16, 4500),  # more keys than a chunk takes (MAX_CHUNK), whatever the threads
    ],
)
@pytest.mark.parametrize("ragged", [False, True])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_the_kernel_matches_pytorchs_attention(rows, heads, kv_heads, dim, keys, ragged, threads):
    """On 1, 2 and 3 threads, which split the keys into different chunks (ragged rows: some chunks past a row's
    keys); with its probabilities (`kernel_attention_probs`), the same output and PyTorch's softmax, 0 past a row's
    length."""
    key, value = cache_views(rows, kv_heads, keys, dim)
    query = torch.randn(rows, heads, 1, dim, generator=torch.Generator().manual_seed(1))
    lengths = torch.tensor([max(1, keys - 97 * b) for b in range(rows)]) if ragged else None
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = kernel_attention(query, key, value, None, lengths)
        attended = kernel_attention_probs(query, key, value, None, lengths)
    finally:
        torch.set_num_threads(before)
    assert out is not None and out.shape == query.shape
    torch.testing.assert_close(out, grouped_attention(query, key, value, None, lengths), rtol=1e-5, atol=1e-5)
    assert attended is not None and attended[1].shape == (rows, heads, keys)
    torch.testing.assert_close(attended[0], out, rtol=0, atol=0)
    expected = grouped_probs(query, key, None, lengths)[:, :, 0]
    torch.testing.assert_close(attended[1], expected, rtol=1e-5, atol=1e-7)
    if lengths is not None:
        for b, n in enumerate(lengths.tolist()):
            assert attended[1][b, :, n:].eq(0).all()


@pytest.mark.parametrize("ragged", [False, True])
@pytest.mark.parametrize("threads", [1, 2])
def test_a_bfloat16_cache_is_read_as_its_float32_widening(ragged, threads):
    """A bfloat16 cache is widened to float32 as it loads (exactly: bfloat16 is a float32's top half), and the
    kernel computes in float32: its output is the float32 kernel's on the widened tensors, rounded once to bfloat16,
    and its probabilities are the same, to the bit."""
    key, value = (t.bfloat16() for t in cache_views(2, 3, 2176, 64, seed=6))
    query = torch.randn(2, 9, 1, 64, generator=torch.Generator().manual_seed(7)).bfloat16()
    lengths = torch.tensor([2176, 700]) if ragged else None
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out, probs = kernel_attention_probs(query, key, value, None, lengths)
        wide, wide_probs = kernel_attention_probs(query.float(), key.float(), value.float(), None, lengths)
    finally:
        torch.set_num_threads(before)
    assert out.dtype == torch.bfloat16 and probs.dtype == torch.float32
    assert torch.equal(out, wide.bfloat16()) and torch.equal(probs, wide_probs)
    reference = grouped_attention(query.double(), key.double(), value.double(), None, lengths)
    torch.testing.assert_close(out.double(), reference, rtol=0.01, atol=0.01)  # bfloat16's rounding of the output


def test_large_logits_and_a_given_scale():
    """Logits of more than a hundred (a softmax that would overflow unshifted) and a scale other than 1/sqrt(d),
    against float64 attention. A float32 logit of 130 is rounded by up to eps x 130 (1.5e-5), which moves the output
    by that times |value|, whatever the order of the sums: that is the tolerance (6.8e-5 here), and PyTorch's
    float32 attention is held to it too (the kernel is 7.2e-6 off, PyTorch 8.1e-6; their errors differ, up to
    1.5e-5 from each other, so they are not compared with each other at 1e-5 as the small logits above are)."""
    key, value = cache_views(2, 2, 700, 64)
    query = 8 * torch.randn(2, 6, 1, 64, generator=torch.Generator().manual_seed(2))
    lengths = torch.tensor([700, 333])
    group = query.shape[1] // key.shape[1]
    keys64, values64 = (t.double().repeat_interleave(group, 1) for t in (key, value))
    logits = query.double() @ keys64.transpose(-1, -2) * 0.5  # (rows, heads, 1, keys)
    logits = logits.masked_fill(torch.arange(700) >= lengths.view(-1, 1, 1, 1), float("-inf"))
    assert logits.amax() > 100
    reference = logits.softmax(-1) @ values64
    tolerance = torch.finfo(torch.float32).eps * logits.amax().item() * value.abs().max().item()
    out = kernel_attention(query, key, value, 0.5, lengths)
    for attention in (out, grouped_attention(query, key, value, 0.5, lengths)):
        assert (attention.double() - reference).abs().max() < tolerance


def test_a_row_reads_only_its_own_keys():
    """Keys past a row's length (the batch's padding) change nothing, however large (3000 keys are more than one
    chunk, so the first row's later chunks lie wholly past its keys)."""
    key, value = cache_views(2, 1, 3000, 16)
    query = torch.randn(2, 2, 1, 16)
    lengths = torch.tensor([120, 3000])
    before = kernel_attention(query, key, value, None, lengths)
    torch.testing.assert_close(before, grouped_attention(query, key, value, None, lengths), rtol=1e-5, atol=1e-5)
    key[0, :, 120:] = 1e4
    value[0, :, 120:] = float("nan")
    after = kernel_attention(query, key, value, None, lengths)
    torch.testing.assert_close(after, before)


def test_tensors_the_kernel_does_not_serve_take_pytorchs_attention():
    key, value = cache_views(1, 2, 50, 64)
    query = torch.randn(1, 4, 1, 64)
    assert supports(query, key, value) and supports(query.bfloat16(), key.bfloat16(), value.bfloat16())
    assert not supports(query.half(), key.half(), value.half()) and not supports(query.bfloat16(), key, value)
    assert not supports(torch.randn(1, 4, 3, 64), key, value)  # several queries (a prefill)
    key80, value80 = cache_views(1, 2, 50, 80)
    assert kernel_attention(torch.randn(1, 4, 1, 80), key80, value80, None) is None
    strided = key.transpose(-1, -2).contiguous().transpose(-1, -2)  # d not contiguous
    assert kernel_attention(query, strided, value, None) is None
    bf16 = dense_attention(query.bfloat16(), key.bfloat16(), value.bfloat16(), None)  # still answered, by SDPA
    torch.testing.assert_close(bf16.float(), kernel_attention(query, key, value, None), rtol=0.02, atol=0.02)


def test_dense_attention_takes_the_kernel_for_one_query(monkeypatch):
    key, value = cache_views(1, 2, 40, 16)
    query = torch.randn(1, 4, 1, 16)
    calls = []
    monkeypatch.setattr(torch.ops.kvsieve, "decode_attention", lambda *args: calls.append(args) or args[0])
    dense_attention(query, key, value, None)
    assert len(calls) == 1
    with fast_paths.using(attention_kernel=False):
        dense_attention(query, key, value, None)
    assert len(calls) == 1


def test_bad_lengths_are_refused():
    key, value = cache_views(1, 1, 10, 16)
    query = torch.randn(1, 1, 1, 16)
    for bad in (0, 11):
        with pytest.raises(RuntimeError, match="length must be in 1..10"):
            kernel_attention(query, key, value, None, torch.tensor([bad]))


def test_the_dispatch_takes_the_kernel_where_it_serves_and_pytorch_elsewhere():
    """`decode_attention` / `decode_attention_probs` are the one choice between the kernel and PyTorch: float32 on
    a CPU gives exactly the kernel's output; with the kernel switched off or a soft-cap (which the kernel lacks),
    PyTorch's grouped product or SDPA answers, and every answer agrees with PyTorch's attention (bfloat16's within
    its rounding)."""
    from kvsieve.kernels.attention import decode_attention, decode_attention_probs

    key, value = cache_views(2, 2, 300, 64, seed=4)
    query = torch.randn(2, 6, 1, 64, generator=torch.Generator().manual_seed(5))
    lengths = torch.tensor([300, 170])
    expected = grouped_attention(query, key, value, None, lengths)
    served = kernel_attention(query, key, value, None, lengths)
    assert served is not None and torch.equal(decode_attention(query, key, value, None, lengths), served)
    assert torch.equal(decode_attention_probs(query, key, value, None, lengths)[0], served)
    with fast_paths.using(attention_kernel=False):
        out, probs = decode_attention_probs(query, key, value, None, lengths)
        torch.testing.assert_close(decode_attention(query, key, value, None, lengths), expected)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(probs, grouped_probs(query, key, None, lengths)[:, :, 0])
    capped = decode_attention(query, key, value, None, lengths, softcap=5.0)
    torch.testing.assert_close(capped, grouped_attention(query, key, value, None, lengths, None, 5.0))
    assert not torch.allclose(capped, expected, atol=1e-3)  # the cap was applied, not the kernel's plain attention
    row = decode_attention(query[:1].bfloat16(), key[:1].bfloat16(), value[:1].bfloat16(), None)
    torch.testing.assert_close(row.float(), dense_attention(query[:1], key[:1], value[:1], None), rtol=0.03, atol=0.03)


def test_no_module_outside_the_kernels_package_calls_a_kernel():
    """The fast paths' seam: only `kvsieve.kernels` calls kvsieve's C++ operators or loads their library, so each
    operator's choice and fallback live in one place."""
    from pathlib import Path

    import kvsieve

    package = Path(kvsieve.__file__).parent
    calls = ("torch.ops.kvsieve", "native.load(", "kernels.native import load")
    callers = [
        str(path.relative_to(package))
        for path in package.rglob("*.py")
        if path.parent.name != "kernels" and any(call in path.read_text() for call in calls)
    ]
    assert callers == []
