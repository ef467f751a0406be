"""The installed `kvsieve` console script, run as a user types it: each test starts the venv's `kvsieve` as a
subprocess (the commands docs/CLI.md and the README write, at the smallest sizes they take) and reads its exit
status, standard output and standard error. Standard output carries only the answer (or only the JSON with
`--json`); everything meant for a person goes to standard error.

The in-process tests (test_cli.py) check each command's behaviour in detail; these check what only a subprocess can
see: the console script's entry point, the streams, the exit status, signals, and the server started by its own
command, spoken to with the official `openai` client.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import psutil
import pytest

from kvsieve.cli import main
from kvsieve.data import Case, passkey_case
from kvsieve.paths import cache_dir

pytestmark = pytest.mark.real_model

KVSIEVE = Path(sys.executable).with_name("kvsieve")  # the console script pip installed beside this interpreter
SERVE_START_SECONDS = 120  # import, load and the kernels' check: about 10 s on the 2-core VM, more when it is busy


@dataclass
class Ran:
    code: int
    out: str
    err: str


def environment(**changes: str) -> dict[str, str]:
    """The test process's environment (threads per worker, from conftest) with no hub access."""
    return {**os.environ, "HF_HUB_OFFLINE": "1", "NO_COLOR": "1", **changes}


def start(*argv: str, env: dict[str, str] | None = None, cwd: Path | None = None, stdin=subprocess.DEVNULL):
    return subprocess.Popen(
        [str(KVSIEVE), *argv], stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=env or environment(), cwd=cwd,
    )  # fmt: skip


