"""`kvsieve generate` and `kvsieve inspect`: answer a question about a long context, or show what GemFilter keeps
of it."""

from __future__ import annotations

import argparse
import json
import os
import sys

from kvsieve.cli import options
from kvsieve.errors import KvsieveError


def cmd_generate(args: argparse.Namespace) -> None:
    """Generate from a long context (file or stdin) and a question; the answer streams to stdout."""
    from kvsieve.engine import generate

    spec = options.spec_of(args)  # a bad name or setting fails before the model loads
    sampling = options.sampling_of(args)
    sampling.validate()
    context = options.read_context(args.context)
    model, tokenizer = options.load(args)
    stream = None if args.json else (lambda piece: print(piece, end="", flush=True))
    result = generate(
        model, tokenizer, context, args.question, raw=args.raw, method=spec, sampling=sampling, stream=stream
    )
    if args.json:
        print(json.dumps({"method": spec.to_dict(), **result.to_dict()}, indent=1))
    else:
        print()
        options.report_result(result)


def cmd_inspect(args: argparse.Namespace) -> None:
    """Run GemFilter's selection and print the prompt with the kept tokens highlighted."""
    from kvsieve.engine import select_tokens
    from kvsieve.prompt import build_prompt

    spec = options.spec_of(args)
    if spec.select is None:
        raise KvsieveError(
            f"Method '{spec.name}' has no select stage, so there is nothing to inspect; use --method gemfilter "
            "or add one with --set select=gemfilter."
        )
    context = options.read_context(args.context)
    model, tokenizer = options.load(args)
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
    options.say(
        f"\nGemFilter kept {len(kept)} of {prompt.length} tokens ({100 * len(kept) / prompt.length:.1f}%) "
        f"at filter layer {d['layer']}; tail kept: {d['kept_tail']} tokens; first pass {d['first_pass_seconds']:.2f} s."
        + ("" if color else " Kept spans are shown [[like this]].")
    )


def add(sub: argparse._SubParsersAction) -> None:
    """Add generate, inspect to the command line."""
    p = options.command(sub, "generate", "answer a question about a long context", cmd_generate)
    options.add_prompt(p)
    options.add_method(p, multi=False, default="full")
    options.add_sampling(p)
    p.add_argument("--json", action="store_true", help="print the whole result (timings, stages, ids) as JSON")

    p = options.command(sub, "inspect", "show which tokens GemFilter keeps", cmd_inspect)
    options.add_prompt(p)
    options.add_method(p, multi=False, default="gemfilter")
    p.add_argument("--plain", action="store_true", help="mark kept spans with [[ ]] instead of colour")
