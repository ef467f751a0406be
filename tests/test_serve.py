"""`kvsieve serve` end to end: a real server on a free localhost port, the official `openai` client and plain HTTP.

A tiny random Llama with a word-level tokenizer (every id is a word, so every answer is text) and a
chat template is saved to a folder and loaded by path, exactly as `kvsieve serve --model FOLDER`
loads it. Answers are checked against the library run on the same token ids (`kvsieve.run`),
which the server must reproduce for every method, alone or batched, streamed or not.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch
from conftest import build_model
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import DynamicCache, PreTrainedTokenizerFast

from kvsieve import Prompt, Sampling, load_model, method, run
from kvsieve.attention import attention_hooks
from kvsieve.compress.stages import Compress
from kvsieve.decode import TextStream, extend
from kvsieve.engine import output as output_module
from kvsieve.engine.prefix_cache import BLOCK, reuse_tail
from kvsieve.prompt import ids_prompt, question_tail
from kvsieve.serve import ServerThread, create_server

TEMPLATE = (
    "{% for m in messages %}<s> question {{ m['content'] }} </s>{% endfor %}"
    "{% if add_generation_prompt %} answer{% endif %}"
)
WORDS = ["[UNK]", "<s>", "</s>", *"the pass key is what remember it answer question hello world .".split()]
DOC = " ".join(["the pass key is hello world remember it"] * 12)  # 96 words
SMALL = {"compress.budget": 24, "compress.policy.window": 4}


def word_tokenizer() -> PreTrainedTokenizerFast:
    """One word per id for all 256 ids of the tiny model (w15 ... w255 after the real words and the period)."""
    vocab = {w: i for i, w in enumerate(WORDS + [f"w{i}" for i in range(len(WORDS), 256)])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", bos_token="<s>", eos_token="</s>")
    tokenizer.chat_template = TEMPLATE
    return tokenizer


@pytest.fixture(scope="module")
def tiny():
    """The tiny model and tokenizer, loaded from a folder as `--model FOLDER` loads them."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models gain nothing from threads on a busy 2-core machine
    folder = __import__("tempfile").mkdtemp(prefix="kvsieve-serve-")
    build_model("llama", num_layers=3, max_positions=512).save_pretrained(folder)
    word_tokenizer().save_pretrained(folder)
    yield load_model(folder, device="cpu", dtype="float32")
    torch.set_num_threads(before)


def start(tiny, **options) -> ServerThread:
    model, tokenizer = tiny
    options.setdefault("max_body_bytes", 100_000)
    options.setdefault("max_prompt_tokens", 2000)
    return ServerThread(create_server(model, tokenizer, model_name="tiny", **options)).start()


@pytest.fixture(scope="module")
def server(tiny):
    running = start(tiny, cache_bytes=50_000_000, max_step_tokens=32)  # prompts over ~32 tokens prefill in slices
    yield running
    running.stop()


def client(server: ServerThread, key: str = "none") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=60)


def reference(tiny, ids: list[int], name: str = "full", settings=None, tokens: int = 8, tail: int | None = None) -> str:
    """What the library answers for these token ids (the last `tail` the question, none: the library's stand-in for
    a prompt that names none): the text the server must return."""
    model, tokenizer = tiny
    prompt = ids_prompt(ids, tail, tokenizer=tokenizer)
    return run(model, tokenizer, prompt, method=method(name, settings or {}), sampling=Sampling(tokens)).text


def ids_of(tiny, words: str) -> list[int]:
    return tiny[1](words, add_special_tokens=False)["input_ids"]


def metric(server: ServerThread, pattern: str, missing: float | None = None) -> float:
    """The value of one series on /metrics. A series that is not there fails the test, unless the caller says what
    its absence means (`missing`: a labelled counter appears only at its first count)."""
    text = httpx.get(f"{server.url}/metrics").text
    match = re.search(rf"^{re.escape(pattern)} (\S+)$", text, re.MULTILINE)
    if match:
        return float(match.group(1))
    if missing is None:
        pytest.fail(f"/metrics has no {pattern}")
    return missing


