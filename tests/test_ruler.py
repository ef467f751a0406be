"""RULER in kvsieve (`kvsieve.eval.ruler`, `kvsieve ruler`): NVIDIA's generators, RULER's metrics, the sweep.

The cases are NVIDIA's own (its variable-tracking generator, the cheapest, at 1024 tokens with the default model's
tokenizer), answered by a tiny random-weight Llama with that tokenizer's vocabulary: the scores mean nothing, what
is checked is the plumbing: the prompt holds the generator's text with the question where it starts, the metrics are
RULER's, every configuration of the sweep runs in each mode, sharing one prefill of the context changes no answer,
the question-agnostic mode compresses the context before the question, and a rerun resumes.
"""

from __future__ import annotations

import copy
import importlib.metadata
import json
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import kvsieve
from kvsieve import engine, registry
from kvsieve.errors import KvsieveError
from kvsieve.eval import ruler
from kvsieve.eval.report import write_report
from kvsieve.prompt import build_task_prompt

# The cases are generated once per worker (NVIDIA's generator in a process of its own, 10 s): one worker runs them.
pytestmark = pytest.mark.xdist_group("ruler_cases")

LENGTH = 1024  # vt's generator never ends at 512: its smallest case does not fit


@pytest.fixture(scope="module")
def tokenizer(smollm):
    return smollm[1]


@pytest.fixture(scope="module")
def cases_folder(tokenizer, tmp_path_factory):
    folder = tmp_path_factory.mktemp("ruler-cases")
    ruler.generate_cases(tokenizer, "vt", LENGTH, 1, 42, folder)
    return folder


@pytest.fixture
def model(tokenizer, single_thread):
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=False,
    )  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = None  # every answer runs to the task's length
    return kvsieve.prepare(model)


def test_the_cases_are_nvidias_with_the_question_where_it_starts(tokenizer, cases_folder):
    raw = ruler.generate_cases(tokenizer, "vt", LENGTH, 1, 42, cases_folder)
    assert len(raw) == 1 and all(len(r["outputs"]) == 5 for r in raw)  # vt: one chain of 4 hops, 5 variables
    assert all(r["length"] <= LENGTH for r in raw)  # RULER's length holds the prompt and the answer
    cases = ruler.load_cases(tokenizer, "vt", LENGTH, 1, 42, cases_folder)
    text = raw[0]["input"]
    context, question, lead = ruler.split_input(text, ruler.task_configs()["vt"])
    assert context + question + lead == text
    assert question.startswith("\nQuestion: Find all variables") and lead.startswith(" Answer: According to")
    prompt, boundary = cases[0].prompt, cases[0].boundary
    ids = prompt.ids[0].tolist()
    assert tokenizer.decode(ids[prompt.context_start : boundary]) == context
    after = tokenizer.decode(ids[boundary:])  # the user turn closes after the question; the lead opens the answer
    assert after.startswith(question) and after.endswith(lead.lstrip())
    assert cases[0].max_new_tokens == 30 and cases[0].references == raw[0]["outputs"]


def test_scores_are_rulers_metrics():
    # string_match_all: the share of references in the answer; string_match_part: any reference
    assert ruler.score("vt", "X1 and x2 are", ["X1", "X2", "X3", "X4"]) == 50.0
    assert ruler.score("qa_1", "it was France.", ["Paris", "france"]) == 100.0
    assert ruler.score("cwe", "\x00 tail rowing", ["rowing", "tail"]) == 100.0


