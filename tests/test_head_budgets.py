"""Per-head budgets (AdaKV) in a segmented cache: the same logits as masking each head's dropped keys out of a full
cache, fewer bytes than a padded layer, the kernel's segments against PyTorch, and the engine decoding such rows
alone."""

from __future__ import annotations

import pytest
import torch
from conftest import FakeTokenizer, make_prompt
from transformers import AttentionInterface, DynamicCache

from kvsieve import Sampling, run
from kvsieve.attention import attention_hooks, kvsieve_attention
from kvsieve.compress.policies.h2o import H2O
from kvsieve.compress.policies.snapkv import SnapKV
from kvsieve.compress.stages import Compress, Evict
from kvsieve.engine.request import Request
from kvsieve.engine.scheduler import Scheduler
from kvsieve.errors import KvsieveError
from kvsieve.kernels.attention import segment_attention
from kvsieve.kv.cache import cache_nbytes
from kvsieve.kv.heads import ROOM, SegmentedLayer, head_counts, is_segmented
from kvsieve.models import architecture, with_cache
from kvsieve.registry import method
from kvsieve.spec import MethodSpec

MASKS: dict[int, torch.Tensor] = {}  # per layer (kv_heads, n) True where a head keeps a prompt entry


def masked_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """Eager attention over the full cache with each KV head's dropped prompt entries masked out (the reference); a
    sliding layer, never compressed, attends as kvsieve's own attention does in both runs."""
    if module.layer_idx not in MASKS:
        return kvsieve_attention(module, query, key, value, attention_mask, scaling, **kwargs)
    keep = MASKS[module.layer_idx]
    heads, kv_heads, q, k = query.shape[1], key.shape[1], query.shape[2], key.shape[2]
    allowed = torch.ones(kv_heads, q, k, dtype=torch.bool)
    allowed[:, :, : keep.shape[1]] = keep[:, None, :]
    allowed &= torch.arange(k) <= (k - q + torch.arange(q))[:, None]  # bottom-right causal
    logits = query @ key.repeat_interleave(heads // kv_heads, 1).transpose(-1, -2) * scaling
    if kwargs.get("softcap") is not None:  # Gemma 2
        logits = torch.tanh(logits / kwargs["softcap"]) * kwargs["softcap"]
    logits = logits.masked_fill(~allowed.repeat_interleave(heads // kv_heads, 0), float("-inf"))
    out = logits.softmax(-1) @ value.repeat_interleave(heads // kv_heads, 1)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register("test-head-masks", masked_attention)


def prefill(model, ids, compress: Compress | None):
    """The prompt's cache, compressed by `compress` where given; the run (its kept positions)."""
    cache, state = DynamicCache(config=model.config), compress.begin() if compress else None
    observers = state.observers(arch=architecture(model)) if state else []
    with torch.no_grad(), attention_hooks(last_pass=observers):
        model(input_ids=ids, **with_cache(model, cache), use_cache=True)
    if state:
        state.compress(cache)
    return cache, state


def continue_logits(model, cache, tokens: torch.Tensor, position: int) -> torch.Tensor:
    """Logits of `tokens` fed after the cache: a pass of several, then one decoding step."""
    with torch.no_grad():
        first = model(
            input_ids=tokens[:, :-1],
            position_ids=torch.arange(position, position + tokens.shape[1] - 1)[None],
            **with_cache(model, cache),
            use_cache=True,
        ).logits
        last = model(
            input_ids=tokens[:, -1:],
            position_ids=torch.tensor([[position + tokens.shape[1] - 1]]),
            **with_cache(model, cache),
            use_cache=True,
        ).logits
    return torch.cat([first, last], dim=1)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3", "gemma2"])
def test_per_head_caches_give_the_logits_of_a_full_cache_with_dropped_keys_masked(make_model, arch):
    model = make_model(arch, num_layers=6 if arch.startswith("gemma") else 3)  # Gemma: 2 or 3 global layers of 6
    ids = make_prompt(120, tail_len=8).ids
    compress = Compress(SnapKV(window=8, pool_size=1), budget=0.25, head_budgets=True)
    segmented, state = prefill(model, ids, compress)
    full, _ = prefill(model, ids, None)
    global_layers = architecture(model).global_layers
    assert all(is_segmented(segmented.layers[j]) for j in global_layers)
    MASKS.clear()
    for j in global_layers:
        kept = state.kept_positions[j]
        MASKS[j] = torch.zeros(kept.shape[0], 120, dtype=torch.bool)
        for g in range(kept.shape[0]):
            MASKS[j][g, kept[g][kept[g] >= 0]] = True
    counts = [segmented.layers[j].lengths for j in global_layers]
    assert any(len(set(c.tolist())) > 1 for c in counts)  # the heads really hold different counts
    assert all(int(c.sum()) == 30 * c.shape[0] for c in counts)  # budget x heads in all
    tokens = torch.tensor([[5, 9, 17, 3]])
    ours = continue_logits(model, segmented, tokens, 120)
    model.set_attn_implementation("test-head-masks")
    try:
        reference = continue_logits(model, full, tokens, 120)
    finally:
        model.set_attn_implementation("kvsieve")
    torch.testing.assert_close(ours, reference, rtol=1e-4, atol=1e-4)


def test_a_segmented_layer_holds_its_heads_counts_not_the_longest_heads_and_copies_on_write(make_model):
    model = make_model("llama", num_layers=2)
    ids = make_prompt(200, tail_len=8).ids
    cache, _ = prefill(model, ids, Compress(SnapKV(window=8, pool_size=1), budget=0.25, head_budgets=True))
    layer = cache.layers[0]
    entry_bytes = layer.key_buffer.shape[-1] * 2 * layer.key_buffer.element_size()
    assert layer.nbytes == 50 * layer.kv_heads * entry_bytes  # exactly budget x heads entries
    assert cache_nbytes(cache) == sum(lay.nbytes for lay in cache.layers)
    assert layer.nbytes < int(layer.lengths.max()) * layer.kv_heads * entry_bytes  # a padded layer would hold more
    shared = layer.shared()
    before = layer.key_buffer.clone()
    shared.update(torch.randn(1, layer.kv_heads, 1, 16), torch.randn(1, layer.kv_heads, 1, 16))
    assert torch.equal(layer.key_buffer, before) and torch.equal(layer.lengths, shared.lengths - 1)
    padded_keys, _ = shared.padded()
    for g in range(layer.kv_heads):
        n = int(layer.lengths[g])
        assert torch.equal(padded_keys[0, g, :n], layer.head(g)[0])


def test_head_counts_pool_the_heads_with_a_floor():
    scores = torch.tensor([[9.0, 8, 7, 6, 5, 4], [0.1, 0.2, 0.3, 0.4, 0.5, 0.6]])
    protected = torch.zeros(6, dtype=torch.bool)
    assert head_counts(scores, 3, 0.0, protected).tolist() == [6, 0]  # one top-6 over both heads
    assert head_counts(scores, 3, 0.34, protected).tolist() == [5, 1]  # each keeps round(0.34 x 3) = 1 first
    protected[-1] = True  # the window: every head keeps it, within its share
    assert head_counts(scores, 3, 0.0, protected).tolist() == [5, 1]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_segment_attention_reads_each_heads_segment(dtype, device):
    """On a CPU a decoding step is the kernel's; several queries, and every step on CUDA, the gathered path."""
    if device == "cuda":
        assert torch.cuda.is_available(), "the gpu tests need CUDA (run them with `make test-gpu` on a GPU machine)"
    generator = torch.Generator().manual_seed(0)
    lengths = torch.tensor([[5, 40, 17], [33, 3, 60]], device=device)
    sizes = (lengths + 7).flatten()  # 7 free entries after each segment
    starts = (torch.cumsum(sizes, 0) - sizes).view(2, 3)
    key = torch.randn(int(sizes.sum()), 64, generator=generator).to(device, dtype)
    value = torch.randn(int(sizes.sum()), 64, generator=generator).to(device, dtype)
    for q in (1, 3):
        query = torch.randn(2, 9, q, 64, generator=generator).to(device, dtype)
        out = segment_attention(query, key, value, starts, lengths, None, 60)
        for b in range(2):
            for g in range(3):
                k = key[starts[b, g] : starts[b, g] + lengths[b, g]]
                v = value[starts[b, g] : starts[b, g] + lengths[b, g]]
                heads = query[b : b + 1, 3 * g : 3 * g + 3]
                expected = torch.nn.functional.scaled_dot_product_attention(
                    heads.float(), k[None, None].float(), v[None, None].float(),
                    attn_mask=_bottom_right(q, len(k)).to(device),
                )  # fmt: skip
                tol = 1e-5 if dtype == torch.float32 else 2e-2
                torch.testing.assert_close(out[b, 3 * g : 3 * g + 3].float(), expected[0], rtol=tol, atol=tol)


def _bottom_right(q: int, k: int) -> torch.Tensor:
    return torch.arange(k) <= (k - q + torch.arange(q))[:, None]


def test_per_head_rows_decode_in_one_segmented_batch_with_others_each_as_alone(make_model):
    """Two per-head requests and one of one count per head decode together (segmented tables: each row's heads hold
    their own entries); an evicting request waits until the batch is padded again. Every answer is its answer
    alone."""
    model = make_model("gemma3", num_layers=6)  # sliding layers' rings beside the segmented global layers
    tokenizer = FakeTokenizer()
    prompts = [make_prompt(100, tail_len=8, seed=s) for s in (1, 2)]
    heads = method("snapkv", {"compress.head_budgets": True, "compress.budget": 0.5, "compress.policy.window": 8})
    specs = [(prompts[0], heads), (prompts[1], heads), (prompts[0], method("snapkv")), (prompts[1], method("h2o"))]
    sampling = Sampling(max_new_tokens=140)  # past the segments' first room: the batch reallocates them
    alone = [run(model, tokenizer, prompt, method=spec, sampling=sampling).tokens for prompt, spec in specs]
    scheduler = Scheduler(model, tokenizer)
    requests = [Request(prompt, spec, sampling) for prompt, spec in specs]
    widths = []
    original = scheduler.batch.step

    def step():
        widths.append((len(scheduler.batch), scheduler.batch.tables.segmented))
        return original()

    scheduler.batch.step = step
    scheduler.run_to_end(requests)
    assert [r.result.tokens for r in requests] == alone
    assert (3, True) in widths  # the per-head rows and the plain one together
    assert all(not (size == 4) for size, _ in widths)  # the evicting one never with the per-head ones
    assert widths[-1] == (1, False)  # it decodes in padded tables once they left


def test_a_waiting_evicting_request_goes_before_a_later_per_head_one(make_model):
    """Per-head, evicting, per-head: the evicting one waits for the first to leave, and the last waits for it (no
    kind waits for ever behind the other); each answers as alone."""
    model = make_model("llama", num_layers=2)
    tokenizer, prompt = FakeTokenizer(), make_prompt(100, tail_len=8)
    heads = method("snapkv", {"compress.head_budgets": True, "compress.budget": 0.5, "compress.policy.window": 8})
    specs = [heads, method("h2o", {"evict.budget": 40}), heads]
    sampling = Sampling(max_new_tokens=5)
    alone = [run(model, tokenizer, prompt, method=spec, sampling=sampling).tokens for spec in specs]
    scheduler = Scheduler(model, tokenizer)
    requests = [Request(prompt, spec, sampling) for spec in specs]
    kinds = []
    original = scheduler.batch.step

    def step():
        kinds.append(tuple(r.spec.name for r in scheduler.running))
        return original()

    scheduler.batch.step = step
    scheduler.run_to_end(requests)
    assert [r.result.tokens for r in requests] == alone
    assert [k for i, k in enumerate(kinds) if i == 0 or k != kinds[i - 1]] == [("snapkv",), ("h2o",), ("snapkv",)]


def test_a_segmented_layer_holds_each_heads_entries_then_room_after_each():
    layer = SegmentedLayer([torch.randn(n, 4) for n in (5, 9)], [torch.randn(n, 4) for n in (5, 9)], room=0)
    assert layer.nbytes == 14 * 2 * 4 * 4 and not layer.equal
    layer.update(torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4))  # no room: reallocated with ROOM after each head
    assert layer.counts == [8, 12] and layer.has_room(ROOM - 3) and not layer.has_room(ROOM - 2)


def test_head_budgets_refuse_what_holds_one_count_per_head(make_model):
    with pytest.raises(KvsieveError, match="prompt scorer"):
        Compress(H2O(), head_budgets=True)
    with pytest.raises(KvsieveError, match="head_floor"):
        Compress(SnapKV(), head_budgets=True, head_floor=1.5)
    model = make_model("llama", num_layers=2)
    both = MethodSpec("both", "", compress=Compress(SnapKV(), 0.5, head_budgets=True), evict=Evict(H2O(), 0.25))
    with pytest.raises(KvsieveError, match="evict stage"):
        run(model, FakeTokenizer(), make_prompt(100), method=both, sampling=Sampling(max_new_tokens=2))
    with pytest.raises(KvsieveError, match="cannot be compressed again"):
        cache, state = prefill(model, make_prompt(100).ids, Compress(SnapKV(), 0.5, head_budgets=True))
        state.compress(cache)
    assert isinstance(cache.layers[0], SegmentedLayer)
