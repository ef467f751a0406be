"""The CPU's compiled decoding step (`engine.static_step.compiled_steps`, `DecodeBatch(compiled=True)`).

It runs up to COMPILED_ROWS rows, evicting ones at their budget included. It must give the ordinary step's logits
(up to the order of float32 sums) while the tables grow and rows join and leave, compile once for one row and once
for several (not per step, capacity or row count), give another model its own logits (other weights, int8
weights under bfloat16), trace evicting rows' observers into the step (a batch with a row under its budget steps the
ordinary way until the row reaches it), and run eagerly, with one warning, where compiling fails.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from conftest import WINDOW, build_model, make_prompt

from kvsieve import fast_paths, method
from kvsieve.compiled import Compiled
from kvsieve.engine import static_step as static_step_module
from kvsieve.engine.batch import SPARE, DecodeBatch, Row, warm_up
from kvsieve.engine.pipeline import PrefillResult, prefill
from kvsieve.kv.cache import wrap_cache
from kvsieve.models import architecture
from kvsieve.quantize import quantize

# The float32 model's step is compiled once per worker process (about 10 s with an empty inductor cache): the
# tests that need it run in one worker (`--dist loadgroup`).
SAME_WORKER = pytest.mark.xdist_group("compiled_float_step")

CASES = [  # the first decodes alone, then the others join; none evicts
    ("full", {}, 40),
    ("snapkv", {"compress.budget": 24, "compress.policy.window": 4}, 70),
    ("imdc", {"feed.chunk": 16, "feed.memory": 24, "feed.schedule": "square-sqrt"}, 90),  # layers of many sizes
]


@pytest.fixture
def model(single_thread):
    return build_model("llama", num_layers=2, max_positions=512)


def prefilled(model, cases, reserve: int) -> list[PrefillResult]:
    return [prefill(model, make_prompt(n, seed=n), method=method(name, s), reserve=reserve) for name, s, n in cases]


def decode(
    model, done: list[PrefillResult], tokens: list[int], compiled: bool | None = None, join_at: int = 3
) -> tuple[list, int]:
    """Teacher-forced steps: the first prefill alone, the others joining at step `join_at` and leaving five steps
    later; each step's logits and how many steps were static. `compiled` None: the batch's default."""
    batch, logits, rows, static = DecodeBatch(model, static=compiled, compiled=compiled), [], [], 0

    def join(d: PrefillResult) -> None:
        layers = [(layer.keys.clone(), layer.values.clone()) for layer in d.prefilled.cache.layers]
        rows.append(Row(0, d.prefilled.next_position, copy.deepcopy(d.state.evict)))
        batch.add(rows[-1], wrap_cache(model, layers))

    join(done[0])
    for i, token in enumerate(tokens):
        if i == join_at:
            for d in done[1:]:
                join(d)
        if i == join_at + 5:
            batch.remove(rows[1:])
        for row in batch.rows:
            row.token = token
        logits.append(batch.step())
        static += batch.static_step is not None
    return logits, static


def unique_graphs() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


@SAME_WORKER
def test_compiled_steps_give_the_ordinary_steps_logits_and_compile_once(model):
    """One row alone for more steps than the tables' spare room (rebuilt: a new capacity), then two rows of other
    lengths join for five steps (padded rows) and leave: every step's logits agree with the ordinary step's, every
    step is compiled, and the whole run compiles at most two graphs (one row, several; none where an earlier test
    compiled this model's steps), whatever capacities it meets; a model with other weights gets its own logits
    from them."""
    steps = SPARE + 20
    done = prefilled(model, CASES, reserve=steps + 8)
    tokens = torch.randint(3, 200, (steps,), generator=torch.Generator().manual_seed(5)).tolist()
    eager, eager_static = decode(model, done, tokens, compiled=False, join_at=SPARE + 5)
    before = unique_graphs()
    compiled, compiled_static = decode(model, done, tokens, compiled=True, join_at=SPARE + 5)
    assert eager_static == 0 and compiled_static == steps
    assert unique_graphs() - before <= 2
    for a, b in zip(eager, compiled, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
    # another model of the same architecture: its parameters are the graph's inputs, so the graph serves it too
    other = build_model("llama", num_layers=2, max_positions=512, seed=1)
    done = prefilled(other, CASES[:1], reserve=20)
    eager, _ = decode(other, done, tokens[:10], compiled=False)
    compiled, _ = decode(other, done, tokens[:10], compiled=True)
    assert unique_graphs() - before <= 2
    for a, b in zip(eager, compiled, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)


def test_int8_weights_under_bfloat16_get_their_own_logits(model):
    """The compiled step skips some of dynamo's guards on the model's modules; a model with int8 weights and
    bfloat16 activations (its int8 product traced into the step) gets a graph of its own and its own logits.
    Inductor keeps a fused kernel's intermediates in float32 where eager rounds every operator's output to
    bfloat16: logits of magnitude up to ~10 differ by a few of their bfloat16 steps (0.03-0.06)."""
    other = quantize(build_model("llama", num_layers=2, max_positions=512, seed=2).to(torch.bfloat16), "int8")
    done = prefilled(other, CASES[:1], reserve=20)
    tokens = list(range(5, 15))
    eager, _ = decode(other, done, tokens, compiled=False)
    compiled, static = decode(other, done, tokens, compiled=True)
    assert static == len(tokens)
    for a, b in zip(eager, compiled, strict=True):
        assert b.dtype == torch.bfloat16
        torch.testing.assert_close(b, a, rtol=1e-1, atol=1e-1)


EVICTING = [  # an H2O row under its budget, a second H2O row (the two scored together) and an A2SF row
    ("h2o", {"evict.budget": 30}, 20),
    ("h2o", {"evict.budget": 30}, 61),
    ("a2sf", {"evict.budget": 24}, 47),
]


def test_evicting_rows_are_compiled_with_their_observers_once_at_their_budget(single_thread, monkeypatch, caplog):
    """Rows that evict every step at their budget: their policies' observers are traced into the compiled step and
    their compaction runs after it. The first row's prompt (20 tokens) is under its budget (30): the batch steps the
    ordinary way for the 10 steps it takes to reach it, then every step is compiled (one graph; dynamo is called
    for the first only, the rest call the code its guards chose, the row's scores carried between them), and every
    step's logits are the ordinary step's (so each compiled step evicted the same entries). The model is a hybrid
    one (Qwen2 with its window on: a global layer, then a sliding layer of 8): the compiled step writes the sliding
    layer's entries round its ring, whose column wraps at the window, while the rows evict from the global layer."""
    model = build_model("qwen2-window", num_layers=2, max_positions=512)
    assert architecture(model).windows == (None, WINDOW)
    tokens = list(range(5, 21))
    done = prefilled(model, EVICTING, reserve=len(tokens) + 8)
    eager, eager_static = decode(model, done, tokens, compiled=False, join_at=0)
    before, calls, call = unique_graphs(), [], Compiled.__call__
    monkeypatch.setattr(Compiled, "__call__", lambda self, *args: calls.append(1) or call(self, *args))
    with caplog.at_level(logging.WARNING):
        compiled, static = decode(model, done, tokens, compiled=True, join_at=0)
    assert eager_static == 0 and static == len(tokens) - 10 and len(calls) == 1
    assert "compiling failed" not in caplog.text
    assert unique_graphs() - before <= 1
    for a, b in zip(eager, compiled, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)


@SAME_WORKER
def test_a_static_step_calls_dynamo_once(model, monkeypatch):
    """A static step's first compiled step goes through dynamo; from its second on, it calls the compiled code that
    dynamo's guards choose for the second step's arguments directly (`Compiled.bound`), until rows join or leave
    (or the tables grow) and a new static step checks the guards again. Every step's logits stay the ordinary
    step's (an evicting row's: `test_evicting_rows_are_compiled_with_their_observers_once_at_their_budget`)."""
    calls, call = [], Compiled.__call__
    monkeypatch.setattr(Compiled, "__call__", lambda self, *args: calls.append(1) or call(self, *args))
    tokens = list(range(5, 17))
    done = prefilled(model, CASES, reserve=len(tokens) + 8)
    eager, _ = decode(model, done, tokens, compiled=False)
    calls.clear()
    compiled, static = decode(model, done, tokens, compiled=True)
    assert static == len(tokens) and len(calls) == 3  # one row; three from step 3; one again from step 8
    for a, b in zip(eager, compiled, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)


def test_bound_runs_the_compiled_code_its_arguments_select(monkeypatch):
    """`Compiled.bound` returns the compiled code that dynamo would run for its arguments, callable without the guard
    check; None for arguments no compiled code accepts, for code with a graph break (the rest would run eagerly) and
    where torch has no list of dynamo's cache entries (then every call goes through dynamo). Compiled with dynamo's
    eager backend, which compiles nothing: `bound` reads dynamo's cache entries, whichever backend made them."""
    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda function, dynamic, options: real_compile(function, backend="eager"))

    factor = 2.0

    def scaled(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:  # a closure: `factor`
        return x * factor + y

    def broken(x: torch.Tensor) -> torch.Tensor:
        x = x + 1
        torch._dynamo.graph_break()
        return x * 2

    compiled, x, y = Compiled("scaled", scaled), torch.randn(5), torch.randn(5)
    assert compiled.bound(x, y) is None  # nothing compiled yet
    torch.testing.assert_close(compiled(x, y), x * 2 + y)
    run = compiled.bound(x, y)
    other = torch.randn(5), torch.randn(5)
    torch.testing.assert_close(run(*other), other[0] * 2 + other[1])
    assert compiled.bound(x.to(torch.float64), y) is None  # the guards of the float32 code reject it
    with_break = Compiled("broken", broken)
    torch.testing.assert_close(with_break(x), (x + 1) * 2)
    assert with_break.bound(x) is None
    monkeypatch.delattr(torch._C._dynamo.eval_frame, "_debug_get_cache_entry_list")
    assert compiled.bound(x, y) is None


def test_a_failed_compile_runs_the_step_eagerly(model, monkeypatch, caplog):
    monkeypatch.setattr(static_step_module, "compiled_steps", Compiled("decoding step", static_step_module.model_step))

    def broken(*args, **kwargs):
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(torch, "compile", broken)
    done = prefilled(model, CASES[:1], reserve=20)
    tokens = list(range(5, 10))
    eager, _ = decode(model, done, tokens, compiled=False)
    with caplog.at_level(logging.WARNING, logger="kvsieve.compiled"):
        compiled, static = decode(model, done, tokens, compiled=True)
    assert static == len(tokens) and caplog.text.count("no compiler here") == 1
    for a, b in zip(eager, compiled, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


@SAME_WORKER
def test_warm_up_compiles_the_steps_a_server_will_run(model, monkeypatch):
    """With compiled steps on (`--compile-steps`: the switch `compiled_steps`, `kvsieve.fast_paths`), `warm_up` (what
    `kvsieve serve` runs before answering) compiles the step for one row and for several; requests' steps after
    it (one row, then three) compile nothing more. Off, batches step the ordinary way."""
    monkeypatch.setattr(fast_paths, "_current", fast_paths.FastPaths())  # the defaults; restored after the test
    assert not DecodeBatch(model).compiled and not DecodeBatch(model).static
    fast_paths.configure(compiled_steps=True)  # what the CLI's --compile-steps does
    assert DecodeBatch(model).compiled and DecodeBatch(model).static
    compiled_steps, calls, call = static_step_module.compiled_steps, [], Compiled.__call__
    monkeypatch.setattr(Compiled, "__call__", lambda self, *args: calls.append(1) or call(self, *args))
    warm_up(model)
    assert calls and compiled_steps.compiled is not None  # the warm-up ran (and so compiled) the compiled step
    warmed = unique_graphs()
    done = prefilled(model, CASES, reserve=30)
    logits, static = decode(model, done, list(range(5, 25)))
    assert static == 20 and unique_graphs() == warmed
