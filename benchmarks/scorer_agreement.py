"""Whether a question-agnostic scorer ranks a context as its question will: the share of the top entries by the
question's own attention that each scorer, reading the context alone, also puts in its top (per layer, averaged
over KV heads), against KNorm, the newest entries and a random choice, and how much of each top lies in the context's
newest entries; then each method's answer at each budget.

    python benchmarks/scorer_agreement.py --length 2000 --depth 0.5 --budgets 0.25,0.5

SmolLM2 float32, one passkey prompt. Quality only (the answers do not depend on timing): it may share the machine.
"""

from __future__ import annotations

import argparse
import json

import torch

from kvsieve import Sampling, load_model, method, run
from kvsieve.attention import PassReader, attention_hooks
from kvsieve.compress.policies.expected_attention import ExpectedAttention
from kvsieve.compress.policies.snapkv import SnapKV
from kvsieve.compress.policy import LayerPass
from kvsieve.data import prompt_case
from kvsieve.models import architecture

SINKS = 4


def overlap(scores: torch.Tensor, reference: torch.Tensor, top: int) -> float:
    """Share of `reference`'s `top` entries per KV head that `scores` also ranks in its top, averaged over heads."""
    mine, theirs = scores.topk(top, dim=1).indices, reference.topk(top, dim=1).indices
    shared = [len(set(a.tolist()) & set(b.tolist())) for a, b in zip(mine, theirs, strict=True)]
    return sum(shared) / (top * scores.shape[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=2000, help="passkey prompt tokens (default 2000)")
    parser.add_argument("--depth", type=float, default=0.5, help="where the key sits (default 0.5)")
    parser.add_argument("--share", type=float, default=0.25, help="the top share of the context compared (0.25)")
    parser.add_argument("--layers", default="2,8,15,22,29", help="layers compared")
    parser.add_argument("--budgets", default="0.25,0.5", help="budgets the answers are asked at")
    parser.add_argument("--methods", default="snapkv,expected-attention,kvzip", help="methods answering")
    args = parser.parse_args()
    model, tokenizer = load_model(dtype=torch.float32)
    _, prompt = prompt_case(tokenizer, "passkey", args.length, args.depth)
    context = prompt.context_start + prompt.context_len
    passes: dict[int, tuple[torch.Tensor, ...]] = {}

    def keep(layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        passes[layer] = (query[0], key[0], value[0])

    with torch.no_grad(), attention_hooks(observers=[PassReader(keep)]):
        model(prompt.ids)
    arch = architecture(model)
    generator = torch.Generator().manual_seed(0)
    for layer in (int(j) for j in args.layers.split(",")):
        query, key, value = passes[layer]
        question = SnapKV(window=prompt.length - context, pool_size=1).prompt_scores(LayerPass(query, key))
        reference = question[:, SINKS:context]  # the question's attention to the context's entries
        alone = LayerPass(query[:, :context], key[:, :context], value[:, :context], arch.rotary(layer))
        scorers = {
            "expected-attention": ExpectedAttention(sinks=SINKS).prompt_scores(alone)[:, SINKS:],
            "knorm": -key[:, SINKS:context].float().norm(dim=-1),
            "newest": torch.arange(context - SINKS, dtype=torch.float32).expand(key.shape[0], -1),
            "random": torch.rand(reference.shape, generator=generator),
        }
        top = int(reference.shape[1] * args.share)
        agreement = {name: round(overlap(s, reference, top), 3) for name, s in scorers.items()}
        last = reference.shape[1] - top  # where the context's last `share` starts
        newest = {  # the share of each one's top entries that lie in the context's last `share`
            name: round(float((s.topk(top, dim=1).indices >= last).float().mean()), 3)
            for name, s in {"question": reference, "expected-attention": scorers["expected-attention"]}.items()
        }
        line = {"layer": layer, "top_share": args.share, "agreement": agreement, "top_in_newest": newest}
        print(json.dumps(line), flush=True)
    for name in args.methods.split(","):
        for budget in (float(b) for b in args.budgets.split(",")):
            spec = method(name, {"compress.budget": budget})
            answer = run(model, tokenizer, prompt, method=spec, sampling=Sampling(max_new_tokens=8)).text
            print(json.dumps({"method": name, "budget": budget, "answer": answer}), flush=True)


if __name__ == "__main__":
    main()
