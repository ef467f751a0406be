"""Result files of long evaluation runs: written after every row, resumable, self-describing.

A result file is JSON: {"kind", "schema", "command", "commands", "machine", "settings", "rows"}. `settings`
are everything that changes a row's value (methods' options, probe, tokens); rerunning with the
same settings resumes (finished rows are kept and skipped), with other settings it refuses to mix
them. `command` is the latest run's command line, `commands` every distinct one that added to the file, oldest
first (a resumed run that adds lengths is a second command: a report lists both). Every save writes a temporary
file and renames it, so Ctrl-C never leaves a torn file.
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvsieve.errors import KvsieveError
from kvsieve.spec import MethodSpec, renamed_settings

SCHEMA = 1


def machine() -> dict[str, Any]:
    """What the figures were measured on: CPU, cores, memory, GPU, library versions."""
    import torch
    import transformers

    cpu = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        names = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines() if "model name" in line]
        cpu = names[0] if names else cpu
    memory_gb = None
    meminfo = Path("/proc/meminfo")
    if meminfo.is_file():
        total_kb = int(meminfo.read_text().split("MemTotal:")[1].split()[0])
        memory_gb = round(total_kb / 2**20, 1)
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "memory_gb": memory_gb,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }


def model_settings(model: Any, name: str | None) -> dict[str, Any]:
    """The model a run used: its name (None: the embedded default), dtype and device type, and its weights'
    quantization where there is one (so a run with int8 weights never resumes one without)."""
    from kvsieve.quantize import weight_scheme

    settings = {"model": name, "dtype": str(model.dtype).removeprefix("torch."), "device": model.device.type}
    scheme = weight_scheme(model)
    return settings if scheme == "none" else {**settings, "quantize": scheme}


def command_line() -> str:
    """The command as the user typed it (program name shortened to `kvsieve`)."""
    program = Path(sys.argv[0]).name
    program = "kvsieve" if program in ("kvsieve", "__main__.py", "cli.py") else program
    return shlex.join([program, *sys.argv[1:]])


def check_writable(path: Path) -> None:
    """Fail before any work if `path` cannot be written (directory missing rights, a folder, ...)."""
    if path.is_dir():
        raise KvsieveError(f"Output {path} is a directory; give a file name such as {path / 'results.json'}.")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        probe = path.with_name(path.name + ".probe")
        probe.write_text("")
        probe.unlink()
    except OSError as error:
        raise KvsieveError(f"Cannot write results to {path}: {error}. Choose another --out.") from error


def open_results(
    path: Path, kind: str, settings: dict[str, Any], fresh: bool = False, grows: Sequence[str] = ()
) -> dict[str, Any]:
    """The result document to fill: the existing one when it was made with `settings`, else a new one.

    Raises when `path` holds another kind of result or other settings (unless `fresh`, which
    starts over and overwrites it at the first save). A count named in `grows` may be larger than the file's (a
    sweep grown to more cases): the file then takes the new count, and the caller checks that the rows it holds
    are of the cases it now runs.
    """
    check_writable(path)
    settings = json.loads(json.dumps(settings))  # the form it takes once saved (tuples -> lists)
    command = command_line()
    new = {"kind": kind, "schema": SCHEMA, "command": command, "machine": machine(), "settings": settings}
    if fresh or not path.exists():
        return {**new, "commands": [command], "rows": []}
    try:
        old = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise KvsieveError(f"{path} exists but is not a kvsieve result file ({error}); use --fresh or --out.") from None
    if old.get("kind") != kind or old.get("schema") != SCHEMA:
        raise KvsieveError(f"{path} holds {old.get('kind')!r} results, not {kind!r}; choose another --out.")
    before = read_today(old.get("settings", {}))
    changed = sorted(
        key
        for key in {*settings, *before}
        if settings.get(key) != before.get(key) and not (key in grows and _grown(before.get(key), settings.get(key)))
    )
    if changed:
        raise KvsieveError(
            f"{path} was made with other settings ({', '.join(changed)} differ), so its rows cannot be resumed. "
            "Rerun with the same settings, add --fresh to start over, or choose another --out."
        )
    commands = commands_of(old)
    return {**new, "commands": commands + ([command] if command not in commands else []), "rows": old.get("rows", [])}


def read_today(settings: dict[str, Any]) -> dict[str, Any]:
    """Recorded settings as this library reads them: each method's spec rebuilt from its record (`MethodSpec`), so a
    field the library added since takes its default and a renamed field its new name. A file from before a field
    existed then resumes under a run that leaves the field at its default, and only there; a spec this library cannot
    read stays as recorded (and differs)."""
    methods = settings.get("methods")
    if not isinstance(methods, dict):
        return settings
    return {**settings, "methods": {name: spec_today(data) for name, data in methods.items()}}


def spec_today(recorded: Any) -> Any:
    """One recorded method spec as this library reads it (`read_today`); as recorded where it cannot."""
    try:
        return json.loads(json.dumps(MethodSpec.from_dict(recorded).to_dict()))
    except KvsieveError:
        return recorded


def _grown(before: Any, now: Any) -> bool:
    """Whether a recorded count `before` grew to `now` (a count only: an absent or other value is a change)."""
    counts = all(isinstance(v, int) and not isinstance(v, bool) for v in (before, now))
    return counts and now > before


def commands_of(document: dict[str, Any]) -> list[str]:
    """Every command that added to a result file, oldest first (a file from before `commands`: its one command)."""
    return list(document.get("commands") or [document["command"]])


# Options whose recorded value named a folder of the machine that ran them, and what a reader passes instead.
CHECKOUTS = {"--before": "../before/src", "--after": "../after/src"}  # benchmarks/code_ab.py's two source trees
RUN_FOLDERS = {"--cases": "runs/ruler_cases", "--plots": "runs/plots"}


def portable_model(name: str) -> str:
    """A model as a reader names it: an alias or hub id as recorded, a folder of the machine that ran it as
    runs/models/NAME (a random-weight folder made by benchmarks/random_weights.py, as the GPU checks use)."""
    return f"runs/models/{Path(name).name}" if name.startswith("/") else name


def runnable_command(command: str, out: str) -> str:
    """A recorded command as a reader runs it from the repository root: its `--out` is `out` (the file it made, as
    it is kept now), a plot goes under runs/plots/, a folder of the machine that ran it becomes the folder a reader
    uses (`CHECKOUTS`, `RUN_FOLDERS`, `portable_model`), a `--set` field renamed since has its name of today, and an
    option recorded without a value (argparse's None) is left out. Commands joined by " ; " (a file several runs
    added to) each get the same."""
    runs = []
    for part in command.split(" ; "):
        tokens, shown = shlex.split(part), []
        while tokens:
            token = tokens.pop(0)
            if not (token.startswith("--") and tokens and not tokens[0].startswith("--")):
                shown.append(token)
                continue
            value = tokens.pop(0)
            if value == "None":
                continue
            local = value.startswith("/") or value.startswith("runs/s") and value[6:7].isdigit()
            if token == "--out":
                value = out
            elif token == "--plot":
                value = f"runs/plots/{Path(out).stem}.png"
            elif token == "--model":
                value = portable_model(value)
            elif token == "--set" and "=" in value:  # a field renamed since: its name today
                path, _, setting = value.partition("=")
                value = f"{renamed_settings(path)}={setting}"
            elif local and token in CHECKOUTS:
                value = CHECKOUTS[token]
            elif local and token in RUN_FOLDERS:
                value = RUN_FOLDERS[token]
            shown += [token, value]
        runs.append(shlex.join(shown))
    return " ; ".join(runs)


def save(path: Path, document: dict[str, Any]) -> None:
    """Write `document` atomically (temporary file + rename)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(document, indent=1))
    os.replace(tmp, path)


def load(path: Path, kind: str) -> dict[str, Any]:
    """Read a result file of `kind`, with a clear error when it is missing or of another kind."""
    try:
        document = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise KvsieveError(f"Cannot read {kind} results from {path}: {error}") from None
    if document.get("kind") != kind:
        raise KvsieveError(f"{path} holds {document.get('kind')!r} results, not {kind!r}.")
    return document
