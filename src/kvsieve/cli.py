"""The `kvsieve` command line: generate, inspect, methods, calibrate, niah, ruler, ppl, bench, report, simulate, demo,
serve.

User mistakes (bad options, unreadable files, unsupported models) print one clear message and
exit with status 2; they never show a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
from pathlib import Path

from kvsieve.errors import KvsieveError

DESCRIPTION = """kvsieve: faster, smaller long-context inference for Hugging Face causal LMs.
Runs on the embedded SmolLM2-135M-Instruct by default (no network needed)."""


# ----------------------------------------------------------------------------- argument groups


def _count(text: str) -> int | float:
    """A token count ("1024") or a fraction of the prompt ("0.25")."""
    try:
        return int(text)
    except ValueError:
        try:
            return float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"'{text}' is neither a token count nor a fraction") from None


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a comma-separated list of integers") from None


def _float_list(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a comma-separated list of numbers") from None


def _add_model(parser: argparse.ArgumentParser) -> None:
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


def _methods_epilog() -> str:
    """Every registered method and its settable fields, from the registry (never written out by hand)."""
    from kvsieve.registry import REGISTRY

    lines = ["methods and their fields (--set PATH=VALUE; `kvsieve methods` explains each):"]
    for name, spec in REGISTRY.items():
        paths = ", ".join(f.path for f in spec.fields()) or "no fields"
        lines.append(f"  {name}: {paths}")
    lines.append("a whole stage: --set attention=critiprefill, --set evict=a2sf, --set compress=none, ...")
    return "\n".join(lines)


def _add_method(parser: argparse.ArgumentParser, *, multi: bool, default: str) -> None:
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
    parser.epilog = _methods_epilog()
    parser.formatter_class = argparse.RawDescriptionHelpFormatter


def _spec(args: argparse.Namespace):
    from kvsieve.registry import method
    from kvsieve.spec import parse_settings

    return method(args.method, parse_settings(args.set))


def _specs(args: argparse.Namespace):
    from kvsieve.eval.methods import build_specs
    from kvsieve.spec import parse_settings

    return build_specs(args.methods, parse_settings(args.set))


def _add_prompt(parser: argparse.ArgumentParser) -> None:
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


def _add_sampling(parser: argparse.ArgumentParser) -> None:
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


def _sampling(args: argparse.Namespace):
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
        grammar=_grammar(args),
    )


def _grammar(args: argparse.Namespace) -> str | None:
    """--json-answer: any JSON; --json-schema FILE: that schema's text (checked when the answer starts)."""
    from kvsieve.structured import ANY_JSON

    if args.json_schema is not None:
        try:
            return args.json_schema.read_text(encoding="utf-8")
        except OSError as error:
            raise KvsieveError(f"Cannot read the JSON schema {args.json_schema}: {error.strerror}.") from None
    return ANY_JSON if args.json_answer else None


def _read_context(source: str) -> str:
    if source == "-":
        if sys.stdin is None or sys.stdin.isatty():
            raise KvsieveError("No context: pass --context FILE or pipe the text on stdin.")
        return sys.stdin.read()
    try:
        return Path(source).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise KvsieveError(f"Cannot read context file '{source}': {error}") from error


def _load(args: argparse.Namespace, warm_steps: bool = False):
    """The model and tokenizer, with what its CPU decoding steps call built before anything is timed: the C++
    kernels, on a machine that has not built them (about 11 s, once), would otherwise be counted in the first
    prompt's time to first token. `warm_steps` (a server): with --compile-steps, the decoding step's graphs too
    (`kvsieve.engine.batch.warm_up`); a one-shot command's step compiles at its first token instead."""
    from kvsieve import fast_paths
    from kvsieve.engine.batch import warm_up
    from kvsieve.kernels.native import warm_up as warm_up_kernels
    from kvsieve.models import load_model

    if args.compile_steps:
        fast_paths.configure(compiled_steps=True)
    model, tokenizer = load_model(args.model, device=args.device, dtype=args.dtype, quantize=args.quantize)
    seconds = (warm_up if warm_steps else warm_up_kernels)(model)
    if seconds > 1 and warm_steps and args.compile_steps:
        _err(f"kvsieve: compiled the decoding step in {seconds:.1f} s (and, once per machine, the CPU's C++ kernels)")
    elif seconds > 1:
        _err(f"kvsieve: built the CPU's C++ decoding kernels in {seconds:.1f} s (once per machine)")
    return model, tokenizer


