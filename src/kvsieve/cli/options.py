"""What the commands share: the option groups (model, method, prompt, decoding, output and resume), the parsers of
their values, loading the model, and the messages on stderr. Each is defined once here and added by the commands that
take it, so one option reads and behaves the same on every command."""

from __future__ import annotations

import argparse
import inspect
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from kvsieve.errors import KvsieveError

if TYPE_CHECKING:  # the command line imports torch and transformers only when a command runs
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


class Parser(argparse.ArgumentParser):
    """argparse's parser, whose refusals are one line: what was wrong and where the help is (argparse's own
    prints the whole usage first, which for `kvsieve serve` is 15 lines above the one that matters)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def count(text: str) -> int | float:
    """A token count ("1024") or a fraction of the prompt ("0.25")."""
    try:
        return int(text)
    except ValueError:
        try:
            return float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"'{text}' is neither a token count nor a fraction") from None


def int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a comma-separated list of integers") from None


def float_list(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a comma-separated list of numbers") from None


def command(
    sub: argparse._SubParsersAction, name: str, help: str, run: Callable, *, model: bool = True
) -> argparse.ArgumentParser:
    """A command's parser: its line in `kvsieve --help`, the function that runs it (`args.func`; its docstring, as one
    paragraph, opens the command's own --help) and, unless it loads no model, the model options."""
    description = " ".join(inspect.cleandoc(run.__doc__ or "").split())
    parser = sub.add_parser(name, help=help, description=description)
    parser.set_defaults(func=run)
    if model:
        add_model(parser)
    return parser


def add_model(parser: argparse.ArgumentParser) -> None:
    from kvsieve.quantize import QUANTIZE_CHOICES

    group = parser.add_argument_group("model")
    group.add_argument(
        "--model",
        help="local transformers folder, .gguf file or Hugging Face model id (default: embedded SmolLM2-135M-Instruct)",
    )
    group.add_argument("--device", help="cpu, cuda, cuda:1, ... (default: cuda when available, else cpu)")
    group.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16", "float64"],
        help="weights and activations (default: bfloat16 on cuda, float32 on cpu); scores are always float32",
    )
    group.add_argument(
        "--quantize",
        choices=QUANTIZE_CHOICES,
        default="none",
        help="int8: store the linear layers' weights as int8, one scale per output row (weight-only; activations "
        "keep --dtype). A quarter of float32's weight bytes; on the CPU a decoding step reads them through "
        "kvsieve's C++ product kernel (built once per machine with the other kernels). Default none",
    )
    group.add_argument(
        "--compile-steps",
        action="store_true",
        help="compile the whole decoding step (torch.compile). On a CPU, for up to 8 requests (those that evict "
        "once at their budget): up to 2.3x faster per token on SmolLM2 (least with a long full-attention cache), "
        "after a compile of one to two and a half minutes per process on 2 cores, and about a minute more for each "
        "eviction policy at its first use. On CUDA, the compiled step is captured as a CUDA "
        "graph: 1.7-2.5x faster than the captured uncompiled step on an H100, after 80-90 s. Worth it for long "
        "answers and servers",
    )


def methods_epilog() -> str:
    """Every registered method and its settable fields, from the registry (never written out by hand)."""
    from kvsieve.registry import REGISTRY

    lines = ["methods and their fields (--set PATH=VALUE; `kvsieve methods` explains each):"]
    for name, spec in REGISTRY.items():
        paths = ", ".join(f.path for f in spec.fields()) or "no fields"
        lines.append(f"  {name}: {paths}")
    lines.append("a whole stage: --set attention=critiprefill, --set evict=a2sf, --set compress=none, ...")
    return "\n".join(lines)


def add_method(parser: argparse.ArgumentParser, *, multi: bool, default: str) -> None:
    """--method NAME (or --methods A,B) plus repeatable --set PATH=VALUE, shared by every command."""
    group = parser.add_argument_group("method (one spec for every command: `kvsieve methods` lists them)")
    if multi:
        group.add_argument("--methods", default=default, help=f"comma-separated method names (default {default})")
    else:
        group.add_argument("--method", default=default, help=f"a registered method name (default {default})")
    group.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="PATH=VALUE",
        help="change a field of the method's stages, e.g. compress.budget=0.25 or attention.budget=2048 "
        "(repeatable; with several methods it applies to each that has the field)",
    )
    parser.epilog = methods_epilog()
    parser.formatter_class = argparse.RawDescriptionHelpFormatter


def spec_of(args: argparse.Namespace):
    from kvsieve.registry import method
    from kvsieve.spec import parse_settings

    return method(args.method, parse_settings(args.set))


def specs_of(args: argparse.Namespace):
    from kvsieve import registry
    from kvsieve.spec import parse_settings

    return registry.methods(args.methods, parse_settings(args.set))


