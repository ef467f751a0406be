"""RULER (Hsieh et al., 2024): NVIDIA's synthetic long-context suite, as a score-versus-KV-budget sweep of presets.

The cases come from NVIDIA's own generators (the `nvidia-long-context-eval` package, installed by the `ruler` extra):
its task configs (`synthetic.yaml`), templates and answer prefixes (`data/synthetic/constants.py`) and its generator
scripts, run with the model's own tokenizer at each length, where a length is RULER's `max_seq_length` (the prompt
plus the task's answer tokens). They are scored by RULER's own metrics: `string_match_all` (the share of the
references found in the answer) for the needle, variable-tracking and word-frequency tasks, `string_match_part` (100
when any reference is found) for QA.

Tasks, by RULER's categories: retrieval (`niah_*`, 8 variants), multi-hop tracing (`vt`), aggregation (`cwe`, `fwe`)
and question answering (`qa_1` on SQuAD, `qa_2` on HotpotQA). Every file they read ships in the package's wheel;
the essay haystacks' sentence splitter (nltk's punkt_tab model) comes from llama-index-core's wheel
(`punkt_folder`), so nothing is downloaded at run time.

Configurations: each preset at each budget, a share of the prompt set on the preset's KV budget field
(`budget_field`), and the presets without one (full attention, the ceiling; CritiPrefill) once. Three modes (the
first two by default):
- "question": the method sees the question in the prompt, as `kvsieve generate` does;
- "agnostic": the context (instructions and document, everything before the question) is first compressed by the
  method's own scorer to the budget without the question (the server's `--reuse-budget`, kvpress's default); the
  question's tokens are then appended and nothing is pruned again with their scores (an evicting method keeps that
  size while it decodes). Only presets with a scorer (`reuse_compress`) have this mode; full attention (run once,
  with the question) is the ceiling of every mode.
- "unmarked": the whole prompt as token ids with nothing marking where its question starts, as a completions
  request (`/v1/completions`, `generate` on ids) gives it: the question-guided stages (IMDC's chunk pruning,
  GemFilter's kept tail) read the library's stand-in for a question instead (`kvsieve.prompt.question_tail`).
  Presets with a KV budget; each runs its prompt whole (no stored context: nothing says where one ends).

The sweep shares its expensive part through the engine's prefix cache: before a case's configurations run, its
context is prefilled once per kind of exact state (`fill_prefix_caches`), which stores the state every question-mode
configuration that continues a stored prefix starts from and every agnostic configuration's compressed one; each
configuration then runs only its question (reuse never changes an answer, `engine.prefix_cache`). GemFilter stores
its own selection pass; chunked feeds and CritiPrefill's attention plan their own prefill. `kvsieve.eval.leaderboard`
turns the rows into the leaderboard.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from tqdm import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from kvsieve.errors import KvsieveError
from kvsieve.eval import records
from kvsieve.eval.methods import check_lengths
from kvsieve.models import architecture
from kvsieve.prompt import STAND_IN, Prompt, build_task_prompt, ids_prompt
from kvsieve.spec import MethodSpec

CATEGORIES = {
    "retrieval": ["niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2",
                  "niah_multikey_3", "niah_multivalue", "niah_multiquery"],
    "multi-hop tracing": ["vt"],
    "aggregation": ["cwe", "fwe"],
    "question answering": ["qa_1", "qa_2"],
}  # fmt: skip
TASKS = [task for tasks in CATEGORIES.values() for task in tasks]
BUDGETS = (0.1, 0.25, 0.5, 0.75)  # shares of the prompt kept: the report's x axis
MODES = ("question", "agnostic", "unmarked")
DEFAULT_MODES = ("question", "agnostic")
# The field that sets a preset's KV budget, first found first: what the cache keeps after the prefill.
BUDGET_FIELDS = ("compress.budget", "evict.budget", "feed.memory", "select.k")
GENERATOR_SECONDS = 600  # one task's cases; 4K cases take seconds, a length too small never ends
RULER_DISTRIBUTION = "nvidia-long-context-eval"  # what installs `long_context_eval`
INSTALL = "RULER needs the `ruler` extra: pip install 'kvsieve[ruler]' (make setup installs it)."


def package_folder() -> Path:
    """The installed `long_context_eval` package (NVIDIA's RULER), or a KvsieveError saying how to install it."""
    spec = importlib.util.find_spec("long_context_eval")
    if spec is None or not spec.submodule_search_locations:
        raise KvsieveError(f"NVIDIA's RULER generators are not installed. {INSTALL}")
    return Path(spec.submodule_search_locations[0])


def punkt_folder() -> Path | None:
    """An NLTK data folder holding the punkt_tab sentence model (llama-index-core's copy), None when absent."""
    spec = importlib.util.find_spec("llama_index.core") if importlib.util.find_spec("llama_index") else None
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = Path(spec.submodule_search_locations[0]) / "_static" / "nltk_cache"
    return folder if (folder / "tokenizers" / "punkt_tab" / "english").is_dir() else None


@functools.cache
def task_configs() -> dict[str, dict[str, Any]]:
    """Each task's generator arguments (`args`), generator (`task`), template, answer prefix and answer tokens, as
    NVIDIA's `prepare.py` merges them from `synthetic.yaml` and the task constants. Read once: every answer's score
    looks its task up, and callers only read it."""
    import yaml
    from long_context_eval.data.synthetic.constants import TASKS as BASE

    configs = yaml.safe_load((package_folder() / "synthetic.yaml").read_text())
    return {name: {**config, **BASE[config["task"]]} for name, config in configs.items()}


def needs_punkt(config: Mapping[str, Any]) -> bool:
    """Whether a task's generator splits essays into sentences (nltk's punkt_tab)."""
    return config["task"] == "niah" and config["args"].get("type_haystack") == "essay"


def available_tasks(tasks: Sequence[str] | None = None) -> tuple[list[str], dict[str, str]]:
    """The tasks that can run here (default: all of RULER's) and, for each that cannot, why."""
    configs = task_configs()
    names = list(tasks) if tasks else TASKS
    if unknown := [t for t in names if t not in configs]:
        raise KvsieveError(f"Unknown RULER task(s) {', '.join(unknown)}; choose from {', '.join(TASKS)}.")
    skipped = {}
    if punkt_folder() is None:
        for name in names:
            if needs_punkt(configs[name]):
                skipped[name] = "its essay haystack needs nltk's punkt_tab model, which llama-index-core carries"
    return [n for n in names if n not in skipped], skipped


def tokenizer_key(tokenizer: PreTrainedTokenizerBase) -> str:
    """A short fingerprint of `tokenizer`'s vocabulary: the generators size every case with it, so cases made with
    one tokenizer are never read back for another."""
    vocabulary = json.dumps(sorted(tokenizer.get_vocab().items()))
    return hashlib.sha256(vocabulary.encode()).hexdigest()[:10]


def cases_key(tokenizer: PreTrainedTokenizerBase, task: str) -> str:
    """What a task's cases depend on besides their length, count and seed: the tokenizer (`tokenizer_key`), the RULER
    package's version and the task's settings (its generator arguments, template, answer prefix): cases kept under
    one key are never read back for another."""
    settings = json.dumps(task_configs()[task], sort_keys=True, default=str)
    version = importlib.metadata.version(RULER_DISTRIBUTION)
    task_hash = hashlib.sha256(f"{version}\n{settings}".encode()).hexdigest()[:8]
    return f"{tokenizer_key(tokenizer)}-{version}-{task_hash}"


def generate_cases(
    tokenizer: PreTrainedTokenizerBase, task: str, length: int, samples: int, seed: int, folder: Path
) -> list[dict[str, Any]]:
    """`samples` cases of `task` at RULER length `length`, made by NVIDIA's generator script with `tokenizer` (run as
    its `prepare.py` runs it, in a process of its own), kept in `folder` under `cases_key` (the tokenizer, RULER's
    version, the task's settings) and read back from there next time."""
    path = folder / f"{task}-{length}-{samples}-{seed}-{cases_key(tokenizer, task)}.jsonl"
    if not path.is_file():
        config = task_configs()[task]
        script = package_folder() / "data" / "synthetic" / f"{config['task']}.py"
        with tempfile.TemporaryDirectory() as work:
            tokenizer.save_pretrained(Path(work) / "tokenizer")
            argv = [
                sys.executable, str(script), "--save_dir", work, "--save_name", task, "--subset", "validation",
                "--tokenizer_path", str(Path(work) / "tokenizer"), "--tokenizer_type", "hf",
                "--max_seq_length", str(length), "--tokens_to_generate", str(config["tokens_to_generate"]),
                "--num_samples", str(samples), "--random_seed", str(seed),
                "--template", config["template"] + config.get("answer_prefix", ""),
            ]  # fmt: skip
            for key, value in config["args"].items():
                argv += [f"--{key}", str(value)]
            if config["task"] == "qa":
                argv += ["--pre_samples", "0"]
            env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
            if (punkt := punkt_folder()) is not None:
                env["NLTK_DATA"] = str(punkt)
            try:
                timeout = GENERATOR_SECONDS
                done = subprocess.run(argv, cwd=work, env=env, capture_output=True, text=True, timeout=timeout)
            except subprocess.TimeoutExpired:
                raise KvsieveError(
                    f"RULER's generator for {task} did not finish in {GENERATOR_SECONDS} s at {length} tokens. Its "
                    "generators loop while their smallest case does not fit (QA's is 10 documents, about 1,500 "
                    "tokens): use a longer length."
                ) from None
            made = Path(work) / task / "validation.jsonl"
            if done.returncode != 0 or not made.is_file():
                tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-5:])
                raise KvsieveError(f"RULER's generator for {task} at {length} tokens failed:\n{tail}")
            folder.mkdir(parents=True, exist_ok=True)
            path.write_text(made.read_text())
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@dataclass(frozen=True)
class Case:
    """One RULER case: its RULER length, the prompt, where its context ends (the question starts), the references,
    the answer length."""

    task: str
    length: int
    index: int
    prompt: Prompt
    boundary: int
    references: list[str]
    max_new_tokens: int