def _load_off_main_thread(args: argparse.Namespace):
    """`_load` in a thread of its own that ends before the server starts, for a server whose engine thread runs
    the model. libgomp (PyTorch's OpenMP on Linux) gives each thread that runs parallel work its own pool of
    workers; a pool left in the main thread by loading beside the engine thread's own oversubscribes the cores,
    and libgomp then stops spinning and puts workers to sleep after every parallel region. Measured on the
    2-core VM: one int8 decoding step in the engine thread took 53.8 ms after loading in the main thread and
    27.2 ms after loading in a thread that ended (docs/STUDIES.md, decoding). The CPU kernels are built and, with
    --compile-steps, the decoding step (`kvsieve.engine.batch.warm_up`) compiled there too, before the
    server answers anything."""
    loaded: dict[str, object] = {}

    def load() -> None:
        try:
            loaded["model"] = _load(args, warm_steps=True)  # no request waits for the kernels or the step's compile
        except BaseException as error:  # re-raised in the caller's thread, with its own message
            loaded["error"] = error

    thread = threading.Thread(target=load, name="kvsieve-load")
    thread.start()
    thread.join()
    if "error" in loaded:
        raise loaded["error"]
    return loaded["model"]


def _err(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _report(result) -> None:
    _err(
        f"\n[{result.prompt_tokens} prompt tokens | time to first token {result.prefill_seconds:.2f} s | "
        f"{len(result.tokens)} tokens at {result.decode_tokens_per_s:.1f} tok/s | "
        f"KV cache {result.prefill_kv_length} after prefill, {result.kv_cache_length} at the end | "
        f"finished: {result.finish_reason}]"
    )
    for stage in result.stages:
        details = ", ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in stage.details.items())
        _err(f"  {stage.stage:<8} {stage.method:<10} {stage.seconds:6.2f} s  {details}")


def _add_run_file(parser: argparse.ArgumentParser, default: str) -> None:
    parser.add_argument(
        "--out", type=Path, default=Path(default), help=f"result JSON, written after every case (default {default})"
    )
    parser.add_argument(
        "--fresh", action="store_true", help="start over instead of resuming the finished cases in --out"
    )


# ----------------------------------------------------------------------------- commands


def cmd_generate(args: argparse.Namespace) -> None:
    from kvsieve.engine.offline import generate

    spec = _spec(args)  # a bad name or setting fails before the model loads
    sampling = _sampling(args)
    sampling.validate()
    context = _read_context(args.context)
    model, tokenizer = _load(args)
    stream = None if args.json else (lambda piece: print(piece, end="", flush=True))
    result = generate(
        model, tokenizer, context, args.question, raw=args.raw, method=spec, sampling=sampling, stream=stream
    )
    if args.json:
        print(json.dumps({"method": spec.to_dict(), **result.to_dict()}, indent=1))
    else:
        print()
        _report(result)


def cmd_inspect(args: argparse.Namespace) -> None:
    from kvsieve.pipeline import select_tokens
    from kvsieve.prompt import build_prompt

    spec = _spec(args)
    if spec.select is None:
        raise KvsieveError(
            f"Method '{spec.name}' has no select stage, so there is nothing to inspect; use --method gemfilter "
            "or add one with --set select=gemfilter."
        )
    context = _read_context(args.context)
    model, tokenizer = _load(args)
    prompt = build_prompt(tokenizer, context, args.question, raw=args.raw)
    indices, record, _ = select_tokens(model, prompt, spec.select, spec.attention)
    kept = set(indices.tolist())
    color = sys.stdout.isatty() and not os.environ.get("NO_COLOR") and not args.plain
    on, off = ("\x1b[1;30;43m", "\x1b[0m") if color else ("[[", "]]")
    pieces, inside = [], False
    for i, token in enumerate(prompt.ids[0].tolist()):
        if (i in kept) != inside:
            pieces.append(on if not inside else off)
            inside = not inside
        pieces.append(tokenizer.decode([token]))
    pieces.append(off if inside else "")
    print("".join(pieces))
    d = record.details
    _err(
        f"\nGemFilter kept {len(kept)} of {prompt.length} tokens ({100 * len(kept) / prompt.length:.1f}%) "
        f"at filter layer {d['layer']}; tail kept: {d['kept_tail']} tokens; first pass {d['first_pass_seconds']:.2f} s."
        + ("" if color else " Kept spans are shown [[like this]].")
    )


def cmd_calibrate(args: argparse.Namespace) -> None:
    from kvsieve.select.calibrate import calibrate, plot_recall
    from kvsieve.select.gemfilter import GemFilter
    from kvsieve.select.layers import calibration_file

    selector = _spec(args).select
    if not isinstance(selector, GemFilter):
        raise KvsieveError(
            f"Method '{args.method}' has no GemFilter select stage to calibrate; use --method gemfilter "
            "(its --set select.* options change how each layer scores)."
        )
    model, tokenizer = _load(args)
    result = calibrate(
        model, tokenizer, args.lengths, args.depths, args.k, args.probe, save=not args.no_save, selector=selector
    )
    print(f"{'layer':>5}  {'needle tokens in top-k':>22}")
    for layer, recall in enumerate(result.recall):
        mark = "  <- recommended" if layer == result.layer else ""
        print(f"{layer:>5}  {recall:>22.3f}{mark}")
    args.plot.parent.mkdir(parents=True, exist_ok=True)
    plot_recall(result, args.plot, f"GemFilter filter-layer calibration ({args.probe}, k={args.k})")
    print(f"\nRecommended filter layer: {result.layer}. Curve: {args.plot}")
    if not args.no_save:
        print(
            f"Saved to {calibration_file()}; use it with --set select.layer=calibrated "
            f"(GemFilter(layer='calibrated') in Python)."
        )


def _resumable(path: Path, work):
    """Run `work()`; on Ctrl-C say where the finished cases are before exiting."""
    try:
        return work()
    except KeyboardInterrupt:
        _err(f"\nFinished cases are saved in {path}; rerun the same command to resume.")
        raise


def cmd_niah(args: argparse.Namespace) -> None:
    from kvsieve.eval.niah import plot_heatmaps, run_grid, summarize

    specs = _specs(args)
    model, tokenizer = _load(args)
    document = _resumable(
        args.out,
        lambda: run_grid(
            model,
            tokenizer,
            specs,
            args.lengths,
            args.depths,
            args.out,
            probe=args.probe,
            max_new_tokens=args.max_new_tokens,
            model_name=args.model,
            fresh=args.fresh,
        ),
    )
    summary = summarize(document["rows"])
    print(f"{'method':<13} {'cases':>5} {'hits':>5} {'mean ROUGE-1':>12}  per length")
    for method, s in summary.items():
        per_length = "  ".join(f"{n}: {v:.2f}" for n, v in s["by_length"].items())
        print(f"{method:<13} {s['cases']:>5} {s['hits']:>5} {s['rouge1']:>12.3f}  {per_length}")
    plots = plot_heatmaps(document, args.plots, prefix=f"{args.probe}")
    print(f"\nCases: {args.out}\nHeatmaps: {', '.join(str(p) for p in plots)}")


def cmd_ruler(args: argparse.Namespace) -> None:
    from kvsieve.eval.ruler import run_ruler, summarize

    specs = _specs(args)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()] if args.tasks else None
    model, tokenizer = _load(args)
    document = _resumable(
        args.out,
        lambda: run_ruler(
            model, tokenizer, specs, args.lengths, args.out, tasks=tasks, samples=args.samples, seed=args.seed,
            budgets=args.budgets, modes=modes, share_prefill=not args.no_share, model_name=args.model,
            fresh=args.fresh, say=_err,
        ),
    )  # fmt: skip
    print(f"{'method':<24} {'budget':>6} {'mode':<9} {'KV kept':>7} {'RULER avg':>9} {'cases':>5}")
    for (method, budget, mode), s in summarize(document["rows"]).items():
        share = "-" if budget is None else f"{budget:g}"
        print(f"{method:<24} {share:>6} {mode:<9} {s['kept']:>7.2f} {s['average']:>9.1f} {s['cases']:>5}")
    print(f"\nRuns this time: {document['seconds']:.0f} s. Cases: {args.out} (draw them with kvsieve report --ruler)")


