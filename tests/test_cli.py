"""The kvsieve CLI on the real default model: each command's happy path and each bad input."""

import json

import pytest

import kvsieve.loading
from kvsieve.cli import main
from kvsieve.data import passkey_case

pytestmark = pytest.mark.real_model


@pytest.fixture(autouse=True)
def default_model_loaded_once(smollm, monkeypatch):
    """Commands that load the default model (no --model, --device, --dtype or --quantize) get the process's `smollm`.

    Each command would load it again (half a second, some 25 times); loading itself, offline from the
    converted cache, is tested in test_real_model. Any other model, device or dtype loads as usual.
    """
    load = kvsieve.loading.load_model

    def load_model(name_or_path=None, *, device=None, dtype=None, quantize=None):
        if name_or_path is None and device is None and dtype is None and quantize in (None, "none"):
            return smollm
        return load(name_or_path, device=device, dtype=dtype, quantize=quantize)

    monkeypatch.setattr(kvsieve.loading, "load_model", load_model)


@pytest.fixture(scope="module")
def passkey_file(tmp_path_factory, smollm):
    _, tokenizer = smollm
    case = passkey_case(tokenizer, 400, 0.5, seed=5)
    path = tmp_path_factory.mktemp("ctx") / "context.txt"
    path.write_text(case.context)
    return path, case