def test_chat_streamed_and_whole_give_the_same_answer(server, tiny):
    messages = [{"role": "user", "content": DOC + " what is the pass key"}]
    whole = client(server).chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0)
    choice = whole.choices[0]
    assert whole.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.finish_reason in ("length", "stop") and choice.message.content
    assert whole.usage.prompt_tokens == 2 + 96 + 5 + 2 and whole.usage.completion_tokens <= 10
    info = whole.model_extra["kvsieve"]
    assert info["method"] == "full" and info["kv_entries"] == whole.usage.prompt_tokens
    chunks = list(
        client(server).chat.completions.create(
            model="tiny", messages=messages, max_tokens=10, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == choice.message.content
    assert chunks[-2].choices[0].finish_reason == choice.finish_reason
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-2].model_extra["kvsieve"]["cache"] == "hit"  # the same prompt again: its stored state


def test_completions_with_token_ids_and_text_match_the_library(server, tiny):
    ids = ids_of(tiny, DOC + " what is it")
    out = client(server).completions.create(model="tiny", prompt=ids, max_tokens=8, temperature=0)
    assert out.choices[0].text == reference(tiny, ids)
    assert out.usage.prompt_tokens == len(ids)
    streamed = client(server).completions.create(model="tiny", prompt=DOC, max_tokens=8, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == reference(tiny, ids_of(tiny, DOC))


def test_a_completion_s_stand_in_question_is_its_last_sentence(server, tiny):
    """A completions prompt marks no question: IMDC's pruning reads the library's stand-in (`question_tail` with the
    server's tokenizer), here the 20 words after the document's last period, longer than the 16-token window."""
    question = "what is the pass key hello world remember it the pass key is what is the key hello world it"
    ids = ids_of(tiny, f"{DOC} . {question}")
    assert question_tail(ids, tokenizer=tiny[1]) == len(question.split()) == 20
    settings = {"feed.chunk": 32, "feed.memory": 24}
    extra = {"kvsieve": {"method": "imdc", "set": settings, "cache": False}}
    out = client(server).completions.create(model="tiny", prompt=ids, max_tokens=8, temperature=0, extra_body=extra)
    [feed] = [s for s in out.model_extra["kvsieve"]["stages"] if s["stage"] == "feed"]
    assert feed["details"]["question_tokens"] == 20
    assert out.choices[0].text == reference(tiny, ids, "imdc", settings)


@pytest.mark.parametrize(
    "name,settings",
    [("snapkv", SMALL), ("a2sf", {"evict.budget": 20}), ("imdc", {"feed.chunk": 32, "feed.memory": 24})],
)
def test_extra_body_chooses_the_method(server, tiny, name, settings):
    ids = ids_of(tiny, DOC + " remember the key")
    extra = {"kvsieve": {"method": name, "set": settings, "cache": False}}
    out = client(server).completions.create(model="tiny", prompt=ids, max_tokens=8, temperature=0, extra_body=extra)
    info = out.model_extra["kvsieve"]
    assert info["method"] == name and info["cache"] == "bypassed" and info["kv_entries"] <= 28
    assert [s["stage"] for s in info["stages"]][0] in ("feed", "select")
    assert out.choices[0].text == reference(tiny, ids, name, settings)
    resolved = method(name, settings).to_dict()  # the record echoes every stage's resolved settings
    assert info["settings"] == {
        stage: resolved[stage] for stage in ("select", "feed", "attention", "compress", "evict")
    }
    if resolved["evict"] is not None:  # and says how eviction started, beside the prefill stages
        evict = info["stages"][-1]
        assert evict["stage"] == "evict" and evict["details"]["budget"] == settings["evict.budget"]


def test_metrics_move_with_each_request(server, tiny):
    listed = 'kvsieve_requests_total{endpoint="/v1/models",status="200"}'
    before = metric(server, listed, missing=0.0)  # the module's server may not have been asked for it yet
    httpx.get(f"{server.url}/v1/models")
    assert metric(server, listed) == before + 1  # every request counted, GETs included
    httpx.get(f"{server.url}/v1/models/tiny")
    httpx.get(f"{server.url}/v1/models/nope")  # one label per route, not per URL
    assert metric(server, 'kvsieve_requests_total{endpoint="/v1/models/{model_id:path}",status="404"}') >= 1
    unrouted = 'kvsieve_requests_total{endpoint="other",status="404"}'
    scanned = metric(server, unrouted, missing=0.0)
    httpx.get(f"{server.url}/wp-admin/setup.php")
    assert metric(server, unrouted) == scanned + 1
    done = 'kvsieve_requests_total{endpoint="/v1/completions",status="200"}'
    before = [metric(server, m, missing=0.0) for m in (done, "kvsieve_time_to_first_token_seconds_count")]
    generated = metric(server, "kvsieve_generation_tokens_total")
    client(server).completions.create(model="tiny", prompt=[5, 6, 7, 8], max_tokens=5, temperature=0)
    after = [metric(server, m) for m in (done, "kvsieve_time_to_first_token_seconds_count")]
    assert after == [b + 1 for b in before]
    assert metric(server, "kvsieve_generation_tokens_total") >= generated + 1
    text = httpx.get(f"{server.url}/metrics").text
    for name in ("queue_depth", "kv_entries", "prefix_cache_hits_total", "time_per_output_token_seconds_bucket"):
        assert f"kvsieve_{name}" in text
    # memory, part by part beside the resident size: the model's bytes are its parameters' and buffers' (the rotary
    # frequencies), the batch's tables are empty once nothing runs, and the resident size holds at least the model
    model, _ = tiny
    weights = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    assert metric(server, "kvsieve_model_bytes") == weights
    assert metric(server, "kvsieve_resident_bytes") > weights
    assert metric(server, "kvsieve_batch_table_bytes") == 0 and metric(server, "kvsieve_largest_step_bytes") >= 0


def test_a_peak_watch_sees_what_a_step_allocates_and_the_batch_counts_its_tables(tiny):
    """PeakWatch: 256 MB touched inside the watched stretch shows in its peak (Linux's resident high-water mark,
    reset at `start`; the margin allows for what the process frees meanwhile, the server's thread included); freed
    before the next stretch, it does not show there. DecodeBatch.nbytes: its tables, none once
    its one row has left without keeping its entries."""
    from kvsieve.engine.batch import DecodeBatch, Row
    from kvsieve.engine.pipeline import prefill
    from kvsieve.memory import PeakWatch

    watch = PeakWatch(torch.device("cpu"))
    assert watch.measures  # Linux: /proc/self/clear_refs resets the resident high-water mark
    watch.start()
    block = torch.ones(64 * 2**20)  # 256 MB, written
    assert watch.peak() >= 192 * 2**20
    del block
    watch.start()
    assert watch.peak() < 32 * 2**20
    model, _ = tiny
    batch = DecodeBatch(model)
    assert batch.nbytes == 0
    done = prefill(model, Prompt(torch.tensor([[5, 6, 7, 8]]), 0, 4))
    row = Row(token=9, position=done.prefilled.next_position)
    batch.add(row, done.prefilled.cache)
    assert batch.nbytes == 2 * batch.tables.keys.numel() * batch.tables.keys.element_size() > 0
    batch.remove([row], keep_entries=False)  # a finished answer: its entries are not copied out of the tables
    assert done.prefilled.cache.layers == [] and batch.nbytes == 0


BAD = [
    (b"{not json", 400, "invalid_json"),
    ({"messages": [{"role": "user", "content": "hi"}]}, 400, None),  # no model
    ({"model": "other", "messages": [{"role": "user", "content": "hi"}]}, 404, "model_not_found"),
    ({"model": "tiny", "messages": []}, 400, None),
    ({"model": "tiny", "messages": [{"role": "user", "content": "   "}]}, 400, None),
    ({"model": "tiny", "messages": [{"role": "robot", "content": "hi"}]}, 400, None),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, 400, None),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": "5"}, 400, None),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, 400, None),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "n": 17}, 400, None),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "kvsieve": {"bogus": 1}}, 400, None),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "kvsieve": {"method": "nope"}}, 400, None),
    (
        {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "kvsieve": {"set": {"compress.x": 1}}},
        400,
        "invalid_method",
    ),
    (
        {"model": "tiny", "prompt": [1, 2], "kvsieve": {"method": "snapkv", "set": {"compress.budget": -3}}},
        400,
        "invalid_method",
    ),
    (  # JSON has types: a string where a number belongs is refused, not converted as on the command line
        {"model": "tiny", "prompt": [1, 2], "kvsieve": {"method": "snapkv", "set": {"compress.budget": "0.25"}}},
        400,
        "invalid_method",
    ),
    (  # a setting only the model can refuse: 4 dense layers of a 3-layer model
        {
            "model": "tiny",
            "prompt": [5] * 60,
            "kvsieve": {"method": "critiprefill", "set": {"attention.dense_layers": 4}},
        },
        400,
        "invalid_method",
    ),
    ({"model": "tiny", "prompt": [1, 999]}, 400, None),  # a token id outside the vocabulary
    ({"model": "tiny", "prompt": [1, 2], "max_tokens": 2, "min_tokens": 3}, 400, "invalid_value"),
    ({"model": "tiny", "prompt": [5, 6], "seed": 2**70}, 400, "invalid_value"),  # before any model work
    (b'{"model": "tiny", "prompt": ' + b"[" * 30_000 + b"]" * 30_000 + b"}", 400, "invalid_json"),
    (b'{"model": "tiny", "messages": [{"role": "user", "content": "\\ud800"}]}', 400, "invalid_json"),
    (  # only the engine, with the model, finds a filter layer beyond the model's 3: still the client's 400
        {"model": "tiny", "prompt": [5] * 60, "kvsieve": {"method": "gemfilter", "set": {"select.layer": 7}}},
        400,
        "invalid_method",
    ),
    ({"model": "tiny", "prompt": list(range(3, 250)) * 3}, 400, "context_length_exceeded"),  # 741 > 512 positions
    ({"model": "tiny", "prompt": [5] * 2100, "kvsieve": {"method": "imdc"}}, 400, "prompt_too_long"),
    ({"model": "tiny", "prompt": "hello " * 30_000}, 413, "request_too_large"),
]


def test_vllm_extensions_work_and_unknown_fields_are_ignored(server, caplog):
    """What vLLM's own clients (its serving benchmark) send: `ignore_eos`, `continuous_usage_stats`,
    `min_tokens`, `top_k`, and fields nobody documents, which are ignored and logged once. [5, 6, 7]
    meets EOS after 79 tokens."""
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 100, "temperature": 0, "vendor_knob": {"x": 1}}
    with caplog.at_level("WARNING", logger="kvsieve.serve"):
        stops = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
        httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert stops.status_code == 200 and stops.json()["usage"]["completion_tokens"] == 79
    assert stops.json()["choices"][0]["finish_reason"] == "stop"
    assert sum("vendor_knob" in record.getMessage() for record in caplog.records) == 1  # logged, once per name
    held = httpx.post(f"{server.url}/v1/completions", json={**body, "min_tokens": 90, "top_k": -1}, timeout=60)
    assert held.json()["usage"]["completion_tokens"] >= 90  # no EOS before 90 tokens
    streamed = {**body, "ignore_eos": True, "stream": True}
    streamed["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=streamed, timeout=60) as response:
        chunks = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    counts = [c["usage"]["completion_tokens"] for c in chunks if c["choices"] and c["choices"][0]["text"]]
    assert counts == sorted(counts) and len(counts) >= 50  # the usage so far in every text chunk
    assert chunks[-1]["usage"]["completion_tokens"] == 100  # on past EOS to max_tokens
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"


def test_bad_input_gets_4xx_while_a_good_request_completes(server, tiny):
    ids = ids_of(tiny, DOC)
    good = {}

    def long_request():
        out = client(server).completions.create(model="tiny", prompt=ids, max_tokens=150, temperature=0, stream=True)
        good["text"] = "".join(c.choices[0].text for c in out)

    worker = threading.Thread(target=long_request)
    worker.start()
    for body, status, code in BAD:
        path = "/v1/completions" if isinstance(body, dict) and "prompt" in body else "/v1/chat/completions"
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        answer = httpx.post(f"{server.url}{path}", content=data, headers={"Content-Type": "application/json"})
        assert answer.status_code == status, (body if isinstance(body, bytes) else str(body)[:120], answer.text)
        error = answer.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]
        if code:
            assert error["code"] == code, error
    assert httpx.get(f"{server.url}/nowhere").status_code == 404
    worker.join(60)
    assert good["text"] == reference(tiny, ids, tokens=150)
    assert httpx.get(f"{server.url}/health").json()["status"] == "ok"