def cmd_ppl(args: argparse.Namespace) -> None:
    from kvsieve.eval.perplexity import run_perplexity

    specs = _specs(args)
    methods = list(specs)
    model, tokenizer = _load(args)
    document = _resumable(
        args.out,
        lambda: run_perplexity(
            model,
            tokenizer,
            specs,
            args.lengths,
            args.out,
            tokens=args.tokens,
            model_name=args.model,
            fresh=args.fresh,
        ),
    )
    rows = document["rows"]
    full = {r["length"]: r["ppl"] for r in rows if r["method"] == "full"}
    print(f"{'length':>6} {'method':<13} {'perplexity':>10} {'vs full':>8} {'KV after prefill':>16}")
    for row in sorted(rows, key=lambda r: (r["length"], methods.index(r["method"]) if r["method"] in methods else 99)):
        ratio = f"{row['ppl'] / full[row['length']]:.3f}" if row["length"] in full else "-"
        print(f"{row['length']:>6} {row['method']:<13} {row['ppl']:>10.3f} {ratio:>8} {row['kv_length']:>16}")
    print(f"\nRows: {args.out}")


def cmd_bench(args: argparse.Namespace) -> None:
    from kvsieve.eval.bench import bench, plot_scaling, summarize
    from kvsieve.eval.methods import check_lengths
    from kvsieve.models import architecture

    specs = _specs(args)
    fractions = [
        name
        for name, spec in specs.items()
        for stage in (spec.compress, spec.evict)
        if stage is not None and isinstance(stage.budget, float)
    ]
    if fractions:
        raise KvsieveError(
            f"bench needs KV budgets as token counts so every length keeps the same cache size; {', '.join(fractions)} "
            "got a fraction (set e.g. compress.budget=1024)."
        )
    if args.baseline not in specs:
        raise KvsieveError(f"--baseline {args.baseline} is not among --methods {','.join(specs)}; add it.")
    model, _ = _load(args)
    check_lengths(specs, args.lengths, args.decode_tokens, architecture(model).max_positions)
    del model
    document = _resumable(
        args.out,
        lambda: bench(
            specs,
            args.lengths,
            args.repeats,
            args.out,
            decode_tokens=args.decode_tokens,
            model=args.model,
            device=args.device,
            dtype=args.dtype,
            quantize=args.quantize,
            fresh=args.fresh,
        ),
    )
    summary = summarize(document["rows"], args.baseline)
    print(
        f"{'length':>6} {'method':<12} {'TTFT s (min/med/max)':<22} {'speedup vs ' + args.baseline:<20} "
        f"{'decode tok/s (med)':>18} {'peak MB (med)':>13} {'added MB (med)':>14} {'peak ratio':>10} "
        f"{'added ratio':>11}"
    )
    for s in summary:
        ttft = "/".join(f"{v:.2f}" for v in s["ttft_s"])
        speed = "/".join(f"{v:.2f}" for v in s["speedup"]) if s["speedup"] else "-"
        mem = f"{s['memory_ratio'][1]:.3f}" if s["memory_ratio"] else "-"
        added = f"{s['added_ratio'][1]:.3f}" if s["added_ratio"] else "-"
        print(
            f"{s['length']:>6} {s['method']:<12} {ttft:<22} {speed:<20} {s['decode_tokens_per_s'][1]:>18.1f} "
            f"{s['peak_mb'][1]:>13.0f} {s['added_mb'][1]:>14.0f} {mem:>10} {added:>11}"
        )
    plot = plot_scaling(summary, args.plot)
    print(f"\nRaw rows: {args.out}\nScaling plot: {plot}")