def split_input(text: str, config: Mapping[str, Any]) -> tuple[str, str, str]:
    """A generated input as (context, question, lead): the instructions and document, the question after them, and
    the answer prefix. The question starts at the last occurrence of the template's text after `{context}` (up to
    its first field), the lead at the last of the answer prefix's; single-needle tasks have both in the singular,
    as the generator writes them."""

    def last(marker_of: str, before: int) -> int:
        marker = re.split(r"\{\w+\}", marker_of)[0]
        singular = marker.replace("Some", "A").replace("are all", "is").replace("are", "is")
        found = max(text.rfind(marker, 0, before), text.rfind(singular, 0, before) if singular else -1)
        if not marker or found < 0:
            raise KvsieveError(f"Cannot find {marker!r} in a generated {config['task']} case.")
        return found

    lead_at = last(config.get("answer_prefix", ""), len(text)) if config.get("answer_prefix") else len(text)
    question_at = last(config["template"].split("{context}", 1)[1], lead_at)
    return text[:question_at], text[question_at:lead_at], text[lead_at:]


def load_cases(
    tokenizer: PreTrainedTokenizerBase, task: str, length: int, samples: int, seed: int, folder: Path
) -> list[Case]:
    """The task's cases at `length` as kvsieve prompts (`build_task_prompt`)."""
    config = task_configs()[task]
    cases = []
    for sample in generate_cases(tokenizer, task, length, samples, seed, folder):
        context, question, lead = split_input(sample["input"], config)
        prompt = build_task_prompt(tokenizer, context, question, lead)
        boundary = prompt.context_start + prompt.context_len
        cases.append(
            Case(task, length, sample["index"], prompt, boundary, sample["outputs"], config["tokens_to_generate"])
        )
    return cases


