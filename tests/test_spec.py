"""The method spec and registry: one definition per name, JSON round trips, `--set` paths and their errors."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from kvsieve import A2SF, REGISTRY, TOVA, CritiPrefill, Evict, KvsieveError, MethodSpec, SnapKV, method
from kvsieve.compress.policies.collie import Collie
from kvsieve.compress.policies.kvzip import KVzip
from kvsieve.select.gemfilter import GemFilter
from kvsieve.spec import component, components, parse_settings

EXPECTED = ["full", "gemfilter", "gemfilter-paper", "critiprefill", "critiprefill-code", "fm", "fm-paper", "im"]
EXPECTED += ["im-paper", "imdc", "imdc-paper", "snapkv"]
EXPECTED += ["snapkv-paper", "pyramidkv", "expected-attention", "kvzip", "kvzip-pooled", "adakv"]
EXPECTED += ["adakv-expected-attention"]
EXPECTED += ["h2o", "a2sf", "a2sf-paper", "streaming", "local", "tova", "knorm"]
EXPECTED += ["gemfilter-critiprefill", "gemfilter-snapkv"]


def test_registry_holds_the_presets_with_their_stages_and_provenance():
    assert list(REGISTRY) == EXPECTED
    assert method("gemfilter").select.k == 1024 and method("critiprefill").attention == CritiPrefill()
    recommended = method("gemfilter").select  # beyond the paper, chosen by the needle study
    assert (recommended.queries, recommended.softmax, recommended.block) == (32, True, 64)
    assert (GemFilter().queries, GemFilter().softmax, GemFilter().block) == (1, False, 1)  # the paper's
    code = method("critiprefill-code").attention  # the reference code's run scripts
    assert (code.budget, code.alpha, code.dense_prefix) == (2048, 0.75, 4096)
    assert method("imdc").feed.decremental and method("imdc").feed.schedule == "linear"
    assert method("fm").feed.schedule == "fixed" and not method("fm").feed.decremental
    for name in ("fm", "im", "imdc"):  # tuned: the question's SnapKV votes prune; -paper: the authors' Collie
        tuned, paper = method(name).feed, method(f"{name}-paper").feed
        assert tuned.pruner == SnapKV(pool_size=63) and tuned.question_guided
        assert paper.pruner == Collie() and not paper.question_guided
        assert replace(tuned, pruner=Collie(), question_guided=False) == paper
    assert method("snapkv").compress.policy == SnapKV(pool_size=63) and method("snapkv").evict is None
    assert method("adakv").compress == replace(method("snapkv").compress, head_budgets=True)  # AdaKV on the tuned votes
    assert method("adakv-expected-attention").compress == replace(
        method("expected-attention").compress, head_budgets=True
    )
    assert not method("snapkv").compress.head_budgets and method("adakv").compress.head_floor == 0.2
    assert method("kvzip-pooled").compress == replace(method("kvzip").compress, policy=KVzip(pool_size=5))
    assert method("a2sf").evict.policy == A2SF(alpha=0.9, pool_size=63)  # the study's best at the preset budget
    assert method("a2sf-paper").evict.policy == A2SF() and method("snapkv-paper").compress.policy == SnapKV()
    assert method("gemfilter-paper").select == GemFilter()
    assert all(spec.summary.endswith("]") for spec in REGISTRY.values() if spec.name != "full")  # provenance
    assert (SnapKV().pool_size, A2SF().alpha, A2SF().pool_size) == (5, 0.2, 1)  # the classes keep the papers' values
    assert method("h2o").evict.policy.name == "h2o" and method("h2o").compress is None
    assert method("tova").evict.policy == TOVA()
    both = method("gemfilter-critiprefill")  # combinations build on the tuned presets' stages
    assert both.select == method("gemfilter").select and both.attention == CritiPrefill()
    snap = method("gemfilter-snapkv")
    assert snap.select == replace(method("gemfilter").select, k=2048) and snap.compress.budget == 1024
    assert snap.compress.policy == method("snapkv").compress.policy


@pytest.mark.parametrize("name", EXPECTED)
def test_every_spec_round_trips_through_json(name):
    spec = REGISTRY[name]
    assert MethodSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec
    changed = spec.with_settings([(f.path, f.default) for f in spec.fields() if not isinstance(f.default, dict)])
    assert changed == spec  # every listed default parses back to itself


def test_specs_say_what_their_stages_can_do():
    """The capabilities the engine and the server ask a method about, read off its stages (one_pass: no chunked
    feed; continues_prefix: a stored prefix can be extended; prompt_logprobs: every position's logits)."""
    expected = {  # name: (one_pass, continues_prefix, prompt_logprobs)
        "full": (True, True, True),
        "snapkv": (True, True, True),
        "a2sf": (True, True, True),
        "gemfilter": (True, True, False),
        "critiprefill": (True, False, False),
        "gemfilter-critiprefill": (True, False, False),
        "imdc": (False, False, False),
        "fm-paper": (False, False, False),
    }
    for name, flags in expected.items():
        spec = method(name)
        assert (spec.one_pass, spec.continues_prefix, spec.prompt_logprobs) == flags, name
    assert MethodSpec("bare").prompt_logprobs  # no stage at all: the one-pass feed


@pytest.mark.parametrize("name", EXPECTED)
def test_every_spec_describes_itself_in_one_line(name):
    """`describe` is one line (a row of `kvsieve methods` and of the report's tables), KVzip's prompts included."""
    text = REGISTRY[name].describe()
    assert "\n" not in text and text.isprintable()
    if name == "kvzip":
        assert "first='\\n\\nRepeat the previous context exactly.'" in text


def test_settings_change_nested_fields_and_whole_stages():
    spec = method("imdc", [("feed.pruner", "a2sf"), ("feed.pruner.alpha", "0.5"), ("feed.chunk", "512")])
    assert spec.feed.pruner.alpha == 0.5 and spec.feed.chunk == 512 and spec.feed.decremental
    combined = method("gemfilter", {"attention": "critiprefill", "attention.budget": 2048, "evict": "a2sf"})
    assert combined.attention.budget == 2048 and isinstance(combined.evict, Evict)
    assert combined.stages().keys() == {"select", "attention", "evict"}
    assert method("snapkv", {"compress.budget": "0.25"}).compress.budget == 0.25  # a fraction
    assert method("snapkv", {"compress.budget": "256"}).compress.budget == 256  # a count
    assert method("gemfilter", {"select.layer": "calibrated"}).select.layer == "calibrated"
    assert method("gemfilter", {"select.layer": "none"}).select.layer is None
    assert method("gemfilter", {"select.keep_tail": "false"}).select.keep_tail is False
    assert method("critiprefill", {"attention": "none"}).attention is None
    assert REGISTRY["snapkv"].compress.budget == 1024  # presets are never changed


@pytest.mark.parametrize(
    ("name", "settings", "message"),
    [
        ("snapkv", {"compress.budget": "lots"}, "compress.budget: 'lots' is not a count"),
        ("snapkv", {"compress.budget": 1.5}, "not a fraction"),
        ("snapkv", {"compress.window": 8}, "compress has no field 'window'; its fields are: policy, budget"),
        ("snapkv", {"compress.policy": "pyramid"}, "unknown policy 'pyramid'; choose one of"),
        ("snapkv", {"attention.budget": 8}, "has no attention stage; add one first with --set attention="),
        ("snapkv", {"budget": 8}, "a path starts with a stage"),
        ("snapkv", {"compress.budget.x": 8}, "is a plain value"),
        ("fm", {"feed.schedule": "cubic"}, "one of fixed, linear, sqrt"),
        ("critiprefill", {"attention.alpha": "2"}, "alpha must be between 0 and 1"),
        ("critiprefill", {"attention.segment": True}, "is not a whole number"),
        ("gemfilter", {"select.keep_tail": "maybe"}, "is not true or false"),
        ("snapkv", {"evict": "snapkv"}, "no per-step eviction rule"),
        ("snapkv", {"attention": "sparse"}, "not one of none, critiprefill"),
        ("nope", {}, "Unknown method 'nope'; choose one of: full, gemfilter"),
    ],
)
def test_bad_settings_say_what_is_valid(name, settings, message):
    with pytest.raises(KvsieveError, match=message.replace("(", r"\(").replace(".", r"\.")):
        method(name, settings)


def test_bad_spec_documents_are_refused():
    with pytest.raises(KvsieveError, match="'type'"):
        MethodSpec.from_dict({"name": "x", "compress": {"budget": 3}})
    with pytest.raises(KvsieveError, match="Unknown method spec keys"):
        MethodSpec.from_dict({"name": "x", "decode": None})
    with pytest.raises(KvsieveError, match="unknown compress 'evict'"):
        MethodSpec.from_dict({"name": "x", "compress": {"type": "evict"}})
    with pytest.raises(KvsieveError, match="Method .x.: .* is not a compress component"):
        MethodSpec("x", compress=Evict())
    with pytest.raises(KvsieveError, match="PATH=VALUE"):
        parse_settings(["compress.budget"])
    assert parse_settings(["a.b = 3", "c=x=y"]) == [("a.b", "3"), ("c", "x=y")]


def test_fields_describe_every_path_with_default_and_help():
    infos = {f.path: f for f in method("imdc-paper").fields()}
    assert infos["feed.chunk"].default == 1024 and "chunk size" in infos["feed.chunk"].help
    assert infos["feed.pruner"].default == "collie" and "tova" in infos["feed.pruner"].type
    assert infos["feed.pruner.pool_size"].default == 5 and infos["feed.pruner.sinks"].default == 4
    assert "feed.pruner.window" in {f.path for f in method("imdc-paper", {"feed.pruner": "snapkv"}).fields()}
    assert {f.path: f for f in method("imdc").fields()}["feed.pruner.pool_size"].default == 63
    assert method("snapkv").has("compress.policy.window") and not method("h2o").has("compress.budget")
    assert not method("snapkv").has("compress.policy.alpha") and method("h2o").has("attention")


def test_a_new_component_is_usable_everywhere_once_registered():
    """What 'one module plus one registry line' relies on: components register themselves by tag."""
    from dataclasses import dataclass

    from kvsieve.compress.policy import Policy
    from kvsieve.registry import register

    @component("test-oldest", "policy")
    @dataclass(frozen=True)
    class Oldest(Policy):
        """Keeps the oldest tokens: score = minus the position."""

        def prompt_scores(self, seen):
            import torch

            key = seen.key
            return -torch.arange(key.shape[1], device=key.device, dtype=torch.float32).expand(key.shape[0], -1)

    try:
        spec = register(
            MethodSpec("test-oldest", "oldest tokens", compress=method("snapkv").compress.__class__(Oldest()))
        )
        assert method("test-oldest", {"compress.budget": 8}).compress.budget == 8
        assert method("fm", {"feed.pruner": "test-oldest"}).feed.pruner == Oldest()
        assert MethodSpec.from_dict(spec.to_dict()) == spec
    finally:
        REGISTRY.pop("test-oldest", None)
        from kvsieve import spec as spec_module

        spec_module._COMPONENTS.pop("test-oldest", None)
    assert "test-oldest" not in components("policy")


RENAMED = "'kernel' is now called 'pool_size'"


def test_a_renamed_field_keeps_its_old_name_for_one_release_with_a_warning():
    """`kernel` became `pool_size` (CHANGELOG.md). A `--set` path, a spec's dict form (what a server request or an
    older result file holds), a constructor keyword and an attribute read under the old name still work, each
    warning with the new name; `has` answers for it; giving both names is refused."""
    with pytest.warns(FutureWarning, match=RENAMED):
        assert method("snapkv", {"compress.policy.kernel": 31}).compress.policy.pool_size == 31
    data = method("a2sf").to_dict()
    data["evict"]["policy"]["kernel"] = data["evict"]["policy"].pop("pool_size")
    with pytest.warns(FutureWarning, match=RENAMED):
        assert MethodSpec.from_dict(data) == method("a2sf")
    with pytest.warns(FutureWarning, match=RENAMED):
        assert SnapKV(kernel=7) == SnapKV(pool_size=7) and Collie(kernel=3).pool_size == 3
    with pytest.warns(FutureWarning, match=RENAMED):
        assert GemFilter().kernel == 5
    assert method("gemfilter").has("select.kernel") and method("gemfilter").has("select.pool_size")
    with pytest.raises(TypeError, match="both"):
        SnapKV(kernel=7, pool_size=7)
    assert "kernel" not in json.dumps(method("a2sf").to_dict())  # what is written is the new name


def test_renamed_names_of_the_python_api_warn_and_still_work():
    """`attention_hooks(kernel=...)` (now `prefill=`), `RunState.kernel` (now `attention`) and the classes
    `pipeline.Prefill` (`PrefillResult`) and `feed.Prefilled` (`FeedOutput`) answer under their old names too."""
    import kvsieve.engine.pipeline as pipeline
    import kvsieve.feed as feed
    from kvsieve.attention import Hooks, _active, attention_hooks

    def attend(layer, query, key, value, scaling):
        return query

    with pytest.warns(FutureWarning, match="'kernel' is now called 'prefill'"), attention_hooks(kernel=attend):
        assert (_active.get() or Hooks()).prefill is attend
    with pytest.warns(FutureWarning, match="'kernel' is now called 'attention'"):
        assert pipeline.RunState(attention="critiprefill's run").kernel == "critiprefill's run"
    with pytest.warns(FutureWarning, match="PrefillResult"):
        assert pipeline.Prefill is pipeline.PrefillResult
    with pytest.warns(FutureWarning, match="FeedOutput"):
        assert feed.Prefilled is feed.FeedOutput


def test_the_moved_pipeline_module_answers_its_old_path_warning():
    """`kvsieve.pipeline` moved under `kvsieve.engine`; the old path gives the same objects for one release."""
    import kvsieve.pipeline as old
    from kvsieve import engine

    with pytest.warns(FutureWarning, match="'pipeline.prefill' is now called 'engine.prefill'"):
        assert old.prefill is engine.prefill
    with pytest.raises(AttributeError):
        old.no_such_name  # noqa: B018


@pytest.mark.parametrize(
    ("old", "new"), [("kvsieve.linear", "kvsieve.kernels.products"), ("kvsieve.native", "kvsieve.kernels.native")]
)
def test_the_moved_kernel_modules_answer_under_their_old_names(old, new):
    """The fast paths moved into `kvsieve.kernels` (CHANGELOG.md); the modules' old names import with a warning
    and hand out the same functions (`warm_up`, which PERFORMANCE.md documented under both)."""
    import importlib
    import sys

    sys.modules.pop(old, None)
    with pytest.warns(FutureWarning, match=new.replace(".", r"\.")):
        module = importlib.import_module(old)
    from kvsieve.kernels.native import build_kernels

    assert module.warm_up is build_kernels


def test_the_answer_grading_module_answers_under_its_old_name():
    """`kvsieve.eval.scoring` is `kvsieve.eval.grading` (`kvsieve.select.scoring` scores attention): the old name
    imports with a warning and hands out the same functions."""
    import importlib
    import sys

    from kvsieve.eval import grading

    sys.modules.pop("kvsieve.eval.scoring", None)
    with pytest.warns(FutureWarning, match=r"kvsieve\.eval\.grading"):
        module = importlib.import_module("kvsieve.eval.scoring")
    assert module.rouge1_recall is grading.rouge1_recall and module.contains is grading.contains
