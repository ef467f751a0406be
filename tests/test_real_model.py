"""The embedded default model (SmolLM2-135M-Instruct): offline loading and passkey answers."""

import pytest
import torch
from conftest import word_level_tokenizer

from kvsieve import GemFilter, Sampling, generate, load_model, method
from kvsieve.data import passkey_case
from kvsieve.models import converted_default_dir
from kvsieve.prompt import build_prompt

pytestmark = pytest.mark.real_model  # `smollm` (conftest): the default model, loaded offline once


def test_default_model_loads_offline_from_cache(smollm):
    model, tokenizer = smollm
    assert (converted_default_dir() / "model.safetensors").is_file()
    assert model.config.model_type == "llama"
    assert (model.config.num_hidden_layers, model.config.num_attention_heads, model.config.num_key_value_heads) == (
        30,
        9,
        3,
    )
    assert model.config._attn_implementation == "kvsieve"
    assert tokenizer.chat_template


@pytest.mark.parametrize("select", [None, GemFilter(k=512, layer=15)], ids=["full", "gemfilter"])
def test_short_passkey_is_answered(smollm, select):
    model, tokenizer = smollm
    case = passkey_case(tokenizer, 1000, 0.4, seed=3)
    result = generate(model, tokenizer, case.context, case.question, select=select, sampling=Sampling(24))
    assert case.answer in result.text
    if select is not None:
        assert len(result.selected_indices) == 512
        assert case.answer in result.selected_text


def test_needle_answered_with_critiprefill(smollm):
    from kvsieve import CritiPrefill
    from kvsieve.data import needle_case
    from kvsieve.eval.scoring import contains

    model, tokenizer = smollm
    case = needle_case(tokenizer, 3000, 0.5)  # 3K tokens: segments 3 and 4 of 6 run sparse
    result = generate(model, tokenizer, case.context, case.question, attention=CritiPrefill(), sampling=Sampling(40))
    assert contains(result.text, case.answer)


def test_imdc_retrieves_a_key_pruned_before_the_question_arrives(smollm):
    """IMDC as shipped (chunk 1024, memory 1024, every chunk pruned by the question's SnapKV votes) on a 4.2K-token
    prompt with the key before its last two chunks (in the plan's 5 chunks, at the border of the 2nd and 3rd): the
    memory that holds it is pruned at least twice before the last chunk arrives. Pruned by each
    chunk's own votes (the authors' feed, `imdc-paper`), such keys are lost at 4K with this model (on this very
    case it answers "123456"; docs/STUDIES.md, "Question-guided chunked prefill", also at 16K and 64K). Prompts
    beyond the 8192 trained positions are tested on tiny models (test_chunked.py); the real model's 16K runs are
    in STUDIES. That the key lies before the last two chunks comes from the feed's own plan, not from the depth."""
    model, tokenizer = smollm
    case = passkey_case(tokenizer, 4200, 0.5, seed=7)
    prompt = build_prompt(tokenizer, case.context, case.question)
    key_at = prompt.context_start + len(
        tokenizer(case.context[: case.needle_start], add_special_tokens=False)["input_ids"]
    )
    spec = method("imdc")
    chunks, _ = spec.feed.plan(prompt.length, model.config.num_hidden_layers)
    assert len(chunks) == 5 and key_at + 16 < prompt.length - chunks[-1] - chunks[-2]
    result = generate(model, tokenizer, case.context, case.question, method=spec, sampling=Sampling(16))
    feed = result.stages[0].details
    assert result.prompt_tokens == prompt.length and feed["steps"] == 5 and feed["question_tokens"] > 0
    # positions re-encoded within the sinks, the memory and a chunk; the cache the sinks and the memory
    sinks, memory = spec.feed.sinks, spec.feed.memory
    assert feed["max_position"] < sinks + memory + max(chunks) and feed["kv_cache"] == sinks + memory
    assert case.answer in result.text


def test_bfloat16_default_model_answers_through_gemfilter():
    """What GPU users run: the model in bfloat16 (scores still float32) keeps the key and answers."""
    model, tokenizer = load_model(dtype="bfloat16")
    assert next(model.parameters()).dtype == torch.bfloat16
    case = passkey_case(tokenizer, 600, 0.3, seed=3)
    spec = method("gemfilter", {"select.k": 256, "select.layer": 15})
    result = generate(model, tokenizer, case.context, case.question, method=spec, sampling=Sampling(16))
    assert case.answer in result.text and case.answer in result.selected_text


def test_the_tests_haystack_prefix_tokenizes_as_the_whole_haystack_begins(smollm, haystack_prefix):
    """conftest serves the tests a prefix of the haystack: every case built from it must be the whole haystack's.

    Cases, perplexity texts and `simulate` read the first tokens of the haystack; these are the same tokens
    when the prefix tokenizes as the start of the whole text does, with more tokens than any test reads.
    """
    whole, prefix = haystack_prefix.whole(), haystack_prefix()
    assert len(prefix) < len(whole)
    for tokenizer in (smollm[1], word_level_tokenizer()):
        short = tokenizer(prefix, add_special_tokens=False)["input_ids"]
        assert len(short) > 2 * 8192 and short == tokenizer(whole, add_special_tokens=False)["input_ids"][: len(short)]
