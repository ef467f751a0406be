"""`pipeline("kvsieve-text-generation")` (kvsieve.integrations.pipeline_task): on tiny random-weight models saved as
folders (Llama, and Gemma 3's hybrid sliding layers), every method answers as `kvsieve.generate` answers, full
attention as transformers' own `generate`, several questions of one context as each alone (from one prefill), a list
of contexts as each alone, a streamer gets the answer; bad calls are refused by name. The real default model: the
task with no model named answers a passkey question."""

from __future__ import annotations

import pytest
import torch
from conftest import build_model
from test_custom_generate import PRESET_SETTINGS, Recording
from test_serve import DOC, word_tokenizer
from transformers import AutoModelForCausalLM, pipeline
from transformers.pipelines import PIPELINE_REGISTRY

import kvsieve
from kvsieve import KvsieveError, Sampling
from kvsieve.integrations import pipeline_task
from kvsieve.integrations.pipeline_task import TASK

QUESTION = "what is the pass key"
SHORT = " ".join(DOC.split()[:40])


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def folder(request, tmp_path_factory):
    """A tiny model and its word tokenizer saved as a folder, as a user names one to `pipeline`."""
    path = tmp_path_factory.mktemp(f"pipe-{request.param}")
    build_model(request.param, num_layers=3, max_positions=512).save_pretrained(path)
    word_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def pipe(folder):
    torch.set_num_threads(1)
    pipe = pipeline(TASK, model=str(folder), device="cpu")
    pipe.model.generation_config.eos_token_id = None  # random weights: decode every asked token
    return pipe


def test_the_task_is_registered_and_loads_through_kvsieve(pipe):
    assert TASK in PIPELINE_REGISTRY.get_supported_tasks()
    assert isinstance(pipe, pipeline_task.KvsieveTextGenerationPipeline)
    assert pipe.model.config._attn_implementation == "kvsieve" and pipe.model.dtype == torch.float32


@pytest.mark.parametrize("name", ["full", *PRESET_SETTINGS])
def test_each_method_answers_as_kvsieve_generate(name, pipe):
    settings = PRESET_SETTINGS.get(name, {})
    [answer] = pipe(DOC, question=QUESTION, method=name, set=settings, max_new_tokens=5)
    alone = kvsieve.generate(pipe.model, pipe.tokenizer, DOC, QUESTION, method=kvsieve.method(name, settings),
                             sampling=Sampling(max_new_tokens=5))  # fmt: skip
    assert answer["tokens"] == alone.tokens and answer["generated_text"] == alone.text
    assert answer["question"] == QUESTION and answer["prompt_tokens"] == alone.prompt_tokens
    assert answer["prefill_kv_length"] == alone.prefill_kv_length
    assert [stage["stage"] for stage in answer["stages"]] == [stage.stage for stage in alone.stages]


def test_full_attention_answers_as_transformers_generate(pipe):
    [answer] = pipe(DOC, question=QUESTION, method="full", max_new_tokens=6)
    prompt = kvsieve.build_prompt(pipe.tokenizer, DOC, QUESTION)
    plain = AutoModelForCausalLM.from_pretrained(pipe.model.name_or_path, attn_implementation="sdpa")
    theirs = plain.generate(prompt.ids, max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=None)
    assert answer["tokens"] == theirs[0, prompt.length :].tolist()


@pytest.mark.parametrize("name", ["snapkv", "gemfilter", "a2sf"])
def test_questions_of_one_context_answer_as_each_alone_from_one_prefill(name, pipe):
    questions = [QUESTION, "what is it", "remember the key"]
    settings = PRESET_SETTINGS[name]
    answers = pipe(DOC, questions=questions, method=name, set=settings, max_new_tokens=4)
    for answer, question in zip(answers, questions, strict=True):
        [alone] = pipe(DOC, question=question, method=name, set=settings, max_new_tokens=4)
        assert answer["tokens"] == alone["tokens"] and answer["question"] == question
    first_pass = {"snapkv": "feed", "a2sf": "feed", "gemfilter": "select"}[name]
    reused = [next(s for s in a["stages"] if s["stage"] == first_pass)["details"] for a in answers]
    if name == "gemfilter":  # its selection pass up to the filter layer continues the stored context's
        assert all(d["first_pass_seconds"] > 0 for d in reused)
    else:  # the later questions ran only their tail on the stored context (cut to whole blocks of 16 where the
        # method's window of 8 scored queries reaches into it)
        assert "reused_tokens" not in reused[0] and all(d["reused_tokens"] >= 64 for d in reused[1:])
        runs = zip(reused[1:], answers[1:], strict=True)
        assert all(d["tokens"] + d["reused_tokens"] == a["prompt_tokens"] for d, a in runs)


