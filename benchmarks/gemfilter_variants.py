"""Which GemFilter scoring keeps the needle? Per-layer recall of several scoring options at once.

For every probe (essay needle or passkey, lengths x depths) one full forward pass of the model
scores each layer with every variant, the way `kvsieve calibrate` scores one: the fraction of
the needle's tokens inside the variant's top-k at that layer. A variant is a set of GemFilter
options (`queries`, `softmax`, `kernel`, `block`), named like `q32-soft-k5-b1`.

    python benchmarks/gemfilter_variants.py --probe needle --lengths 2048,4096,8000 --out runs/study/gf_variants.json

The table printed at the end gives each variant's recall at the filter layer (default: the
middle layer, what GemFilter uses) and at its best layer.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from tqdm import tqdm

from kvsieve import load_model
from kvsieve.data import PROBES
from kvsieve.select.calibrate import layer_recall
from kvsieve.select.gemfilter import GemFilter

DEFAULT_VARIANTS = (
    "q1-raw-k5-b1,q1-soft-k5-b1,q1-raw-k15-b1,q8-soft-k5-b1,q32-soft-k5-b1,q32-raw-k5-b1,"
    "q32-soft-k15-b1,q32-soft-k5-b16,q32-soft-k5-b32,q32-soft-k5-b64,q1-raw-k5-b32"
)


def parse_variant(name: str) -> GemFilter:
    """`q32-soft-k5-b16` -> GemFilter(queries=32, softmax=True, kernel=5, block=16)."""
    try:
        queries, scoring, kernel, block = name.split("-")
        return GemFilter(
            queries=int(queries.removeprefix("q")),
            softmax={"soft": True, "raw": False}[scoring],
            kernel=int(kernel.removeprefix("k")),
            block=int(block.removeprefix("b")),
        )
    except (ValueError, KeyError) as error:
        raise SystemExit(
            f"Bad variant '{name}': write q<queries>-<soft|raw>-k<kernel>-b<block>, e.g. q32-soft-k5-b16."
        ) from error


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--probe", choices=sorted(PROBES), default="needle", help="probe kind (default needle)")
    parser.add_argument("--lengths", default="2048,4096,8000", help="probe context lengths in tokens")
    parser.add_argument("--depths", default="0,0.25,0.5,0.75,1", help="needle depths in [0, 1]")
    parser.add_argument("--k", type=int, default=1024, help="tokens kept (default 1024, GemFilter's k)")
    parser.add_argument("--variants", default=DEFAULT_VARIANTS, help="comma-separated variant names")
    parser.add_argument("--layer", type=int, help="filter layer to report (default: the middle layer)")
    parser.add_argument("--out", type=Path, default=Path("runs/study/gemfilter_variants.json"), help="result JSON")
    args = parser.parse_args()

    names = args.variants.split(",")
    selectors = [parse_variant(name) for name in names]
    model, tokenizer = load_model()
    lengths = [int(n) for n in args.lengths.split(",")]
    depths = [float(d) for d in args.depths.split(",")]
    grid = [(n, d) for n in lengths for d in depths]
    rows = []
    for n, d in tqdm(grid, desc="probes", unit="probe"):
        recall = layer_recall(model, tokenizer, PROBES[args.probe](tokenizer, n, d), args.k, selectors)
        rows.append(
            {"length": n, "depth": d, "recall": {name: r.tolist() for name, r in zip(names, recall, strict=True)}}
        )
    layers = len(rows[0]["recall"][names[0]])
    layer = args.layer if args.layer is not None else layers // 2
    mean = {name: torch.tensor([row["recall"][name] for row in rows]).mean(0) for name in names}
    summary = {
        name: {"at_layer": float(m[layer]), "best_layer": int(m.argmax()), "best": float(m.max())}
        for name, m in mean.items()
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps({"probe": args.probe, "k": args.k, "layer": layer, "cases": rows, "summary": summary}, indent=1)
    )
    print(f"{args.probe} recall of the needle's tokens in the top {args.k}, mean over {len(grid)} probes")
    print(f"{'variant':<20} {'layer ' + str(layer):>9} {'best layer':>11} {'best':>6}")
    for name, row in summary.items():
        print(f"{name:<20} {row['at_layer']:>9.3f} {row['best_layer']:>11} {row['best']:>6.3f}")
    print(f"Saved {args.out}")


if __name__ == "__main__":
    main()