def score(task: str, answer: str, references: list[str]) -> float:
    """RULER's score of one answer, 0-100: its task's metric on the answer cleaned as its evaluate.py cleans
    predictions (stripped, control characters as line breaks). `string_match_all` is the share of the references
    found in the answer (case-insensitive; 3 of 4 values found score 75), `string_match_part` is 100 when any one is."""
    from long_context_eval.eval.synthetic.constants import TASKS as METRICS

    cleaned = re.sub(r"[\x00-\x1f]", "\n", answer.strip()).strip()
    metrics = cast(dict[str, dict[str, Any]], METRICS)  # its table's entries mix numbers and functions
    return metrics[task_configs()[task]["task"]]["metric_fn_per_sample"]([cleaned], [references])[0]


def budget_field(spec: MethodSpec) -> str | None:
    """The field that sets `spec`'s KV budget (`BUDGET_FIELDS`), None where the method keeps every entry."""
    return next((field for field in BUDGET_FIELDS if spec.has(field)), None)


@dataclass(frozen=True)
class Config:
    """One line point: a preset at a budget (None: as registered, no KV budget) in one mode."""

    method: str
    budget: float | None
    mode: str

    @property
    def key(self) -> tuple:
        return self.method, self.budget, self.mode


def configurations(specs: Mapping[str, MethodSpec], budgets: Sequence[float], modes: Sequence[str]) -> list[Config]:
    """Every (preset, budget, mode) a sweep runs: presets with a KV budget at each budget, the others once (full
    attention, the ceiling of every mode, in question mode); the agnostic mode for presets whose context a scorer
    can compress without the question (`reuse_compress`); the unmarked mode for every preset with a KV budget."""
    from kvsieve.engine import reuse_compress

    configs = []
    for mode in modes:
        for name, spec in specs.items():
            if budget_field(spec) is None:
                if mode == "question":
                    configs.append(Config(name, None, mode))
                continue
            for budget in budgets:
                if mode != "agnostic" or reuse_compress(spec, budget) is not None:
                    configs.append(Config(name, budget, mode))
    return configs