def test_a_client_that_disconnects_frees_its_slot(server, tiny):
    gone = 'kvsieve_requests_total{endpoint="/v1/completions",status="499"}'
    before = metric(server, gone, missing=0.0)
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 400, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data:")
    deadline = time.monotonic() + 20
    while metric(server, gone) < before + 1 or metric(server, "kvsieve_active_requests") > 0:
        assert time.monotonic() < deadline, "the engine kept decoding for a client that left"
        time.sleep(0.05)
    assert metric(server, "kvsieve_kv_entries") == 0


def test_answered_failed_and_cancelled_requests_free_their_tensors_at_once(tiny, monkeypatch):
    """Issue 48: with Python's garbage collector off, no request outlives its answer (nothing the engine or the
    front keeps, and no reference cycle) and no tensor it made is left behind: whole, streamed with n = 2,
    evicting (A2SF), failed by a bug at its first token, and cancelled by a client that left mid-stream. Every
    step in which a prefill or an answer ended gave freed heap memory back (`kvsieve.memory.release_freed`)."""
    import gc

    from kvsieve.engine.request import Request
    from kvsieve.serve import engine_thread as engine_module

    def live_tensors() -> dict[int, int]:
        objects = gc.get_objects()  # type(), not isinstance: a deprecated torch proxy warns on __class__
        return {id(o): o.numel() * o.element_size() for o in objects if issubclass(type(o), torch.Tensor)}

    releases = []
    monkeypatch.setattr(engine_module, "release_freed", lambda: releases.append(1) or True)
    server = start(tiny, cache_bytes=0, max_step_tokens=32)
    body = {"model": "tiny", "prompt": ids_of(tiny, DOC), "max_tokens": 6, "temperature": 0}
    httpx.post(f"{server.url}/v1/completions", json=body, timeout=30).raise_for_status()  # warm: lazy buffers
    gc.collect()
    gc.disable()
    try:
        before = live_tensors()
        httpx.post(f"{server.url}/v1/completions", json=body, timeout=30).raise_for_status()
        with httpx.stream("POST", f"{server.url}/v1/completions", json={**body, "n": 2, "stream": True}) as r:
            assert sum(line.startswith("data:") for line in r.iter_lines()) > 2
        evicting = {**body, "kvsieve": {"method": "a2sf", "set": {"evict.budget": 40}}}
        httpx.post(f"{server.url}/v1/completions", json=evicting, timeout=30).raise_for_status()
        with monkeypatch.context() as patched:
            patched.setattr(output_module, "next_token", lambda *args, **kwargs: 1 / 0)
            # pytest's log capture keeps the record, whose traceback holds the request: a server's log does not
            patched.setattr(logging.getLogger("kvsieve.engine"), "disabled", True)
            assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=30).status_code == 500
        endless = {**body, "max_tokens": 400, "stream": True}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=endless) as response:
            assert next(response.iter_lines()).startswith("data:")
        deadline = time.monotonic() + 20
        while metric(server, "kvsieve_active_requests") > 0 or any(type(o) is Request for o in gc.get_objects()):
            assert time.monotonic() < deadline, "a request outlived its answer"
            time.sleep(0.05)
        left = {k: v for k, v in live_tensors().items() if k not in before}
        assert sum(left.values()) < 4096, f"{len(left)} tensors ({sum(left.values())} bytes) outlived their request"
    finally:
        gc.enable()
        server.stop()
    assert len(releases) >= 5 * 2  # each request's prefill ended and its answers left


