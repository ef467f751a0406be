"""Compress once, then ask: passkey documents kept at a reuse budget by each method's scorer before the question is
known (`generate(..., [question], reuse_budget=...)`, what the server's --reuse-budget stores), keys found per method.

    python benchmarks/agnostic_needles.py --length 2000 --budget 0.1 --depths 0.1,0.3,0.5,0.7,0.9 \
        --methods snapkv,kvzip,kvzip:across_layers=true

SmolLM2 float32. A method may carry settings of its compress policy (or, named in full, its compress stage) after a
colon. Quality only (the answers do not
depend on timing): it may share the machine.
"""

from __future__ import annotations

import argparse
import json

import torch

from kvsieve import Sampling, generate, load_model, method
from kvsieve.data import passkey_case
from kvsieve.spec import parse_settings


def spec_of(text: str):
    """`kvzip:across_layers=true` -> the kvzip preset with compress.policy.across_layers=true (`--set`'s parser); a
    setting of the stage itself is named in full (`kvzip:compress.head_budgets=false`)."""
    name, *fields = text.split(":")
    return method(name, parse_settings([f if f.startswith("compress.") else f"compress.policy.{f}" for f in fields]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=2000, help="passkey document tokens (default 2000)")
    parser.add_argument("--budget", type=float, default=0.1, help="reuse budget, a share of the document (0.1)")
    parser.add_argument("--depths", default="0.1,0.3,0.5,0.7,0.9", help="where the key sits")
    parser.add_argument("--seeds", type=int, default=1, help="cases per depth (default 1)")
    parser.add_argument("--methods", default="snapkv,kvzip,kvzip:across_layers=true", help="methods compared")
    args = parser.parse_args()
    model, tokenizer = load_model(dtype=torch.float32)
    found = dict.fromkeys(args.methods.split(","), 0)
    cases = 0
    for seed in range(args.seeds):
        for depth in (float(d) for d in args.depths.split(",")):
            case = passkey_case(tokenizer, args.length, depth, seed=seed)
            cases += 1
            for name in found:
                [result] = generate(model, tokenizer, case.context, [case.question], method=spec_of(name),
                                    reuse_budget=args.budget, sampling=Sampling(max_new_tokens=12))  # fmt: skip
                hit = str(case.answer) in result.text
                found[name] += hit
                line = {"depth": depth, "seed": seed, "method": name, "found": hit, "answer": result.text}
                print(json.dumps(line), flush=True)
    print(json.dumps({"cases": cases, "budget": args.budget, "found": found}), flush=True)


if __name__ == "__main__":
    main()