def spec_at(spec: MethodSpec, budget: float | None, length: int) -> MethodSpec:
    """`spec` with its KV budget at `budget` of the prompt (a whole-number field, the chunked feeds' memory, takes
    that share of the prompt's `length` tokens)."""
    field = budget_field(spec)
    if budget is None or field is None:
        return spec
    value = round(budget * length) if field == "feed.memory" else budget
    return spec.with_settings([(field, value)])


def settings(
    specs: Mapping[str, MethodSpec],
    budgets: Sequence[float],
    samples: int,
    seed: int,
    model: dict[str, Any],
    modes: Sequence[str],
) -> dict[str, Any]:
    """What makes a sweep's rows comparable; a resumed run must match it (tasks, lengths, modes and samples may
    grow). With the unmarked mode, the rule of its stand-in question (`prompt.STAND_IN`): a later rule's answers are
    not a resume."""
    return {
        "methods": {name: spec.to_dict() for name, spec in specs.items()},
        "budgets": list(budgets),
        "samples": samples,
        "seed": seed,
        **model,
        **({"stand_in": dict(STAND_IN)} if "unmarked" in modes else {}),
    }


def run_ruler(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    specs: Mapping[str, MethodSpec],
    lengths: Sequence[int],
    out: Path,
    *,
    tasks: Sequence[str] | None = None,
    samples: int = 10,
    seed: int = 42,
    budgets: Sequence[float] = BUDGETS,
    modes: Sequence[str] = DEFAULT_MODES,
    share_prefill: bool = True,
    cache_bytes: int = 2 * 10**9,
    model_name: str | None = None,
    fresh: bool = False,
    cases: Path | None = None,
    say=print,
) -> dict[str, Any]:
    """Run every (task, length, case, configuration) not yet in `out`, saving after each case; return the document.

    `share_prefill` False runs each configuration from scratch (no prefix cache): the sweep's own baseline. The
    cases are kept in `cases` (default: beside `out`, `<out>.cases/`), so a rerun neither regenerates nor changes
    them."""
    if unknown := [m for m in modes if m not in MODES]:
        raise KvsieveError(f"Unknown mode(s) {', '.join(unknown)}; choose from {', '.join(MODES)}.")
    if not budgets or any(not 0 < b < 1 for b in budgets):
        raise KvsieveError(f"Budgets are shares of the prompt in (0, 1), got {list(budgets)}.")
    if samples < 1:
        raise KvsieveError(f"--samples must be at least 1, got {samples}.")
    runnable, skipped = available_tasks(tasks)
    for task, why in skipped.items():
        say(f"kvsieve: skipping RULER task {task}: {why}. {INSTALL}")
    if not runnable:
        raise KvsieveError("No RULER task can run here. " + INSTALL)
    configs_ = task_configs()
    check_lengths(specs, list(lengths), 16, architecture(model).max_positions)  # a length includes the answer
    document = records.open_results(
        out,
        "ruler",
        settings(specs, budgets, samples, seed, records.model_settings(model, model_name), modes),
        fresh=fresh,
        grows=("samples",),
    )
    done = {(r["task"], r["length"], r["index"], r["method"], r["budget"], r["mode"]) for r in document["rows"]}
    plan = configurations(specs, budgets, modes)
    folder = cases if cases is not None else out.with_name(out.name + ".cases")
    groups: dict[tuple[str, float | None], list[Config]] = {}  # one scheduler (and prefix cache) per mode and budget
    for config in plan:
        reuse = config.budget if config.mode == "agnostic" else None
        groups.setdefault((config.mode, reuse), []).append(config)
    work = [(task, length) for length in lengths for task in runnable]
    for task, length in work:
        if length < 2 * configs_[task]["tokens_to_generate"]:
            raise KvsieveError(
                f"A RULER length includes the answer: {length} tokens leave too little room for {task}'s prompt "
                f"beside its {configs_[task]['tokens_to_generate']} answer tokens; use at least "
                f"{2 * configs_[task]['tokens_to_generate']}."
            )
    case_sets = {(task, length): load_cases(tokenizer, task, length, samples, seed, folder) for task, length in work}
    if short := [f"{task} at {length} ({len(c)})" for (task, length), c in case_sets.items() if len(c) < samples]:
        raise KvsieveError(f"RULER's generators made fewer than {samples} cases for: {', '.join(short)}.")
    same_stored_cases(document["rows"], case_sets, out)
    bar = tqdm(total=len(work) * samples * len(plan), desc="RULER", unit="answer")
    seconds = 0.0
    # Sample by sample across the tasks: a run stopped part way holds the first samples of every task, a smaller
    # leaderboard over all of them, rather than every sample of the first tasks.
    for position in range(samples):
        for task, length in work:
            case = case_sets[(task, length)][position]
            todo = {
                group: [c for c in configs if (task, length, case.index, *c.key) not in done]
                for group, configs in groups.items()
            }
            bar.update(sum(len(configs) - len(todo[group]) for group, configs in groups.items()))
            if not any(todo.values()):
                continue
            start = time.perf_counter()
            rows = _answer_case(model, tokenizer, case, specs, todo, share_prefill, cache_bytes, bar)
            elapsed = time.perf_counter() - start
            seconds += elapsed
            for row in rows:
                row["seconds"] = elapsed / len(rows)  # the case's wall time, shared by its answers
            document["rows"].extend(rows)
            records.save(out, document)
    bar.close()
    document["seconds"] = round(seconds, 3)
    records.save(out, document)
    return document


