"""The architecture adapter, `prepare` and `load_model` on tiny local models."""

from __future__ import annotations

import pytest
import torch
from conftest import HEAD_DIM, HEADS, KV_HEADS, VOCAB, build_model, make_prompt, tiny_config, word_level_tokenizer
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

import kvsieve
from kvsieve import KvsieveError, architecture, load_model, prepare
from kvsieve.attention import ATTENTION_NAME

pytestmark = pytest.mark.usefixtures("single_thread")


def test_architecture_reports_heads_and_layers(arch, make_model):
    model = make_model(arch, num_layers=3, max_positions=128)
    info = architecture(model)
    assert info.model_type == arch
    assert info.num_layers == 3
    assert info.num_heads == HEADS
    assert info.num_kv_heads == KV_HEADS
    assert info.n_rep == HEADS // KV_HEADS == 2
    assert info.head_dim == HEAD_DIM
    assert info.max_positions == 128
    assert info.layers is model.model.layers
    assert info.rotary_emb is model.model.rotary_emb


def test_architecture_without_gqa_has_n_rep_one():
    config = tiny_config("llama")
    config.num_key_value_heads = HEADS
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    info = architecture(model)
    assert info.num_kv_heads == HEADS and info.n_rep == 1


def tiny_gpt2():
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=32)).eval()


def test_unsupported_architecture_is_named():
    model = tiny_gpt2()
    with pytest.raises(KvsieveError, match="'gpt2'") as info:
        architecture(model)
    assert "llama" in str(info.value)  # the message lists what is supported
    with pytest.raises(KvsieveError, match="gpt2"):
        prepare(model)


def test_supported_type_without_projections_is_refused(make_model):
    model = make_model("llama", num_layers=2)
    model.model.layers[1].self_attn = torch.nn.Identity()
    with pytest.raises(KvsieveError, match="Layer 1"):
        architecture(model)


def test_prepare_switches_attention_and_eval_mode():
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("qwen2"))
    model.train()
    assert model.config._attn_implementation != ATTENTION_NAME
    assert prepare(model) is model
    assert model.config._attn_implementation == ATTENTION_NAME
    assert not model.training
    prepare(model)  # idempotent
    assert model.config._attn_implementation == ATTENTION_NAME


@pytest.mark.parametrize("bad", ["/nonexistent", "/nonexistent/model.gguf"])
def test_load_model_missing_path(bad):
    with pytest.raises(KvsieveError, match="Cannot load model") as info:
        load_model(bad)
    assert bad in str(info.value) and "never downloads" in str(info.value)


def test_load_model_folder_without_config(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(KvsieveError, match="config.json"):
        load_model(tmp_path)


def test_load_model_broken_config(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(KvsieveError, match="Cannot load model from"):
        load_model(tmp_path)


def test_load_model_from_local_folder(tmp_path):
    original = build_model("llama")
    original.save_pretrained(tmp_path)
    word_level_tokenizer().save_pretrained(tmp_path)

    model, tokenizer = load_model(tmp_path)
    assert model.config._attn_implementation == ATTENTION_NAME
    assert not model.training
    assert next(model.parameters()).dtype == torch.float32
    assert architecture(model).num_kv_heads == KV_HEADS
    assert tokenizer("the pass key", add_special_tokens=False)["input_ids"] == [3, 4, 5]
    assert tokenizer.eos_token_id == 2

    ids = make_prompt(16).ids
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, original(ids).logits)

    result = kvsieve.generate(
        model, tokenizer, "the pass key is hello", "what is it", raw=True, sampling=kvsieve.Sampling(max_new_tokens=3)
    )
    assert result.prompt_tokens == 8
    assert 1 <= len(result.tokens) <= 3
    assert all(0 <= t < VOCAB for t in result.tokens)


def test_load_model_refuses_unsupported_saved_model(tmp_path):
    tiny_gpt2().save_pretrained(tmp_path)
    word_level_tokenizer().save_pretrained(tmp_path)
    with pytest.raises(KvsieveError, match="gpt2"):
        load_model(tmp_path)


def test_sliding_window_models_are_refused():
    from transformers import AutoModelForCausalLM, MistralConfig

    config = MistralConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        sliding_window=8,
        max_position_embeddings=128,
    )
    with pytest.raises(KvsieveError, match="sliding-window"):
        architecture(AutoModelForCausalLM.from_config(config))