def test_the_sweep_runs_every_configuration_and_sharing_the_prefill_changes_no_answer(
    model, tokenizer, cases_folder, tmp_path, monkeypatch
):
    specs = registry.methods("full,snapkv,h2o,gemfilter,streaming,critiprefill")
    options = dict(tasks=["vt"], samples=1, budgets=[0.25, 0.5], cases=cases_folder, say=lambda _: None)
    passes = []
    fill = engine.fill_prefix_caches
    monkeypatch.setattr(engine, "fill_prefix_caches", lambda *args: passes.append(fill(*args)) or passes[-1])
    shared = ruler.run_ruler(model, tokenizer, specs, [LENGTH], tmp_path / "shared.json", **options)
    alone = ruler.run_ruler(model, tokenizer, specs, [LENGTH], tmp_path / "alone.json", share_prefill=False, **options)
    configs = ruler.configurations(specs, [0.25, 0.5], ruler.DEFAULT_MODES)
    # question mode: 4 presets x 2 budgets + full + critiprefill; agnostic: the 3 with a scorer x 2
    assert len(configs) == 10 + 6 and len(shared["rows"]) == len(configs)
    key = lambda r: (r["index"], r["method"], r["budget"], r["mode"])  # noqa: E731
    assert {key(r): r["answer"] for r in shared["rows"]} == {key(r): r["answer"] for r in alone["rows"]}
    rows = {key(r): r for r in shared["rows"]}
    cases = ruler.load_cases(tokenizer, "vt", LENGTH, 1, 42, cases_folder)
    index = 0
    # every method that continues its one-pass feed starts from the context's state, filled before any group ran
    assert {rows[(index, m, b, "question")]["reuse"] for m, b in [("full", None), ("snapkv", 0.25), ("h2o", 0.5)]} == {
        "hit"
    }
    assert rows[(index, "gemfilter", 0.25, "question")]["reuse"] == "miss"  # its own selection pass, stored
    assert rows[(index, "gemfilter", 0.5, "question")]["reuse"] == "hit"  # and shared across its budgets
    assert rows[(index, "critiprefill", None, "question")]["reuse"] == "not reusable"
    # both modes' states come from one prefill per kind of exact state (full, snapkv and streaming keep no sums,
    # h2o its accumulated ones): 2 passes for the 13 configurations that continue a stored context
    assert passes == [2]
    agnostic = [r for r in shared["rows"] if r["mode"] == "agnostic"]
    assert len(agnostic) == 6 and {r["reuse"] for r in agnostic} == {"hit"}
    assert {r["reuse"] for r in alone["rows"] if r["mode"] == "agnostic"} == {"miss"}
    # agnostic: the context (up to the question) compressed to a quarter before the question came, the question's
    # entries then appended and nothing pruned again, by a compress stage or an evicting one
    question = cases[index].prompt.length - cases[index].boundary
    for name in ("snapkv", "h2o", "streaming"):
        assert rows[(index, name, 0.25, "agnostic")]["kv_length"] == round(0.25 * cases[index].boundary) + question
    assert rows[(index, "snapkv", 0.25, "question")]["kv_length"] == round(0.25 * cases[index].prompt.length)
    assert all(0 <= r["score"] <= 100 and r["references"] for r in shared["rows"])
    summary = ruler.summarize(shared["rows"])
    assert summary[("full", None, "question")]["kept"] == 1.0
    assert summary[("snapkv", 0.25, "question")]["kept"] < 0.3
    path = write_report(tmp_path / "docs" / "RESULTS.md", ruler_files=[tmp_path / "shared.json"])
    text = path.read_text()
    # a random-weight model scores nothing: the report says so, with full attention's calibration
    assert "Full attention scores below 20 on every task run." in text
    assert "| vt | 0.0 | 1 | no: full attention scores 0.0 < 20" in text


def test_the_unmarked_mode_answers_as_a_completions_request_does(model, tokenizer, cases_folder, tmp_path, monkeypatch):
    """The unmarked mode gives each preset the case's whole prompt as token ids, nothing marking the question (what
    `/v1/completions` and `generate` on ids get): each request's prompt is `ids_prompt` of those ids, each answer
    exactly `kvsieve.run` on it, and no stored context is used. IMDC's guided pruning then reads the prompt's
    stand-in question (`question_tail` with the tokenizer) where the question mode gives it the case's question."""
    from kvsieve import Sampling
    from kvsieve.prompt import ids_prompt, question_tail

    prompts = []
    request = engine.Request
    monkeypatch.setattr(engine, "Request", lambda prompt, *a, **k: prompts.append(prompt) or request(prompt, *a, **k))
    specs = registry.methods("full,imdc,snapkv")
    options = dict(tasks=["vt"], samples=1, budgets=[0.25], modes=["unmarked"], cases=cases_folder, say=print)
    document = ruler.run_ruler(model, tokenizer, specs, [LENGTH], tmp_path / "unmarked.json", **options)
    rows = {r["method"]: r for r in document["rows"]}
    assert set(rows) == {"imdc", "snapkv"}  # full attention, without a budget, is the question mode's reference
    assert {r["mode"] for r in rows.values()} == {"unmarked"} and {r["reuse"] for r in rows.values()} == {"off"}
    assert document["settings"]["stand_in"] == {"window": 16, "longest": 64}  # the rule, so a later one is not a resume
    [case] = ruler.load_cases(tokenizer, "vt", LENGTH, 1, 42, cases_folder)
    ids = case.prompt.ids[0].tolist()
    stand_in = question_tail(ids, tokenizer=tokenizer)
    assert len(prompts) == 2
    for prompt in prompts:
        assert prompt.ids[0].tolist() == ids and not prompt.asked and prompt.tail_len == stand_in
    runs, unmarked = {}, ids_prompt(ids, tokenizer=tokenizer)
    for name, row in rows.items():
        spec = ruler.spec_at(specs[name], 0.25, len(ids))
        runs[name] = kvsieve.run(model, tokenizer, unmarked, method=spec, sampling=Sampling(case.max_new_tokens))
        assert row["answer"] == runs[name].text, name
    marked = kvsieve.run(model, tokenizer, case.prompt, method=ruler.spec_at(specs["imdc"], 0.25, len(ids)),
                         sampling=Sampling(case.max_new_tokens))  # fmt: skip
    guided = {r.stage: r.details.get("question_tokens") for r in runs["imdc"].stages}
    assert guided["feed"] == stand_in
    assert {r.stage: r.details.get("question_tokens") for r in marked.stages}["feed"] == case.prompt.tail_len > 16


