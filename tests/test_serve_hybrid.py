"""`kvsieve serve` on a hybrid model (a tiny random Gemma 3: sliding layers of 8 tokens beside a global one, loaded
from a folder as `--model FOLDER` loads it), spoken to with the official client: every preset, a stored document
reused whole, `--reuse-budget`, n > 1 and `--upstream`. The references are the library's answers (`kvsieve.run`)
or, for the reuse budget, the library's parts assembled by hand (test_serve's `compressed_context_reference`)."""

from __future__ import annotations

import tempfile

import pytest
import torch
from conftest import WINDOW, build_model
from test_serve import (
    DOC,
    SHRINK,
    ask,
    client,
    compressed_context_reference,
    ids_of,
    reference,
    start,
    word_tokenizer,
)

from kvsieve import REGISTRY, Sampling, load_model, method, run
from kvsieve.prompt import Prompt


@pytest.fixture(scope="module")
def tiny():
    """The name test_serve's helpers take: here a hybrid model (layers 0, 1 slide, layer 2 is global)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    folder = tempfile.mkdtemp(prefix="kvsieve-serve-hybrid-")
    build_model("gemma3", num_layers=3, max_positions=512).save_pretrained(folder)
    word_tokenizer().save_pretrained(folder)
    yield load_model(folder, device="cpu", dtype="float32")
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def server(tiny):
    running = start(tiny, cache_bytes=50_000_000, max_step_tokens=32)  # longer prompts prefill in slices
    yield running
    running.stop()


def test_every_preset_answers_as_the_library(server, tiny):
    """Greedy tokens of every preset equal `kvsieve.run`'s, with the prefix cache on and the prefill sliced
    between decoding steps, twice (the second time from the stored prefix where the method continues one)."""
    ids = ids_of(tiny, "hello " + DOC + " " + DOC[:260] + " what is the pass key")
    assert len(ids) > 15 * WINDOW
    for name, preset in REGISTRY.items():
        settings = {path: value for path, value in SHRINK.items() if preset.has(path)}
        extra = {"kvsieve": {"method": name, "set": settings}}
        for _ in range(2):
            out = client(server).completions.create(
                model="tiny", prompt=ids, max_tokens=8, temperature=0, extra_body=extra
            )
            assert out.choices[0].text == reference(tiny, ids, name, settings), name


@pytest.mark.parametrize(
    "name,settings", [("full", {}), ("a2sf", {"evict.budget": 24}), ("gemfilter", {"select.k": 40})]
)
def test_a_stored_document_past_its_window_is_reused_whole(server, tiny, name, settings):
    """The document's state (its sliding layers past their window) is stored after the first question and the
    second question continues it whole: both answers equal the library's on the whole prompt."""
    doc = f"world {name} " + DOC
    context = len(ids_of(tiny, f"<s> question {doc} </s>"))
    for question, expected in [("what is the pass key", "miss"), ("what is it remember", "hit")]:
        answer = ask(server, doc, question, name, settings)
        whole = ids_of(tiny, f"<s> question {doc} </s><s> question {question} </s> answer")
        assert answer.choices[0].message.content == reference(tiny, whole, name, settings, tail=len(whole) - context)
        assert answer.model_extra["kvsieve"]["cache"] == expected, question


def test_n_answers_are_each_the_answer_their_seed_gives(server, tiny):
    ids = ids_of(tiny, DOC)
    out = client(server).completions.create(
        model="tiny", prompt=ids, max_tokens=6, temperature=1.0, seed=11, n=2,
        extra_body={"kvsieve": {"method": "a2sf", "set": {"evict.budget": 24}}},
    )  # fmt: skip
    model, tokenizer = tiny
    for i, choice in enumerate(sorted(out.choices, key=lambda c: c.index)):
        sampling = Sampling(6, temperature=1.0, seed=11 + i)
        alone = run(
            model,
            tokenizer,
            Prompt(torch.tensor([ids]), 0, len(ids)),
            method=method("a2sf", {"evict.budget": 24}),
            sampling=sampling,
        )
        assert choice.text == alone.text


def test_a_reuse_budget_stores_the_global_layers_compressed(tiny):
    settings = {"compress.budget": 24, "compress.policy.window": 4}
    with start(tiny, cache_bytes=50_000_000, reuse_budget=30) as server:
        context = ids_of(tiny, f"<s> question {DOC} </s>")
        for question in ("what is the pass key", "what is it remember"):
            answer = ask(server, DOC, question, "snapkv", settings)
            asked = ids_of(tiny, f"<s> question {question} </s> answer")
            policy = method("snapkv", settings).compress.policy
            expected = compressed_context_reference(tiny, context, asked, policy, 30)
            assert answer.choices[0].message.content == expected, question
            assert answer.model_extra["kvsieve"]["context_entries"] == 30


def test_upstream_prefills_the_selected_tokens(tiny):
    """GemFilter selects here (at the global layer); the upstream, a second server, prefills the kept ids."""
    gemfilter = method("gemfilter", {"select.k": 30})
    with start(tiny, cache_bytes=0) as upstream, start(tiny, spec=gemfilter, upstream=upstream.url) as front:
        ids = ids_of(tiny, DOC)
        relayed = client(front).completions.create(model="tiny", prompt=ids, max_tokens=6, temperature=0)
        info = relayed.model_extra["kvsieve"]
        assert info["selected_tokens"] == info["upstream_prompt_tokens"] == 30
        model, tokenizer = tiny
        selected = gemfilter.select.select(model, Prompt(torch.tensor([ids]), 0, len(ids))).indices.tolist()
        kept = [ids[i] for i in selected]
        direct = client(upstream).completions.create(model="tiny", prompt=kept, max_tokens=6, temperature=0)
        assert relayed.choices[0].text == direct.choices[0].text
