"""The two kinds of KV policy, and PyramidKV, the policy written to show that a new one is one short file.

Every registered policy is a prompt scorer or a per-step rule, never both; each kind's defaults give the stages
exactly what the policies declared by hand before. PyramidKV's budgets follow the paper's allocation: falling
linearly over the budgeted layers, the budget on average, and only in the compress stage.
"""

from __future__ import annotations

import pytest
import torch
from conftest import FakeTokenizer, make_prompt

from kvsieve import Compress, Evict, Sampling, method, run
from kvsieve.compress.policies.pyramidkv import PyramidKV
from kvsieve.compress.policy import PromptScorer, StepRule
from kvsieve.errors import KvsieveError
from kvsieve.spec import components


def test_every_registered_policy_is_exactly_one_kind():
    kinds = {
        name: (issubclass(cls, PromptScorer), issubclass(cls, StepRule)) for name, cls in components("policy").items()
    }
    assert {name for name, (scorer, rule) in kinds.items() if scorer == rule} == set()
    assert {name for name, (_, rule) in kinds.items() if rule} == {"h2o", "a2sf"}
    assert "pyramidkv" in kinds


@pytest.mark.parametrize(
    "name, decodes, reads_row",
    [("h2o", True, True), ("a2sf", True, True), ("tova", True, True), ("knorm", True, False),
     ("streaming", True, False), ("local", True, False), ("snapkv", False, False), ("collie", False, False),
     ("pyramidkv", False, False)],
)  # fmt: skip
def test_each_kind_tells_the_stages_what_its_policies_do(name, decodes, reads_row):
    policy = components("policy")[name]()
    assert policy.decodes is decodes and policy.step_reads_attention is reads_row
    assert policy.budgets_per_layer is (name == "pyramidkv")


def test_a_prompt_scorer_that_rescores_evicts_with_the_newest_query_alone():
    """KNorm declares only its prompt scores and `rescores`: a decoding step scores the keys again."""
    knorm = components("policy")["knorm"]()
    key = torch.randn(2, 9, 8)
    assert torch.equal(knorm.step_scores(None, torch.randn(4, 1, 8), key, 8**-0.5), -key.norm(dim=-1))


def test_pyramidkv_budgets_fall_linearly_and_average_the_budget():
    policy, layers = PyramidKV(), list(range(8))
    budgets = [policy.layer_budget(256, j, layers) for j in layers]
    steps = {a - b for a, b in zip(budgets, budgets[1:], strict=False)}
    assert len(steps) == 1 and steps.pop() > 0  # linear, falling
    share = 256 - policy.window
    assert policy.window + share // policy.beta <= budgets[-1] < policy.window + share // policy.beta + len(layers)
    assert 256 <= sum(budgets) / len(budgets) < 256 + len(layers)  # the average (the step is rounded down)
    assert PyramidKV().layer_budget(256, 3, [3]) == 256  # one budgeted layer: the budget
    assert (
        policy.layer_budget(256, 4, [0, 4, 8])
        == budgets[0] - (budgets[0] - policy.layer_budget(256, 8, [0, 4, 8])) // 2
    )


def test_pyramidkv_compresses_each_layer_to_its_own_budget(make_model):
    model = make_model("llama", num_layers=4)
    policy = PyramidKV(window=4)
    result = run(model, FakeTokenizer(), make_prompt(120), compress=Compress(policy, 40), sampling=Sampling(2))
    # budget 40, window 4: share 36, top layer 36 // 20 = 1, bottom 2 * 36 - 1 = 71, step (71 - 1) // 3 = 23
    expected = [4 + 71, 4 + 48, 4 + 25, 4 + 2]
    assert [int(k.shape[-1]) for k in result.state.compress.kept_positions] == expected
    assert next(s for s in result.stages if s.stage == "compress").details["layer_entries"] == expected
    assert expected[0] > 40 > expected[-1]
    kept = result.state.compress.kept_positions
    assert all(set(range(116, 120)) <= set(k[0].tolist()) for k in kept)  # the observation window is kept


def test_pyramidkv_budgets_only_the_global_layers_of_a_hybrid_model(make_model):
    model, prompt = make_model("gemma3", num_layers=6), make_prompt(150)
    full = run(model, FakeTokenizer(), prompt, sampling=Sampling(1)).state.prefilled.cache
    compress = Compress(PyramidKV(window=4), 40)
    result = run(model, FakeTokenizer(), prompt, compress=compress, sampling=Sampling(1))
    entries = next(s for s in result.stages if s.stage == "compress").details["layer_entries"]
    sliding = [j for j, kind in enumerate(model.config.layer_types) if kind == "sliding_attention"]
    glob = [j for j in range(6) if j not in sliding]
    assert sliding and all(entries[j] == full.layers[j].keys.shape[2] for j in sliding)  # never budgeted
    assert [entries[j] for j in glob] == [compress.policy.layer_budget(40, j, glob) for j in glob]
    assert entries[glob[0]] > 40 > entries[glob[-1]]


def test_pyramidkv_is_refused_where_one_budget_serves_every_layer():
    with pytest.raises(KvsieveError, match="one budget for every layer"):
        Evict(PyramidKV())
    with pytest.raises(KvsieveError, match="budget of its own"):
        method("imdc", {"feed.pruner": "pyramidkv"})
    assert method("pyramidkv", {"compress.budget": 0.25}).compress.policy == PyramidKV()