def test_a_reuse_budget_keeps_the_context_compressed_for_every_question(pipe):
    answers = pipe(DOC, questions=[QUESTION, "what is it"], method="snapkv", set=PRESET_SETTINGS["snapkv"],
                   reuse_budget=32, max_new_tokens=3)  # fmt: skip
    for answer in answers:
        feed = answer["stages"][0]["details"]
        assert feed.get("context_entries", 32) == 32  # the question's pass saw the 32 kept entries, not the document


@pytest.mark.parametrize("name", ["h2o", "a2sf", "tova"])
def test_eviction_after_a_question_agnostic_context_does_not_see_the_question(name, pipe):
    """A context compressed before any question (`reuse_budget`) is then evicted from while decoding: by scores of
    the context's own queries, never the question's. Two questions leave the same scores on the context's entries."""
    questions = [QUESTION, "remember it what is the answer"]
    spec = kvsieve.method(name, {"evict.budget": 40})
    results = kvsieve.generate(pipe.model, pipe.tokenizer, DOC, questions, method=spec, reuse_budget=32,
                               sampling=Sampling(max_new_tokens=1))  # fmt: skip
    kept = [r.stages[0].details["context_entries"] for r in results]
    assert kept == [32, 32]
    first, second = (r.state.evict.scores for r in results)
    for layer in first:
        torch.testing.assert_close(first[layer][:, :32], second[layer][:, :32], rtol=0, atol=0)


def test_a_list_of_contexts_is_one_batch_answering_each_as_alone(pipe):
    contexts = [DOC, SHORT]
    out = pipe(contexts, question=QUESTION, method="snapkv", set=PRESET_SETTINGS["snapkv"], max_new_tokens=4)
    assert len(out) == 2
    for answers, context in zip(out, contexts, strict=True):
        [alone] = pipe(context, question=QUESTION, method="snapkv", set=PRESET_SETTINGS["snapkv"], max_new_tokens=4)
        assert answers[0]["tokens"] == alone["tokens"]


def test_a_streamer_receives_the_prompt_then_the_answer(pipe):
    streamer = Recording(pipe.tokenizer)
    [answer] = pipe(DOC, question=QUESTION, method="snapkv", set=PRESET_SETTINGS["snapkv"], max_new_tokens=5,
                    streamer=streamer)  # fmt: skip
    assert streamer.puts[0] == kvsieve.build_prompt(pipe.tokenizer, DOC, QUESTION).ids[0].tolist()
    assert sum(streamer.puts[1:], []) == answer["tokens"] and streamer.ended == 1


def test_sampling_options_apply_as_generate_applies_them(pipe):
    """top_k=1 leaves one token to sample: any temperature gives the greedy answer; n answers come as a list."""
    [greedy] = pipe(SHORT, question=QUESTION, method="full", max_new_tokens=5)
    sampled = pipe(SHORT, question=QUESTION, method="full", max_new_tokens=5, do_sample=True, temperature=1.5,
                   top_k=1, num_return_sequences=2)  # fmt: skip
    assert [s["tokens"] for s in sampled] == [greedy["tokens"]] * 2
    [same] = pipe(SHORT, question=QUESTION, method="full", max_new_tokens=5, return_full_text=False)  # its own way
    assert same["tokens"] == greedy["tokens"]


@pytest.mark.parametrize(
    "options, message",
    [
        ({"method": "pyramid"}, "Unknown method 'pyramid'"),
        ({"questions": [QUESTION, " "]}, r"questions\[1\] is empty"),
        ({"question": QUESTION, "num_beams": 2}, "does not run beam search"),
        ({"question": QUESTION, "bogus": 1}, "Unknown option\\(s\\) bogus"),
        ({"question": QUESTION, "questions": [QUESTION]}, "not both"),
        ({"question": QUESTION, "method": "snapkv", "set": {"compress.nope": 1}}, "has no field 'nope'"),
        ({"question": QUESTION, "reuse_budget": 0.5}, "pass a list of questions"),
        ({"question": QUESTION, "output_scores": True}, "not per-step scores"),
        ({"questions": [QUESTION, "what is it"], "streamer": Recording()}, "stream= takes one answer"),
        ({"question": QUESTION, "max_length": 50}, "takes max_new_tokens"),
        ({"question": QUESTION, "return_full_text": True}, "returns the answer alone"),
    ],
)
def test_bad_calls_are_refused_by_name(options, message, pipe):
    with pytest.raises(KvsieveError, match=message):
        pipe(SHORT, **options)


