"""The architecture adapter, `prepare` and `load_model` on tiny local models."""

from __future__ import annotations

import pytest
import torch
from conftest import HEAD_DIM, HEADS, KV_HEADS, build_model, make_prompt, tiny_config, word_level_tokenizer
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

import kvsieve
import kvsieve.loading
from kvsieve import KvsieveError, architecture, load_model, prepare
from kvsieve.attention import ATTENTION_NAME
from kvsieve.loading import resolve_device, resolve_dtype

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


class _NoHub:
    """Stands in for AutoModelForCausalLM / AutoTokenizer: any load attempt fails the test."""

    @staticmethod
    def from_pretrained(*args, **kwargs):
        raise AssertionError(f"from_pretrained was called with {args} {kwargs}")


@pytest.mark.parametrize("bad", ["/nonexistent", "/nope/model.gguf", "./nope", "~/kvsieve-nope", "nope.gguf"])
def test_load_model_missing_path_never_reaches_the_hub(bad, monkeypatch):
    monkeypatch.setattr(kvsieve.loading, "AutoModelForCausalLM", _NoHub)
    monkeypatch.setattr(kvsieve.loading, "AutoTokenizer", _NoHub)
    with pytest.raises(KvsieveError, match="does not exist") as info:
        load_model(bad)
    assert f"'{bad}'" in str(info.value)


def test_load_model_missing_pathlike_object_is_a_path(tmp_path, monkeypatch):
    monkeypatch.setattr(kvsieve.loading, "AutoModelForCausalLM", _NoHub)
    monkeypatch.setattr(kvsieve.loading, "AutoTokenizer", _NoHub)
    missing = tmp_path / "org" / "model"  # a Path is never a hub id, even without a leading '/'
    with pytest.raises(KvsieveError, match="does not exist"):
        load_model(missing)


def test_load_model_sends_plain_names_to_transformers(monkeypatch):
    """A name that is not a local path goes to transformers as a hub id, with no local_files_only."""
    calls = []

    class Recorder:
        @staticmethod
        def from_pretrained(*args, **kwargs):
            calls.append((args, kwargs))
            raise OSError("not in the cache")

    monkeypatch.setattr(kvsieve.loading, "AutoTokenizer", Recorder)
    monkeypatch.setattr(kvsieve.loading, "AutoModelForCausalLM", Recorder)
    monkeypatch.setattr(kvsieve.loading.huggingface_hub.constants, "HF_HUB_CACHE", "/some/hf/cache")
    monkeypatch.setattr(kvsieve.loading.huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(KvsieveError) as info:
        load_model("kvsieve-test/absent-model", device="cpu")
    assert calls == [(("kvsieve-test/absent-model",), {})]
    message = str(info.value)
    for part in ("'kvsieve-test/absent-model'", "/some/hf/cache", "HF_HUB_OFFLINE=1", "not in the cache"):
        assert part in message
    assert "hf download kvsieve-test/absent-model" in message


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("float32", torch.float32),
        ("fp32", torch.float32),
        ("bfloat16", torch.bfloat16),
        ("bf16", torch.bfloat16),
        ("BF16", torch.bfloat16),
        ("float16", torch.float16),
        ("fp16", torch.float16),
        ("float64", torch.float64),
        (torch.bfloat16, torch.bfloat16),
        (torch.float32, torch.float32),
    ],
)
def test_resolve_dtype(value, expected):
    assert resolve_dtype(value) is expected


def test_resolve_dtype_default_follows_the_device():
    assert resolve_dtype(None, "cpu") is torch.float32
    expected = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    assert resolve_dtype(None) is expected


@pytest.mark.parametrize("bad", ["float8", "half-ish", "", torch.int8])
def test_resolve_dtype_rejects_unknown_names(bad):
    with pytest.raises(KvsieveError) as info:
        resolve_dtype(bad)
    for name in ("float32", "bfloat16", "float16", "float64", "fp32", "bf16", "fp16"):
        assert name in str(info.value)


