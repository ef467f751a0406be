"""The one engine: the scheduler gives each request exactly the tokens it gets alone.

Requests with different prompt lengths, methods and budgets (full attention, SnapKV compression,
A2SF, TOVA and StreamingLLM eviction at every step, StreamingLLM re-encoding its positions, IMDC
with per-layer memory sizes, GemFilter, CritiPrefill) are added before the first step, so they
join the decode batch one by one and leave at different steps (different max_tokens); the first
one decodes alone (in place, under eviction) until the second joins. `FakeTokenizer` writes
token 17 as "<17>", so the answer text is the token sequence itself. Prefill slices: a long
prompt prefilled in slices of a small budget gives the tokens of an unsliced run, while a
running request decodes a token at every step.
"""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
from conftest import FakeTokenizer, build_model, make_prompt

from kvsieve import Sampling, fast_paths, method, run
from kvsieve.engine import prefill_run
from kvsieve.engine.batch import DecodeBatch
from kvsieve.engine.events import Failed, Finished, Started, Text
from kvsieve.engine.request import Request
from kvsieve.engine.scheduler import Scheduler
from kvsieve.errors import KvsieveError
from kvsieve.kv.cache import wrap_cache

CASES = [
    # first: decodes alone in buffers (H2O's recent half needs the entries back in time order), then joins the batch
    ("h2o", {"evict.budget": 30}, 50, 14),
    ("a2sf", {"evict.budget": 30}, 44, 12),
    ("full", {}, 40, 12),
    ("snapkv", {"compress.budget": 24, "compress.policy.window": 4}, 70, 9),
    ("streaming", {"evict.budget": 20}, 33, 12),
    ("streaming", {"evict.budget": 20, "evict.policy.reencode": True}, 36, 13),
    ("imdc", {"feed.chunk": 16, "feed.memory": 24, "feed.schedule": "square-sqrt"}, 90, 10),  # per-layer sizes
    ("full", {}, 7, 3),
    ("gemfilter", {"select.k": 24}, 60, 8),
    ("tova", {"evict.budget": 20}, 45, 10),
    ("critiprefill", {"attention.segment": 16, "attention.block": 4, "attention.budget": 16}, 80, 11),
]


class Collector:
    """The events of one request."""

    def __init__(self):
        self.events = []

    def emit(self, event):
        self.events.append(event)

    @property
    def text(self) -> str:
        return "".join(e.piece for e in self.events if isinstance(e, Text))

    @property
    def done(self) -> bool:
        return any(isinstance(e, Finished | Failed) for e in self.events)


@pytest.fixture
def model(single_thread):
    return build_model("llama", num_layers=3, max_positions=512)


def drain(scheduler: Scheduler, limit: int = 10_000) -> int:
    """Step until nothing is left; the number of steps."""
    steps = 0
    while scheduler.has_work():
        scheduler.step()
        steps += 1
        assert steps < limit
    return steps


def test_batched_greedy_decoding_equals_each_request_alone(model, monkeypatch):
    sizes = []
    step = DecodeBatch.step
    monkeypatch.setattr(DecodeBatch, "step", lambda self: sizes.append(len(self.rows)) or step(self))
    scheduler = Scheduler(model, FakeTokenizer(), max_batch=16)
    cases = []
    for i, (name, settings, length, new_tokens) in enumerate(CASES):
        spec, prompt, sink = method(name, settings), make_prompt(length, seed=10 + i), Collector()
        scheduler.add(Request(prompt, spec, Sampling(max_new_tokens=new_tokens), sink.emit))
        cases.append((prompt, spec, new_tokens, sink))
        if i == 0:  # prefilled, then five steps alone
            for _ in range(6):
                scheduler.step()
    drain(scheduler)
    assert sizes[0] == 1 and max(sizes) >= 6  # the first decoded alone, then most really decoded together
    for prompt, spec, new_tokens, sink in cases:
        alone = run(model, FakeTokenizer(), prompt, method=spec, sampling=Sampling(max_new_tokens=new_tokens))
        started, finished = sink.events[0], sink.events[-1]
        assert isinstance(started, Started) and isinstance(finished, Finished), sink.events
        assert sink.text == alone.text, spec.to_dict()
        assert finished.completion_tokens == len(alone.tokens) == new_tokens
        assert started.info["kv_entries"] == alone.prefill_kv_length
        if spec.evict is not None:  # the request's own eviction ran on its row of the batch
            assert finished.info["kv_entries_at_end"] == alone.kv_cache_length
    assert len(scheduler.batch) == 0 and scheduler.kv_entries() == 0  # every cache freed