def test_a_rerun_resumes_and_other_settings_are_refused(model, tokenizer, cases_folder, tmp_path):
    specs = registry.methods("full,snapkv")
    out = tmp_path / "ruler.json"
    options = dict(tasks=["vt"], samples=1, budgets=[0.5], modes=["question"], cases=cases_folder, say=print)
    first = ruler.run_ruler(model, tokenizer, specs, [LENGTH], out, **options)
    assert len(first["rows"]) == 2
    again = ruler.run_ruler(model, tokenizer, specs, [LENGTH], out, **options)
    assert again["rows"] == first["rows"] and json.loads(out.read_text())["kind"] == "ruler"
    with pytest.raises(KvsieveError, match="other settings"):
        ruler.run_ruler(model, tokenizer, specs, [LENGTH], out, **{**options, "budgets": [0.25]})
    # The unmarked mode's stand-in rule is a setting of the sweeps that run it, so they resume under it alone.
    assert "stand_in" not in first["settings"]
    with pytest.raises(KvsieveError, match=r"other settings \(stand_in differ\)"):
        ruler.run_ruler(model, tokenizer, specs, [LENGTH], out, **{**options, "modes": ["question", "unmarked"]})


def test_a_sweep_grows_to_more_samples_keeping_the_cases_it_answered(model, tokenizer, cases_folder, tmp_path):
    """A board grown from 1 case a task to 2 keeps its answers (NVIDIA's generator makes the same first case for a
    larger count), takes the new count, and refuses rows of another case or a smaller count."""
    specs = registry.methods("full")
    out = tmp_path / "ruler.json"
    options = dict(tasks=["vt"], budgets=[0.5], modes=["question"], cases=cases_folder, say=print)
    first = ruler.run_ruler(model, tokenizer, specs, [LENGTH], out, samples=1, **options)
    grown = ruler.run_ruler(model, tokenizer, specs, [LENGTH], out, samples=2, **options)
    assert grown["settings"]["samples"] == 2 and json.loads(out.read_text())["settings"]["samples"] == 2
    assert grown["rows"][:1] == first["rows"] and [r["index"] for r in grown["rows"]] == [0, 1]
    with pytest.raises(KvsieveError, match=r"other settings \(samples differ\)"):
        ruler.run_ruler(model, tokenizer, specs, [LENGTH], out, samples=1, **options)
    tampered = json.loads(out.read_text())
    tampered["rows"][1]["references"] = ["NOT-THIS-CASE"]
    out.write_text(json.dumps(tampered))
    with pytest.raises(KvsieveError, match="holds answers to another vt case 1 at 1024 tokens"):
        ruler.run_ruler(model, tokenizer, specs, [LENGTH], out, samples=2, **options)


def test_tasks_that_cannot_run_offline_are_skipped_saying_why(monkeypatch):
    runnable, skipped = ruler.available_tasks()
    assert runnable == ruler.TASKS and not skipped  # make setup installs every file RULER reads
    monkeypatch.setattr(ruler, "punkt_folder", lambda: None)
    runnable, skipped = ruler.available_tasks()
    essays = {"niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multivalue", "niah_multiquery"}
    assert set(skipped) == essays and all("punkt_tab" in why for why in skipped.values())
    assert "vt" in runnable and "qa_2" in runnable
    with pytest.raises(KvsieveError, match="Unknown RULER task"):
        ruler.available_tasks(["vt", "niah"])