def test_resolve_device_cpu_and_default():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device(torch.device("cpu")) == torch.device("cpu")
    assert resolve_device(None) == torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("asked", ["cuda", "cuda:0", "cuda:3"])
def test_resolve_device_refuses_cuda_without_cuda(asked, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(KvsieveError, match="CUDA is not available") as info:
        resolve_device(asked)
    assert f"'{asked}'" in str(info.value) and "Available devices: cpu" in str(info.value)
    assert resolve_device(None) == torch.device("cpu")


@pytest.mark.parametrize("garbage", ["banana", "gpu0", "cuda:x", "meta"])
def test_resolve_device_rejects_garbage(garbage):
    with pytest.raises(KvsieveError) as info:
        resolve_device(garbage)
    assert f"'{garbage}'" in str(info.value) and "cpu" in str(info.value)


@pytest.mark.parametrize("bad", ["float8", "gpu"])
def test_load_model_checks_options_before_loading(bad, tmp_path, monkeypatch):
    monkeypatch.setattr(kvsieve.loading, "AutoModelForCausalLM", _NoHub)
    monkeypatch.setattr(kvsieve.loading, "AutoTokenizer", _NoHub)
    options = {"dtype": bad} if bad == "float8" else {"device": bad}
    with pytest.raises(KvsieveError, match=bad):
        load_model(tmp_path, **options)


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

    model, tokenizer = load_model(tmp_path, device="cpu")
    assert model.config._attn_implementation == ATTENTION_NAME
    assert not model.training
    assert next(model.parameters()).dtype == torch.float32
    assert next(model.parameters()).device == torch.device("cpu")
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
    prompt = kvsieve.build_prompt(tokenizer, "the pass key is hello", "what is it", raw=True)
    with torch.no_grad():
        expected = original.generate(prompt.ids, max_new_tokens=3, do_sample=False, eos_token_id=2, pad_token_id=0)
    assert result.tokens == expected[0, prompt.length :].tolist()  # transformers' own greedy tokens


@pytest.mark.parametrize("dtype", [torch.bfloat16, "bf16"])
def test_load_model_local_folder_in_bfloat16(dtype, tmp_path):
    original = build_model("llama")
    original.save_pretrained(tmp_path)
    word_level_tokenizer().save_pretrained(tmp_path)

    model, _ = load_model(tmp_path, device="cpu", dtype=dtype)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.config._attn_implementation == ATTENTION_NAME
    # transformers' own bfloat16 load of the same folder (its RoPE inv_freq stays float32).
    reference = prepare(AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16))
    ids = make_prompt(16).ids
    with torch.no_grad():
        logits = model(ids).logits
        torch.testing.assert_close(logits, reference(ids).logits, rtol=0, atol=0)
        torch.testing.assert_close(logits.float(), original(ids).logits, rtol=0.05, atol=0.5)


def test_load_model_defaults_to_the_best_device(tmp_path):
    build_model("llama").save_pretrained(tmp_path)
    word_level_tokenizer().save_pretrained(tmp_path)
    model, _ = load_model(tmp_path)
    parameter = next(model.parameters())
    assert parameter.device.type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert parameter.dtype == (torch.bfloat16 if torch.cuda.is_available() else torch.float32)


def test_load_model_refuses_unsupported_saved_model(tmp_path):
    tiny_gpt2().save_pretrained(tmp_path)
    word_level_tokenizer().save_pretrained(tmp_path)
    with pytest.raises(KvsieveError, match="gpt2"):
        load_model(tmp_path)


def test_layers_of_a_kind_kvsieve_does_not_run_are_refused_by_name(make_model):
    """Sliding-window layers are supported (tests/test_hybrid.py); chunked attention (Llama 4) is not."""
    model = make_model("llama")
    model.config.layer_types = ["full_attention", "chunked_attention"]
    with pytest.raises(KvsieveError, match="chunked_attention"):
        architecture(model)