def same_stored_cases(
    rows: Sequence[Mapping[str, Any]], case_sets: Mapping[tuple[str, int], list[Case]], out: Path
) -> None:
    """Refuse to resume `out` when a row it holds is of another case than the one now at its task, length and index
    (its references or prompt length differ). A sweep grown to more samples keeps its rows only because RULER's
    generators make the first cases of a larger count the same (they draw case after case from one seeded stream);
    this checks it on every row rather than trusting it."""
    now = {(task, length, case.index): case for (task, length), cases in case_sets.items() for case in cases}
    for row in rows:
        case = now.get((row["task"], row["length"], row["index"]))
        if case is not None and (row["references"] != case.references or row["prompt_tokens"] != case.prompt.length):
            raise KvsieveError(
                f"{out} holds answers to another {row['task']} case {row['index']} at {row['length']} tokens than "
                "RULER's generator makes now (other references or prompt length), so its rows cannot be resumed. "
                "Add --fresh to start over, or choose another --out."
            )


def _answer_case(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    case: Case,
    specs: Mapping[str, MethodSpec],
    todo: Mapping[tuple[str, float | None], list[Config]],
    share_prefill: bool,
    cache_bytes: int,
    bar: tqdm,
) -> list[dict[str, Any]]:
    """Every configuration of `todo` on `case`, in one scheduler, each with the prefix cache of its (mode, reuse
    budget); its rows.

    With `share_prefill`, the context is prefilled once per kind of exact state before any request runs
    (`fill_prefix_caches`): the question mode's exact states and the agnostic mode's compressed ones come from the
    same passes, so every configuration that continues a stored prefix runs only the question."""
    from kvsieve.decode import Sampling
    from kvsieve.engine import PrefixCache, Request, Scheduler, fill_prefix_caches, fillable

    length = case.prompt.length
    caches = {
        (mode, reuse): PrefixCache(model, cache_bytes, reuse)
        if mode == "agnostic" or (share_prefill and mode == "question")
        else None
        for mode, reuse in todo
    }
    # The unmarked mode's prompt, where it runs: the case's ids with no question marked (their tail stands in for it).
    unmarked = any(m == "unmarked" for m, _ in todo)
    prompts = {"unmarked": ids_prompt(case.prompt.ids[0].tolist(), tokenizer=tokenizer)} if unmarked else {}
    jobs = [(caches[group], c, spec_at(specs[c.method], c.budget, length)) for group, cs in todo.items() for c in cs]
    if share_prefill and (
        entries := [(cache, spec) for cache, _, spec in jobs if cache is not None and fillable(spec, cache.budget)]
    ):
        fill_prefix_caches(model, case.prompt.ids[0, : case.boundary].tolist(), entries)
    # Every configuration decodes in one batch, each request with its group's prefix cache: one step feeds all of
    # them (groups decoding one after another would step as many times more, each reading every weight).
    scheduler = Scheduler(model, tokenizer, max_batch=len(jobs))
    requests = [
        (config, Request(prompts.get(config.mode, case.prompt), spec, Sampling(case.max_new_tokens),
                         boundary=case.boundary, keep_cache=False, prefix_cache=cache))
        for cache, config, spec in jobs
    ]  # fmt: skip
    scheduler.run_to_end([request for _, request in requests])
    rows = []
    for config, request in requests:
        result = request.result
        rows.append(
            {
                "task": case.task, "length": case.length, "index": case.index, "method": config.method,
                "budget": config.budget, "mode": config.mode, "prompt_tokens": result.prompt_tokens,
                "answer": result.text, "references": case.references,
                "score": score(case.task, result.text, case.references),
                "kv_length": result.prefill_kv_length, "reuse": request.info.get("cache", "off"),
                "ttft_s": result.prefill_seconds,
            }
        )  # fmt: skip
        bar.update(1)
    return rows


def summarize(rows: list[dict[str, Any]]) -> dict[tuple, dict[str, Any]]:
    """Per (method, budget, mode), over the cases it answered: the RULER average (`leaderboard.ruler_average`), the
    cases, and the mean share of the prompt's KV entries kept (`leaderboard.kept_share`). A quick look after a run;
    the leaderboard compares configurations on the same cases."""
    from kvsieve.eval.leaderboard import by_config, kept_share, ruler_average

    return {
        key: {
            "average": ruler_average({case: row["score"] for case, row in mine.items()}),
            "cases": len(mine),
            "kept": sum(kept_share(row) for row in mine.values()) / len(mine),
        }
        for key, mine in by_config(rows).items()
    }