@pytest.mark.parametrize("static", [False, True], ids=["eager", "static"])
@pytest.mark.parametrize("trial", range(3))
def test_rows_joining_and_leaving_at_random_steps_each_decode_their_own_tokens(model, trial, static):
    """Requests of every kind arrive at random steps, so rows of different lengths join and leave the batch's
    tables while others decode (evicting in place): each answer is the one its request gives alone (through
    the ordinary step). `static`: the scheduler's batch steps rows that do not evict through the static step
    (what a GPU captures), switching to the ordinary step whenever an evicting row is in the batch."""
    import random

    rnd = random.Random(trial)
    scheduler = Scheduler(model, FakeTokenizer(), max_batch=6, max_step_tokens=32)
    scheduler.batch.static = static
    arrivals = [
        (rnd.randrange(12), CASES[rnd.randrange(len(CASES))], make_prompt(20 + rnd.randrange(60), seed=100 * trial + i))
        for i in range(6)
    ]
    arrivals.sort(key=lambda arrival: arrival[0])
    requests, step = [], 0
    while arrivals or scheduler.has_work():
        while arrivals and arrivals[0][0] <= step:
            _, (name, settings, _, new_tokens), prompt = arrivals.pop(0)
            request = Request(prompt, method(name, settings), Sampling(max_new_tokens=new_tokens))
            scheduler.add(request)
            requests.append((request, prompt))
        scheduler.step()
        step += 1
    for request, prompt in requests:
        alone = run(model, FakeTokenizer(), prompt, method=request.spec, sampling=request.sampling)
        assert request.result.tokens == alone.tokens, request.spec.to_dict()


def test_rows_of_different_lengths_ignore_whatever_their_padding_holds(model):
    """Rows right-padded to the longest: what lies past a row's entries (stale entries of earlier steps, here large
    values) never reaches its logits, which equal the row decoded alone; each row's new entry lands at its own
    column. (The tables start as zeros: a NaN of never written memory would survive a 0 attention weight.)"""
    from kvsieve.engine.batch import Row
    from kvsieve.engine.pipeline import prefill

    prompts = [make_prompt(n, seed=n) for n in (30, 50)]
    done = [prefill(model, p, reserve=4) for p in prompts]
    alone = []
    for d in done:
        single = DecodeBatch(model)
        layers = [(layer.keys.clone(), layer.values.clone()) for layer in d.prefilled.cache.layers]
        single.add(Row(7, d.prefilled.next_position), wrap_cache(model, layers))
        alone.append(single.step()[0])
    batch = DecodeBatch(model)
    for d in done:
        batch.add(Row(7, d.prefilled.next_position), d.prefilled.cache)
    batch.tables.keys[:, 0, :, 30:] = 1e4  # row 0 holds 30 entries, row 1 holds 50
    batch.tables.values[:, 0, :, 30:] = 1e4
    logits = batch.step()
    assert [batch.entries(i) for i in range(2)] == [31, 51]
    for row, expected in zip(logits, alone, strict=True):
        torch.testing.assert_close(row, expected, rtol=1e-4, atol=1e-4)


STATIC_CASES = [  # the first four start together, the others join midway
    ("full", {}, 40),
    ("snapkv", {"compress.budget": 24, "compress.policy.window": 4}, 70),
    ("imdc", {"feed.chunk": 16, "feed.memory": 24, "feed.schedule": "square-sqrt"}, 90),  # layers of many sizes
    ("h2o", {"evict.budget": 30}, 50),
    ("gemfilter", {"select.k": 24}, 60),
    ("tova", {"evict.budget": 20}, 45),
    ("h2o", {"evict.budget": 30}, 66),  # a second H2O and a second TOVA row: each pair scores together
    ("tova", {"evict.budget": 20}, 52),
    ("full", {}, 5),  # shorter than a hybrid model's window (conftest.WINDOW), which fills in the static steps
]


