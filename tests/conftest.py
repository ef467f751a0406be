"""Shared fixtures: tiny random-weight models of every supported architecture, and a fake tokenizer.

The models are a few layers of width 64 with grouped-query attention (4 query heads, 2 KV heads),
float32, seeded, in eval mode, built with `AutoModelForCausalLM.from_config` (no download) and
routed through kvsieve's attention with `kvsieve.prepare`. Building one takes milliseconds, so
every test gets a fresh model and may change its attention implementation or generation config.

Tests feed token ids directly (`Prompt(ids=..., context_start=..., context_len=...)`) instead of
tokenizing text: the library code under test (selection, prefill, decoding) only sees ids. The
pipeline needs a tokenizer for just three things: `decode(ids, skip_special_tokens=True)` to
produce the answer text (and to find stop strings in it), `eos_token_id` to stop decoding, and
decoding the selected ids into `selected_text`. `FakeTokenizer` provides exactly those, with an
unambiguous text form ("<17><203>") so tests can predict where a stop string cuts, and no EOS,
so generation always runs to `max_new_tokens` unless a test asks otherwise.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    Phi3Config,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
)

import kvsieve
from kvsieve.prompt import Prompt

VOCAB = 256
HIDDEN = 64
HEADS = 4
KV_HEADS = 2
HEAD_DIM = HIDDEN // HEADS
ARCHS = ("llama", "mistral", "qwen2", "qwen3", "phi3")


def tiny_config(arch: str, num_layers: int = 2, max_positions: int = 256):
    """A transformers config for a tiny GQA model of architecture `arch`."""
    common = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=max_positions,
        # Larger than the usual 0.02 so logits have clear gaps and greedy choices are not
        # decided by float rounding differences between attention implementations.
        initializer_range=0.2,
        tie_word_embeddings=False,
    )
    if arch == "llama":
        return LlamaConfig(head_dim=HEAD_DIM, **common)
    if arch == "mistral":
        return MistralConfig(head_dim=HEAD_DIM, sliding_window=None, **common)
    if arch == "qwen2":
        return Qwen2Config(**common)
    if arch == "qwen3":
        return Qwen3Config(head_dim=HEAD_DIM, **common)
    if arch == "phi3":
        # Phi-3 fuses q/k/v into qkv_proj; its default pad id (32000) is outside our vocabulary.
        return Phi3Config(pad_token_id=0, bos_token_id=1, eos_token_id=2, **common)
    raise ValueError(arch)


def build_model(arch: str, num_layers: int = 2, max_positions: int = 256, seed: int = 0) -> PreTrainedModel:
    """A fresh, seeded, kvsieve-prepared tiny model with no EOS (decoding never stops early)."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, num_layers, max_positions), dtype=torch.float32)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return kvsieve.prepare(model.eval())


class FakeTokenizer:
    """The part of a tokenizer that `kvsieve.pipeline.run` and `decode` use, on raw ids.

    `decode` writes each id as "<id>" so every token's text is distinct and a stop string such
    as "<17>" matches exactly one token. `eos_token_id` is None by default (no EOS at all).
    """

    def __init__(self, eos_token_id: int | None = None):
        self.eos_token_id = eos_token_id

    def decode(self, ids: Iterable[int] | torch.Tensor, skip_special_tokens: bool = True) -> str:
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        return "".join(f"<{int(i)}>" for i in ids)


def make_prompt(n: int, tail_len: int = 4, context_start: int = 2, seed: int = 1) -> Prompt:
    """Random ids (1, n): `context_start` prefix tokens, a context, and `tail_len` tail tokens."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (1, n), generator=generator)
    return Prompt(ids=ids, context_start=context_start, context_len=n - context_start - tail_len)


def word_level_tokenizer() -> PreTrainedTokenizerFast:
    """An offline tokenizer: one id per whitespace-separated word of a fixed vocabulary."""
    words = "the pass key is what remember it answer question hello world".split()
    vocab = {"[UNK]": 0, "<s>": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate(words)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", bos_token="<s>", eos_token="</s>")


@pytest.fixture
def single_thread():
    """Run tiny models on one intra-op thread, restoring the setting afterwards.

    Models this small gain nothing from threads, and when another process keeps the (2) cores
    busy, OpenMP's thread hand-offs make every tiny matmul about 30x slower.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def make_model(single_thread) -> Callable[..., PreTrainedModel]:
    """Factory: make_model(arch, num_layers=2, max_positions=256, seed=0)."""
    return build_model


@pytest.fixture(params=ARCHS)
def arch(request) -> str:
    """Every supported architecture in turn."""
    return request.param


@pytest.fixture
def tiny_model(arch: str, single_thread) -> PreTrainedModel:
    """A 2-layer tiny model of each supported architecture."""
    return build_model(arch)


@pytest.fixture
def tokenizer() -> FakeTokenizer:
    return FakeTokenizer()


@pytest.fixture
def isolated_cache(tmp_path, monkeypatch):
    """An empty kvsieve cache dir, so calibration lookups never read the user's real one.

    Not autouse: real-model tests need the real cache, where the converted default model lives.
    """
    folder = tmp_path / "kvsieve-cache"
    monkeypatch.setenv("KVSIEVE_CACHE_DIR", str(folder))
    return folder