def test_a_model_the_user_loaded_is_prepared_and_finds_its_tokenizer(folder):
    plain = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa")
    pipe = pipeline(TASK, model=plain, device="cpu")
    assert plain.config._attn_implementation == "kvsieve" and pipe.tokenizer.chat_template is not None
    assert pipe(SHORT, question=QUESTION, method="full", max_new_tokens=2)[0]["generated_text"]


def test_a_gguf_file_is_loaded_by_kvsieve_as_transformers_names_it(monkeypatch, folder):
    """model=FOLDER, model_kwargs={"gguf_file": NAME}: kvsieve's loader gets the file, dtype "auto" its default."""
    asked = []
    tiny = build_model("llama", num_layers=3, max_positions=512)

    def loader(source, dtype=None):
        asked.append((str(source), dtype))
        return tiny, word_tokenizer()

    monkeypatch.setattr(pipeline_task, "load_model", loader)
    model = pipeline_task.KvsieveModel.from_pretrained(str(folder), gguf_file="m.gguf", dtype="auto")
    assert model is tiny and asked == [(str(folder / "m.gguf"), None)]


@pytest.mark.real_model
def test_the_task_with_no_model_answers_with_the_embedded_default(smollm):
    """`pipeline("kvsieve-text-generation")` on a fresh install: the embedded SmolLM2, a passkey answered, with the
    tokens `kvsieve.generate` gives (float32)."""
    from kvsieve.data import passkey_case

    pipe = pipeline(TASK)
    case = passkey_case(pipe.tokenizer, 600, 0.5, seed=2)
    [answer] = pipe(case.context, question=case.question, method="snapkv", set={"compress.budget": 0.5},
                    max_new_tokens=12)  # fmt: skip
    model, tokenizer = smollm
    alone = kvsieve.generate(model, tokenizer, case.context, case.question, method=kvsieve.method(
        "snapkv", {"compress.budget": 0.5}), sampling=Sampling(max_new_tokens=12))  # fmt: skip
    assert case.answer in answer["generated_text"] and answer["tokens"] == alone.tokens


REAL_SETTINGS = {  # budgets that bite on a 180-token prompt
    "gemfilter": {"select.k": 96},
    "snapkv": {"compress.budget": 64},
    "a2sf": {"evict.budget": 64},
    "imdc": {"feed.chunk": 48, "feed.memory": 48},
    "critiprefill": {"attention.segment": 32, "attention.block": 8, "attention.budget": 48},
}


@pytest.mark.real_model
def test_every_seed_preset_answers_as_kvsieve_on_smollm2_through_both_fronts(smollm):
    """SmolLM2 in float32: through the pipeline, each preset gives `kvsieve.generate`'s tokens for the same context
    and question; through `model.generate`, `kvsieve.run`'s tokens for the same ids."""
    from kvsieve.data import passkey_case
    from kvsieve.prompt import ids_prompt

    model, tokenizer = smollm
    pipe = pipeline(TASK, model=model, tokenizer=tokenizer)
    case = passkey_case(tokenizer, 180, 0.3, seed=4)
    ids = kvsieve.build_prompt(tokenizer, case.context, case.question).ids
    for name, settings in REAL_SETTINGS.items():
        spec = kvsieve.method(name, settings)
        [answer] = pipe(case.context, question=case.question, method=name, set=settings, max_new_tokens=6)
        alone = kvsieve.generate(model, tokenizer, case.context, case.question, method=spec, sampling=Sampling(6))
        assert answer["tokens"] == alone.tokens, name
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
                             custom_generate=kvsieve.decoding(name, settings))  # fmt: skip
        direct = kvsieve.run(model, tokenizer, ids_prompt(ids[0].tolist()), method=spec, sampling=Sampling(6))
        assert out[0, ids.shape[1] :].tolist()[: len(direct.tokens)] == direct.tokens, name