def cmd_report(args: argparse.Namespace) -> None:
    from kvsieve.eval.report import write_report

    path = write_report(
        args.out, args.niah, args.ppl, args.bench, args.notes, args.baseline, args.kvpress, ruler_files=args.ruler,
        calibration_files=args.ruler_calibration,
    )  # fmt: skip
    print(f"Wrote {path} (figures in {path.parent / 'figures'}, result files in {path.parent / 'results'})")


def cmd_simulate(args: argparse.Namespace) -> None:
    from kvsieve.eval.perplexity import essay_ids
    from kvsieve.eval.simulate import compare_policies
    from kvsieve.spec import components

    policies = components("policy")
    unknown = [name for name in args.methods if name not in policies]
    if unknown:
        raise KvsieveError(f"Unknown policy {', '.join(unknown)}; choose from {', '.join(policies)}.")
    methods = {}
    for name in args.methods:
        cls = policies[name]
        given = {"sinks": args.sinks, "recent": args.recent}
        values = {k: v for k, v in given.items() if k in cls.__dataclass_fields__}
        if name == "a2sf":
            methods.update({f"a2sf alpha={a}": cls(alpha=a, **values) for a in args.alphas})
        else:
            methods[name] = cls(**values)
    model, tokenizer = _load(args)
    most = model.config.max_position_embeddings
    if not 2 <= args.length <= most:
        raise KvsieveError(f"--length must be within 2..{most}, the model's positions.")
    ids = essay_ids(tokenizer, args.length)  # host ids; compare_policies moves them to the model
    rows = compare_policies(model, ids, methods, args.budget)
    print(f"{'method':<16} {'budget':>6} {'NLL':>7} {'perplexity':>10} {'cosine to ideal':>15}")
    for row in rows:
        print(f"{row['method']:<16} {row['budget']:>6} {row['nll']:>7.4f} {row['ppl']:>10.3f} {row['cosine']:>15.4f}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(rows, indent=1))


def cmd_methods(args: argparse.Namespace) -> None:
    from kvsieve.registry import REGISTRY
    from kvsieve.spec import components

    if args.json:
        print(json.dumps({name: spec.to_dict() for name, spec in REGISTRY.items()}, indent=1))
        return
    for name, spec in REGISTRY.items():
        print(f"{name}: {spec.summary}")
        print(f"  stages: {spec.describe()}")
        for info in spec.fields():
            print(f"    {info.path} = {info.default!r}  ({info.type}) {info.help}")
        print()
    print(
        "KV policies for compress.policy, evict.policy and feed.pruner (e.g. --set feed.pruner=snapkv): "
        + ", ".join(components("policy"))
    )
    print("Change any field with --set PATH=VALUE on generate, inspect, niah, ruler, ppl, bench, demo and serve.")


DEMO_METHODS = "full,gemfilter,critiprefill,snapkv,a2sf,imdc"


def cmd_demo(args: argparse.Namespace) -> None:
    from kvsieve.data import needle_case
    from kvsieve.decode import Sampling
    from kvsieve.engine.offline import generate
    from kvsieve.eval.scoring import contains, rouge1_recall

    specs = _specs(args)
    model, tokenizer = _load(args)
    case = needle_case(tokenizer, args.length, args.depth)
    print(
        f"Haystack: {args.length} tokens of Paul Graham essays; needle at {args.depth:.0%} depth:\n  {case.needle}\n"
        f"Question: {case.question}\n"
    )
    # One short warm-up answer first, so the first method timed does not pay for one-time setup.
    generate(model, tokenizer, case.context[:2000], case.question, sampling=Sampling(max_new_tokens=2))
    sampling = Sampling(max_new_tokens=args.max_new_tokens)
    results = {}
    for name, spec in specs.items():
        print(f"--- {name} ({spec.describe()}):\n    ", end="", flush=True)
        result = generate(
            model,
            tokenizer,
            case.context,
            case.question,
            method=spec,
            sampling=sampling,
            stream=lambda p: print(p, end="", flush=True),
        )
        results[name] = result
        print("\n")
    first = next(iter(specs))
    print(
        f"{'method':<16} {'answer has the needle':>21} {'ROUGE-1':>8} {'TTFT s':>7} {'vs ' + first:>9} {'KV kept':>8}"
    )
    for name, result in results.items():
        speed = results[first].prefill_seconds / result.prefill_seconds
        print(
            f"{name:<16} {'yes' if contains(result.text, case.answer) else 'no':>21} "
            f"{rouge1_recall(result.text, case.answer):>8.2f} {result.prefill_seconds:>7.2f} {speed:>8.2f}x "
            f"{result.prefill_kv_length:>8}"
        )
    print(
        f"\nOne document, one run each: times are indicative, not a benchmark (kvsieve bench repeats and "
        f"interleaves). 'KV kept' is the cache entries per layer and KV head after prefill, of "
        f"{results[first].prompt_tokens} prompt tokens. docs/RESULTS.md has every method over whole grids."
    )
    print("See what GemFilter kept: kvsieve inspect --context FILE --question ...; every method: kvsieve methods")


def cmd_serve(args: argparse.Namespace) -> None:
    """Serve the model on OpenAI's API (docs/SERVING.md)."""
    from kvsieve.engine.prefix_cache import parse_bytes, parse_reuse_budget
    from kvsieve.models import DEFAULT_MODEL
    from kvsieve.serve import create_server

    spec = _spec(args)  # a bad method fails before the model loads
    cache_bytes = parse_bytes(args.cache_memory)
    reuse_budget = parse_reuse_budget(args.reuse_budget)
    api_key = args.api_key or os.environ.get("KVSIEVE_API_KEY") or None
    if args.host not in ("127.0.0.1", "localhost", "::1") and api_key is None:
        _err(f"kvsieve: warning: serving on {args.host} without --api-key: anyone who can reach it can use it.")
    model, tokenizer = _load_off_main_thread(args)
    name = args.served_model_name or (Path(args.model).name if args.model else DEFAULT_MODEL)
    app = create_server(
        model,
        tokenizer,
        model_name=name,
        spec=spec,
        api_key=api_key,
        cache_bytes=cache_bytes,
        reuse_budget=reuse_budget,
        max_queue=args.max_queue,
        max_batch=args.max_batch,
        max_step_tokens=args.max_step_tokens or None,
        max_body_bytes=parse_bytes(args.max_body),
        max_prompt_tokens=args.max_prompt_tokens,
        default_max_tokens=args.default_max_tokens,
        upstream=args.upstream,
        upstream_model=args.upstream_model,
        upstream_api_key=os.environ.get("KVSIEVE_UPSTREAM_API_KEY"),
        upstream_timeout=args.upstream_timeout,
    )
    import uvicorn

    where = f" -> upstream {args.upstream}" if args.upstream else ""
    _err(f"kvsieve: serving {name} with method {spec.name} on http://{args.host}:{args.port}/v1{where}")
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)