def ask(server: ServerThread, doc: str, question: str, name: str, settings: dict, **options):
    """A chat request with the document and the question as two messages (the document is reusable)."""
    messages = [{"role": "user", "content": doc}, {"role": "user", "content": question}]
    extra = {"kvsieve": {"method": name, "set": settings, **options}}
    return client(server).chat.completions.create(
        model="tiny", messages=messages, max_tokens=8, temperature=0, extra_body=extra
    )


def test_reuse_continues_the_stored_document_and_answers_as_the_library_does(server, tiny):
    """A second question about a document runs only its new tokens on the stored document, and the
    method still sees the whole prompt: the answer equals `kvsieve.run` on the whole prompt (an
    independent computation, no server and no reuse), for the first question, the second and a
    repeat, and with the cache bypassed. GemFilter continues its selection pass up to the filter layer
    and prefills its kept tokens afresh. Methods that cannot continue a prefix say so and still answer
    as the library does."""
    cases = [
        ("full", {}, True),
        ("snapkv", SMALL, True),
        ("snapkv", {**SMALL, "compress.policy.window": 12}, True),  # windows longer than the question: cut states
        ("a2sf", {"evict.budget": 24}, True),
        ("h2o", {"evict.budget": 24}, True),
        ("tova", {"evict.budget": 20}, True),
        ("imdc", {"feed.chunk": 32, "feed.memory": 24}, False),
        ("gemfilter", {"select.k": 40}, True),
        ("gemfilter-snapkv", {"select.k": 60, "compress.budget": 30, "compress.policy.window": 4}, True),
        ("critiprefill", {"attention.segment": 16, "attention.block": 4, "attention.budget": 32}, False),
    ]
    for i, (name, settings, reusable) in enumerate(cases):
        doc = "world " * (i + 1) + DOC  # a document of its own per method
        context = len(ids_of(tiny, f"<s> question {doc} </s>"))
        for question, expected in [
            ("what is the pass key", "miss"),
            ("what is it remember", "hit"),
            ("what is it remember", "hit"),
        ]:
            answer = ask(server, doc, question, name, settings)
            info = answer.model_extra["kvsieve"]
            whole = ids_of(tiny, f"<s> question {doc} </s><s> question {question} </s> answer")
            expected_text = reference(tiny, whole, name, settings, tail=len(whole) - context)
            assert answer.choices[0].message.content == expected_text, (name, question)
            if not reusable:
                assert info["cache"] == "not reusable" and info["cached_tokens"] == 0
                continue
            assert info["cache"] == expected, (name, info)
            # A later request continues the longest stored state that fits, or the first whole blocks of one.
            longest = answer.usage.prompt_tokens - reuse_tail(method(name, settings))
            # Each request stores the document, or the whole blocks of it that leave its method's scored queries new
            # after the document's end: the same state for every question of that document, whatever its length.
            before = context - reuse_tail(method(name, settings))
            keep = context if context <= longest else before - before % BLOCK
            if expected == "miss":
                stored = [keep]
            else:
                cached = max(n if n <= longest else longest - longest % BLOCK for n in stored)
                stored.append(keep)
                assert info["cached_tokens"] == answer.usage.prompt_tokens_details.cached_tokens == cached
                if name.startswith("gemfilter"):  # the full model ran on the kept tokens only
                    assert info["prefill_tokens"] == settings["select.k"]
                else:
                    assert info["prefill_tokens"] == answer.usage.prompt_tokens - cached
        fresh = ask(server, doc, "what is it remember", name, settings, cache=False)
        assert fresh.model_extra["kvsieve"]["cache"] == "bypassed"
        assert fresh.model_extra["kvsieve"]["prefill_tokens"] == settings.get("select.k", fresh.usage.prompt_tokens)
        assert fresh.choices[0].message.content == answer.choices[0].message.content


def compressed_context_reference(tiny, context: list[int], question: list[int], policy, reuse: int) -> str:
    """The reuse-budget path assembled from the library's parts: the context alone compressed to `reuse` by
    `policy`, the question appended on it at its own positions (question-agnostic: nothing is pruned again with
    the question's scores), then 8 greedy tokens."""
    model, tokenizer = tiny
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        alone = Compress(policy, reuse).begin()
        with attention_hooks(last_pass=alone.observers()):
            extend(model, cache, torch.tensor([context]), 0)
        alone.compress(cache)
        logits = extend(model, cache, torch.tensor([question]), len(context))[-1]  # appended, nothing pruned
        answer, position = TextStream(tokenizer, Sampling(8), {tokenizer.eos_token_id}), len(context) + len(question)
        while answer.add(token := int(logits.argmax())) is not None and answer.finish is None:
            logits, position = extend(model, cache, torch.tensor([[token]]), position)[-1], position + 1
    return answer.text


