"""Every registered method through every entry point, with its fields set by `--set`.

A tiny random Llama with a word-level tokenizer (and a chat template) is saved to a folder once and
loaded by path, so `kvsieve generate --method NAME --json`, `niah`, `ppl` and the bench worker run
every method of the registry in seconds.
"""

from __future__ import annotations

import json

import pytest
from conftest import build_model, word_level_tokenizer

import kvsieve.engine.scheduler
from kvsieve import REGISTRY, method
from kvsieve.cli import main
from kvsieve.eval import bench as bench_module

TEMPLATE = (
    "{% for m in messages %}<s> question {{ m['content'] }} </s>{% endfor %}"
    "{% if add_generation_prompt %} answer{% endif %}"
)
# --set values that fit a 160-token prompt; each is given only where the method has the field.
SETTINGS = {
    "select.k": "48",
    "select.layer": "1",
    "feed.chunk": "48",
    "feed.memory": "40",
    "attention.segment": "16",
    "attention.block": "4",
    "attention.budget": "16",
    "compress.budget": "40",
    "evict.budget": "40",
}


def sets(name: str) -> list[str]:
    spec = method(name)
    return [arg for path, value in SETTINGS.items() if spec.has(path) for arg in ("--set", f"{path}={value}")]


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llama")
    build_model("llama", num_layers=3, max_positions=1024).save_pretrained(folder)
    tokenizer = word_level_tokenizer()
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("name", list(REGISTRY))
def test_generate_json_runs_every_method_with_its_fields_set(name, tiny_folder, tmp_path, capsys, single_thread):
    context = tmp_path / "context.txt"
    context.write_text(" ".join(["the pass key is hello world"] * 25))
    argv = ["generate", "--model", str(tiny_folder), "-c", str(context), "-q", "what is the pass key"]
    code = main([*argv, "--method", name, *sets(name), "--max-new-tokens", "3", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and len(out["tokens"]) == 3
    expected = method(name).with_settings([(p, v) for p, v in SETTINGS.items() if method(name).has(p)])
    assert out["method"] == expected.to_dict()  # the result records the exact spec it ran
    if name not in ("full", "critiprefill", "critiprefill-code"):
        assert out["prefill_kv_length"] <= 4 + 48


def test_niah_ppl_and_bench_run_every_method(tiny_folder, tmp_path, capsys, monkeypatch, single_thread):
    names = ",".join(REGISTRY)
    settings = [arg for path, value in SETTINGS.items() for arg in ("--set", f"{path}={value}")]
    common = ["--model", str(tiny_folder), "--methods", names, *settings, "--lengths", "160"]
    niah = tmp_path / "niah.json"
    argv = ["niah", *common, "--depths", "0.5", "--max-new-tokens", "2", "--out", str(niah)]
    assert main(argv) == 0  # heatmaps: test_eval (one PNG per method, 0.5 s each)
    rows = json.loads(niah.read_text())["rows"]
    assert [r["method"] for r in rows] == list(REGISTRY)
    ppl = tmp_path / "ppl.json"
    assert main(["ppl", *common, "--tokens", "4", "--out", str(ppl)]) == 0
    saved = json.loads(ppl.read_text())
    assert [r["method"] for r in saved["rows"]] == list(REGISTRY)
    assert saved["settings"]["methods"]["tova"]["evict"]["budget"] == 40
    # The bench worker, in this process (the subprocess around it is tested on the real model).
    measured = []
    monkeypatch.setattr(bench_module, "run_in_process", lambda c: measured.append(c) or bench_module.measure(c))
    bench = tmp_path / "bench.json"
    assert main(["bench", *common, "--repeats", "1", "--decode-tokens", "2", "--out", str(bench)]) == 0
    capsys.readouterr()
    assert [c.spec["name"] for c in measured] == list(REGISTRY)
    assert {r["method"]: r["prefill_kv_length"] for r in json.loads(bench.read_text())["rows"]}["knorm"] == 40


def every_token_is_eos(model, tokenizer) -> set[int]:
    return set(range(model.config.vocab_size))


def test_bench_times_the_same_number_of_steps_for_every_method(tiny_folder, monkeypatch):
    """A bench run decodes exactly decode_tokens tokens even where the model emits EOS at once."""
    monkeypatch.setattr(kvsieve.engine.scheduler, "eos_token_ids", every_token_is_eos)
    for name in ("full", "h2o"):
        spec = method(name, {"evict.budget": 64} if name == "h2o" else {}).to_dict()
        row = bench_module.measure(bench_module.BenchConfig(spec, 200, decode_tokens=4, model=str(tiny_folder)))
        assert row["generated_tokens"] == 4


def test_generate_ignore_eos_flag(tiny_folder, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(kvsieve.engine.scheduler, "eos_token_ids", every_token_is_eos)
    context = tmp_path / "context.txt"
    context.write_text("the pass key is hello world")
    argv = ["generate", "--model", str(tiny_folder), "-c", str(context), "--max-new-tokens", "3", "--json"]
    assert main(argv) == 0
    assert len(json.loads(capsys.readouterr().out)["tokens"]) == 1  # every token is EOS here
    assert main([*argv, "--ignore-eos"]) == 0
    assert len(json.loads(capsys.readouterr().out)["tokens"]) == 3


def test_a_command_builds_the_kernels_before_the_prompt_is_timed(tiny_folder, tmp_path, capsys, monkeypatch):
    """The CPU kernels' first build (about 11 s on a fresh machine) happens after loading, before the prompt, so
    it is never counted in a time to first token; it says so on stderr when it took over a second."""
    import kvsieve.engine
    import kvsieve.kernels.native

    order, generate = [], kvsieve.engine.generate
    monkeypatch.setattr(kvsieve.kernels.native, "build_kernels", lambda model: order.append("kernels") or 10.4)
    monkeypatch.setattr(kvsieve.engine, "generate", lambda *a, **k: order.append("prompt") or generate(*a, **k))
    context = tmp_path / "context.txt"
    context.write_text("the pass key is hello world")
    assert main(["generate", "--model", str(tiny_folder), "-c", str(context), "--max-new-tokens", "2"]) == 0
    assert order == ["kernels", "prompt"]
    assert "built the CPU's C++ decoding kernels in 10.4 s (once per machine)" in capsys.readouterr().err
    monkeypatch.setattr(kvsieve.kernels.native, "build_kernels", lambda model: 0.01)  # built before: nothing said
    assert main(["generate", "--model", str(tiny_folder), "-c", str(context), "--max-new-tokens", "2"]) == 0
    assert "kernels" not in capsys.readouterr().err


def test_bench_runs_each_configuration_in_its_own_process(tiny_folder, tmp_path, capsys, monkeypatch):
    """The real worker subprocess (peak RSS of its own) for GemFilter, ratios against a chosen baseline within a
    repeat. The baseline is measured in this process: each worker spends about 10 s importing transformers."""
    real = bench_module.run_in_process
    spawned = []

    def run_in_process(config: bench_module.BenchConfig) -> dict:
        if config.spec["name"] == "fm":
            return bench_module.measure(config)
        spawned.append(config.spec["name"])
        return real(config)

    monkeypatch.setattr(bench_module, "run_in_process", run_in_process)
    out = tmp_path / "bench.json"
    base = ["bench", "--model", str(tiny_folder), "--lengths", "300", "--repeats", "1", "--decode-tokens", "3"]
    base += ["--out", str(out)]
    argv = [*base, "--set", "feed.chunk=64", "--set", "feed.memory=32"]
    assert main([*argv, "--set", "select.k=64", "--methods", "fm,gemfilter", "--baseline", "fm"]) == 0
    printed = capsys.readouterr().out
    assert "speedup vs fm" in printed
    rows = {r["method"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["fm"]["prefill_kv_length"] == 4 + 32  # the sinks and the memory
    gem = rows["gemfilter"]  # the k selected tokens after prefill, then one more per decoded token but the last
    assert gem["prefill_kv_length"] == 64 and gem["kv_cache_length"] == 64 + gem["generated_tokens"] - 1
    assert all(r["peak_mb"] > 50 and r["ttft_s"] > 0 for r in rows.values())
    summary = {s["method"]: s for s in bench_module.summarize(list(rows.values()), "fm")}
    assert summary["fm"]["speedup"] == (1.0, 1.0, 1.0) and summary["gemfilter"]["speedup"] is not None
    assert spawned == ["gemfilter"]
    assert main([*argv, "--methods", "fm,imdc"]) == 2
    assert "--baseline full is not among" in capsys.readouterr().err
    assert main([*base, "--methods", "full,snapkv", "--set", "compress.budget=0.5", "--fresh"]) == 2
    assert "token counts" in capsys.readouterr().err
