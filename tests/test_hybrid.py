"""Hybrid attention: models whose sliding-window layers sit beside global ones (Gemma 2/3, Qwen2 with its window
on) or whose every layer slides (Mistral with a window).

The rule (docs/MODELS.md, "Hybrid attention, the rule"): a sliding layer keeps exactly its window and is never
compressed, evicted or scored; budgets, GemFilter's filter layer and CritiPrefill's sparsity belong to the global
layers; a chunked feed moves a sliding layer's window into each step's position frame as one block; decoding keeps
a sliding layer in a ring of its window. The references are transformers' own eager attention and `generate`,
never kvsieve's code.
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import HYBRID_ARCHS, WINDOW, Decoder, FakeTokenizer, build_model, make_prompt
from transformers import AutoModelForCausalLM, Cohere2Config

import kvsieve
from kvsieve import REGISTRY, KvsieveError, Sampling, method, run
from kvsieve.engine.pipeline import prefill
from kvsieve.feed import PromptState
from kvsieve.kv.cache import WindowBuffer, is_windowed
from kvsieve.models import architecture

pytestmark = pytest.mark.usefixtures("single_thread")

PROMPT = 5 * WINDOW  # prompts several windows long
SHRINK = {  # every preset at budgets that drop tokens from a PROMPT-token prompt (where the field exists)
    "select.k": 24,
    "select.block": 4,
    "feed.chunk": 12,
    "feed.memory": 12,
    "attention.segment": 8,
    "attention.block": 4,
    "attention.budget": 8,
    "attention.dense_prefix": 0,
    "compress.budget": 16,
    "compress.policy.window": 4,
    "compress.policy.pool_size": 3,
    "evict.budget": 16,
}


def shrunk(name: str) -> dict:
    return {path: value for path, value in SHRINK.items() if REGISTRY[name].has(path)}


def transformers_tokens(model, prompt, new: int) -> list[int]:
    """Greedy tokens of transformers' own `generate` with its eager attention (its masks, its caches)."""
    reference = copy.deepcopy(model)
    reference.set_attn_implementation("eager")
    with torch.no_grad():
        out = reference.generate(
            prompt.ids, attention_mask=torch.ones_like(prompt.ids), max_new_tokens=new, do_sample=False,
            eos_token_id=None, pad_token_id=0,
        )  # fmt: skip
    return out[0, prompt.length :].tolist()


def test_the_adapter_reads_each_layers_window_and_rotary():
    gemma3 = architecture(build_model("gemma3", num_layers=6))
    assert gemma3.windows == (WINDOW, WINDOW, None, WINDOW, WINDOW, None) and gemma3.global_layers == (2, 5)
    positions = torch.arange(5)[None]
    local, world = gemma3.rotary(0)(torch.empty(0), positions), gemma3.rotary(2)(torch.empty(0), positions)
    assert not torch.allclose(local[0], world[0])  # bases 10K and 1M: two embeddings
    assert architecture(build_model("qwen2-window", num_layers=4)).global_layers == (0, 1)
    assert architecture(build_model("gemma2", num_layers=4)).global_layers == (1, 3)
    assert architecture(build_model("mistral-window", num_layers=3)).global_layers == ()
    assert not architecture(build_model("llama")).hybrid


def test_a_family_kvsieve_cannot_run_is_refused_naming_what_it_lacks():
    config = Cohere2Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, sliding_window=8, layer_types=["sliding_attention", "full_attention"],
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(config)
    with pytest.raises(KvsieveError, match="NoPE"):
        kvsieve.prepare(model)


@pytest.mark.parametrize("arch", HYBRID_ARCHS)
def test_full_attention_gives_transformers_tokens_over_several_windows(arch):
    """Prefill, then decoding through the engine's step (sliding layers in rings) far past the window."""
    model = build_model(arch, num_layers=4)
    prompt = make_prompt(PROMPT)
    result = run(model, FakeTokenizer(), prompt, sampling=Sampling(max_new_tokens=3 * WINDOW))
    assert result.tokens == transformers_tokens(model, prompt, 3 * WINDOW)