def finish(process: subprocess.Popen, timeout: float = 300, input: str | None = None) -> Ran:
    try:
        out, err = process.communicate(input, timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        out, err = process.communicate()
        pytest.fail(f"{process.args} ran past {timeout} s; stderr: {err[-2000:]}")
    return Ran(process.returncode, out, err)


def kvsieve(*argv: str, input: str | None = None, **options) -> Ran:
    stdin = subprocess.PIPE if input is not None else subprocess.DEVNULL
    return finish(start(*argv, stdin=stdin, **options), input=input)


@pytest.fixture(scope="module")
def tokenizer(smollm):
    return smollm[1]


@pytest.fixture(scope="module")
def case(tokenizer) -> Case:
    """A 400-token passkey document SmolLM2 answers with full attention and GemFilter (as in test_cli)."""
    return passkey_case(tokenizer, 400, 0.5, seed=5)


@pytest.fixture(scope="module")
def context_file(tmp_path_factory, case) -> Path:
    path = tmp_path_factory.mktemp("context") / "report.txt"
    path.write_text(case.context, encoding="utf-8")
    return path


def test_the_console_script_is_installed():
    assert KVSIEVE.is_file() and os.access(KVSIEVE, os.X_OK), f"no kvsieve script at {KVSIEVE}: pip install -e ."


def test_generate_streams_the_answer_and_reports_on_stderr(context_file, case):
    ran = kvsieve("generate", "-c", str(context_file), "-q", case.question, "--max-new-tokens", "12")
    assert ran.code == 0, ran.err
    assert case.answer in ran.out and "time to first token" not in ran.out  # the answer alone on stdout
    assert "time to first token" in ran.err


def test_generate_json_from_stdin_is_json_on_a_models_first_run(case, tmp_path):
    """The context on standard input, `--json` out, with an empty cache folder: the default model is converted
    first, and its notices must not reach standard output, which a script pipes into a JSON parser. The folder gets
    the CPU kernels' library already built (a link), so the run pays for the model's conversion (15 s) and not the
    kernels' compilation (40 s)."""
    fresh = tmp_path / "fresh-cache"
    fresh.mkdir()
    if (cache_dir() / "kernels").is_dir():
        (fresh / "kernels").symlink_to(cache_dir() / "kernels", target_is_directory=True)
    argv = ["generate", "-q", case.question, "--max-new-tokens", "12", "--json", "--method", "gemfilter"]
    ran = kvsieve(*argv, input=case.context, env=environment(KVSIEVE_CACHE_DIR=str(fresh)))
    assert ran.code == 0, ran.err
    assert "converting" in ran.err and (fresh / "models").is_dir()  # this run did convert
    result = json.loads(ran.out)  # the whole of stdout
    assert case.answer in result["text"] and result["method"]["name"] == "gemfilter"
    assert result["stages"][0]["stage"] == "select" and result["prompt_tokens"] > 400


def test_methods_json_is_the_registry():
    ran = kvsieve("methods", "--json")
    assert ran.code == 0, ran.err
    specs = json.loads(ran.out)
    assert {"full", "gemfilter", "imdc", "critiprefill", "a2sf", "snapkv", "pyramidkv"} <= set(specs)
    assert specs["gemfilter"]["select"]["type"] == "gemfilter" and specs["imdc"]["feed"]["type"] == "chunked"


def test_inspect_marks_the_kept_tokens(context_file, case):
    ran = kvsieve("inspect", "-c", str(context_file), "-q", case.question, "--set", "select.k=64", "--plain")
    assert ran.code == 0, ran.err
    kept = "".join(part.split("]]")[0] for part in ran.out.split("[[")[1:])
    assert case.question in kept and "kept 64 of" in ran.err


def test_demo_answers_side_by_side():
    """The table is the subject here (8 tokens answer no needle): the methods' rows, full's speed 1.00x against
    itself, GemFilter's KV entries at its k."""
    argv = ["demo", "--methods", "full,gemfilter", "--length", "400", "--max-new-tokens", "8", "--set", "select.k=192"]
    ran = kvsieve(*argv)
    assert ran.code == 0, ran.err
    assert "--- full" in ran.out and "--- gemfilter (select=gemfilter(k=192" in ran.out
    table = ran.out[ran.out.index("answer has the needle") :].splitlines()
    rows = {line.split()[0]: line.split() for line in table[1:3]}
    assert set(rows) == {"full", "gemfilter"} and all(row[1] in ("yes", "no") for row in rows.values())
    assert rows["full"][-2] == "1.00x" and int(rows["full"][-1]) > 400 and int(rows["gemfilter"][-1]) == 192


def test_calibrate_on_its_smallest_grid(tmp_path):
    plot = tmp_path / "calibration.png"
    argv = ["calibrate", "--lengths", "300", "--depths", "0.5", "--k", "32", "--plot", str(plot), "--no-save"]
    ran = kvsieve(*argv)
    assert ran.code == 0, ran.err
    layers = [line.split() for line in ran.out.splitlines() if line.strip()[:2].strip().isdigit()]
    assert [int(row[0]) for row in layers] == list(range(30)) and plot.stat().st_size > 1000
    assert "Recommended filter layer" in ran.out


def test_evaluations_write_their_files_and_report_draws_them(tmp_path):
    """niah, ppl, bench, ruler and simulate at their smallest sizes, side by side (each is its own process), then
    `report` on the files they wrote."""
    runs = tmp_path / "runs"
    commands = {
        "niah": ["niah", "--methods", "full", "--lengths", "400", "--depths",
                 "0.5", "--out", str(runs / "niah.json"), "--plots", str(runs / "plots")],
        "ppl": ["ppl", "--methods", "full,snapkv", "--set", "compress.budget=64", "--lengths", "256", "--tokens", "8",
                "--out", str(runs / "ppl.json")],
        "bench": ["bench", "--methods", "full", "--lengths", "256", "--repeats", "1", "--decode-tokens", "2",
                  "--out", str(runs / "bench.json"), "--plot", str(runs / "scaling.png")],
        "ruler": ["ruler", "--tasks", "vt", "--lengths", "1024", "--samples", "1", "--methods", "full",
                  "--budgets", "0.5", "--modes", "question", "--out", str(runs / "ruler.json")],
        "simulate": ["simulate", "--length", "96", "--budget", "0.5", "--methods", "local,a2sf", "--alphas", "0.2",
                     "--out", str(runs / "simulate.json")],
    }  # fmt: skip
    processes = {name: start(*argv) for name, argv in commands.items()}
    ran = {name: finish(process, timeout=400) for name, process in processes.items()}
    for name, result in ran.items():
        assert result.code == 0, f"{name}: {result.err[-3000:]}"
    niah = json.loads((runs / "niah.json").read_text())["rows"]
    assert [row["method"] for row in niah] == ["full"] and niah[0]["hit"]  # full finds the needle at 400 tokens
    assert "Heatmaps:" in ran["niah"].out
    ppl = {row["method"]: row for row in json.loads((runs / "ppl.json").read_text())["rows"]}
    assert ppl["snapkv"]["kv_length"] == 64 and 1 < ppl["full"]["ppl"] < ppl["snapkv"]["ppl"] * 10
    bench = json.loads((runs / "bench.json").read_text())["rows"]
    assert len(bench) == 1 and bench[0]["ttft_s"] > 0 and (runs / "scaling.png").stat().st_size > 1000
    ruler = json.loads((runs / "ruler.json").read_text())["rows"]
    assert len(ruler) == 1 and ruler[0]["task"] == "vt" and 0 <= ruler[0]["score"] <= 100
    simulate = json.loads((runs / "simulate.json").read_text())
    assert [row["method"] for row in simulate] == ["full", "local", "a2sf alpha=0.2"]
    assert all(row["budget"] == 48 for row in simulate[1:]) and simulate[0]["cosine"] == 1.0
    assert simulate[1]["ppl"] > simulate[0]["ppl"] and 0 < simulate[2]["cosine"] < 1

    report = tmp_path / "docs" / "RESULTS.md"
    files = ["--niah", str(runs / "niah.json"), "--ppl", str(runs / "ppl.json"), "--bench", str(runs / "bench.json"),
             "--ruler", str(runs / "ruler.json")]  # fmt: skip
    drawn = kvsieve("report", *files, "--out", str(report))
    assert drawn.code == 0, drawn.err
    page = report.read_text()
    assert "## Needle retrieval" in page and "| snapkv |" in page and "RULER" in page and "*Measured on*" in page
    assert drawn.out.startswith(f"Wrote {report}")


def test_bad_input_is_exit_2_with_one_line_and_nothing_on_stdout(context_file, case):
    """The installed script on one refused input: exit 2, one line on stderr, nothing on stdout."""
    ran = kvsieve("generate", "-c", "missing.txt", "-q", case.question, cwd=context_file.parent)
    assert ran.code == 2 and ran.out == ""
    lines = ran.err.strip().splitlines()
    assert len(lines) == 1 and "Cannot read context file 'missing.txt'" in lines[0], ran.err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["generate", "-c", "{context}", "-q", "  "], "question is empty"),
        (["generate", "-c", "{context}", "-q", "{question}", "--method", "gemfilter", "--set", "select.nope=1"],
         "has no field 'nope'"),
        (["generate", "-c", "{context}", "-q", "{question}", "--method", "gemfilter", "--set", "select.k=0"],
         "GemFilter k must be"),
    ],
)  # fmt: skip
def test_other_refusals_take_the_same_way_out(argv, message, context_file, case, capsys):
    """Further refused inputs, through the function the script runs (`kvsieve.cli:main`, what the test above runs as
    a process): status 2, one line, nothing on stdout. In-process: each start of the script costs about 7 s of CPU
    importing torch and transformers, and these differ from the test above only in which check refuses."""
    filled = [arg.replace("{context}", str(context_file)).replace("{question}", case.question) for arg in argv]
    assert main(filled) == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert out == "" and len(lines) == 1 and message in lines[0] and lines[0].startswith("kvsieve"), err


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_for_health(process: subprocess.Popen, url: str) -> httpx.Response:
    """GET /health until the server answers (any status), failing if the process exits or start-up runs long."""
    deadline = time.monotonic() + SERVE_START_SECONDS
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"kvsieve serve exited with {process.returncode}: {process.stderr.read()[-3000:]}")
        try:
            return httpx.get(f"{url}/health", timeout=5)
        except httpx.TransportError:
            time.sleep(0.5)
    process.kill()
    pytest.fail(f"kvsieve serve did not answer /health within {SERVE_START_SECONDS} s")


