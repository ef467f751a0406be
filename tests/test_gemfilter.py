"""GemFilter: the first pass, the scores, the selection, and its equivalence with full attention."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from conftest import HEAD_DIM, HEADS, KV_HEADS, FakeTokenizer, make_prompt

from kvsieve import GemFilter, KvsieveError, Prompt, Sampling, run
from kvsieve.select.scoring import filter_layer_qk, gemfilter_scores, resolve_count, top_k_with_tail

pytestmark = pytest.mark.usefixtures("single_thread")


def reference_scores(query_last: torch.Tensor, keys: torch.Tensor, kernel: int = 5) -> torch.Tensor:
    """Sum over query heads of q_last[h] . keys[h // n_rep, j], then a zero-padded mean over `kernel`."""
    heads, kv_heads, n = query_last.shape[0], keys.shape[0], keys.shape[1]
    n_rep = heads // kv_heads
    q, k = query_last.double(), keys.double()
    raw = torch.zeros(n, dtype=torch.float64)
    for h in range(heads):
        for j in range(n):
            raw[j] += torch.dot(q[h], k[h // n_rep, j])
    half = kernel // 2
    padded = F.pad(raw, (half, half))
    return padded.unfold(0, kernel, 1).mean(-1).float()


def reference_selection(scores: torch.Tensor, k: int, tail_len: int) -> list[int]:
    n = scores.shape[0]
    body = sorted(range(n - tail_len), key=lambda j: -float(scores[j]))[: k - tail_len]
    return sorted(body + list(range(n - tail_len, n)))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat([-second, first], dim=-1)


def manual_qk(model, ids: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer `layer`'s last post-RoPE query (h, d) and keys (kv, n, d), from its projections."""
    n = ids.shape[1]
    with torch.no_grad():
        hidden = model.model(input_ids=ids, use_cache=False, output_hidden_states=True).hidden_states[layer]
        block = model.model.layers[layer]
        x = block.input_layernorm(hidden)
        q = block.self_attn.q_proj(x).view(1, n, HEADS, HEAD_DIM).transpose(1, 2)
        k = block.self_attn.k_proj(x).view(1, n, KV_HEADS, HEAD_DIM).transpose(1, 2)
        cos, sin = model.model.rotary_emb(x, torch.arange(n)[None])
        cos, sin = cos[:, None], sin[:, None]
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
    return q[0, :, -1], k[0]


# --- (a) k == prompt length reproduces full attention -------------------------------------------


def test_gemfilter_with_k_equal_to_prompt_length_matches_full_generation(arch, make_model):
    model = make_model(arch, num_layers=3)
    prompt = make_prompt(48, tail_len=5)
    sampling = Sampling(max_new_tokens=8)
    tokenizer = FakeTokenizer()
    full = run(model, tokenizer, prompt, select=None, sampling=sampling)
    for k in (prompt.length, 1.0):
        filtered = run(model, tokenizer, prompt, select=GemFilter(k=k, layer=1), sampling=sampling)
        assert filtered.tokens == full.tokens
        assert filtered.text == full.text
        assert filtered.selected_indices == list(range(prompt.length))
        assert filtered.kv_cache_length == full.kv_cache_length == prompt.length + 7
        assert filtered.selected_text == tokenizer.decode(prompt.ids[0])
    assert full.selected_indices is None and full.selected_text is None
    assert [s.stage for s in full.stages] == ["feed", "decode"]
    assert [s.stage for s in filtered.stages] == ["select", "feed", "decode"]
    assert filtered.stages[0].details["kept"] == prompt.length
    assert filtered.stages[0].details["layer"] == 1


@pytest.mark.parametrize("arch_name", ["llama", "qwen2"])
def test_gemfilter_second_pass_is_a_fresh_prefill_of_the_selected_tokens(arch_name, make_model):
    """With k < n the answer is what the full model gives on the kept tokens at positions 0..k-1."""
    model = make_model(arch_name, num_layers=3)
    prompt = make_prompt(60, tail_len=6)
    sampling = Sampling(max_new_tokens=6)
    filtered = run(model, FakeTokenizer(), prompt, select=GemFilter(k=20, layer=1), sampling=sampling)
    kept = filtered.selected_indices
    assert len(kept) == 20
    sub = Prompt(ids=prompt.ids[:, kept], context_start=0, context_len=20 - prompt.tail_len)
    direct = run(model, FakeTokenizer(), sub, sampling=sampling)
    assert filtered.tokens == direct.tokens
    assert filtered.kv_cache_length == 20 + 5
    assert filtered.prompt_tokens == 60


# --- (b) selected indices --------------------------------------------------------------------------


@pytest.mark.parametrize("arch_name", ["llama", "mistral", "qwen2", "qwen3", "phi3"])
@pytest.mark.parametrize("keep_tail", [True, False])
def test_selection_is_sorted_unique_top_k_with_tail(arch_name, keep_tail, make_model):
    model = make_model(arch_name, num_layers=3)
    prompt = make_prompt(50, tail_len=7, seed=3)
    selector = GemFilter(k=16, layer=2, keep_tail=keep_tail)
    selection = selector.select(model, prompt)
    indices = selection.indices.tolist()
    assert len(indices) == 16
    assert indices == sorted(set(indices))
    assert all(0 <= i < prompt.length for i in indices)
    tail = list(range(prompt.length - prompt.tail_len, prompt.length))
    if keep_tail:
        assert set(tail) <= set(indices)
    # The selection is exactly the reference top-k (plus tail) of the reference scores.
    queries, keys = filter_layer_qk(model, prompt.ids, 2)
    query_last = queries[:, -1]  # (h, 1, d): the last query alone by default
    expected = reference_selection(reference_scores(query_last, keys), 16, prompt.tail_len if keep_tail else 0)
    assert indices == expected
    assert selection.details["k"] == 16
    assert selection.details["kept_tail"] == (7 if keep_tail else 0)


def test_keep_tail_keeps_low_scoring_tail_tokens():
    scores = torch.tensor([5.0, 4.0, 3.0, 2.0, 1.0, -10.0, -20.0])
    assert top_k_with_tail(scores, 4, 2).tolist() == [0, 1, 5, 6]
    assert top_k_with_tail(scores, 4, 0).tolist() == [0, 1, 2, 3]
    assert top_k_with_tail(torch.tensor([1.0, 3.0, 2.0, 0.0]), 2, 1).tolist() == [1, 3]


# --- (c) the first pass stops inside layer r ---------------------------------------------------


def _count_calls(model):
    counts = {"attn": [], "mlp": [], "o_proj": [], "lm_head": 0, "norm": 0}
    handles = []
    for index, block in enumerate(model.model.layers):
        handles.append(block.self_attn.register_forward_pre_hook(lambda m, a, i=index: counts["attn"].append(i)))
        handles.append(block.mlp.register_forward_pre_hook(lambda m, a, i=index: counts["mlp"].append(i)))
        handles.append(
            block.self_attn.o_proj.register_forward_hook(lambda m, a, o, i=index: counts["o_proj"].append(i))
        )

    def bump(name):
        def hook(module, args, output=None):
            counts[name] += 1

        return hook

    handles.append(model.lm_head.register_forward_pre_hook(bump("lm_head")))
    handles.append(model.model.norm.register_forward_pre_hook(bump("norm")))
    return counts, handles


@pytest.mark.parametrize("arch_name", ["llama", "mistral", "qwen2", "qwen3", "phi3"])
@pytest.mark.parametrize("layer", [0, 1, 3])
def test_first_pass_runs_layers_up_to_r_attention_only(arch_name, layer, make_model):
    model = make_model(arch_name, num_layers=4)
    prompt = make_prompt(30)
    counts, handles = _count_calls(model)
    try:
        query_last, keys = filter_layer_qk(model, prompt.ids, layer)
        assert counts["attn"] == list(range(layer + 1))
        assert counts["mlp"] == list(range(layer))  # no MLP of layer r or beyond
        assert counts["o_proj"] == list(range(layer))  # layer r's attention stops before its output
        assert counts["lm_head"] == 0 and counts["norm"] == 0

        for key in ("attn", "mlp", "o_proj"):
            counts[key].clear()
        GemFilter(k=10, layer=layer).select(model, prompt)
        assert counts["attn"] == list(range(layer + 1))
        assert counts["mlp"] == list(range(layer))
        assert counts["lm_head"] == 0
    finally:
        for handle in handles:
            handle.remove()
    assert query_last.shape == (HEADS, 1, HEAD_DIM)  # the last query alone by default
    assert keys.shape == (KV_HEADS, prompt.length, HEAD_DIM)


def test_first_pass_builds_no_cache_and_leaves_hooks_clean(make_model):
    model = make_model("llama", num_layers=4)
    prompt = make_prompt(20)
    filter_layer_qk(model, prompt.ids, 1)
    counts, handles = _count_calls(model)
    try:
        with torch.no_grad():
            model(prompt.ids)  # a normal pass afterwards runs every layer (no stale StopForward observer)
    finally:
        for handle in handles:
            handle.remove()
    assert counts["attn"] == [0, 1, 2, 3] and counts["mlp"] == [0, 1, 2, 3] and counts["lm_head"] == 1


# --- (d) scores against a plain reference -------------------------------------------------------


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 2), (6, 2), (4, 4), (8, 1)])
@pytest.mark.parametrize("kernel", [1, 3, 5, 7])
def test_gemfilter_scores_match_reference(heads, kv_heads, kernel):
    generator = torch.Generator().manual_seed(heads * 10 + kv_heads + kernel)
    query_last = torch.randn(heads, 16, generator=generator)
    keys = torch.randn(kv_heads, 23, 16, generator=generator)
    scores = gemfilter_scores(query_last, keys, kernel)
    assert scores.dtype == torch.float32
    assert scores.shape == (23,)
    torch.testing.assert_close(scores, reference_scores(query_last, keys, kernel), atol=1e-4, rtol=1e-5)


def test_gemfilter_scores_are_fp32_for_half_inputs_and_unscaled():
    query_last = torch.ones(2, 4, dtype=torch.bfloat16)
    keys = torch.zeros(1, 9, 4, dtype=torch.bfloat16)
    keys[0, 4] = 1.0  # token 4 scores 2 heads * 4 dims = 8 raw, no 1/sqrt(d)
    scores = gemfilter_scores(query_last, keys, pool_size=5)
    assert scores.dtype == torch.float32
    # avg pool, zero padding, kernel 5: tokens 2..6 see 8 / 5; the rest 0.
    expected = torch.tensor([0, 0, 1.6, 1.6, 1.6, 1.6, 1.6, 0, 0])
    torch.testing.assert_close(scores, expected)


def test_gemfilter_scores_zero_padding_at_the_edges():
    query_last = torch.ones(1, 1)
    keys = torch.ones(1, 4, 1)  # raw scores all 1
    torch.testing.assert_close(gemfilter_scores(query_last, keys, pool_size=5), torch.tensor([0.6, 0.8, 0.8, 0.6]))


# --- (e) the captured query/key are the layer's post-RoPE projections ---------------------------


@pytest.mark.parametrize("arch_name", ["llama", "mistral", "qwen2"])
@pytest.mark.parametrize("layer", [0, 2])
def test_captured_query_and_keys_match_manual_projection(arch_name, layer, make_model):
    model = make_model(arch_name, num_layers=3)
    ids = make_prompt(25).ids
    queries, keys = filter_layer_qk(model, ids, layer)
    assert queries.shape[1] == 1
    query_last = queries[:, -1]
    expected_q, expected_k = manual_qk(model, ids, layer)
    torch.testing.assert_close(query_last, expected_q, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(keys, expected_k, atol=1e-5, rtol=1e-5)


# --- options and errors --------------------------------------------------------------------------


def test_resolve_count_fractions_and_counts():
    assert resolve_count(0.5, 10, "k") == 5
    assert resolve_count(1.0, 10, "k") == 10
    assert resolve_count(0.01, 10, "k") == 1  # never rounds down to zero
    assert resolve_count(0.3, 100, "k") == 30
    assert resolve_count(1, 10, "k") == 1  # the int 1 is one token, not "everything"
    assert resolve_count(10, 10, "k") == 10
    assert resolve_count(3, 10, "k") == 3


@pytest.mark.parametrize(
    ("value", "message"),
    [(0, "at least 1"), (-3, "at least 1"), (11, "exceeds the prompt's 10 tokens"), (0.0, "(0, 1]"), (1.5, "(0, 1]")],
)
def test_resolve_count_errors(value, message):
    with pytest.raises(KvsieveError, match=message.replace("(", r"\(").replace("]", r"\]")):
        resolve_count(value, 10, "k")


def test_filter_layer_out_of_range_raises_naming_the_range(make_model):
    model = make_model("llama", num_layers=3)
    prompt = make_prompt(20)
    for layer in (99, 3):
        with pytest.raises(KvsieveError, match=r"0\.\.2") as info:
            GemFilter(k=8, layer=layer).select(model, prompt)
        assert str(layer) in str(info.value) and "3 layers" in str(info.value)
    with pytest.raises(KvsieveError, match="0-based layer index"):
        GemFilter(k=8, layer=-1)


@pytest.mark.parametrize("kernel", [4, 0, -1])
def test_bad_kernel_raises(kernel, make_model):
    with pytest.raises(KvsieveError, match="odd"):
        GemFilter(k=8, layer=0, pool_size=kernel)


def test_k_not_above_tail_raises(make_model):
    model = make_model("llama")
    prompt = make_prompt(20, tail_len=6)
    for k in (6, 3):
        with pytest.raises(KvsieveError, match="tail"):
            GemFilter(k=k, layer=0).select(model, prompt)
    assert len(GemFilter(k=7, layer=0).select(model, prompt).indices) == 7
    # Without keep_tail the same k is fine.
    assert len(GemFilter(k=3, layer=0, keep_tail=False).select(model, prompt).indices) == 3


def test_k_at_least_the_prompt_keeps_it_whole_and_says_so(make_model):
    """A prompt shorter than k runs whole (as full attention does), with a note instead of an error."""
    model, prompt = make_model("llama"), make_prompt(20)
    kept = run(model, FakeTokenizer(), prompt, select=GemFilter(k=21, layer=0), sampling=Sampling(max_new_tokens=6))
    full = run(model, FakeTokenizer(), prompt, sampling=Sampling(max_new_tokens=6))
    assert kept.tokens == full.tokens and kept.selected_indices == list(range(20))
    assert "every token kept" in kept.stages[0].details["note"]


def test_a_prompt_without_a_question_keeps_its_query_window(make_model):
    """Token-id prompts carry no question/context split: the voting queries' window is kept as the tail."""
    model = make_model("llama")
    ids = make_prompt(60).ids
    no_split = Prompt(ids, 0, 60)
    kept = GemFilter(k=16, layer=0, queries=5).select(model, no_split).indices.tolist()
    assert kept[-5:] == list(range(55, 60)) and kept != list(range(44, 60))
    assert GemFilter(k=16, layer=0, queries=5, keep_tail=False).select(model, no_split).details["kept_tail"] == 0


def test_default_layer_is_the_middle_and_calibration_is_asked_for(make_model, isolated_cache):
    model = make_model("llama", num_layers=4)
    assert GemFilter(k=8).filter_layer(model) == 2
    assert GemFilter(k=8, layer=0).filter_layer(model) == 0
    with pytest.raises(KvsieveError, match="kvsieve calibrate"):
        GemFilter(k=8, layer="calibrated").filter_layer(model)
    isolated_cache.mkdir(parents=True)
    key = model.config.name_or_path or model.config.model_type
    (isolated_cache / "calibration.json").write_text(json.dumps({key: {"layer": 1}}))
    # A recorded calibration changes nothing unless it is asked for: same call, same result everywhere.
    assert GemFilter(k=8).filter_layer(model) == 2
    assert GemFilter(k=8, layer="calibrated").filter_layer(model) == 1
    assert GemFilter.calibrated(model, k=8).layer == 1
    assert GemFilter(k=8, layer="calibrated").select(model, make_prompt(20)).details["layer"] == 1
    assert GemFilter(k=8, layer=3).filter_layer(model) == 3


# --- options beyond the paper: several voting queries, softmax per query, whole blocks ----------


def reference_window_scores(queries: torch.Tensor, keys: torch.Tensor, softmax: bool, kernel: int) -> torch.Tensor:
    """Loop reference: each head and query votes q . k_j (raw) or softmax(q . k / sqrt(d)) over j <= its position."""
    heads, w, dim = queries.shape
    n, n_rep = keys.shape[1], heads // keys.shape[0]
    raw = torch.zeros(n, dtype=torch.float64)
    for h in range(heads):
        for i in range(w):
            position = n - w + i
            logits = torch.stack([torch.dot(queries[h, i].double(), keys[h // n_rep, j].double()) for j in range(n)])
            if softmax:
                logits[position + 1 :] = float("-inf")
                logits = (logits / dim**0.5).softmax(0)
            raw += logits
    half = kernel // 2
    return F.pad(raw, (half, half)).unfold(0, kernel, 1).mean(-1).float()


@pytest.mark.parametrize("softmax", [False, True])
@pytest.mark.parametrize("w", [1, 4])
def test_window_and_softmax_scores_match_the_loop_reference(w, softmax):
    torch.manual_seed(w)
    queries, keys = torch.randn(HEADS, w, HEAD_DIM), torch.randn(KV_HEADS, 20, HEAD_DIM)
    expected = reference_window_scores(queries, keys, softmax, kernel=3)
    torch.testing.assert_close(gemfilter_scores(queries, keys, 3, softmax), expected, atol=1e-4, rtol=1e-4)


def test_one_query_without_softmax_is_the_paper_score():
    torch.manual_seed(0)
    query, keys = torch.randn(HEADS, HEAD_DIM), torch.randn(KV_HEADS, 30, HEAD_DIM)
    torch.testing.assert_close(gemfilter_scores(query, keys, 5), reference_scores(query, keys, 5))


def test_block_selection_keeps_whole_blocks_then_fills_with_single_tokens():
    scores = torch.tensor([0.0, 9.0, 0.0, 0.0, 5.0, 5.0, 5.0, 5.0, 0.0, 0.0, 1.0, 2.0])
    # k 7, tail 2 (positions 10, 11): one whole block of 4 (the best mean: 4..7), then the best single token (1).
    assert top_k_with_tail(scores, 7, 2, block=4).tolist() == [1, 4, 5, 6, 7, 10, 11]
    # Block 1 is the paper's token top-k: the block's lone zero-scored neighbours lose to token 1.
    assert top_k_with_tail(scores, 5, 0).tolist() == [1, 4, 5, 6, 7]
    # Room for more than the whole blocks of the body (8 of its 11 tokens): both blocks of the best
    # means, then the best single token of the partial block 8..10, no position twice.
    assert top_k_with_tail(scores, 10, 1, block=4).tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 10, 11]


def test_gemfilter_options_select_the_reference_top_k(make_model):
    model = make_model("llama", num_layers=3)
    prompt = make_prompt(60, tail_len=5, seed=4)
    selector = GemFilter(k=24, layer=2, queries=6, softmax=True, block=4)
    indices = selector.select(model, prompt).indices
    queries, keys = filter_layer_qk(model, prompt.ids, 2, queries=6)
    scores = reference_window_scores(queries, keys, softmax=True, kernel=5)
    means = scores[:52].view(13, 4).mean(1)  # body of 55 tokens: 13 whole blocks of 4
    blocks = sorted(int(b) for b in means.topk(4).indices)  # (24 - 5) // 4 = 4 blocks, then 3 single tokens
    chosen = [4 * b + i for b in blocks for i in range(4)]
    rest = [j for j in sorted(range(55), key=lambda j: -float(scores[j])) if j not in chosen][:3]
    assert indices.tolist() == sorted(chosen + rest + list(range(55, 60)))


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(queries=0), "queries must be a whole number"),
        (dict(block=2.5), "block must be a whole number"),
        (dict(softmax="yes"), "softmax must be true or false"),
    ],
)
def test_bad_scoring_options_raise(options, message):
    with pytest.raises(KvsieveError, match=message):
        GemFilter(**options)