def test_a_reuse_budget_stores_the_context_compressed_and_every_request_continues_it(tiny):
    """--reuse-budget 30: the stored document keeps 30 entries per layer and KV head, chosen by the method's
    own policy from the document's own queries; every request, the first included, appends its question to
    that state and prunes nothing with the question's scores. The answers equal the same steps assembled from
    the library's parts, the record says their context was chosen without the question, the cache holds the 30
    entries plus the question's, and the stored state takes the bytes of 30 entries, not of the document's."""
    model, _ = tiny
    settings = SMALL  # SnapKV, budget 24, window 4
    with start(tiny, cache_bytes=50_000_000, reuse_budget=30) as server:
        context = ids_of(tiny, f"<s> question {DOC} </s>")
        for question, expected in [
            ("what is the pass key", "miss"),
            ("what is it remember", "hit"),
            ("what is the pass key", "hit"),
        ]:
            answer = ask(server, DOC, question, "snapkv", settings)
            info = answer.model_extra["kvsieve"]
            asked = ids_of(tiny, f"<s> question {question} </s> answer")
            policy = method("snapkv", settings).compress.policy
            expected_text = compressed_context_reference(tiny, context, asked, policy, 30)
            assert answer.choices[0].message.content == expected_text, question
            assert info["cache"] == expected
            assert info["query_aware"] is False and info["context_entries"] == 30 and info["reuse_budget"] == 30
            assert info["stages"][0]["details"]["context_entries"] == 30
            assert info["kv_entries"] == 30 + len(asked)  # the question's entries on top, none pruned
        entry_bytes = (
            2
            * model.config.num_hidden_layers
            * model.config.num_key_value_heads
            * 4
            * (model.config.hidden_size // model.config.num_attention_heads)
        )
        assert metric(server, "kvsieve_prefix_cache_bytes") == 30 * entry_bytes
        # An accumulating policy's stored sums are cut to the kept entries: a first request and a repeat agree.
        h2o = [ask(server, "world " + DOC, "what is it remember", "h2o", {"evict.budget": 24}) for _ in range(2)]
        assert [a.model_extra["kvsieve"]["cache"] for a in h2o] == ["miss", "hit"]
        assert h2o[0].choices[0].message.content == h2o[1].choices[0].message.content
        assert h2o[1].model_extra["kvsieve"]["context_entries"] == 30
        # The question-agnostic scorers keep a document the same way; KVzip's second pass writes its repeat prompt
        # with the tokenizer the server was given.
        for name in ("expected-attention", "kvzip"):
            asked = [ask(server, "hello " + DOC, q, name, {"compress.budget": 24}) for q in ("what is it", "remember")]
            infos = [a.model_extra["kvsieve"] for a in asked]
            assert [i["cache"] for i in infos] == ["miss", "hit"], name
            assert all(i["context_entries"] == 30 and i["query_aware"] is False for i in infos), name
        # Per-head budgets keep the document with its heads' own counts (30 on average); the stored state is shared
        # copy-on-write by the requests that continue it, so asking again gives the same answer.
        heads = {"compress.budget": 24, "compress.policy.window": 4}
        asked = [ask(server, "per head " + DOC, "what is it", "adakv", heads) for _ in range(3)]
        infos = [a.model_extra["kvsieve"] for a in asked]
        assert [i["cache"] for i in infos] == ["miss", "hit", "hit"]
        assert all(i["context_entries"] == 30 and i["query_aware"] is False for i in infos)
        assert len({a.choices[0].message.content for a in asked}) == 1
        exact = ask(server, DOC, "what is the pass key", "full", {})  # full attention has no scorer: kept whole
        assert exact.model_extra["kvsieve"]["query_aware"] is True
        assert exact.model_extra["kvsieve"]["reuse_budget"] == "whole"  # no scorer: full attention's state is whole
        assert exact.choices[0].message.content == reference(
            tiny, context + ids_of(tiny, "<s> question what is the pass key </s> answer")
        )


def greedy_reference(tiny, ids: list[int], steps: int, adjust=lambda logits, prompt, answer: logits, eos=True):
    """Greedy answer and each chosen token's raw log-probability, from whole forward passes with no cache;
    `adjust` changes the logits before the choice (the penalties as OpenAI and CTRL define them)."""
    model, tokenizer = tiny
    answer, logprobs = [], []
    with torch.no_grad():
        for _ in range(steps):
            logits = model(input_ids=torch.tensor([ids + answer])).logits[0, -1].float()
            token = int(adjust(logits.clone(), ids, answer).argmax())
            logprobs.append(float(torch.log_softmax(logits, -1)[token]))
            answer.append(token)
            if eos and token == tokenizer.eos_token_id:
                break
    return answer, logprobs


def test_logprobs_are_the_models_raw_log_probabilities_in_both_formats(server, tiny):
    """logprobs / top_logprobs: each answer token's log-probability under the model's raw distribution (checked
    against whole forward passes), the greedy token first among its alternatives, streamed and not alike."""
    prompt = ids_of(tiny, "the pass key is hello world remember it what is the pass key")
    answer, expected = greedy_reference(tiny, prompt, 6)
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0, "logprobs": 3, "ignore_eos": True}
    whole = httpx.post(f"{server.url}/v1/completions", json=body).json()["choices"][0]
    logprobs = whole["logprobs"]
    assert logprobs["tokens"] == [tiny[1].decode([t]) for t in answer] == whole["text"].split()
    assert logprobs["token_logprobs"] == pytest.approx(expected, abs=1e-4)
    for token, top, chosen in zip(*(logprobs[k] for k in ("tokens", "top_logprobs", "token_logprobs")), strict=True):
        assert len(top) == 3 and max(top, key=top.get) == token and top[token] == pytest.approx(chosen)
    for token, offset in zip(logprobs["tokens"], logprobs["text_offset"], strict=True):
        assert whole["text"][offset:].lstrip().startswith(token)  # where the text grows by the token
    with httpx.stream("POST", f"{server.url}/v1/completions", json={**body, "stream": True}, timeout=60) as response:
        chunks = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    pieces = [c["choices"][0]["logprobs"] for c in chunks if c["choices"] and c["choices"][0]["logprobs"]]
    assert [t for piece in pieces for t in piece["tokens"]] == logprobs["tokens"]
    assert [o for piece in pieces for o in piece["text_offset"]] == logprobs["text_offset"]
    messages = [{"role": "user", "content": "what is the pass key"}]
    chat = (
        client(server)
        .chat.completions.create(
            model="tiny", messages=messages, max_tokens=5, temperature=0, logprobs=True, top_logprobs=2
        )
        .choices[0]
    )
    answer, expected = greedy_reference(tiny, ids_of(tiny, "<s> question what is the pass key </s> answer"), 5)
    content = chat.logprobs.content
    words = [tiny[1].decode([t]) for t in answer if t != tiny[1].eos_token_id]
    assert [c.token for c in content] == words
    assert [c.logprob for c in content] == pytest.approx(expected[: len(words)], abs=1e-4)
    assert all(c.top_logprobs[0].token == c.token and len(c.top_logprobs) == 2 for c in content)
    assert content[0].bytes == list(content[0].token.encode())
    plain = client(server).chat.completions.create(model="tiny", messages=messages, max_tokens=2, temperature=0)
    assert plain.choices[0].logprobs is None