def stop(process: subprocess.Popen) -> Ran:
    """SIGTERM, as a service manager stops it, and what the process wrote."""
    process.send_signal(signal.SIGTERM)
    return finish(process, timeout=60)


def test_serve_answers_the_official_client_and_stops_on_sigterm(tokenizer):
    case = passkey_case(tokenizer, 500, 0.4, seed=3)  # as test_serve_real asks it, in a system message
    port = free_port()
    process = start("serve", "--port", str(port))  # as SERVING.md starts it, on a free port
    url = f"http://127.0.0.1:{port}"
    try:
        health = wait_for_health(process, url)
        assert health.status_code == 200 and health.json()["status"] == "ok"
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        messages = [{"role": "system", "content": case.context}, {"role": "user", "content": case.question}]
        chat = client.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0)
        assert case.answer in chat.choices[0].message.content
        assert chat.model_extra["kvsieve"]["method"] == "full"
        prompt = "The capital of France is"
        whole = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0)
        pieces = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0, stream=True)
        streamed = "".join(piece.choices[0].text for piece in pieces if piece.choices)
        assert streamed == whole.choices[0].text and len(streamed) > 0
        children = psutil.Process(process.pid).children(recursive=True)
    except BaseException:
        process.kill()
        raise
    ran = stop(process)
    assert ran.code == 0, ran.err[-3000:]
    assert "serving" in ran.err and ran.out == ""
    assert not [child.pid for child in children if alive(child)]


def alive(process: psutil.Process) -> bool:
    """Still running (a zombie, or a process gone while asked, is not)."""
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_serve_with_an_unreachable_upstream_says_so(case):
    """`--upstream` at a port nobody listens on: the server starts (the upstream may come up later), /health says
    503 naming the upstream, and a request is refused with 502, not a 5xx of its own making."""
    port, nobody = free_port(), free_port()
    process = start("serve", "--port", str(port), "--method", "gemfilter", "--upstream", f"http://127.0.0.1:{nobody}")
    url = f"http://127.0.0.1:{port}"
    try:
        health = wait_for_health(process, url)
        assert health.status_code == 503 and f"127.0.0.1:{nobody}" in health.text
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
        with pytest.raises(openai.APIStatusError) as refused:
            model = client.models.list().data[0].id
            client.completions.create(model=model, prompt=case.context + case.question, max_tokens=4)
        assert refused.value.status_code == 502 and f"127.0.0.1:{nobody}" in refused.value.message
    finally:
        ran = stop(process) if process.poll() is None else finish(process)
    assert ran.code == 0 and ran.out == "", ran.err[-3000:]


def test_serve_refuses_a_bad_option_in_one_line():
    ran = kvsieve("serve", "--port", "eighty")
    assert ran.code == 2 and ran.out == ""
    assert ran.err.strip().splitlines() == [
        "kvsieve serve: error: argument --port: invalid int value: 'eighty' (see kvsieve serve --help)"
    ]
