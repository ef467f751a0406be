"""Chunked prefill with a compressed memory (FM / IM / IMDC, Zeng et al., EMNLP 2024) and its schedules.

Expected schedule values below are worked out by hand from the paper's equations, not from the
code: n = 4 chunks, m_max = 100, so m_0 = m_max / n = 25 (section 4.1) and
  linear (eq. 1): 25 + 75 i / 3            -> 25, 50, 75, 100
  square (eq. 8): 25 + 75 i^2 / 9          -> 25, 33.3, 58.3, 100     -> 25, 33, 58, 100
  sqrt   (eq. 9): 25 + 75 sqrt(i) / sqrt 3 -> 25, 68.3, 86.2, 100     -> 25, 68, 86, 100
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from conftest import FakeTokenizer, build_model, make_prompt
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from kvsieve import A2SF, H2O, Collie, SnapKV, StreamingLLM
from kvsieve.attention import attention_hooks
from kvsieve.compress.policy import LayerPass
from kvsieve.compress.stages import Evict
from kvsieve.decode import Sampling
from kvsieve.engine.offline import run
from kvsieve.errors import KvsieveError
from kvsieve.feed.chunked import ChunkedPrefill, rerotate_keys
from kvsieve.feed.full import FullPrefill
from kvsieve.feed.schedules import (
    adaptive_memory,
    decremental_chunks,
    fixed_chunks,
    incremental_memory,
    layer_memory,
    num_chunks,
    retention_ratio,
    square_sqrt_curves,
)
from kvsieve.kv.cache import rotation, rotation_table, table_turn

ARCHS3 = ("llama", "mistral", "qwen2")
# (schedule, decremental): FM, IM with each curve, IMDC.
VARIANTS = [
    ("fixed", False),
    ("linear", False),
    ("sqrt", False),
    ("square", False),
    ("square-sqrt", False),
    ("adaptive", False),
    ("linear", True),
    ("square-sqrt", True),
    ("adaptive", True),
]


# ---------------------------------------------------------------- schedules (pure functions)


def test_incremental_curves_match_the_paper():
    assert incremental_memory(4, 100, "linear") == [25, 50, 75, 100]
    assert incremental_memory(4, 100, "square") == [25, 33, 58, 100]
    assert incremental_memory(4, 100, "sqrt") == [25, 68, 86, 100]
    # One chunk is the last step: the whole memory. Rounding is half up, sizes at least 1:
    # m_max = 4, n = 8: 0.5, 1, 1.5, ..., 4.
    assert incremental_memory(1, 100) == [100]
    assert incremental_memory(8, 4) == [1, 1, 2, 2, 3, 3, 4, 4]
    # initial m_0 = 0: 0, 4.5, 9 -> the first is raised to 1 slot, 4.5 rounds half up.
    assert incremental_memory(3, 9, "linear", initial=0) == [1, 5, 9]
    assert layer_memory("fixed", 3, 7, 2) == [[7, 7]] * 3
    assert num_chunks(100, 16) == 7 and fixed_chunks(100, 16) == [16] * 6 + [4]


def test_square_sqrt_is_per_layer():
    assert square_sqrt_curves(4) == ["square", "square", "sqrt", "sqrt"]
    assert square_sqrt_curves(3) == ["square", "linear", "sqrt"]
    steps = layer_memory("square-sqrt", 4, 100, 3)
    assert steps == [[25, 25, 25], [33, 50, 68], [58, 75, 86], [100, 100, 100]]
    # Adaptive starts from the linear sizes b_i^j (eq. 3's base).
    assert layer_memory("adaptive", 4, 100, 2) == [[25, 25], [50, 50], [75, 75], [100, 100]]


def test_adaptive_scales_linear_by_retention():
    # eq. 3: p / sum(p) * N * b: N = 2, b = 50, p = 0.2 / 0.6 -> 0.25 * 100, 0.75 * 100.
    assert adaptive_memory([50, 50], [0.2, 0.6]) == [25, 75]
    assert adaptive_memory([40, 40, 40], [0.5, 0.5, 0.5]) == [40, 40, 40]
    assert adaptive_memory([30, 30], [0.0, 0.0]) == [30, 30]  # nothing retained: linear
    assert adaptive_memory([10, 10], [0.0, 1.0]) == [1, 20]  # at least one slot
    # eq. 2: sinks 0-1, previous memory at [2, 6) -> kept memory 3, 5 (from memory), 7, 9 (chunk).
    assert retention_ratio(torch.tensor([[0, 1, 3, 5, 7, 9]]), 2, 6, sinks=2) == 0.5
    assert retention_ratio(torch.tensor([[0, 1, 3, 5, 7, 9], [0, 1, 6, 7, 8, 9]]), 2, 6, sinks=2) == 0.25


def test_decremental_chunks_eq_5_to_7():
    # L = n * c: c_0 = 10, c_i = c + m_hat - m_{i-1} with m_hat = (2 + 4 + 6) / 3 = 4.
    memory = [2, 4, 6, 8]
    chunks = decremental_chunks(40, 10, memory)
    assert chunks == [10, 12, 10, 8]
    assert {c + m for c, m in zip(chunks[1:], memory[:-1], strict=True)} == {14}  # eq. 6
    assert sum(chunks) / len(chunks) == 10  # eq. 5
    # L not a multiple of c: the later chunks share L - c_0; memory + chunk within one token.
    assert decremental_chunks(37, 10, memory) == [10, 11, 9, 7]
    # L = 38: K = 13 leaves one spare token, given to the earliest step (memory + chunk 14, 13, 13).
    assert decremental_chunks(38, 10, memory) == [10, 12, 9, 7]
    # A memory much larger than the chunk: eq. 7 would go below one token; clamp, keep the sum.
    assert decremental_chunks(25, 10, [1, 30, 60]) == [10, 14, 1]
    assert decremental_chunks(5, 10, [3]) == [5]


@pytest.mark.parametrize("length", [1000, 1024, 1500, 3001])
@pytest.mark.parametrize("curve", ["linear", "sqrt", "square"])
def test_decremental_chunks_sum_and_constant_kv(length, curve):
    n = num_chunks(length, 128)
    memory = incremental_memory(n, 128, curve)
    chunks = decremental_chunks(length, 128, memory)
    assert len(chunks) == n and sum(chunks) == length and min(chunks) >= 1 and chunks[0] == 128
    kv = [c + m for c, m in zip(chunks[1:], memory, strict=False)]
    assert max(kv) - min(kv) <= 1  # eq. 6, whole tokens
    assert max(kv) < 128 + 128  # below FM's c + m_max


# ---------------------------------------------------------------- the feed


@pytest.mark.parametrize("arch", ARCHS3)
def test_large_memory_reproduces_full_prefill(arch, single_thread):
    model = build_model(arch)
    ids = make_prompt(90).ids
    full = FullPrefill().prefill(model, ids).last_logits
    for schedule, decremental in VARIANTS:
        # IM starts from m_max / n: m_max = L * n keeps every token at every step.
        feed = ChunkedPrefill(chunk=16, memory=90 * 6, schedule=schedule, decremental=decremental)
        out = feed.prefill(model, ids)
        assert out.next_position == 90
        assert out.cache.get_seq_length() == 90
        torch.testing.assert_close(out.last_logits, full, atol=1e-4, rtol=1e-4)


def test_chunk_logits_are_the_full_models_logits(single_thread):
    model = build_model("llama")
    ids = make_prompt(50).ids
    with torch.no_grad():
        reference = model(input_ids=ids).logits[0]
    pieces: dict[int, torch.Tensor] = {}
    out = ChunkedPrefill(chunk=16, memory=400).prefill(model, ids, chunk_logits=lambda lg, s: pieces.update({s: lg}))
    assert sorted(pieces) == [0, 16, 32, 48]
    torch.testing.assert_close(torch.cat([pieces[s] for s in sorted(pieces)]), reference, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out.last_logits, reference[-1], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("pruner", [SnapKV(window=4), StreamingLLM(), A2SF(alpha=0.5), H2O()])
@pytest.mark.parametrize(("schedule", "decremental"), VARIANTS)
def test_memory_never_exceeds_its_step_size(pruner, schedule, decremental, single_thread):
    model = build_model("mistral", num_layers=3)
    ids = make_prompt(120).ids
    feed = ChunkedPrefill(chunk=16, memory=24, schedule=schedule, decremental=decremental, pruner=pruner)
    out = feed.prefill(model, ids)
    sizes = out.details["chunk_sizes"]
    assert sum(sizes) == 120 and out.details["steps"] == len(sizes) == len(out.history)
    planned_chunks, planned_memory = feed.plan(120, 3)
    assert sizes == planned_chunks
    previous = [0, 0, 0]
    for step, record in enumerate(out.history):
        sinks_before, seen = min(4, record["start"]), record["start"] + record["chunk"]
        sinks_after = min(4, seen)
        for layer, length in enumerate(record["cache_lengths"]):
            keys = sinks_before + previous[layer] + record["chunk"]
            assert length == min(keys, sinks_after + record["memory"][layer])
            if schedule != "adaptive":
                assert record["memory"][layer] == planned_memory[step][layer]
        # Attention ran over sinks + previous memory + chunk.
        assert out.details["attention_kv"][step] == max(sinks_before + m + record["chunk"] for m in previous)
        previous = [length - sinks_after for length in record["cache_lengths"]]
    assert [layer.keys.shape[2] for layer in out.cache.layers] == out.history[-1]["cache_lengths"]
    last = out.history[-1]["memory"]
    if schedule == "adaptive":
        assert abs(sum(last) - 3 * 24) <= 3  # eq. 3 keeps the linear total (up to rounding)
    else:
        assert last == [24] * 3  # every schedule ends at m_max
    if decremental and schedule == "linear":
        kv = out.details["attention_kv"][1:]
        assert max(kv) - min(kv) <= 1  # eq. 6
    for layer, kept in enumerate(out.kept_positions):
        assert kept.shape == out.cache.layers[layer].keys.shape[1:3]


def test_imdc_uses_less_attention_than_fm(single_thread):
    model = build_model("llama")
    ids = make_prompt(200).ids
    fm = ChunkedPrefill(chunk=32, memory=32).prefill(model, ids)
    imdc = ChunkedPrefill(chunk=32, memory=32, schedule="linear", decremental=True).prefill(model, ids)
    # eq. 6: memory + chunk constant after step 0 (+ 4 sinks); FM peaks at sinks + m_max + c.
    assert len(set(imdc.details["attention_kv"][1:])) == 1
    assert max(imdc.details["attention_kv"]) < max(fm.details["attention_kv"]) == 4 + 32 + 32
    assert fm.cache.get_seq_length() == imdc.cache.get_seq_length() == 4 + 32


@pytest.mark.parametrize("arch", ARCHS3)
@pytest.mark.parametrize(("schedule", "decremental"), [("fixed", False), ("square-sqrt", True), ("adaptive", False)])
def test_positions_contiguous_and_keys_rerotated_exactly(arch, schedule, decremental, single_thread):
    """Every step's keys sit at [0, s) + [P - M_j, P) + [P, P + c); layer 0's cached keys equal the
    keys computed directly for the same tokens at those positions (layer 0 keys depend only on
    the token), so re-rotation by the position difference is exact."""
    model = build_model(arch)
    ids = make_prompt(100).ids
    captured: list[torch.Tensor] = []
    chunk_positions: list[torch.Tensor] = []

    def capture(layer, query, key):
        if layer == 0:
            captured.append(key[0].clone())

    def record_positions(module, args, kwargs):
        chunk_positions.append(kwargs["position_ids"][0].clone())

    hook = model.model.register_forward_pre_hook(record_positions, with_kwargs=True)
    feed = ChunkedPrefill(
        chunk=16, memory=20, schedule=schedule, decremental=decremental, pruner=SnapKV(window=4), trace=True
    )
    with attention_hooks(observers=[capture]):
        out = feed.prefill(model, ids)
    hook.remove()
    assert len(captured) == len(out.history) == len(chunk_positions)

    attn = model.model.layers[0].self_attn
    with torch.no_grad():
        hidden = model.model.layers[0].input_layernorm(model.model.embed_tokens(ids))
        raw = attn.k_proj(hidden).view(1, 100, -1, attn.head_dim)[0].transpose(0, 1)  # (kv, L, d)
    largest, uneven = 0, False
    for step, record in enumerate(out.history):
        position, size = record["position"], record["chunk"]
        sinks = min(4, record["start"])
        torch.testing.assert_close(chunk_positions[step], torch.arange(position, position + size))
        memories = []
        for layer, positions in enumerate(record["positions"]):
            memory = positions.shape[0] - sinks - size
            memories.append(memory)
            expected = torch.cat([torch.arange(sinks), torch.arange(position - memory, position + size)])
            assert torch.equal(positions, expected), (step, layer)
        assert position == sinks + max(memories)  # the longest memory touches the chunk and the sinks
        uneven |= len(set(memories)) > 1
        largest = max(largest, position + size)
        tokens, positions = record["tokens"][0], record["positions"][0]
        for head in range(tokens.shape[0]):
            keys = raw[head, tokens[head]][None, None]  # (1, 1, n, d)
            cos, sin = model.model.rotary_emb(keys, positions[None])
            _, direct = apply_rotary_pos_emb(keys, keys, cos, sin)
            torch.testing.assert_close(captured[step][head], direct[0, 0], atol=1e-5, rtol=1e-4)
    assert uneven == (schedule != "fixed")  # per-layer schedules exercise the right-aligned memories
    # sinks + memory + chunk; eq. 3 may give one layer up to N * b_i (the layers' total is linear's).
    assert out.details["max_position"] == largest - 1 <= 4 + 20 * (2 if schedule == "adaptive" else 1) + 16
    assert out.next_position == out.history[-1]["position"] + out.history[-1]["chunk"]
    # Tokens of the final cache are prompt indices in increasing order, sinks first.
    for tokens in out.token_indices:
        assert torch.equal(tokens[:, :4], torch.arange(4).expand(tokens.shape[0], 4))
        assert bool((tokens[:, 1:] > tokens[:, :-1]).all())


def test_rerotate_composes_rotations(single_thread):
    """Keys rotated to `start` and moved by `end - start` (per KV head) equal keys rotated to `end`."""
    rotary = build_model("qwen2").model.rotary_emb
    torch.manual_seed(0)
    raw = torch.randn(1, 2, 5, 16)
    start = torch.tensor([[3, 9, 40, 41, 70]])
    end = torch.tensor([[0, 1, 2, 3, 4], [5, 6, 90, 8, 9]])
    cos, sin = rotary(raw, start)
    _, rotated = apply_rotary_pos_emb(raw, raw, cos, sin)
    moved = rerotate_keys(rotated, end - start, rotary)
    for head in range(2):
        cos, sin = rotary(raw, end[head : head + 1])
        _, direct = apply_rotary_pos_emb(raw, raw, cos, sin)
        torch.testing.assert_close(moved[:, head], direct[:, head], atol=1e-5, rtol=1e-5)


def test_a_rotation_table_turns_keys_as_angles_per_key_do(single_thread):
    """A move's angles read from a table of every delta in range (`rotation_table`, `table_turn`) are `rotation`'s
    to the bit, and so are the keys they turn; a partial rotary embedding leaves the other dimensions alone."""
    rotary = build_model("qwen2").model.rotary_emb
    delta = torch.tensor([[-70, -3, 0, 5, 89], [-1, 12, 40, -64, 2]])
    table = rotation_table(-70, 90, rotary, torch.device("cpu"))
    assert table.shape == (160, 2 * 16)
    turn = table_turn(table, delta + 70)
    assert all(torch.equal(a, b) for a, b in zip(turn, rotation(delta, rotary), strict=True))
    keys = torch.randn(1, 2, 5, 16, generator=torch.Generator().manual_seed(0))
    assert torch.equal(rerotate_keys(keys, delta, rotary, turn), rerotate_keys(keys, delta, rotary))
    wider = torch.randn(1, 2, 5, 24, generator=torch.Generator().manual_seed(1))  # 8 dimensions past the rotary's 16
    turned = rerotate_keys(wider, delta, rotary, turn)
    assert torch.equal(turned[..., 16:], wider[..., 16:]) and not torch.equal(turned[..., :16], wider[..., :16])


@pytest.mark.parametrize("pruner", [SnapKV(window=2, pool_size=1), A2SF(alpha=1.0)])
def test_gqa_query_head_h_votes_for_kv_head_h_div_n_rep(pruner):
    """4 query heads, 2 KV heads (n_rep 2): heads 0-1 look at token 2, heads 2-3 at token 5.
    KV head 0 must prefer token 2 and KV head 1 token 5 (h // n_rep; h % kv_heads would mix them)."""
    n, dim = 10, 8
    key = torch.zeros(1, 2, n, dim)
    key[0, :, 2, 0] = 1.0
    key[0, :, 5, 1] = 1.0
    query = torch.zeros(1, 4, 2, dim)
    query[0, 0:2, :, 0] = 50.0
    query[0, 2:4, :, 1] = 50.0
    scores = pruner.prompt_scores(LayerPass(query[0], key[0], scale=dim**-0.5))
    assert scores.shape == (2, n)
    early = scores[:, : n - 2]
    assert int(early[0].argmax()) == 2 and int(early[1].argmax()) == 5


def test_prompt_longer_than_trained_context_runs_through_the_pipeline(single_thread):
    model = build_model("llama", max_positions=64)
    prompt = make_prompt(200)
    with pytest.raises(KvsieveError):
        run(model, FakeTokenizer(), prompt, sampling=Sampling(max_new_tokens=4))
    for feed in (
        ChunkedPrefill(chunk=16, memory=24),
        ChunkedPrefill(chunk=16, memory=24, schedule="linear", decremental=True, pruner=StreamingLLM()),
    ):
        result = run(model, FakeTokenizer(), prompt, feed=feed, sampling=Sampling(max_new_tokens=8))
        assert len(result.tokens) == 8 and result.prompt_tokens == 200
        stage = result.stages[0]
        assert stage.stage == "feed" and stage.method == feed.name
        assert stage.details["max_position"] + 8 < 64
        assert result.kv_cache_length == 4 + 24 + 7
    # The answer goes on from the position after the last chunk: past the trained positions is refused.
    feed = ChunkedPrefill(chunk=16, memory=24)
    last = run(model, FakeTokenizer(), prompt, feed=feed, sampling=Sampling(1)).state.prefilled.next_position
    run(model, FakeTokenizer(), prompt, feed=feed, sampling=Sampling(max_new_tokens=64 - last))  # exactly fills
    with pytest.raises(KvsieveError, match=f"position {last}, so {65 - last} new tokens would reach position 65"):
        run(model, FakeTokenizer(), prompt, feed=feed, sampling=Sampling(max_new_tokens=65 - last))


def test_decoding_eviction_composes_with_the_feed(single_thread):
    model = build_model("qwen2")
    prompt = make_prompt(150)
    evict = Evict(A2SF(alpha=0.5), 12)
    feed = ChunkedPrefill(chunk=32, memory=32, schedule="sqrt", decremental=True)
    result = run(model, FakeTokenizer(), prompt, feed=feed, evict=evict, sampling=Sampling(max_new_tokens=6))
    assert len(result.tokens) == 6 and result.kv_cache_length == 12
    assert feed.name == "imdc"


def test_kept_positions_align_last_step_scores_with_the_final_cache(single_thread):
    """A decoding-eviction stage observing the feed keeps the last step's scores; gathered with
    `kept_positions` they line up with the final cache (what the pipeline can pass to Evict.start)."""
    model = build_model("llama")
    evict = Evict(H2O(), 10).begin()
    feed = ChunkedPrefill(chunk=16, memory=20, schedule="adaptive", pruner=SnapKV(window=4))
    with attention_hooks(observers=evict.observers()):
        out = feed.prefill(model, make_prompt(100).ids)
    for layer, kept in enumerate(out.kept_positions):
        state = evict.scores[layer]
        assert state.shape[1] == out.history[-1]["keys"][layer] >= kept.shape[1]
        assert state.gather(1, kept).shape == out.cache.layers[layer].keys.shape[1:3]
    details = evict.start(out.cache, out.kept_positions)
    assert details["budget"] == 10 and all(layer.keys.shape[2] == 10 for layer in out.cache.layers)


def test_names_and_bad_inputs():
    assert ChunkedPrefill().name == "fm" and ChunkedPrefill().one_pass is False
    assert ChunkedPrefill(schedule="sqrt").name == "im"
    assert ChunkedPrefill(schedule="adaptive", decremental=True).name == "imdc"
    bad = [
        {"chunk": 0},
        {"memory": 0},
        {"memory": 3, "sinks": 4},
        {"sinks": -1},
        {"schedule": "cubic"},
        {"decremental": True},
        {"pruner": object()},
        {"chunk": 1.5},
    ]
    for options in bad:
        with pytest.raises(KvsieveError):
            ChunkedPrefill(**options)
    with pytest.raises(KvsieveError, match="memory >= 1"):
        ChunkedPrefill(memory=0)
    with pytest.raises(KvsieveError, match="linear, sqrt"):
        ChunkedPrefill(schedule="nope")
    with pytest.raises(KvsieveError):
        ChunkedPrefill().prefill(build_model("llama"), torch.ones(2, 5, dtype=torch.long))
    with pytest.raises(KvsieveError):
        decremental_chunks(3, 1, [1, 1, 1, 1])
    with pytest.raises(KvsieveError):
        incremental_memory(4, 10, "cubic")


def test_compress_after_a_chunked_feed_ranks_the_cache_by_the_last_steps_scores(single_thread):
    """A compress stage observes every chunk but the feed prunes its own cache: its scores of the last
    step (over sinks + memory + chunk) must be aligned with the entries the feed kept before ranking."""
    from kvsieve.compress.stages import Compress

    model = build_model("llama")
    prompt = make_prompt(97)  # chunks of 16: the last chunk is a single token
    calls: dict[int, list[torch.Tensor]] = {}

    def reference(layer: int, query: torch.Tensor, key: torch.Tensor) -> None:
        calls.setdefault(layer, []).append(
            H2O().prompt_scores(LayerPass(query[0], key[0], scale=query.shape[-1] ** -0.5))
        )

    feed = ChunkedPrefill(chunk=16, memory=40, pruner=SnapKV(window=4), question_guided=False)  # one pass a step
    compress = Compress(H2O(), 20)
    with attention_hooks(observers=[reference]):
        result = run(model, FakeTokenizer(), prompt, feed=feed, compress=compress, sampling=Sampling(2))
    fed = result.state.prefilled
    assert result.prefill_kv_length == 20 and fed.history[-1]["chunk"] == 1
    for layer in range(len(fed.kept_positions)):
        last = calls[layer][len(fed.history) - 1]  # the feed's last step (decoding steps come after)
        aligned = last.gather(1, fed.kept_positions[layer])  # scores of the feed's final entries
        sinks, recent = H2O().protected(20)
        ranked = aligned.clone()
        ranked[:, :sinks] = float("inf")
        ranked[:, aligned.shape[1] - recent :] = float("inf")
        expected = ranked.topk(20, dim=1).indices.sort(dim=1).values
        assert torch.equal(result.state.compress.kept_positions[layer], expected)


@pytest.mark.parametrize("arch", ARCHS3)
def test_critiprefill_inside_chunks_with_covering_sizes_reproduces_full_prefill(arch, single_thread):
    """CritiPrefill runs on every chunk (queries after a memory); with a budget and memory that cover the
    prompt it is exactly dense, so the chunked feed still reproduces full prefill."""
    from kvsieve.attention.critiprefill import CritiPrefill

    model = build_model(arch)
    ids = make_prompt(90).ids
    full = FullPrefill().prefill(model, ids)
    with attention_hooks(prefill=CritiPrefill(segment=8, block=4, budget=128).begin()):
        chunked = ChunkedPrefill(chunk=24, memory=200).prefill(model, ids)
    torch.testing.assert_close(chunked.last_logits, full.last_logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("pruner", [SnapKV(window=4), H2O(), Collie()])
def test_a_question_guides_every_chunks_pruning_and_leaves_no_trace(pruner, single_thread):
    """question_guided: the question's tokens run after every chunk but the last, their queries' scores replace the
    chunk's, and their entries leave again: the steps' positions, memory sizes and cache lengths are those of the
    unguided feed, the kept tokens are not; a prompt without a question (or the setting off) is the unguided feed."""
    model = build_model("llama")
    prompt = make_prompt(120)
    question = prompt.tail_len
    assert question > 0
    guided = ChunkedPrefill(chunk=16, memory=24, schedule="linear", pruner=pruner)
    plain = replace(guided, question_guided=False)
    ids = prompt.ids
    with torch.no_grad():
        asked = guided.prefill(model, ids, question=question)
        unasked = plain.prefill(model, ids, question=question)
        without = guided.prefill(model, ids)  # no question: nothing to guide with
    assert asked.details["question_tokens"] == question and unasked.details["question_tokens"] == 0
    for a, b in zip(asked.history, unasked.history, strict=True):
        assert (a["position"], a["memory"], a["cache_lengths"]) == (b["position"], b["memory"], b["cache_lengths"])
    assert any(not torch.equal(a, b) for a, b in zip(asked.token_indices, unasked.token_indices, strict=True))
    for a, b in zip(without.token_indices, unasked.token_indices, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(without.last_logits, unasked.last_logits)
    assert asked.next_position == unasked.next_position