# ----------------------------------------------------------------------------- parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvsieve", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("generate", help="answer a question about a long context", description=cmd_generate.__doc__)
    p.description = "Generate from a long context (file or stdin) and a question; the answer streams to stdout."
    _add_model(p)
    _add_prompt(p)
    _add_method(p, multi=False, default="full")
    _add_sampling(p)
    p.add_argument("--json", action="store_true", help="print the whole result (timings, stages, ids) as JSON")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("inspect", help="show which tokens GemFilter keeps")
    p.description = "Run GemFilter's selection and print the prompt with the kept tokens highlighted."
    _add_model(p)
    _add_prompt(p)
    _add_method(p, multi=False, default="gemfilter")
    p.add_argument("--plain", action="store_true", help="mark kept spans with [[ ]] instead of colour")
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("calibrate", help="measure which filter layer finds needles best")
    p.description = (
        "Run needle probes, report per layer the fraction of needle tokens in GemFilter's top-k, plot the curve, "
        "recommend a layer and remember it for this model (used by --set select.layer=calibrated)."
    )
    _add_model(p)
    p.add_argument("--lengths", type=_int_list, default=[2048, 4096], help="probe lengths in tokens")
    p.add_argument("--depths", type=_float_list, default=[0.1, 0.3, 0.5, 0.7, 0.9], help="needle depths in [0, 1]")
    p.add_argument("--k", type=int, default=256, help="top-k used to score each layer (default 256)")
    p.add_argument("--probe", choices=["passkey", "needle"], default="passkey", help="probe kind (default passkey)")
    p.add_argument("--plot", type=Path, default=Path("calibration.png"), help="PNG of the curve")
    p.add_argument("--no-save", action="store_true", help="do not remember the recommended layer")
    _add_method(p, multi=False, default="gemfilter")
    p.set_defaults(func=cmd_calibrate)

    p = sub.add_parser("niah", help="needle-in-a-haystack or passkey grid with heatmaps, any methods")
    p.description = (
        "Hide the San Francisco needle (or IMDC's passkey) at each depth of essays haystacks of each length, ask for "
        "it with greedy decoding, score the answers offline (ROUGE-1 recall and whole-word match) and draw one "
        "heatmap per method. Every case is saved as it finishes; rerunning the same command resumes."
    )
    _add_model(p)
    p.add_argument("--probe", choices=["needle", "passkey"], default="needle", help="probe kind (default needle)")
    p.add_argument("--lengths", type=_int_list, default=[2048, 4096, 8000], help="prompt lengths in tokens")
    p.add_argument("--depths", type=_float_list, default=[0.0, 0.25, 0.5, 0.75, 1.0], help="needle depths in [0, 1]")
    p.add_argument("--max-new-tokens", type=int, default=48, help="answer length limit (default 48)")
    _add_method(p, multi=True, default="full,gemfilter")
    _add_run_file(p, "runs/niah.json")
    p.add_argument("--plots", type=Path, default=Path("runs/plots"), help="folder for the heatmap PNGs")
    p.set_defaults(func=cmd_niah)

    p = sub.add_parser("ruler", help="RULER's average against the share of the KV cache kept, every preset")
    p.description = (
        "NVIDIA's RULER tasks (retrieval, multi-hop tracing, aggregation, QA), generated by NVIDIA's own scripts "
        "with the model's tokenizer (the `ruler` extra: pip install 'kvsieve[ruler]'), answered greedily by each "
        "method at each KV budget (a share of the prompt, on the method's budget field), with the question in the "
        "prompt and question-agnostic (the context compressed before the question is seen), scored by RULER's own "
        "metrics. Methods that continue a stored prefix share one prefill of each case's context. Every case is "
        "saved as it finishes; rerunning the same command resumes; `kvsieve report --ruler` draws the curves."
    )
    _add_model(p)
    p.add_argument(
        "--lengths", type=_int_list, default=[4096], help="RULER lengths in tokens: prompt plus answer (default 4096)"
    )
    p.add_argument("--tasks", default="", help="comma-separated RULER tasks (default: every one that runs offline)")
    p.add_argument("--samples", type=int, default=10, help="cases per task and length (default 10)")
    p.add_argument("--seed", type=int, default=42, help="the generators' random seed (default 42, as RULER's)")
    p.add_argument(
        "--budgets", type=_float_list, default=[0.1, 0.25, 0.5, 0.75],
        help="KV budgets as shares of the prompt (default 0.1,0.25,0.5,0.75)",
    )  # fmt: skip
    p.add_argument("--modes", default="question,agnostic", help="question, agnostic or both (default both)")
    p.add_argument(
        "--no-share", action="store_true", help="run every configuration from scratch (the sweep's own baseline)"
    )
    _add_method(p, multi=True, default="full,snapkv,h2o,a2sf,gemfilter")
    _add_run_file(p, "runs/ruler.json")
    p.set_defaults(func=cmd_ruler)

    p = sub.add_parser("ppl", help="perplexity of essay text continued after each method's context")
    p.description = (
        "For each length, the essay text's LENGTH tokens before a fixed point are the context, handled by each "
        "method as it handles a prompt (selection, chunked feed, sparse prefill, compression); the next --tokens "
        "tokens are teacher-forced on the resulting cache, evicting after every step where the method does. "
        "Reports exp(mean NLL) of those tokens. Rows are saved as they finish; rerunning resumes."
    )
    _add_model(p)
    p.add_argument("--lengths", type=_int_list, default=[2048, 4096, 8000], help="context lengths in tokens")
    p.add_argument("--tokens", type=int, default=192, help="continuation tokens scored (default 192)")
    _add_method(p, multi=True, default="full,snapkv,h2o,a2sf,streaming")
    _add_run_file(p, "runs/ppl.json")
    p.set_defaults(func=cmd_ppl)

    p = sub.add_parser("bench", help="time-to-first-token, decode speed and peak memory over prompt lengths")
    p.description = (
        "Scaling study: time to first token, decode tokens/s and peak memory of each method over prompt lengths, "
        "each run in its own process, repeats interleaving the configurations, ratios against --baseline taken "
        "within the same repeat; writes a log-log plot of cost against length. Rerunning resumes."
    )
    _add_model(p)
    p.add_argument("--lengths", type=_int_list, default=[2048, 4096, 8000], help="prompt lengths in tokens")
    _add_method(p, multi=True, default="full,gemfilter")
    p.add_argument(
        "--baseline", default="full", help="method the ratios compare against (default full; fm beyond the context)"
    )
    p.add_argument(
        "--decode-tokens",
        type=int,
        default=32,
        help="tokens decoded per run to time decoding, EOS ignored so every method decodes as many (default 32)",
    )
    p.add_argument("--repeats", type=int, default=3, help="repeats per configuration (default 3)")
    _add_run_file(p, "runs/bench.json")
    p.add_argument("--plot", type=Path, default=Path("runs/plots/scaling.png"), help="log-log cost plot (PNG)")
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("report", help="one Markdown report of niah, ppl and bench results, with figures")
    p.description = (
        "Put quality (needle/passkey heatmaps, perplexity) and cost (time to first token, decode speed, peak memory) "
        "of every method side by side in one Markdown file. The result files are copied to results/ and the "
        "figures drawn to figures/ next to --out; every number comes from the files. Files of one kind are "
        "merged: each method comes from the first file that has it."
    )
    p.add_argument("--niah", type=Path, action="append", default=[], help="kvsieve niah result file (repeatable)")
    p.add_argument("--ppl", type=Path, action="append", default=[], help="kvsieve ppl result file (repeatable)")
    p.add_argument(
        "--bench", type=Path, action="append", default=[], help="kvsieve bench result file (repeatable; ratios per run)"
    )
    p.add_argument("--baseline", default="full", help="method the ratios compare against (default full)")
    p.add_argument("--notes", type=Path, help="a Markdown file of further measurements to link at the end")
    p.add_argument("--kvpress", type=Path, help="output of benchmarks/kvpress_compare.py (optional comparison)")
    p.add_argument(
        "--ruler", type=Path, action="append", default=[],
        help="kvsieve ruler result file (repeatable): the leaderboard that opens the report (each configuration "
        "against full attention on the same cases), its figure, the per-task table, and the quality axis of the "
        "glance table and the pareto figure",
    )  # fmt: skip
    p.add_argument(
        "--ruler-calibration", type=Path, action="append", default=[],
        help="kvsieve ruler result file of full attention on every task (repeatable): the leaderboard keeps the "
        "tasks where it scores 20 or more (default: full attention's rows in --ruler)",
    )  # fmt: skip
    p.add_argument("--out", type=Path, default=Path("docs/RESULTS.md"), help="report path (default docs/RESULTS.md)")
    p.set_defaults(func=cmd_report)

    p = sub.add_parser("simulate", help="eviction replayed at every position: perplexity and Table-2 cosine")
    p.description = (
        "A2SF's protocol: a teacher-forced pass over real text (the essays) in which every position sees only what "
        "the eviction policy would still hold. Reports perplexity per policy and the cosine similarity of each "
        "row's attention to ideal top-budget pruning (A2SF Table 2)."
    )
    _add_model(p)
    p.add_argument("--budget", type=_count, default=0.2, help="tokens kept: count or fraction (default 0.2)")
    p.add_argument("--sinks", type=int, default=4, help="StreamingLLM sink tokens (default 4)")
    p.add_argument("--recent", type=int, default=0, help="A2SF recent tail (default 0, as in the paper)")
    p.add_argument(
        "--methods",
        type=lambda s: s.split(","),
        default=["local", "streaming", "h2o", "a2sf"],
        help="KV policies with an accumulating or positional per-step rule: local,streaming,h2o,a2sf "
        "(default all four)",
    )
    p.add_argument("--alphas", type=_float_list, default=[0.1, 0.5], help="A2SF forgetting factors (default 0.1,0.5)")
    p.add_argument("--length", type=int, default=1024, help="tokens of essay text (default 1024)")
    p.add_argument("--out", type=Path, help="write the rows as JSON")
    p.set_defaults(func=cmd_simulate)

    p = sub.add_parser("methods", help="list the registered methods, their stages and every field")
    p.description = "The method registry: every name, its stages, and every field with its default and meaning."
    p.add_argument("--json", action="store_true", help="the specs as JSON (what --set and the server accept)")
    p.set_defaults(func=cmd_methods)

    p = sub.add_parser("demo", help="needle question on a long essay haystack, answered by several methods")
    p.description = (
        "Answer a needle question from a Paul Graham essays haystack with each method: answer, time to first "
        "token and KV entries side by side."
    )
    _add_model(p)
    p.add_argument("--length", type=int, default=4000, help="haystack length in tokens (default 4000)")
    p.add_argument("--depth", type=float, default=0.5, help="needle depth in [0, 1] (default 0.5)")
    p.add_argument("--max-new-tokens", type=int, default=48, help="longest answer in tokens (default 48)")
    _add_method(p, multi=True, default=DEMO_METHODS)
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("serve", help="an OpenAI-compatible server: batching, compressed-context reuse, --upstream")
    p.description = (
        "Serve the model on OpenAI's API (POST /v1/chat/completions, /v1/completions; GET /v1/models, /health, "
        '/metrics). Requests choose a method with the body field {"kvsieve": {"method": NAME, "set": {...}}}; '
        "decoding steps of all requests run as one batch, with long prefills sliced between them; the states of "
        "recent prompt prefixes are reused exactly (the method still sees the whole prompt)."
    )
    _add_model(p)
    _add_method(p, multi=False, default="full")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument(
        "--api-key",
        help="require Authorization: Bearer KEY on every endpoint but /health (default: $KVSIEVE_API_KEY, else none)",
    )
    p.add_argument("--served-model-name", help="the model id clients send (default: the model's name)")
    p.add_argument(
        "--cache-memory",
        default="2GB",
        help="bytes of reusable prompt states kept, LRU (default 2GB; 0 turns reuse off). It bounds the prefix "
        "cache only: the process also holds the model, the running requests' caches and a prefill's working memory "
        "(docs/SERVING.md#memory-what-the-server-holds)",
    )
    p.add_argument(
        "--reuse-budget",
        default="whole",
        help="KV entries a stored context keeps: 'whole' (default: exact reuse, every answer as generate gives it), "
        "a count (2048) or a fraction of the context (0.5), compressed by the method's own policy before the "
        "question is known (smaller states, more of them fit; the record says query_aware=false)",
    )
    p.add_argument("--max-queue", type=int, default=64, help="requests waiting before 429 (default 64)")
    p.add_argument("--max-batch", type=int, default=16, help="requests prefilling or decoding at once (default 16)")
    p.add_argument(
        "--max-step-tokens",
        type=int,
        default=512,
        help="tokens one engine step runs: a decoding token per running request plus prefill up to this budget, "
        "so a long prompt delays running streams by one slice, not its whole prefill (vLLM's "
        "max_num_batched_tokens; default 512; 0 = whole prefills)",
    )
    p.add_argument("--max-body", default="4MB", help="largest request body (default 4MB)")
    p.add_argument("--max-prompt-tokens", type=int, default=131072, help="longest prompt (default 131072)")
    p.add_argument("--default-max-tokens", type=int, default=256, help="max_tokens when a request omits it")
    p.add_argument(
        "--upstream",
        metavar="URL",
        help="run only the select stage here and send the kept token ids to this OpenAI-compatible server "
        "(vLLM, SGLang, kvsieve); its API key comes from $KVSIEVE_UPSTREAM_API_KEY",
    )
    p.add_argument(
        "--upstream-timeout",
        type=float,
        default=600,
        help="seconds to wait for the upstream's answer before 504 (default 600)",
    )
    p.add_argument("--upstream-model", help="model name for the upstream (default: the first it lists)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(func=cmd_serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except KvsieveError as error:
        _err(f"kvsieve: error: {error}")
        return 2
    except KeyboardInterrupt:
        _err("kvsieve: interrupted")
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