@pytest.mark.parametrize("arch", ["gemma3", "gemma2"])
def test_a_batch_of_ragged_rows_decodes_each_rows_own_tokens(arch):
    """Rows of different lengths in one batch: padded global layers, sliding rings at different places."""
    model = build_model(arch, num_layers=4)
    prompts = [make_prompt(n, seed=n) for n in (PROMPT, WINDOW - 3, 2 * WINDOW + 3)]
    together = run(model, FakeTokenizer(), prompts, sampling=Sampling(max_new_tokens=2 * WINDOW))
    for prompt, result in zip(prompts, together, strict=True):
        assert result.tokens == transformers_tokens(model, prompt, 2 * WINDOW)


def test_decoding_keeps_each_sliding_layer_in_a_ring_of_its_window():
    model = build_model("gemma3", num_layers=3)
    prompt = make_prompt(PROMPT)
    done = prefill(model, prompt)
    cache = done.prefilled.cache
    assert [layer.keys.shape[2] for layer in cache.layers] == [WINDOW - 1, WINDOW - 1, PROMPT]

    decoder = Decoder(model, cache, PROMPT)
    reference = copy.deepcopy(model)
    reference.set_attn_implementation("eager")
    ids = prompt.ids[0].tolist()
    token = int(done.prefilled.last_logits.argmax())
    for _ in range(2 * WINDOW + 1):
        logits = decoder.feed(token)
        ids.append(token)
        with torch.no_grad():
            expected = reference(torch.tensor([ids])).logits[0, -1]
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
        token = int(logits.argmax())
    layers = decoder.batch.caches[0].layers
    assert all(isinstance(layers[j], WindowBuffer) and layers[j].length == WINDOW for j in (0, 1))
    assert layers[2].length == PROMPT + 2 * WINDOW + 1  # the global layer holds everything
    tables = decoder.batch.tables
    assert tables.keys.shape[0] == 1 and tables.rings[0].shape[0] == 2  # tables: 1 global, 2 rings
    assert tables.rings[0].shape[3] == WINDOW  # a ring's memory is its window, however long the answer


def test_a_window_buffer_gives_its_entries_back_in_time_order():
    keys = torch.arange(3.0).view(1, 1, 3, 1)
    ring = WindowBuffer(keys, keys.clone(), window=4)
    for value in (3.0, 4.0, 5.0):
        ring.update(torch.full((1, 1, 1, 1), value), torch.full((1, 1, 1, 1), value))
    assert ring.length == 4 and ring.keys.flatten().tolist() == [4.0, 5.0, 2.0, 3.0]
    assert ring.in_order()[0].flatten().tolist() == [2.0, 3.0, 4.0, 5.0]
    assert ring.detached().keys.flatten().tolist() == [2.0, 3.0, 4.0, 5.0]
    with pytest.raises(KvsieveError, match="one decoding step"):
        ring.update(torch.zeros(1, 1, 2, 1), torch.zeros(1, 1, 2, 1))


@pytest.mark.parametrize("name", ["snapkv", "a2sf", "h2o", "streaming", "tova"])
def test_budgets_apply_to_global_layers_and_sliding_ones_keep_their_window(name):
    model = build_model("gemma3", num_layers=3)
    done = prefill(model, make_prompt(PROMPT), method=method(name, shrunk(name)))
    lengths = [layer.keys.shape[2] for layer in done.prefilled.cache.layers]
    assert lengths == [WINDOW - 1, WINDOW - 1, 16]
    assert done.kv_length == 16


@pytest.mark.parametrize("arch", ["gemma3", "qwen2-window"])
@pytest.mark.parametrize(
    "name,settings",
    [
        ("snapkv", {"compress.budget": PROMPT}),
        ("a2sf", {"evict.budget": PROMPT + 20}),
        ("tova", {"evict.budget": PROMPT + 20}),
        ("gemfilter", {"select.k": PROMPT}),
        ("fm", {"feed.chunk": 12, "feed.memory": PROMPT}),
    ],
)
def test_a_budget_that_keeps_everything_reproduces_full_attention(arch, name, settings):
    model = build_model(arch, num_layers=4)
    prompt = make_prompt(PROMPT)
    full = run(model, FakeTokenizer(), prompt, sampling=Sampling(max_new_tokens=12))
    kept = run(model, FakeTokenizer(), prompt, method=method(name, settings), sampling=Sampling(max_new_tokens=12))
    assert kept.tokens == full.tokens


