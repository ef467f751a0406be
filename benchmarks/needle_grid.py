"""Needle / passkey accuracy grid: several methods on the same cases, one process.

    python benchmarks/needle_grid.py --probe needle --lengths 2048,4096,6144,8000 \
        --depths 0,0.25,0.5,0.75,1 --methods full,gemfilter --k 1024 --out runs/needle_grid.json

Methods: full, gemfilter (k, calibrated layer), critiprefill (paper settings, --fusion-alpha), and the
KV methods snapkv, h2o, a2sf, streaming, local (compress to --budget after prefill; all but snapkv
also evict to it while decoding), as `kvsieve bench` runs them.
Greedy decoding is deterministic, so grids of different methods run separately compare case by
case; `--append` adds rows to an existing output file.

Lengths are prompt tokens (context + chat template + question). Scores: ROUGE-1 recall of the
answer against the reference, and whether the reference appears verbatim ("hit").
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tqdm import tqdm

from kvsieve import Sampling, generate, load_model
from kvsieve.cli import _count
from kvsieve.eval.bench import PROMPT_OVERHEAD, method_stages
from kvsieve.eval.data import PROBES
from kvsieve.eval.scoring import contains, rouge1_recall


def _label(name: str, args: argparse.Namespace) -> str:
    """The method's name with the option that distinguishes its runs."""
    if name == "critiprefill":
        return f"critiprefill alpha={args.fusion_alpha}"
    if name == "a2sf":
        return f"a2sf alpha={args.alpha} budget={args.budget}"
    if name in ("snapkv", "h2o", "streaming", "local"):
        return f"{name} budget={args.budget}"
    return name


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--probe", choices=sorted(PROBES), default="needle")
    parser.add_argument("--lengths", default="2048,4096,6144,8000")
    parser.add_argument("--depths", default="0,0.25,0.5,0.75,1")
    parser.add_argument("--k", type=int, default=1024)
    parser.add_argument("--layer", type=int, help="filter layer (default: calibrated)")
    parser.add_argument(
        "--methods", default="full,gemfilter", help="full,gemfilter,critiprefill,snapkv,h2o,a2sf,streaming,local"
    )
    parser.add_argument("--fusion-alpha", type=float, default=0.25, help="CritiPrefill layer-fusion alpha")
    parser.add_argument("--budget", type=_count, default=0.25, help="KV methods: count or fraction (default 0.25)")
    parser.add_argument("--alpha", type=float, default=0.2, help="A2SF forgetting factor (default 0.2)")
    parser.add_argument("--out", type=Path, default=Path("runs/needle_grid.json"))
    parser.add_argument("--append", action="store_true", help="add rows to an existing --out file")
    args = parser.parse_args()
    model, tokenizer = load_model()
    lengths = [int(x) for x in args.lengths.split(",")]
    depths = [float(x) for x in args.depths.split(",")]
    names = args.methods.split(",")
    options = {"k": args.k, "layer": args.layer, "budget": args.budget, "alpha": args.alpha}
    methods = {_label(name, args): method_stages(name, fusion_alpha=args.fusion_alpha, **options) for name in names}
    rows = json.loads(args.out.read_text()) if args.append and args.out.is_file() else []
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for length in lengths:
        for depth in depths:
            case = PROBES[args.probe](tokenizer, length - PROMPT_OVERHEAD, depth)
            for name, stages in tqdm(methods.items(), desc=f"{length} tokens, depth {depth}", leave=False):
                result = generate(model, tokenizer, case.context, case.question, sampling=Sampling(48), **stages)
                rows.append(
                    {
                        "method": name,
                        "length": result.prompt_tokens,
                        "depth": depth,
                        "answer": result.text,
                        "rouge1": rouge1_recall(result.text, case.answer),
                        "hit": contains(result.text, case.answer),
                        "ttft_s": result.prefill_seconds,
                        "layer": result.stages[0].details.get("layer") if "select" in stages else None,
                    }
                )
                args.out.write_text(json.dumps(rows, indent=1))
    for name in sorted({r["method"] for r in rows}):
        mine = [r for r in rows if r["method"] == name]
        print(
            f"{name:<28} cases={len(mine)} hits={sum(r['hit'] for r in mine)} "
            f"mean ROUGE-1 recall={sum(r['rouge1'] for r in mine) / len(mine):.3f}"
        )
        for length in sorted({r["length"] for r in mine}):
            line = " ".join(f"{r['rouge1']:.2f}" for r in mine if r["length"] == length)
            print(f"  {length:>6} tokens, depths {args.depths}: {line}")


if __name__ == "__main__":
    main()