def run_cli(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_generate_with_int8_weights_finds_the_passkey(capsys, passkey_file):
    """`--quantize int8` loads the default model with int8 linear weights (a model of its own, not `smollm`) and
    still answers; an unknown scheme is refused by the parser with the choices."""
    path, case = passkey_file
    code, out, _ = run_cli(
        capsys, "generate", "-c", str(path), "-q", case.question, "--max-new-tokens", "16", "--quantize", "int8"
    )
    assert code == 0 and case.answer in out
    with pytest.raises(SystemExit):
        main(["generate", "-c", str(path), "-q", case.question, "--quantize", "int4"])
    err = capsys.readouterr().err
    assert "--quantize: invalid choice: 'int4'" in err and "int8" in err


def test_generate_gemfilter_records_its_spec_and_selection(capsys, passkey_file):
    """(Full attention's streamed answer from the installed script: test_commands.)"""
    path, case = passkey_file
    code, out, _ = run_cli(
        capsys,
        "generate",
        "-c",
        str(path),
        "-q",
        case.question,
        "--method",
        "gemfilter",
        "--set",
        "select.k=0.5",
        "--json",
    )
    result = json.loads(out)
    assert code == 0 and case.answer in result["text"]
    assert result["method"]["name"] == "gemfilter" and result["method"]["select"]["k"] == 0.5
    assert result["stages"][0]["stage"] == "select" and result["stages"][0]["details"]["kept"] == len(
        result["selected_indices"]
    )


def test_generate_answers_in_json_and_with_penalties(capsys, passkey_file, tmp_path):
    """--json-schema and --json-answer constrain the answer (the same grammar step as the server's
    response_format); penalties reach the same sampling step; a schema that is not one is exit status 2."""
    path, case = passkey_file
    schema = tmp_path / "schema.json"
    schema.write_text(
        json.dumps({"type": "object", "properties": {"pass_key": {"type": "integer"}}, "required": ["pass_key"]})
    )
    argv = ["generate", "-c", str(path), "-q", case.question, "--max-new-tokens", "24"]
    code, out, _ = run_cli(capsys, *argv, "--json-schema", str(schema))
    assert code == 0 and list(json.loads(out)) == ["pass_key"]
    code, out, _ = run_cli(capsys, *argv, "--json-answer")
    plain = json.loads(out)
    code, out, _ = run_cli(capsys, *argv, "--json-answer", "--repetition-penalty", "1.3")
    penalized = json.loads(out)
    assert code == 0 and penalized != plain  # the penalty reached the sampling step: the answer changed
    schema.write_text("{not a schema")
    code, _, err = run_cli(capsys, *argv, "--json-schema", str(schema))
    assert code == 2 and "JSON schema" in err


@pytest.mark.parametrize(
    "extra, message",
    [
        (["-q", "  "], "question is empty"),
        (["--method", "gemfilter", "--set", "select.k=0"], "GemFilter k must be"),
        (["--method", "gemfilter", "--set", "select.layer=30"], "out of range"),
        (["--method", "gemfilter", "--set", "select.pool_size=4"], "odd"),
        (["--method", "gemfilter", "--set", "select.layer=middle"], "select.layer: 'middle' is not"),
        (["--method", "gemfilter", "--set", "select.nope=1"], "has no field 'nope'; its fields are: k, layer"),
        (["--method", "gemfilter", "--set", "select.k"], "--set takes PATH=VALUE"),
        (["--method", "pyramid"], "Unknown method 'pyramid'; choose one of: full, gemfilter"),
        (["--method", "a2sf", "--set", "evict.policy.alpha=1.5"], "alpha"),
        (["--method", "snapkv", "--set", "compress.budget=16"], "exceeds the budget"),
        (["--method", "snapkv", "--set", "compress.policy.pool_size=4"], "odd"),
        (["--method", "snapkv", "--set", "compress.budget=0"], "Budget must be"),
        (["--method", "local", "--set", "evict.interval=0"], "interval"),
        (["--method", "snapkv", "--set", "evict=snapkv"], "no per-step eviction rule"),
        (["--method", "snapkv", "--set", "compress.budget=lots"], "is not a count (whole number) or a fraction"),
        (["--method", "fm", "--set", "feed.chunk=0"], "chunk >= 1"),
        (["--method", "im", "--set", "feed.memory=2"], "smaller than the 4 sink tokens"),
        (["--method", "fm", "--set", "feed.schedule=cubic"], "feed.schedule: 'cubic' is not one of fixed, linear"),
        (["--method", "fm", "--set", "feed.decremental=true"], "need an incremental memory schedule"),
        (["--temperature", "-1"], "temperature"),
    ],
)
def test_generate_bad_input(capsys, passkey_file, extra, message):
    path, case = passkey_file
    argv = ["generate", "-c", str(path), *(extra if extra[0] == "-q" else ["-q", case.question, *extra])]
    code, _, err = run_cli(capsys, *argv)
    assert code == 2 and message in err and "Traceback" not in err


def test_unreadable_and_empty_context(capsys, tmp_path):
    code, _, err = run_cli(capsys, "generate", "-c", str(tmp_path / "missing.txt"), "-q", "hi")
    assert code == 2 and "Cannot read context file" in err
    empty = tmp_path / "empty.txt"
    empty.write_text("   ")
    code, _, err = run_cli(capsys, "generate", "-c", str(empty))
    assert code == 2 and "prompt is empty" in err


def test_prompt_beyond_context_window(capsys, tmp_path):
    long_file = tmp_path / "long.txt"
    long_file.write_text("The grass is green. " * 2000)  # ~10K tokens > 8192 positions
    code, _, err = run_cli(capsys, "generate", "-c", str(long_file), "-q", "Color?")
    assert code == 2 and "trained for 8192" in err


def test_unsupported_model_is_refused(capsys, tmp_path, smollm):
    from transformers import GPT2Config, GPT2LMHeadModel

    _, tokenizer = smollm
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=49152)).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    context = tmp_path / "c.txt"
    context.write_text("hello")
    code, _, err = run_cli(capsys, "generate", "--model", str(tmp_path), "-c", str(context), "-q", "hi")
    assert code == 2 and "Unsupported architecture 'gpt2'" in err


def test_missing_model_path(capsys, tmp_path):
    context = tmp_path / "c.txt"
    context.write_text("hello")
    code, _, err = run_cli(capsys, "generate", "--model", str(tmp_path / "nope"), "-c", str(context), "-q", "hi")
    assert code == 2 and "does not exist" in err


def test_generate_with_compression_and_eviction(capsys, passkey_file):
    path, case = passkey_file
    base = ["generate", "-c", str(path), "-q", case.question, "--max-new-tokens", "12", "--json"]
    code, out, _ = run_cli(capsys, *base, "--method", "snapkv", "--set", "compress.budget=256")
    result = json.loads(out)
    compress = next(s for s in result["stages"] if s["stage"] == "compress")
    assert code == 0 and compress["method"] == "snapkv" and compress["details"]["budget"] == 256
    assert result["kv_cache_length"] == 256 + len(result["tokens"]) - 1
    code, out, _ = run_cli(
        capsys, *base, "--method", "a2sf", "--set", "evict.policy.alpha=0.2", "--set", "evict.budget=128"
    )
    result = json.loads(out)
    assert code == 0 and result["kv_cache_length"] == 128
    assert result["stages"][-1]["details"]["evict"] == "a2sf"


