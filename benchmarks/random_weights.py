"""Save a random-weight copy of a model folder's architecture, for timing and memory runs where the weights' values
do not matter (time to first token, peak memory, KV kept: the same work whatever the weights hold).

A GPU machine that cannot reach a hub or PyPI gets a long-context model this way from its config alone (Gemma 3
270M: config and tokenizer, 33 MB, instead of 1.1 GB of weights). Retrieval figures need the real weights.

    python benchmarks/random_weights.py CONFIG_FOLDER OUT_FOLDER [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from kvsieve.loading import resolve_dtype


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", type=Path, help="folder with config.json (and the tokenizer's files)")
    parser.add_argument("out", type=Path, help="folder to write the random-weight model and the tokenizer to")
    parser.add_argument("--dtype", default="bfloat16", help="weights' dtype (default bfloat16)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    config = AutoConfig.from_pretrained(args.source)
    model = AutoModelForCausalLM.from_config(config, dtype=resolve_dtype(args.dtype))
    model.save_pretrained(args.out)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (args.source / name).is_file():
            shutil.copy(args.source / name, args.out / name)
    print(f"random-weight {config.model_type} ({sum(p.numel() for p in model.parameters()) / 1e6:.0f}M) in {args.out}")


if __name__ == "__main__":
    main()