@pytest.mark.parametrize("name", ["fm", "imdc"])
def test_a_chunked_feed_moves_sliding_windows_between_frames_exactly(name):
    """Every layer of this Mistral slides, so a chunked feed compresses nothing: each step moves the windows into
    the next frame (sinks first, then the chunk: negative positions for the oldest entries), and RoPE's relative
    positions make the logits those of one pass."""
    model = build_model("mistral-window", num_layers=3)
    prompt = make_prompt(PROMPT)
    done = prefill(model, prompt, method=method(name, {"feed.chunk": 7, "feed.memory": 8}))
    assert done.prefilled.details["steps"] > 3
    with torch.no_grad():
        expected = model(prompt.ids).logits[0, -1]
    torch.testing.assert_close(done.prefilled.last_logits, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", [a for a in HYBRID_ARCHS if a != "gemma3"])  # gemma3: the device test, the server's
def test_every_preset_runs_or_says_why_not(arch):
    """Every registered preset answers on every hybrid family; the only refusals are the ones the rule (docs/MODELS.md)
    names: GemFilter needs a global layer, and Gemma 2's soft-capped logits have no CritiPrefill kernel."""
    model = build_model(arch, num_layers=4)
    prompt = make_prompt(PROMPT)
    full = run(model, FakeTokenizer(), prompt, sampling=Sampling(max_new_tokens=6))
    for name, preset in REGISTRY.items():
        spec = method(name, shrunk(name))
        refused = (arch == "mistral-window" and preset.select is not None) or (
            arch == "gemma2" and preset.attention is not None
        )
        if refused:
            with pytest.raises(KvsieveError, match="global attention layer|soft-caps"):
                run(model, FakeTokenizer(), prompt, method=spec, sampling=Sampling(max_new_tokens=6))
            continue
        result = run(model, FakeTokenizer(), prompt, method=spec, sampling=Sampling(max_new_tokens=6))
        assert len(result.tokens) == 6, name
        if arch == "mistral-window":  # nothing to compress where every layer slides: full attention's answer
            assert result.tokens == full.tokens, name


def test_gemfilter_filters_at_a_global_layer():
    model = build_model("gemma3", num_layers=6)
    assert kvsieve.GemFilter().filter_layer(model) == 2  # the global layer nearest the middle (3)
    assert kvsieve.GemFilter(layer=5).filter_layer(model) == 5
    with pytest.raises(KvsieveError, match="choose a global layer: 2, 5"):
        kvsieve.GemFilter(layer=3).filter_layer(model)


def test_a_prefix_past_its_window_is_reused_whole_but_never_cut():
    model = build_model("gemma3", num_layers=3)
    short, long = make_prompt(WINDOW - 2), make_prompt(PROMPT)
    states = [PromptState(prefill(model, p).prefilled.cache, p.length, p.length) for p in (short, long)]
    assert states[0].cuttable and not states[1].cuttable
    assert states[1].clone(model).cache.layers[0].keys.shape[2] == WINDOW - 1
    with pytest.raises(ValueError, match="sliding layers within their window"):
        states[1].clone(model, PROMPT - 16)
    assert all(is_windowed(layer) for layer in states[1].clone(model).cache.layers[:2])


REAL_MODELS = {
    "llama": "SmolLM2-135M-Instruct (the default; `real_model` tests)",
    "gemma3_text": "Gemma 3 270M (`--model gemma3-270m`; `gemma` tests)",
}


def family_table() -> str:
    """The README's table of supported families, from the tiny models the tests run (conftest's ARCHS and
    HYBRID_ARCHS) and the real models tests run."""
    from conftest import ARCHS

    layouts: dict[str, list[str]] = {}
    for arch in (*ARCHS, *HYBRID_ARCHS):
        model = build_model(arch, num_layers=6)
        shape = architecture(model)
        if not shape.hybrid:
            layout = "global layers"
        elif not shape.global_layers:
            layout = "every layer sliding"
        else:
            layout = "sliding + global layers"
            if len({rotary.layer_type for rotary in shape.rotaries}) > 1:
                layout += ", a RoPE per kind"
        if getattr(model.config, "attn_logit_softcapping", None):
            layout += ", soft-capped logits"
        layouts.setdefault(shape.model_type, []).append(layout)
    rows = ["| family (`model_type`) | layouts tested in `make test` | real model |", "|---|---|---|"]
    for family, kinds in layouts.items():
        rows.append(f"| {family} | {'; '.join(kinds)} | {REAL_MODELS.get(family, '')} |")
    return "\n".join(rows)


def test_the_readme_lists_the_families_the_tests_run():
    from pathlib import Path

    readme = (Path(__file__).parents[1] / "README.md").read_text()
    table = family_table()
    assert table in readme, f"README's table of supported families should read:\n{table}"
    assert set(kvsieve.models.SUPPORTED_MODEL_TYPES) == {line.split(" | ")[0][2:] for line in table.splitlines()[2:]}


def test_every_preset_stays_on_the_models_device_and_runs_in_bfloat16():
    """On `meta` any CPU tensor meeting the model's raises (prefill and compression); in bfloat16 every preset
    decodes through the rings and the padded step; a whole generation creates no tensor without a `device=`."""
    from test_devices import DeviceAudit

    host = make_prompt(PROMPT)
    on_meta = build_model("gemma3", num_layers=3).to("meta")
    meta_prompt = kvsieve.Prompt(host.ids.to("meta"), host.context_start, host.context_len)
    bf16 = build_model("gemma3", num_layers=3).to(torch.bfloat16)
    for name in REGISTRY:
        spec = method(name, shrunk(name))
        per_head = spec.compress is not None and spec.compress.head_budgets
        if not per_head:  # per-head budgets read their heads' counts once (data a meta tensor has none of)
            done = prefill(on_meta, meta_prompt, method=spec)
            assert all(layer.keys.device.type == "meta" for layer in done.prefilled.cache.layers), name
        if spec.evict is None and not per_head:  # per-head budgets take no evict stage
            spec = spec.with_setting("evict", "a2sf").with_setting("evict.budget", 16)  # decoding eviction too
        with DeviceAudit() as audit:
            result = run(bf16, FakeTokenizer(), host, method=spec, sampling=Sampling(4))  # the rings turn at 2
        assert len(result.tokens) == 4 and audit.offenders == [], name


def test_a_prefix_stored_compressed_by_an_accumulating_policy_keeps_its_global_sums():
    """--reuse-budget with A2SF: the stored state's global layer and its accumulated sums are cut to the reuse
    budget together; the sliding layers, never scored, keep their window and have no sums; a request continues
    the state."""
    model = build_model("gemma3", num_layers=3)
    spec = method("a2sf", {"evict.budget": 16})
    prompt = make_prompt(PROMPT)
    first = prefill(model, prompt, method=spec, keep=30, store_with=kvsieve.Compress(spec.evict.policy, 20))
    stored = first.stored
    assert [layer.keys.shape[2] for layer in stored.cache.layers] == [WINDOW - 1, WINDOW - 1, 20]
    assert {alpha: sorted(sums) for alpha, sums in stored.sums.sums.items()} == {spec.evict.policy.alpha: [2]}
    assert stored.sums.sums[spec.evict.policy.alpha][2].shape[-1] == 20
    again = prefill(model, prompt, method=spec, prefix=stored.clone(model))
    # the question-agnostic state is continued by the prompt's other tokens, none pruned with their scores
    assert again.kv_length == 20 + prompt.length - 30 and again.stages[0].details["reused_tokens"] == 30