def add_prompt(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--context", "-c", default="-", help="file with the long context, '-' for stdin (default)")
    parser.add_argument(
        "--question",
        "-q",
        help="question about the context (appended after a blank line, in the model's chat template; a base model "
        "without one gets 'Question: ...' and 'Answer:')",
    )
    parser.add_argument(
        "--raw", action="store_true", help="feed context + question exactly as given: no chat template, no BOS"
    )


def add_sampling(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("decoding")
    group.add_argument("--max-new-tokens", type=int, default=64, help="maximum tokens to generate (default 64)")
    group.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples")
    group.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1.0)")
    group.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens (default 0: all)")
    group.add_argument("--min-tokens", type=int, default=0, help="no EOS before this many new tokens (default 0)")
    group.add_argument("--seed", type=int, help="random seed for sampling")
    group.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    group.add_argument(
        "--ignore-eos", action="store_true", help="decode on past EOS up to --max-new-tokens (for timing)"
    )
    group.add_argument("--presence-penalty", type=float, default=0.0, help="OpenAI's presence penalty, [-2, 2]")
    group.add_argument("--frequency-penalty", type=float, default=0.0, help="OpenAI's frequency penalty, [-2, 2]")
    group.add_argument("--repetition-penalty", type=float, default=1.0, help="CTRL's repetition penalty (1 = off)")
    group.add_argument("--json-answer", action="store_true", help="answer with valid JSON (grammar-constrained)")
    group.add_argument("--json-schema", type=Path, metavar="FILE", help="answer with JSON following this schema")


def sampling_of(args: argparse.Namespace):
    from kvsieve.decode import Sampling

    return Sampling(
        args.max_new_tokens,
        args.temperature,
        args.top_p,
        args.seed,
        tuple(args.stop),
        args.ignore_eos,
        top_k=args.top_k,
        min_tokens=args.min_tokens,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        repetition_penalty=args.repetition_penalty,
        grammar=grammar_of(args),
    )


def grammar_of(args: argparse.Namespace) -> str | None:
    """--json-answer: any JSON; --json-schema FILE: that schema's text (checked when the answer starts)."""
    from kvsieve.structured import ANY_JSON

    if args.json_schema is not None:
        try:
            return args.json_schema.read_text(encoding="utf-8")
        except OSError as error:
            raise KvsieveError(f"Cannot read the JSON schema {args.json_schema}: {error.strerror}.") from None
    return ANY_JSON if args.json_answer else None


def read_context(source: str) -> str:
    if source == "-":
        if sys.stdin is None or sys.stdin.isatty():
            raise KvsieveError("No context: pass --context FILE or pipe the text on stdin.")
        return sys.stdin.read()
    try:
        return Path(source).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise KvsieveError(f"Cannot read context file '{source}': {error}") from error


def load(args: argparse.Namespace, warm_steps: bool = False) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The model and tokenizer, with what its CPU decoding steps call built before anything is timed: the C++
    kernels, on a machine that has not built them (about 11 s, once), would otherwise be counted in the first
    prompt's time to first token. `warm_steps` (a server): with --compile-steps, the decoding step's graphs too
    (`kvsieve.engine.warm_up`); a one-shot command's step compiles at its first token instead."""
    from kvsieve import fast_paths
    from kvsieve.engine import warm_up
    from kvsieve.kernels.native import build_kernels
    from kvsieve.loading import load_model

    if args.compile_steps:
        fast_paths.configure(compiled_steps=True)
    model, tokenizer = load_model(args.model, device=args.device, dtype=args.dtype, quantize=args.quantize)
    seconds = (warm_up if warm_steps else build_kernels)(model)
    if seconds > 1 and warm_steps and args.compile_steps:
        say(f"kvsieve: compiled the decoding step in {seconds:.1f} s (and, once per machine, the CPU's C++ kernels)")
    elif seconds > 1:
        say(f"kvsieve: built the CPU's C++ decoding kernels in {seconds:.1f} s (once per machine)")
    return model, tokenizer


def load_off_main_thread(args: argparse.Namespace) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """`load` in a thread of its own that ends before the server starts, for a server whose engine thread runs
    the model. libgomp (PyTorch's OpenMP on Linux) gives each thread that runs parallel work its own pool of
    workers; a pool left in the main thread by loading beside the engine thread's own oversubscribes the cores,
    and libgomp then stops spinning and puts workers to sleep after every parallel region. Measured on the
    2-core VM: one int8 decoding step in the engine thread took 53.8 ms after loading in the main thread and
    27.2 ms after loading in a thread that ended (docs/STUDIES.md, decoding). The CPU kernels are built and, with
    --compile-steps, the decoding step (`kvsieve.engine.warm_up`) compiled there too, before the
    server answers anything."""
    loaded: list[tuple[PreTrainedModel, PreTrainedTokenizerBase]] = []
    failed: list[BaseException] = []

    def run() -> None:
        try:
            loaded.append(load(args, warm_steps=True))  # no request waits for the kernels or the step's compile
        except BaseException as error:  # re-raised in the caller's thread, with its own message
            failed.append(error)

    thread = threading.Thread(target=run, name="kvsieve-load")
    thread.start()
    thread.join()
    if failed:
        raise failed[0]
    return loaded[0]


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def report_result(result) -> None:
    say(
        f"\n[{result.prompt_tokens} prompt tokens | time to first token {result.prefill_seconds:.2f} s | "
        f"{len(result.tokens)} tokens at {result.decode_tokens_per_s:.1f} tok/s | "
        f"KV cache {result.prefill_kv_length} after prefill, {result.kv_cache_length} at the end | "
        f"finished: {result.finish_reason}]"
    )
    for stage in result.stages:
        details = ", ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in stage.details.items())
        say(f"  {stage.stage:<8} {stage.method:<10} {stage.seconds:6.2f} s  {details}")


def add_output(parser: argparse.ArgumentParser, default: str) -> None:
    parser.add_argument(
        "--out", type=Path, default=Path(default), help=f"result JSON, written after every case (default {default})"
    )
    parser.add_argument(
        "--fresh", action="store_true", help="start over instead of resuming the finished cases in --out"
    )


def resumable(path: Path, work):
    """Run `work()`; on Ctrl-C say where the finished cases are before exiting."""
    try:
        return work()
    except KeyboardInterrupt:
        say(f"\nFinished cases are saved in {path}; rerun the same command to resume.")
        raise