def test_bad_input_is_refused_with_what_to_do(model, tokenizer, cases_folder, tmp_path):
    specs = registry.methods("full")
    run = lambda **kw: ruler.run_ruler(model, tokenizer, specs, [LENGTH], tmp_path / "r.json", tasks=["vt"], **kw)  # noqa: E731
    with pytest.raises(KvsieveError, match=r"Budgets are shares of the prompt in \(0, 1\)"):
        run(budgets=[0.5, 1.5])
    with pytest.raises(KvsieveError, match="Unknown mode"):
        run(modes=["blind"])
    with pytest.raises(KvsieveError, match="use at least 60"):
        ruler.run_ruler(model, tokenizer, specs, [40], tmp_path / "r.json", tasks=["vt"], cases=cases_folder)


CASES = [json.loads(line) for line in (Path(__file__).parent / "data" / "ruler_cases.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("case", CASES, ids=[c["task"] for c in CASES])
def test_the_question_starts_where_nvidias_template_puts_it(case, tokenizer):
    """One case of a needle, a common-words, a frequent-words and a QA task as NVIDIA's generators wrote them
    (tests/data/ruler_cases.jsonl, made by `generate_cases` with the default model's tokenizer): the context ends
    where the document does, the question is the template's text after it, the lead is RULER's answer prefix."""
    text, task = case["input"], case["task"]
    context, question, lead = ruler.split_input(text, ruler.task_configs()[task])
    assert context + question + lead == text
    expected = {
        "niah_single_2": ("\nWhat is the special magic number for upbeat-accountability mentioned in the provided "
                          "text?", " The special magic number for upbeat-accountability mentioned in the provided "
                          "text is"),
        "cwe": ("\nQuestion: What are the 10 most common words in the above list?",
                " Answer: The top 10 words that appear most often in the list are:"),
        "fwe": ("\nQuestion: Do not provide any explanation. Please ignore the dots '....'. What are the three most "
                "frequently appeared words in the above coded text?", " Answer: According to the coded text above, "
                "the three most frequently appeared words are:"),
        "qa_1": ("\n\nAnswer the question based on the given documents. Only give me the answer and do not output "
                 "any other words.\n\nQuestion: In what country is Normandy located?", " Answer:"),
    }  # fmt: skip
    assert (question, lead) == expected[task]
    assert all(r not in question + lead for r in case["outputs"])  # (cwe's context holds a worked example)
    prompt = build_task_prompt(tokenizer, context, question, lead)
    ids = prompt.ids[0].tolist()
    assert tokenizer.decode(ids[prompt.context_start : prompt.context_start + prompt.context_len]) == context


def test_cases_are_kept_apart_for_another_tokenizer(tokenizer, cases_folder):
    """The cases are sized with the tokenizer, so another tokenizer (here one more token in the vocabulary) never
    reads the first one's: its cases are generated again, into a file of their own."""
    other = copy.deepcopy(tokenizer)
    other.add_tokens(["<kvsieve-test-token>"])
    assert ruler.tokenizer_key(other) != ruler.tokenizer_key(tokenizer)
    assert ruler.tokenizer_key(copy.deepcopy(tokenizer)) == ruler.tokenizer_key(tokenizer)
    ruler.generate_cases(other, "vt", LENGTH, 1, 42, cases_folder)
    files = sorted(p.name for p in cases_folder.glob(f"vt-{LENGTH}-1-*.jsonl"))  # one case: the sweeps' own kept apart
    assert files == sorted(f"vt-{LENGTH}-1-42-{ruler.cases_key(t, 'vt')}.jsonl" for t in (tokenizer, other))


def test_the_cases_key_holds_rulers_version_and_the_tasks_settings(tokenizer, monkeypatch):
    """Cases made by another RULER release, or for a task whose settings changed, are never read back."""
    key = ruler.cases_key(tokenizer, "vt")
    version = importlib.metadata.version(ruler.RULER_DISTRIBUTION)
    assert key.startswith(ruler.tokenizer_key(tokenizer)) and version in key
    configs = ruler.task_configs()
    changed = {**configs, "vt": {**configs["vt"], "args": {**configs["vt"]["args"], "num_chains": 99}}}
    with monkeypatch.context() as patch:
        patch.setattr(ruler, "task_configs", lambda: changed)
        assert ruler.cases_key(tokenizer, "vt") != key
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.0")
    assert ruler.cases_key(tokenizer, "vt") != key
