"""Full attention through kvsieve against transformers' own `generate` (its SDPA attention, masks and caches, sliding
windows included) on a passkey prompt: are the greedy tokens the same?

    python benchmarks/transformers_tokens.py --model gemma3-270m --length 16384 --tokens 16
"""

from __future__ import annotations

import argparse
import time

import torch

from kvsieve import Sampling, load_model, run
from kvsieve.data import prompt_case


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="model (default: the embedded SmolLM2), e.g. gemma3-270m")
    parser.add_argument("--length", type=int, default=16384, help="prompt tokens (default 16384)")
    parser.add_argument("--depth", type=float, default=0.5, help="the key's depth in the context (default 0.5)")
    parser.add_argument("--tokens", type=int, default=16, help="greedy tokens compared (default 16)")
    args = parser.parse_args()
    model, tokenizer = load_model(args.model)
    case, prompt = prompt_case(tokenizer, "passkey", args.length, args.depth)
    start = time.perf_counter()
    ours = run(model, tokenizer, prompt, sampling=Sampling(args.tokens, ignore_eos=True)).tokens
    seconds = time.perf_counter() - start
    model.set_attn_implementation("sdpa")
    start = time.perf_counter()
    with torch.no_grad():
        ids = prompt.ids.to(model.device)
        out = model.generate(ids, max_new_tokens=args.tokens, do_sample=False, eos_token_id=None)
    theirs = out[0, prompt.length :].tolist()
    print(f"{prompt.length} prompt tokens; kvsieve {seconds:.1f} s, transformers {time.perf_counter() - start:.1f} s")
    print(f"equal: {ours == theirs}")
    print(f"kvsieve:      {tokenizer.decode(ours)!r}\ntransformers: {tokenizer.decode(theirs)!r}")
    print(f"the key: {case.answer}")


if __name__ == "__main__":
    main()