@pytest.mark.parametrize("arch", ["llama", "gemma3", "qwen2-window"])
def test_static_steps_give_the_ordinary_steps_logits_and_leave_the_same_caches(arch, single_thread):
    """The static step (tensor-held positions and columns, attention over the tables' whole capacity, evicting
    rows' scores carried in place: what a GPU captures as a CUDA graph) against the ordinary step,
    teacher-forced on the same tokens: rows of different lengths, two of them evicting, one row leaving and two
    joining midway, and more steps than the tables' spare room, so they are rebuilt while static steps are
    pending. Every step's logits agree, and so do the entries each row holds and the caches the rows leave
    with. On hybrid models (gemma3's sliding layers before its global one, qwen2-window's after) the
    sliding layers' rings wrap round in the static steps, a short row's ring fills during them, and the
    evictions stay on the global layers."""
    from kvsieve.engine.batch import SPARE, Row
    from kvsieve.engine.pipeline import prefill

    model = build_model(arch, num_layers=3, max_positions=512)
    steps = SPARE + 20
    done = [
        prefill(model, make_prompt(n, seed=n), method=method(name, s), reserve=steps + 8) for name, s, n in STATIC_CASES
    ]
    assert len({layer.keys.shape[2] for layer in done[2].prefilled.cache.layers}) > 1  # IMDC: layers differ
    tokens = torch.randint(3, 200, (steps,), generator=torch.Generator().manual_seed(5)).tolist()

    def decode(static: bool):
        batch, logits, left, rows, runs = DecodeBatch(model, static=static), [], [], [], 0

        def join(d) -> None:
            layers = [(layer.keys.clone(), layer.values.clone()) for layer in d.prefilled.cache.layers]
            evict = copy.deepcopy(d.state.evict)
            rows.append((Row(0, d.prefilled.next_position, evict), wrap_cache(model, layers)))
            batch.add(*rows[-1])

        for d in done[:4]:
            join(d)
        for i, token in enumerate(tokens):
            if i == 7:  # the second row leaves with its cache, the others join
                left.append((batch.entries(1), rows[1][1]))
                batch.remove([rows[1][0]])
                for d in done[4:]:
                    join(d)
            for row in batch.rows:
                row.token = token
            logits.append(batch.step())
            runs += batch.static_step is not None
        entries = [batch.entries(i) for i in range(len(batch))]
        batch.remove(list(batch.rows))
        staying = [rows[0], *rows[2:]]
        return logits, entries, left + [(n, cache) for n, (_, cache) in zip(entries, staying, strict=True)], runs

    eager, static = decode(False), decode(True)
    assert eager[3] == 0 and static[3] == steps  # every step of the batch was a static one
    for a, b in zip(eager[0], static[0], strict=True):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
    assert static[1] == eager[1] and [eager[1][i] for i in (2, 4, 5, 6)] == [30, 20, 30, 20]  # evicting: budgets
    for (n_eager, eager_cache), (n_static, static_cache) in zip(eager[2], static[2], strict=True):
        assert n_static == n_eager
        for a, b in zip(eager_cache.layers, static_cache.layers, strict=True):
            assert b.keys.shape == a.keys.shape
            torch.testing.assert_close(b.keys, a.keys, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(b.values, a.values, rtol=1e-5, atol=1e-5)


def test_a_steady_static_step_reads_and_writes_the_same_memory_and_numbers(model):
    """What lets a GPU replay a recorded step: after the first static step, every later one leaves every Python
    number and every tensor the step reads (the rows' buffers, each eviction's scores, ages and clock) exactly
    where the previous one left them; only their contents change. Rows: full attention, two H2O rows (scored
    together) and TOVA."""
    from kvsieve.engine.batch import Row
    from kvsieve.engine.pipeline import prefill

    batch = DecodeBatch(model, static=True)
    for name, settings, n in [STATIC_CASES[0], STATIC_CASES[3], STATIC_CASES[6], STATIC_CASES[5]]:
        d = prefill(model, make_prompt(n, seed=n), method=method(name, settings), reserve=40)
        batch.add(Row(5, d.prefilled.next_position, d.state.evict), d.prefilled.cache)

    def state() -> list:
        step = batch.static_step
        seen = [step.positions.data_ptr(), step.lengths.data_ptr(), step.columns.data_ptr()]
        for row, cache in zip(batch.rows, batch.caches, strict=True):
            seen += [(layer.length, layer.keys.data_ptr(), layer.keys.shape) for layer in cache.layers]
            if row.evict is not None:
                evict, buffers = row.evict, row.evict.buffers
                seen += [evict.budget, buffers.clock.data_ptr(), buffers.stamps.data_ptr(), buffers.stamps.shape]
                seen += [(j, t.data_ptr(), t.shape) for j, t in sorted(evict.scores.items())]
        return seen

    batch.step()
    first, clock = state(), int(batch.rows[1].evict.buffers.clock)
    for _ in range(5):
        batch.step()
        assert state() == first
    assert int(batch.rows[1].evict.buffers.clock) == clock + 5 and batch.entries(0) == 40 + 6


def test_evicting_rows_score_from_the_steps_own_attention(model, monkeypatch):
    """H2O's and TOVA's per-step rules read only the new query's attention row: the batch's steps, ordinary and
    static, hand them the probabilities the step's attention computed (the CPU kernel's one pass over the keys,
    or `grouped_probs` without the kernel) and compute no second softmax; the three decode the same tokens' logits
    and leave the same running scores."""
    import kvsieve.compress.policy as policy
    import kvsieve.kernels.attention as attention
    from kvsieve.engine.batch import Row
    from kvsieve.engine.pipeline import prefill

    second_pass, kernel_pass = [], []
    counted = policy.attention_probs
    monkeypatch.setattr(policy, "attention_probs", lambda *a: second_pass.append(1) or counted(*a))
    with_probs = attention.kernel_attention_probs

    def served(*args):  # counts the steps the kernel served
        attended = with_probs(*args)
        kernel_pass.extend([] if attended is None else [1])
        return attended

    monkeypatch.setattr(attention, "kernel_attention_probs", served)
    cases = [STATIC_CASES[0], STATIC_CASES[3], STATIC_CASES[6], STATIC_CASES[5]]  # full, two H2O, TOVA
    done = [prefill(model, make_prompt(n, seed=n), method=method(name, s), reserve=12) for name, s, n in cases]
    tokens = torch.randint(3, 200, (6,), generator=torch.Generator().manual_seed(2)).tolist()

    def decode(static: bool, kernel: bool) -> tuple[list[torch.Tensor], list[dict]]:
        second_pass.clear()
        kernel_pass.clear()
        with fast_paths.using(attention_kernel=kernel):
            batch, logits = DecodeBatch(model, static=static), []
            for d in done:
                layers = [(layer.keys.clone(), layer.values.clone()) for layer in d.prefilled.cache.layers]
                batch.add(Row(0, d.prefilled.next_position, copy.deepcopy(d.state.evict)), wrap_cache(model, layers))
            for token in tokens:
                for row in batch.rows:
                    row.token = token
                logits.append(batch.step())
        assert not second_pass and bool(kernel_pass) == kernel, (static, kernel)
        assert (batch.static_step is not None) == static
        return logits, [dict(row.evict.scores) for row in batch.rows if row.evict is not None]

    reference = decode(static=False, kernel=False)
    for other in (decode(static=False, kernel=True), decode(static=True, kernel=True)):
        for a, b in zip(reference[0], other[0], strict=True):
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
        for a, b in zip(reference[1], other[1], strict=True):  # each evicting row's running scores, layer by layer
            assert a.keys() == b.keys()
            for j in a:
                torch.testing.assert_close(b[j], a[j], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name,settings", [("full", {}), ("h2o", {"evict.budget": 24})])
def test_a_dropped_static_step_is_freed_at_once(model, name, settings):
    """A static step the batch drops (a row joins; on CUDA the step holds its graph, the graph's memory and the
    tables) is freed then, not at some later garbage collection: nothing it holds refers back to it, an evicting
    row's observers included."""
    import gc
    import weakref

    from kvsieve.engine.batch import Row
    from kvsieve.engine.pipeline import prefill

    batch = DecodeBatch(model, static=True)
    for _ in range(2):
        d = prefill(model, make_prompt(30), method=method(name, settings), reserve=8)
        batch.add(Row(5, d.prefilled.next_position, d.state.evict), d.prefilled.cache)
        batch.step()
        if len(batch) == 1:
            first = weakref.ref(batch.static_step)
            gc.disable()
    try:
        assert first() is None and batch.static_step is not None
    finally:
        gc.enable()


def test_a_list_of_prompts_runs_as_one_batch_with_each_prompts_answer(model):
    prompts = [make_prompt(n, seed=n) for n in (30, 50, 41)]
    spec = method("h2o", {"evict.budget": 24})
    together = run(model, FakeTokenizer(), prompts, method=spec, sampling=Sampling(max_new_tokens=9))
    for prompt, result in zip(prompts, together, strict=True):
        alone = run(model, FakeTokenizer(), prompt, method=spec, sampling=Sampling(max_new_tokens=9))
        assert result.tokens == alone.tokens and result.kv_cache_length == alone.kv_cache_length == 24


@pytest.mark.parametrize(
    "name,settings", [("full", {}), ("a2sf", {"evict.budget": 24}), ("gemfilter", {"select.k": 30})]
)
def test_n_answers_share_one_prefill_and_each_is_the_answer_its_seed_gives(model, name, settings, monkeypatch):
    """n > 1: the prompt is prefilled once, and answer i (decoded from its own copy of the cache and of the
    eviction state, batched with the others) is exactly the one answer a run seeded seed + i gives."""
    prompt, spec = make_prompt(40, seed=3), method(name, settings)
    prefills = []
    prefill = prefill_run.prefill
    monkeypatch.setattr(prefill_run, "prefill", lambda *a, **k: prefills.append(1) or prefill(*a, **k))
    sampling = Sampling(max_new_tokens=10, temperature=1.0, seed=7, n=3)
    answers = run(model, FakeTokenizer(), prompt, method=spec, sampling=sampling)
    assert len(prefills) == 1 and len(answers) == 3
    for i, answer in enumerate(answers):
        alone = run(model, FakeTokenizer(), prompt, method=spec, sampling=replace(sampling, n=1, seed=7 + i))
        assert answer.tokens == alone.tokens and answer.kv_cache_length == alone.kv_cache_length
    assert len({tuple(a.tokens) for a in answers}) > 1  # sampled apart


@pytest.mark.parametrize(
    "name,settings", [("full", {}), ("gemfilter", {"select.k": 40}), ("a2sf", {"evict.budget": 32})]
)
def test_a_sliced_prefill_gives_the_unsliced_tokens_while_a_stream_keeps_decoding(model, name, settings):
    """Budget 8 tokens per step: a 3-layer pass over 200 tokens takes one layer per step."""
    running, long = Collector(), Collector()
    scheduler = Scheduler(model, FakeTokenizer(), max_step_tokens=8)
    scheduler.add(Request(make_prompt(12, seed=3), method("full"), Sampling(max_new_tokens=60), running.emit))
    scheduler.step()  # its prefill (12 tokens * 3 layers, one slice each) ...
    while not scheduler.running:
        scheduler.step()
    spec = method(name, settings)
    scheduler.add(Request(make_prompt(200, seed=4), spec, Sampling(max_new_tokens=5), long.emit))
    before, steps = len(running.events), 0
    while not long.events:  # until its prefill is done
        scheduler.step()
        steps += 1
    assert steps >= 3  # at least one step per layer of its 200-token pass
    assert len(running.events) - before == steps  # and every one of them decoded the running stream too
    drain(scheduler)
    alone = run(model, FakeTokenizer(), make_prompt(200, seed=4), method=spec, sampling=Sampling(max_new_tokens=5))
    assert long.text == alone.text


def test_cancelled_request_leaves_the_batch_and_others_go_on(model):
    long, short = Collector(), Collector()
    ids = make_prompt(30)
    scheduler = Scheduler(model, FakeTokenizer())
    doomed = Request(ids, method("full"), Sampling(max_new_tokens=400), long.emit)
    scheduler.add(doomed)
    scheduler.add(Request(ids, method("a2sf", {"evict.budget": 16}), Sampling(max_new_tokens=20), short.emit))
    while not any(isinstance(e, Text) for e in long.events):
        scheduler.step()
    doomed.cancelled.set()
    drain(scheduler)
    assert short.done and not long.done  # freed without finishing
    assert len(scheduler.batch) == 0
    assert sum(isinstance(e, Text) for e in long.events) < 400


def test_a_method_the_model_cannot_run_fails_alone(model):
    bad, good = Collector(), Collector()
    ids = make_prompt(40)
    scheduler = Scheduler(model, FakeTokenizer())
    # A GemFilter layer beyond the model's 3 layers is only detectable with the model.
    scheduler.add(Request(ids, method("gemfilter", {"select.layer": 7, "select.k": 8}), Sampling(), bad.emit))
    scheduler.add(Request(ids, method("full"), Sampling(max_new_tokens=4), good.emit))
    drain(scheduler)
    assert isinstance(bad.events[0], Failed) and isinstance(bad.events[0].error, KvsieveError)
    assert "out of range" in str(bad.events[0].error)
    assert isinstance(good.events[-1], Finished)


def test_grouped_attention_masks_each_rows_padding():
    """Right-padded rows (a multi-token query included) attend exactly as each row alone, causally."""
    from kvsieve.attention import dense_attention, grouped_attention

    torch.manual_seed(0)
    for q_len in (1, 2):
        query = torch.randn(3, 4, q_len, 8)
        keys = [torch.randn(1, 2, n, 8) for n in (5, 9, 2)]
        values = [torch.randn(1, 2, n, 8) for n in (5, 9, 2)]
        width = 9
        padded_k = torch.cat([torch.nn.functional.pad(k, (0, 0, 0, width - k.shape[2]), value=7.0) for k in keys])
        padded_v = torch.cat([torch.nn.functional.pad(v, (0, 0, 0, width - v.shape[2]), value=7.0) for v in values])
        lengths = torch.tensor([k.shape[2] for k in keys])
        out = grouped_attention(query, padded_k, padded_v, None, lengths)
        for b in range(3):
            alone = dense_attention(query[b : b + 1], keys[b], values[b], None)
            torch.testing.assert_close(out[b : b + 1], alone)
            sdpa = torch.nn.functional.scaled_dot_product_attention(
                query[b : b + 1], keys[b], values[b], is_causal=q_len > 1, enable_gqa=True
            )  # PyTorch's own kernel: the CPU decoding step (one query) no longer goes through it
            if q_len == 1:
                torch.testing.assert_close(out[b : b + 1], sdpa)


def test_finished_and_cancelled_requests_are_freed_at_once(model):
    """No reference cycle keeps a request (and its caches) alive until the garbage collector runs: a
    finished one, and one cancelled while its prefill is paused between layers."""
    import gc
    import weakref

    gc.disable()
    try:
        scheduler = Scheduler(model, FakeTokenizer(), max_step_tokens=8)
        done = Request(make_prompt(20), method("a2sf", {"evict.budget": 16}), Sampling(max_new_tokens=3))
        paused = Request(make_prompt(200, seed=2), method("snapkv", {"compress.budget": 48}), Sampling())
        scheduler.add(done)
        drain(scheduler)
        scheduler.add(paused)
        scheduler.step()
        assert scheduler.prefilling == [paused] and not paused.slices.done  # paused inside its prefill
        paused.cancelled.set()
        scheduler.step()
        assert not scheduler.has_work()
        refs = [weakref.ref(done), weakref.ref(paused)]
        del done, paused
        assert [ref() for ref in refs] == [None, None]
    finally:
        gc.enable()


def test_the_prefills_that_end_in_one_step_join_the_batch_in_one_rebuild(model, monkeypatch):
    """Without a step budget every waiting request prefills in the first step; they join the batch together, its
    tables rebuilt once (joining one at a time copied every earlier row's entries again), and each still decodes
    its own answer."""
    from kvsieve.kv.tables import BatchTables

    rebuilds = []
    rebuild = BatchTables.rebuild
    monkeypatch.setattr(BatchTables, "rebuild", lambda self, caches, spare: rebuilds.append(len(caches)) or rebuild(
        self, caches, spare))  # fmt: skip
    scheduler = Scheduler(model, FakeTokenizer(), max_batch=8)
    sinks = []
    for i, (name, settings, length, new_tokens) in enumerate(CASES[:5]):
        sinks.append((sink := Collector(), method(name, settings), make_prompt(length, seed=30 + i), new_tokens))
        scheduler.add(Request(sinks[-1][2], sinks[-1][1], Sampling(max_new_tokens=new_tokens), sink.emit))
    scheduler.step()
    assert rebuilds == [5] and len(scheduler.batch) == 5
    drain(scheduler)
    for sink, spec, prompt, new_tokens in sinks:
        alone = run(model, FakeTokenizer(), prompt, method=spec, sampling=Sampling(max_new_tokens=new_tokens))
        assert sink.text == alone.text, spec.to_dict()


def test_a_request_may_bring_its_own_prefix_cache(model):
    """`Request(prefix_cache=...)`: the request reads and stores in its own cache, not its scheduler's (RULER's
    sweep decodes configurations of several reuse budgets in one batch this way)."""
    from kvsieve.engine.prefix_cache import PrefixCache

    shared, own = PrefixCache(model, 10**9), PrefixCache(model, 10**9)
    scheduler = Scheduler(model, FakeTokenizer(), prefix_cache=shared)
    prompt = make_prompt(64, seed=40)
    mine = Request(prompt, method("full"), Sampling(max_new_tokens=3), boundary=48, prefix_cache=own)
    theirs = Request(prompt, method("full"), Sampling(max_new_tokens=3), boundary=48)
    for request in (mine, theirs):
        scheduler.add(request)
    drain(scheduler)
    assert len(own) == 1 and len(shared) == 1  # each stored the prompt's first 48 tokens in its own cache
    assert mine.info["cache"] == theirs.info["cache"] == "miss" and mine.result.text == theirs.result.text


def test_prefill_takes_a_spec_and_says_how_to_look_a_name_up(make_model):
    """Below the entry points a method is a MethodSpec: a preset's name is refused with the lookup to use."""
    from kvsieve.engine import prefill

    with pytest.raises(KvsieveError, match=r"kvsieve.method\('snapkv'\)"):
        prefill(make_model("llama", num_layers=1), make_prompt(8), method="snapkv")


def test_teacher_forcing_in_one_pass_equals_feeding_token_by_token(make_model):
    """`forced_logits` runs the targets of a method without eviction as one pass on the cache; the engine's decoding
    step fed the same tokens one by one (`Continuation`) predicts the same next tokens. With an eviction rule the
    cache stays at its budget while it is fed."""
    from kvsieve import method
    from kvsieve.engine import Continuation, forced_logits, prefill

    model = make_model("llama", num_layers=2)
    prompt, targets = make_prompt(30, seed=3), [5, 9, 2, 7, 11, 4]
    one_pass = forced_logits(model, prefill(model, prompt, reserve=8), targets)
    stepping = Continuation.after(model, prefill(model, prompt, reserve=8))
    with torch.no_grad():
        by_token = torch.stack([stepping.feed(t) for t in targets[:-1]])
    assert one_pass.shape == (len(targets), model.config.vocab_size)
    torch.testing.assert_close(one_pass[1:], by_token, atol=1e-4, rtol=1e-4)
    assert stepping.position == prompt.length + len(targets) - 1

    done = prefill(model, prompt, method=method("h2o", {"evict.budget": 16}), reserve=8)
    evicting = Continuation.after(model, done)
    with torch.no_grad():
        for token in targets:
            evicting.feed(token)
    assert done.kv_length == 16 and evicting.entries == 16