def test_echo_gives_the_prompts_log_probabilities_as_lm_eval_reads_them(server, tiny):
    """echo + logprobs (lm-eval's local-completions loglikelihood request): the prompt's tokens come first,
    the first with no log-probability, each next one's as a whole forward pass gives it; methods that do not
    run the whole prompt densely refuse with a 400; echo alone puts the prompt's text first."""
    model, tokenizer = tiny
    prompt = ids_of(tiny, "the pass key is hello world remember it")
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0, "echo": True, "logprobs": 2}
    choice = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()["choices"][0]
    logprobs = choice["logprobs"]
    with torch.no_grad():
        expected = torch.log_softmax(model(input_ids=torch.tensor([prompt])).logits[0].float(), -1)
    assert logprobs["tokens"][: len(prompt)] == [tokenizer.decode([t]) for t in prompt]
    assert logprobs["token_logprobs"][0] is None and len(logprobs["token_logprobs"]) == len(prompt) + 1
    reference = [float(expected[i, prompt[i + 1]]) for i in range(len(prompt) - 1)]
    assert logprobs["token_logprobs"][1 : len(prompt)] == pytest.approx(reference, abs=1e-4)
    assert all(len(top) == 2 for top in logprobs["top_logprobs"][1:])
    assert choice["text"].startswith(tokenizer.decode(prompt)) and len(choice["text"]) > len(tokenizer.decode(prompt))
    with httpx.stream("POST", f"{server.url}/v1/completions", json={**body, "stream": True}, timeout=60) as response:
        chunks = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    streamed = [
        lp
        for c in chunks
        if c["choices"] and c["choices"][0]["logprobs"]
        for lp in c["choices"][0]["logprobs"]["token_logprobs"]
    ]
    assert streamed[0] is None and streamed[1:] == pytest.approx(logprobs["token_logprobs"][1:], abs=1e-6)
    plain = httpx.post(f"{server.url}/v1/completions", json={**body, "logprobs": None}, timeout=60).json()
    assert plain["choices"][0]["text"] == choice["text"] and plain["choices"][0]["logprobs"] is None
    refused = httpx.post(f"{server.url}/v1/completions", json={**body, "kvsieve": {"method": "gemfilter"}}, timeout=60)
    assert refused.status_code == 400 and "dense pass" in refused.json()["error"]["message"]


def test_penalties_change_the_choice_as_openai_and_ctrl_define_them(server, tiny):
    """presence / frequency penalties over the answer so far and the repetition penalty over prompt and
    answer: the greedy answers equal a reference that applies the definitions to whole forward passes."""
    prompt = ids_of(tiny, "remember it remember it the pass key is")

    def counts(logits, answer):
        return torch.bincount(torch.tensor(answer, dtype=torch.long), minlength=logits.shape[0]).float()

    def frequency(logits, ids, answer):
        return logits - 1.5 * counts(logits, answer) if answer else logits

    def presence(logits, ids, answer):
        return logits - 2.0 * (counts(logits, answer) > 0).float() if answer else logits

    def repetition(logits, ids, answer):
        seen = sorted(set(ids + answer))
        logits[seen] = torch.where(logits[seen] > 0, logits[seen] / 1.8, logits[seen] * 1.8)
        return logits

    plain = greedy_reference(tiny, prompt, 40, eos=False)[0]
    for field, value, adjust in [
        ("frequency_penalty", 1.5, frequency),
        ("presence_penalty", 2.0, presence),
        ("repetition_penalty", 1.8, repetition),
    ]:
        answer, _ = greedy_reference(tiny, prompt, 40, adjust, eos=False)
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 40, "temperature": 0, "ignore_eos": True, field: value}
        text = httpx.post(f"{server.url}/v1/completions", json=body).json()["choices"][0]["text"]
        assert text == tiny[1].decode(answer, skip_special_tokens=True), field
        assert answer != plain, f"{field} changed nothing here: the test would not see it ignored"
    for field, value in [("presence_penalty", 2.5), ("frequency_penalty", -3), ("repetition_penalty", 0)]:
        body = {"model": "tiny", "prompt": prompt, field: value}
        answer = httpx.post(f"{server.url}/v1/completions", json=body)
        assert answer.status_code == 400 and answer.json()["error"]["param"] == field


def test_logit_bias_and_the_openai_fields_clients_send_by_default(server, tiny):
    """logit_bias moves the choice; LangChain's defaults (tools: [], tool_choice "none", response_format text,
    logit_bias null, parallel_tool_calls) are accepted and change nothing; tool use is a 400 naming tools."""
    prompt = ids_of(tiny, "the pass key is")
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    plain = httpx.post(f"{server.url}/v1/completions", json=body).json()["choices"][0]["text"]
    forced = httpx.post(f"{server.url}/v1/completions", json={**body, "logit_bias": {"7": 100}}).json()
    assert forced["choices"][0]["text"] == " ".join([tiny[1].decode([7])] * 4) != plain
    defaults = {"tools": [], "tool_choice": "none", "response_format": {"type": "text"}, "logit_bias": None}
    same = httpx.post(f"{server.url}/v1/completions", json={**body, **defaults, "parallel_tool_calls": True})
    assert same.json()["choices"][0]["text"] == plain
    tool = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}
    for bad in [
        {"tools": [tool]},
        {"tools": [tool], "tool_choice": "required"},
        {"logit_bias": {"7": 101}},
        {"logit_bias": {"seven": 1}},
        {"logit_bias": {"100000": 1}},
        {"response_format": {"type": "json_schema"}},
        {"response_format": {"type": "xml"}},
    ]:
        answer = httpx.post(f"{server.url}/v1/completions", json={**body, **bad})
        assert answer.status_code == 400, bad
        assert answer.json()["error"]["param"] == next(iter(bad)) or "tool" in answer.json()["error"]["message"], bad


def test_a_bug_in_one_step_answers_500_and_the_engine_goes_on(server, tiny, monkeypatch):
    """An unexpected error while a request is between the scheduler's lists (its first token is sampled as its
    prefill ends) still reaches that request as a 500, and the next request is served. Temperatures too small
    to divide by are greedy (vLLM's rule), not NaN probabilities."""
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0}
    greedy = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30).json()["choices"][0]["text"]
    tiny_temperature = httpx.post(f"{server.url}/v1/completions", json={**body, "temperature": 1e-98}, timeout=30)
    assert tiny_temperature.json()["choices"][0]["text"] == greedy
    extreme = {**body, "temperature": 0.5, "repetition_penalty": 5e-324, "seed": 1}  # logits overflow to inf
    assert httpx.post(f"{server.url}/v1/completions", json=extreme, timeout=30).status_code == 200

    def broken(*args, **kwargs):
        raise RuntimeError("a bug")

    monkeypatch.setattr(output_module, "next_token", broken)
    failed = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
    assert failed.status_code == 500 and failed.json()["error"]["type"] == "server_error"
    monkeypatch.undo()
    assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=30).json()["choices"][0]["text"] == greedy


