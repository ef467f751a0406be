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

import os
import threading
from collections.abc import Callable, Iterable

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    Phi3Config,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
)

import kvsieve
import kvsieve.data
import kvsieve.models
from kvsieve.kernels import native
from kvsieve.loading import pair_tokenizer
from kvsieve.prompt import Prompt


def _threads_per_process() -> int:
    """Intra-op threads for each test process: the cores shared out among pytest-xdist's workers.

    With `-n 2` on two cores every worker runs on one thread: two workers each running two OpenMP
    threads fight over the cores, and a busy core makes OpenMP's hand-offs many times slower than
    one thread. Run serially (`-n 0`), a process gets every core. KVSIEVE_TEST_THREADS overrides.
    """
    if os.environ.get("KVSIEVE_TEST_THREADS"):
        return max(1, int(os.environ["KVSIEVE_TEST_THREADS"]))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))


# This process, and through the environment every subprocess a test starts (the bench worker, the
# offline-hub checks), uses the same number of threads.
THREADS = _threads_per_process()
torch.set_num_threads(THREADS)
os.environ["OMP_NUM_THREADS"] = str(THREADS)

VOCAB = 256
HIDDEN = 64
HEADS = 4
KV_HEADS = 2
HEAD_DIM = HIDDEN // HEADS
ARCHS = ("llama", "mistral", "qwen2", "qwen3", "phi3")
# Hybrid attention: sliding-window layers of WINDOW tokens beside global ones (Gemma 3: local and global RoPE of
# different bases; Gemma 2: alternating, soft-capped logits; Qwen2 with its window on above max_window_layers),
# and Mistral's window on every layer (no global layer at all).
HYBRID_ARCHS = ("gemma3", "gemma2", "qwen2-window", "mistral-window")
WINDOW = 8


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
    if arch == "gemma3":  # Gemma 3's 5:1 pattern, shortened: the last layer of every 3 is global
        kinds = ["full_attention" if (j + 1) % 3 == 0 else "sliding_attention" for j in range(num_layers)]
        rope = {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
        }
        return Gemma3TextConfig(
            head_dim=HEAD_DIM, sliding_window=WINDOW, query_pre_attn_scalar=HEAD_DIM, layer_types=kinds,
            rope_parameters=rope, **common,
        )  # fmt: skip
    if arch == "gemma2":
        return Gemma2Config(
            head_dim=HEAD_DIM, sliding_window=WINDOW, query_pre_attn_scalar=HEAD_DIM, attn_logit_softcapping=5.0,
            final_logit_softcapping=30.0, **common,
        )  # fmt: skip
    if arch == "qwen2-window":
        return Qwen2Config(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=num_layers // 2, **common)
    if arch == "mistral-window":
        return MistralConfig(head_dim=HEAD_DIM, sliding_window=WINDOW, **common)
    raise ValueError(arch)


def build_model(arch: str, num_layers: int = 2, max_positions: int = 256, seed: int = 0) -> PreTrainedModel:
    """A fresh, seeded, kvsieve-prepared tiny model with no EOS (decoding never stops early)."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, num_layers, max_positions), dtype=torch.float32)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    model = kvsieve.prepare(model.eval())
    pair_tokenizer(model, FakeTokenizer())  # its tokenizer, as load_model's models have (KVzip writes a prompt)
    return model


class FakeTokenizer:
    """The part of a tokenizer that `kvsieve.run` and `decode` use, on raw ids.

    `decode` writes each id as "<id>" so every token's text is distinct and a stop string such
    as "<17>" matches exactly one token. `eos_token_id` is None by default (no EOS at all).
    """

    def __init__(self, eos_token_id: int | None = None):
        self.eos_token_id = eos_token_id

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """One id per word (3 + its length mod 10): enough for a prompt a stage writes itself (KVzip's)."""
        return [3 + len(word) % 10 for word in text.split()]

    def decode(self, ids: Iterable[int] | torch.Tensor, skip_special_tokens: bool = True) -> str:
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        return "".join(f"<{int(i)}>" for i in ids)


def make_prompt(n: int, tail_len: int = 4, context_start: int = 2, seed: int = 1) -> Prompt:
    """Random ids (1, n): `context_start` prefix tokens, a context, and `tail_len` tail tokens."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (1, n), generator=generator)
    return Prompt(ids=ids, context_start=context_start, context_len=n - context_start - tail_len)


class Decoder:
    """One prefilled cache decoded token by token through the engine's decoding step (a batch of one row), the
    tokens chosen by the test (teacher forcing or greedy): `feed(token)` returns the next (vocab,) logits."""

    def __init__(self, model: PreTrainedModel, cache, position: int, evict=None):
        from kvsieve.engine.batch import DecodeBatch, Row

        self.batch = DecodeBatch(model)
        self.batch.add(Row(0, position, evict), cache)

    def feed(self, token: int) -> torch.Tensor:
        self.batch.rows[0].token = int(token)
        return self.batch.step()[0]


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


# The essays haystack cut at the paragraph break before this many characters: about 20K words of
# the word-level tokenizer and 23K SmolLM2 tokens, far more than any in-process case uses (needle
# cases up to 3K tokens, perplexity text up to 8K), and far less than the whole 640K characters.


@pytest.fixture(scope="session")
def smollm():
    """The embedded default model (SmolLM2-135M-Instruct) and its tokenizer, loaded offline once per process.

    Shared by the real-model tests (test_real_model, test_serve_real, test_cli); generation leaves a
    model as it found it (`kvsieve serve` shares one across requests the same way).
    """
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_HUB_OFFLINE", "1")
        return kvsieve.load_model()


# A scheduling hint for pytest-xdist: these tests (the slowest, longest first; seconds in a fresh `make test` on the
# 2-core VM (2026-11-28), one thread a worker) start before the rest, so no worker is left running one of them
# alone at the end of the run. Only the order changes; a name that no longer exists is ignored.
SLOW_FIRST = (
    "test_commands.py::test_evaluations_write_their_files_and_report_draws_them",  # 70 s (five processes at once)
    "test_commands.py::test_demo_answers_side_by_side",  # 25 s
    "test_commands.py::test_generate_json_from_stdin_is_json_on_a_models_first_run",  # 25 s (converts the model)
    "test_pipeline_task.py::test_every_seed_preset_answers_as_kvsieve_on_smollm2_through_both_fronts",  # 33 s
    "test_commands.py::test_serve_answers_the_official_client_and_stops_on_sigterm",  # 15 s
    "test_custom_generate.py::test_a_prompt_that_names_no_question_is_guided_by_its_tail",  # 14 s
    "test_compiled_step.py::test_compiled_steps_give_the_ordinary_steps_logits_and_compile_once",  # 25 s
    "test_compiled_step.py::test_int8_weights_under_bfloat16_get_their_own_logits",  # 23 s
    "test_serve_real.py::test_langchain_chat_openai_runs_against_the_server",  # 20 s
    "test_real_model.py::test_needle_answered_with_critiprefill",  # 18 s
    "test_real_model.py::test_imdc_retrieves_a_key_pruned_before_the_question_arrives",  # 17 s
    "test_entry_points.py::test_niah_ppl_and_bench_run_every_method",  # 14 s
    "test_entry_points.py::test_bench_runs_each_configuration_in_its_own_process",  # 14 s
    "test_serve_real.py::test_passkey_document_is_reused_for_the_next_question",  # 12 s
    "test_real_model.py::test_bfloat16_default_model_answers_through_gemfilter",  # 11 s
    "test_pipeline_task.py::test_the_task_with_no_model_answers_with_the_embedded_default",  # 9 s
    "test_compiled_step.py::test_evicting_rows_are_compiled_with_their_observers_once_at_their_budget",  # 10 s
    "test_serve.py::test_every_preset_answers_as_the_library",  # 10 s
    "test_serve_hybrid.py::test_every_preset_answers_as_the_library",  # 10 s
    "test_hub_load.py::test_model_id_loads_from_the_offline_hf_cache",  # 10 s
    "test_hybrid.py::test_every_preset_stays_on_the_models_device_and_runs_in_bfloat16",  # 10 s
    "test_cli.py::test_generate_answers_in_json_and_with_penalties",  # 9 s
    "test_cli.py::test_generate_with_compression_and_eviction",  # 8 s
    "test_cli.py::test_generate_gemfilter_records_its_spec_and_selection",  # 5 s
    "test_serve_real.py::test_structured_output_keeps_the_answer_within_json_and_its_schema",  # 8 s
    "test_serve_fuzz.py::test_any_bytes_never_answer_5xx",  # 8 s
    "test_ruler.py::test_the_cases_are_nvidias_with_the_question_where_it_starts",  # 7 s
    "test_cli.py::test_generate_with_int8_weights_finds_the_passkey",  # 7 s
    "test_real_model.py::test_short_passkey_is_answered",  # 7 s
    "test_serve.py::test_reuse_continues_the_stored_document_and_answers_as_the_library_does",  # 6 s
    "test_serve.py::test_load_8_clients_mixed_methods_and_bad_requests",  # 5 s
    "test_ruler.py::test_the_sweep_runs_every_configuration_and_sharing_the_prefill_changes_no_answer",  # 5 s
    "test_cli.py::test_generate_with_chunked_feeds_beyond_the_context",  # 5 s
)


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(f"{item.path.name}::{item.originalname}", len(rank)))  # stable


def pytest_configure(config):
    """Under pytest-xdist, convert the default model and build the CPU kernels' library (once per
    machine) before the workers start.

    `load_model` converts the shipped GGUF on first use, and the first decoding step builds the kernel; on a
    fresh machine several workers would each do both at once. The controller does them first, so the workers
    only read them.
    """
    if hasattr(config, "workerinput") or not config.getoption("numprocesses", None):
        return  # a worker, or no workers: the first test that needs the model converts it

    def build() -> None:
        try:
            native.build()
        except RuntimeError:
            pass  # no compiler: the kernel's tests say so themselves

    builder = threading.Thread(target=build)  # the compiler runs beside the conversion (10 s and 16 s, cold)
    builder.start()
    if not (kvsieve.loading.converted_default_dir() / "config.json").is_file():
        try:
            kvsieve.load_model()
        except kvsieve.KvsieveError:
            pass  # the model's wheel is missing: the real-model tests say so themselves
    builder.join()
