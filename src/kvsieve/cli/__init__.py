"""The `kvsieve` command line: generate, inspect, calibrate, niah, ruler, ppl, bench, report, simulate, methods, demo,
serve.

Each command's parser sits beside the code it drives (`answer`, `evaluate`, `methods`, `demo`, `serve`); what they
share, the option groups and the model's loading, is `options`. To add a command: a `cmd_NAME(args)` and its parser
in `add(sub)` of the module it belongs with (or a new one listed in COMMANDS).

User mistakes (bad options, unreadable files, unsupported models) print one clear message and
exit with status 2; they never show a traceback.
"""

from __future__ import annotations

import argparse
import sys

from kvsieve.cli import answer, demo, evaluate, methods, options, serve
from kvsieve.errors import KvsieveError

DESCRIPTION = """kvsieve: faster, smaller long-context inference for Hugging Face causal LMs.
Runs on the embedded SmolLM2-135M-Instruct by default (no network needed)."""

COMMANDS = (answer, evaluate, methods, demo, serve)  # in the order `kvsieve --help` lists their commands


def build_parser() -> argparse.ArgumentParser:
    parser = options.Parser(prog="kvsieve", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in COMMANDS:
        module.add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except KvsieveError as error:
        options.say(f"kvsieve: error: {error}")
        return 2
    except KeyboardInterrupt:
        options.say("kvsieve: interrupted")
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