def test_budget_above_prompt_keeps_everything_and_says_so(capsys, passkey_file):
    path, case = passkey_file
    code, out, err = run_cli(
        capsys,
        "generate",
        "-c",
        str(path),
        "-q",
        case.question,
        "--set",
        "compress=h2o",
        "--set",
        "compress.budget=5000",
    )
    assert code == 0 and case.answer in out and "everything kept" in err


def test_generate_with_critiprefill_and_its_bad_input(capsys, passkey_file):
    path, case = passkey_file
    base = ["generate", "-c", str(path), "-q", case.question, "--max-new-tokens", "12", "--method", "critiprefill"]
    code, out, _ = run_cli(
        capsys, *base, "--set", "attention.segment=128", "--set", "attention.block=16", "--set", "attention.budget=128"
    )
    assert code == 0 and case.answer in out
    code, _, err = run_cli(capsys, *base, "--set", "attention.segment=100", "--set", "attention.block=32")
    assert code == 2 and "multiple of block" in err
    code, _, err = run_cli(capsys, *base, "--set", "attention.budget=16")
    assert code == 2 and "at least one block" in err


def test_generate_with_chunked_feeds_beyond_the_context(capsys, tmp_path, passkey_file, smollm):
    """A prompt longer than the 8192 trained positions is refused for full prefill with a message that names the
    chunked feed; the chunked feed re-encodes positions (its largest stays within the chunk + memory frame)."""
    _, tokenizer = smollm
    case = passkey_case(tokenizer, 9000, 0.3, seed=11)
    path = tmp_path / "long.txt"
    path.write_text(case.context)
    code, _, err = run_cli(capsys, "generate", "-c", str(path), "-q", case.question, "--max-new-tokens", "12")
    assert code == 2 and "--method imdc" in err
    short, short_case = passkey_file  # 400 tokens in chunks of 96: the same frame logic, in seconds
    argv = ["generate", "-c", str(short), "-q", short_case.question, "--max-new-tokens", "4", "--method", "imdc"]
    code, out, _ = run_cli(capsys, *argv, "--set", "feed.chunk=96", "--set", "feed.memory=64", "--json")
    result = json.loads(out)
    feed = next(s for s in result["stages"] if s["stage"] == "feed")
    assert code == 0 and len(result["tokens"]) > 0
    assert feed["method"] == "imdc" and feed["details"]["pruner"] == "snapkv" and feed["details"]["steps"] == 5
    assert result["prefill_kv_length"] == 4 + 64 and feed["details"]["max_position"] < 4 + 64 + 2 * 96


@pytest.mark.parametrize(
    "argv, message",
    [
        (["niah", "--depths", ""], "Depths must be a non-empty list"),
        (["niah", "--lengths", "9000"], "exceed the model's 8192 positions"),
        (["niah", "--methods", "full,bogus"], "Unknown method(s) bogus"),
        (["ppl", "--lengths", "8100"], "exceed the model's 8192 positions"),
        (["bench", "--lengths", "9000", "--methods", "full,imdc"], "which full need"),
        (["report"], "Nothing to report"),
    ],
)
def test_evaluation_bad_input(capsys, tmp_path, argv, message):
    code, _, err = run_cli(capsys, *argv, "--out", str(tmp_path / "x" / "out.json"))
    assert code == 2 and message in err and "Traceback" not in err


def test_methods_lists_the_registry_with_every_field(capsys):
    code, out, _ = run_cli(capsys, "methods", "--json")
    specs = json.loads(out)
    assert code == 0 and len(specs) == 28
    assert {"tova", "knorm", "imdc", "imdc-paper", "critiprefill", "a2sf-paper", "snapkv-paper"} <= set(specs)
    assert specs["kvzip-pooled"]["compress"]["policy"]["pool_size"] == 5
    assert specs["critiprefill"]["attention"] == {
        "type": "critiprefill",
        "segment": 512,
        "block": 32,
        "budget": 1024,
        "alpha": 0.25,
        "dense_layers": 1,
        "dense_prefix": 0,
    }
    code, out, _ = run_cli(capsys, "methods")
    assert code == 0 and "compress.policy.window = 32" in out and "evict.policy.alpha = 0.9" in out and "[paper]" in out


def test_help_lists_every_methods_fields(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    out = capsys.readouterr().out
    assert "--set PATH=VALUE" in out and "--dtype" in out and "--device" in out
    assert "tova: evict.policy, evict.budget, evict.interval" in out
    assert "critiprefill: attention.segment, attention.block" in out