def test_n_answers_come_from_one_prefill_whole_and_streamed(server, tiny):
    """n = 3: three choices indexed 0..2 from one prefill (the prefilled-token counter moves once), usage
    counting every answer; streamed, each index opens, streams and finishes, and the texts agree."""
    prompt = ids_of(tiny, DOC + " what is it")
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 6, "temperature": 1.0, "seed": 11, "n": 3}
    body |= {"ignore_eos": True, "kvsieve": {"cache": False}}
    prefilled = metric(server, "kvsieve_prefill_tokens_total")
    whole = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
    assert metric(server, "kvsieve_prefill_tokens_total") == prefilled + len(prompt)
    assert [c["index"] for c in whole["choices"]] == [0, 1, 2]
    assert whole["usage"]["completion_tokens"] == 18  # 6 tokens for each answer
    texts = [c["text"] for c in whole["choices"]]
    assert len(set(texts)) > 1
    streamed = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=streamed, timeout=60) as response:
        chunks = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    pieces = {
        i: "".join(c["choices"][0]["text"] for c in chunks if c["choices"] and c["choices"][0]["index"] == i)
        for i in range(3)
    }
    assert [pieces[i] for i in range(3)] == texts
    assert sorted(c["choices"][0]["index"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]) == [
        0,
        1,
        2,
    ]
    assert chunks[-1]["usage"]["completion_tokens"] == 18
    chat = client(server).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=3, temperature=0, n=2
    )
    assert len(chat.choices) == 2 and chat.choices[0].message.content == chat.choices[1].message.content  # greedy


def test_api_key_guards_every_endpoint_but_health(tiny):
    with start(tiny, api_key="s3cret", cache_bytes=0) as guarded:
        for path in ("/v1/models", "/metrics"):
            assert httpx.get(f"{guarded.url}{path}").status_code == 401
            assert httpx.get(f"{guarded.url}{path}", headers={"Authorization": "Bearer nope"}).status_code == 401
        answer = httpx.post(f"{guarded.url}/v1/completions", json={"model": "tiny", "prompt": [1, 2]})
        assert answer.status_code == 401 and answer.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(f"{guarded.url}/health").status_code == 200
        with pytest.raises(openai.AuthenticationError):
            client(guarded, "wrong").models.list()
        assert [m.id for m in client(guarded, "s3cret").models.list()] == ["tiny"]
        out = client(guarded, "s3cret").completions.create(model="tiny", prompt=[5, 6], max_tokens=2, temperature=0)
        assert out.usage.completion_tokens >= 1


def test_a_full_queue_answers_429(tiny):
    with start(tiny, max_queue=1, max_batch=1, cache_bytes=0) as small:
        # [5, 6, 7] meets EOS after 79 tokens, which let the waiting request in before the third was sent (a race)
        body = {"model": "tiny", "prompt": [8, 9, 10], "max_tokens": 500, "temperature": 0}  # 500 tokens, no EOS
        with ThreadPoolExecutor(2) as pool:
            running = pool.submit(httpx.post, f"{small.url}/v1/completions", json=body, timeout=60)
            while metric(small, "kvsieve_active_requests") < 1:
                time.sleep(0.01)
            waiting = pool.submit(httpx.post, f"{small.url}/v1/completions", json=body, timeout=60)
            while metric(small, "kvsieve_queue_depth") < 1:
                time.sleep(0.01)
            refused = httpx.post(f"{small.url}/v1/completions", json=body)
            assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
            assert refused.json()["error"]["code"] == "queue_full"
            assert running.result().status_code == waiting.result().status_code == 200


def test_upstream_relays_the_selected_token_ids(tiny):
    """GemFilter runs here; the upstream (a second kvsieve server) prefills only the k kept tokens."""
    gemfilter = method("gemfilter", {"select.k": 30})
    with start(tiny, cache_bytes=0) as upstream, start(tiny, spec=gemfilter, upstream=upstream.url) as front:
        ids = ids_of(tiny, DOC + " what is the pass key")
        out = client(front).completions.create(model="tiny", prompt=ids, max_tokens=8, temperature=0)
        info = out.model_extra["kvsieve"]
        assert info["selected_tokens"] == info["upstream_prompt_tokens"] == 30 and info["upstream"] == upstream.url
        assert out.usage.prompt_tokens == len(ids)
        assert out.choices[0].text == reference(tiny, ids, "gemfilter", {"select.k": 30})
        messages = [{"role": "user", "content": DOC}, {"role": "user", "content": "what is the pass key"}]
        whole = client(front).chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)
        streamed = client(front).chat.completions.create(
            model="tiny", messages=messages, max_tokens=8, temperature=0, stream=True
        )
        assert "".join(c.choices[0].delta.content or "" for c in streamed) == whole.choices[0].message.content
        assert whole.model_extra["kvsieve"]["upstream_prompt_tokens"] == 30
        everything = client(front).completions.create(
            model="tiny", prompt=ids, max_tokens=8, temperature=0, extra_body={"kvsieve": {"method": "full"}}
        )  # the baseline: the whole prompt goes upstream
        assert everything.model_extra["kvsieve"]["upstream_prompt_tokens"] == len(ids)
        assert everything.choices[0].text == reference(tiny, ids)
        with pytest.raises(openai.BadRequestError, match="only the select stage"):
            client(front).completions.create(model="tiny", prompt=ids, extra_body={"kvsieve": {"method": "snapkv"}})
        penalized = {"model": "tiny", "prompt": ids, "max_tokens": 12, "temperature": 0, "frequency_penalty": 1.5}
        penalized["kvsieve"] = {"method": "full"}
        relayed = httpx.post(f"{front.url}/v1/completions", json=penalized, timeout=60).json()["choices"][0]["text"]
        direct = httpx.post(f"{upstream.url}/v1/completions", json=penalized, timeout=60).json()["choices"][0]["text"]
        assert relayed == direct  # the penalty went upstream with the ids
        for unrelayable in ({"logprobs": 1}, {"n": 2}, {"response_format": {"type": "json_object"}}):
            answer = httpx.post(f"{front.url}/v1/completions", json={**penalized, **unrelayable}, timeout=60)
            assert answer.status_code == 400 and answer.json()["error"]["param"] == next(iter(unrelayable))


def test_a_client_that_leaves_a_relayed_request_cancels_the_upstreams_work(tiny, tmp_path):
    """Non-streamed --upstream: the client disconnecting closes the upstream request, which the upstream (a
    kvsieve server answering a non-streamed request while it decodes) counts as a 499 and frees, long before
    its 480 tokens (a deeper model, so that decoding takes seconds)."""
    build_model("llama", num_layers=24, max_positions=512).save_pretrained(tmp_path)
    word_tokenizer().save_pretrained(tmp_path)
    deep = load_model(str(tmp_path), device="cpu", dtype="float32")
    with start(deep, cache_bytes=0) as upstream, start(tiny, upstream=upstream.url) as front:
        body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 480, "ignore_eos": True, "temperature": 0}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{front.url}/v1/completions", json=body, timeout=0.5)
        deadline = time.monotonic() + 20
        gone = 'kvsieve_requests_total{endpoint="/v1/completions",status="499"}'
        while metric(upstream, gone, missing=0.0) < 1 or metric(upstream, "kvsieve_active_requests") > 0:
            assert time.monotonic() < deadline, "the upstream went on decoding for a client that left"
            time.sleep(0.1)
        assert metric(upstream, "kvsieve_generation_tokens_total") < 480


def test_an_upstream_that_refuses_the_servers_key_is_a_502(tiny):
    """The upstream's 401 is this server's configuration fault, not the client's; /health reports it."""
    with start(tiny, cache_bytes=0, api_key="upstream-secret") as upstream, start(tiny, upstream=upstream.url) as front:
        answer = httpx.post(f"{front.url}/v1/completions", json={"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 2})
        assert answer.status_code == 502 and "KVSIEVE_UPSTREAM_API_KEY" in answer.json()["error"]["message"]
        assert httpx.get(f"{front.url}/health").status_code == 503  # /health says the upstream is not usable
    with start(tiny, cache_bytes=0) as upstream, start(tiny, upstream=upstream.url) as front:
        assert httpx.get(f"{front.url}/health").json() == {"status": "ok", "model": "tiny", "upstream": upstream.url}


def test_load_8_clients_mixed_methods_and_bad_requests(server, tiny):
    """8 concurrent clients x 5 requests (plus one bad request each): every good answer is its own prompt's."""
    methods = [("full", {}), ("snapkv", SMALL), ("a2sf", {"evict.budget": 20}), ("streaming", {"evict.budget": 16})]
    methods += [("imdc", {"feed.chunk": 32, "feed.memory": 24})]
    plans = []
    for c in range(8):
        for r in range(5):
            generator = torch.Generator().manual_seed(100 * c + r)
            ids = torch.randint(3, 256, (20 + 7 * ((c + r) % 9),), generator=generator).tolist()
            name, settings = methods[(c + r) % len(methods)]
            plans.append((c, ids, name, settings, 4 + (c * r) % 9))
    expected = {(c, tuple(ids), n): reference(tiny, ids, n, s, t) for c, ids, n, s, t in plans}

    def client_session(c: int) -> list[tuple[tuple, str]]:
        answers = []
        for _, ids, name, settings, tokens in [p for p in plans if p[0] == c]:
            extra = {"kvsieve": {"method": name, "set": settings}}
            kwargs = dict(model="tiny", prompt=ids, max_tokens=tokens, temperature=0, extra_body=extra)
            if c % 2:
                text = "".join(x.choices[0].text for x in client(server).completions.create(stream=True, **kwargs))
            else:
                text = client(server).completions.create(**kwargs).choices[0].text
            answers.append(((c, tuple(ids), name), text))
        bad = httpx.post(f"{server.url}/v1/completions", json={"model": "tiny", "prompt": [1], "max_tokens": -1})
        assert bad.status_code == 400
        return answers

    start_time = time.perf_counter()
    with ThreadPoolExecutor(8) as pool:
        results = [a for answers in pool.map(client_session, range(8)) for a in answers]
    assert len(results) == 40
    for key, text in results:
        assert text == expected[key], key
    assert time.perf_counter() - start_time < 60
    assert httpx.get(f"{server.url}/health").json()["status"] == "ok"
    deadline = time.monotonic() + 5
    while metric(server, "kvsieve_active_requests") > 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert metric(server, "kvsieve_active_requests") == 0 and metric(server, "kvsieve_queue_depth") == 0


SHRINK = {  # every preset at budgets that drop tokens from a 150-token prompt (applied where the field exists)
    "select.k": 64,
    "select.block": 8,
    "feed.chunk": 32,
    "feed.memory": 40,
    "attention.segment": 16,
    "attention.block": 4,
    "attention.budget": 32,
    "attention.dense_prefix": 0,
    "compress.budget": 40,
    "compress.policy.window": 8,
    "compress.policy.pool_size": 7,
    "evict.budget": 40,
}


def test_every_preset_answers_as_the_library(server, tiny):
    """For every registered preset the server's greedy tokens equal `kvsieve.run`'s on the same prompt,
    with the server's prefix cache on and prefill sliced between decoding steps (the default)."""
    from kvsieve import REGISTRY

    ids = ids_of(tiny, "hello " + DOC + " " + DOC[:260] + " what is the pass key")
    assert len(ids) > 150
    for name, preset in REGISTRY.items():
        settings = {path: value for path, value in SHRINK.items() if preset.has(path)}
        extra = {"kvsieve": {"method": name, "set": settings}}
        for _ in range(2):  # the second time through the stored prefix where the method continues one
            out = client(server).completions.create(
                model="tiny", prompt=ids, max_tokens=12, temperature=0, extra_body=extra
            )
            assert out.choices[0].text == reference(tiny, ids, name, settings, tokens=12), (name, settings)


def test_tokenize_detokenize_and_one_model(server, tiny):
    """vLLM's /tokenize and /detokenize, and OpenAI's GET /v1/models/{id}."""
    ids = ids_of(tiny, "the pass key is hello")
    text = httpx.post(f"{server.url}/tokenize", json={"model": "tiny", "prompt": "the pass key is hello"}).json()
    assert text["tokens"] == tiny[1]("the pass key is hello")["input_ids"] and text["count"] == len(text["tokens"])
    assert text["max_model_len"] == 512
    chat = httpx.post(f"{server.url}/tokenize", json={"messages": [{"role": "user", "content": "hello"}]}).json()
    assert chat["tokens"] == ids_of(tiny, "<s> question hello </s> answer")  # the chat template applied
    back = httpx.post(f"{server.url}/detokenize", json={"tokens": ids}).json()
    assert back == {"prompt": "the pass key is hello"}
    assert httpx.post(f"{server.url}/detokenize", json={"tokens": [1, 999]}).status_code == 400
    assert httpx.post(f"{server.url}/tokenize", json={"prompt": "a", "messages": []}).status_code == 400
    assert client(server).models.retrieve("tiny").id == "tiny"
    missing = httpx.get(f"{server.url}/v1/models/other")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
