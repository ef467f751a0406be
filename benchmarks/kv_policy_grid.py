"""Needle grid for many KV-policy settings from one full prefill per case.

`kvsieve niah` runs every method from scratch, so comparing 15 settings of SnapKV or A2SF costs
15 full prefills per case. Their prefills are identical; only the scores taken from the prompt
and the eviction while decoding differ. This study prefills each case once (plain attention,
the whole cache kept), records the last `--capture` queries of every layer, and then, for each
setting, scores the prompt from those queries, prunes a copy of the cache to the budget and
decodes greedily with the setting's own compress or evict stage, exactly as `kvsieve niah`
would (same prompts, same scoring of the answers).

Why the captured queries suffice: SnapKV reads only its last `window` queries, and A2SF's
forgetting weights alpha^(n-1-q) are exactly 0 in float32 for all but the last few hundred
queries (the script refuses a setting whose weights reach further back than `--capture`).
H2O (alpha 1) needs every query and is not supported here.

    python benchmarks/kv_policy_grid.py --settings a2sf:alpha=0.2:recent=0,a2sf:alpha=0.2:recent=16 \\
        --lengths 2048,4096,8000 --out runs/study/kv_policy_grid.json
"""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import DynamicCache

from kvsieve import load_model
from kvsieve.attention import attention_hooks
from kvsieve.attention.accumulate import accumulation_weights
from kvsieve.compress.policy import LayerPass
from kvsieve.decode import Sampling, TextStream, eos_token_ids
from kvsieve.engine import Continuation
from kvsieve.eval.grading import contains, rouge1_recall
from kvsieve.eval.niah import prompt_case
from kvsieve.feed.full import FullPrefill
from kvsieve.registry import method
from kvsieve.spec import parse_settings


def parse_setting(text: str):
    """`a2sf:alpha=0.3:recent=16` -> the a2sf preset with evict.policy.alpha=0.3, evict.policy.recent=16.

    Short field names are looked up under the preset's compress or evict policy, so `snapkv:window=64`
    and `a2sf:alpha=0.1` work; a full path (`compress.budget=512`) is taken as given.
    """
    name, *fields = text.split(":")
    base = method(name)
    stage = "compress" if base.compress is not None else "evict"
    settings = []
    for item in fields:
        path, _, value = item.partition("=")
        settings.append(f"{path if '.' in path else f'{stage}.policy.{path}'}={value}")
    return method(name, parse_settings(settings))


def prompt_scores(policy, queries: dict[int, torch.Tensor], keys: list[torch.Tensor]) -> dict[int, torch.Tensor]:
    """Every layer's prompt scores, from its captured last queries (1, h, w, d) and its keys (1, g, n, d)."""
    return {layer: policy.prompt_scores(LayerPass(q[0], keys[layer][0])) for layer, q in queries.items()}


def greedy(model, tokenizer, cache, prefilled, evict, sampling: Sampling) -> TextStream:
    """The greedy answer on `cache` (prefilled, compressed or with `evict` started), through the engine's
    decoding step."""
    answer = TextStream(tokenizer, sampling, eos_token_ids(model, tokenizer))
    stepping, logits = Continuation(model, cache, prefilled.next_position, evict), prefilled.last_logits
    with torch.no_grad():
        while True:
            answer.add(int(torch.argmax(logits)))
            if answer.finish is not None:
                return answer
            logits = stepping.feed(answer.tokens[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--settings", required=True, help="comma-separated settings, e.g. a2sf:alpha=0.3:recent=16")
    parser.add_argument("--lengths", default="2048,4096,8000", help="prompt lengths in tokens")
    parser.add_argument("--depths", default="0,0.25,0.5,0.75,1", help="needle depths in [0, 1]")
    parser.add_argument("--probe", default="needle", choices=["needle", "passkey"], help="probe kind")
    parser.add_argument("--capture", type=int, default=512, help="last queries recorded per layer (default 512)")
    parser.add_argument("--max-new-tokens", type=int, default=48, help="answer length limit (default 48)")
    parser.add_argument(
        "--out", type=Path, default=Path("runs/study/kv_policy_grid.json"), help="result JSON (rerunning resumes it)"
    )
    args = parser.parse_args()

    names = args.settings.split(",")
    specs = {name: parse_setting(name) for name in names}
    model, tokenizer = load_model()
    lengths = [int(n) for n in args.lengths.split(",")]
    depths = [float(d) for d in args.depths.split(",")]
    for name, spec in specs.items():
        policy = (spec.compress or spec.evict).policy
        if policy.accumulates:
            _, first = accumulation_weights(float(policy.step_alpha), min(lengths))
            if min(lengths) - first > args.capture:
                raise SystemExit(f"{name}: its weights reach {min(lengths) - first} queries back; raise --capture.")
    rows = json.loads(args.out.read_text())["rows"] if args.out.exists() else []  # resume
    done = {(r["setting"], r["length"], r["depth"]) for r in rows}
    sampling = Sampling(args.max_new_tokens)
    for n in lengths:
        for d in tqdm(depths, desc=f"{args.probe} {n}", unit="case"):
            todo = {name: spec for name, spec in specs.items() if (name, n, d) not in done}
            if not todo:
                continue
            case, prompt = prompt_case(tokenizer, args.probe, n, d)
            queries: dict[int, torch.Tensor] = {}

            def capture(layer: int, query: torch.Tensor, key: torch.Tensor, into=queries) -> None:
                into[layer] = query[:, :, -args.capture :].clone()

            cache = DynamicCache(config=model.config)
            with torch.no_grad(), attention_hooks(last_pass=[capture]):
                prefilled = FullPrefill().prefill(model, prompt.ids.to(model.device), cache=cache)
            keys = [layer.keys for layer in prefilled.cache.layers]
            for name, spec in todo.items():
                stage = spec.compress or spec.evict
                run = stage.begin()
                run.scores = prompt_scores(stage.policy, queries, keys)
                copied = copy.deepcopy(prefilled.cache)
                if spec.compress is not None:
                    run.compress(copied)
                    evict_run = None
                else:
                    run.start(copied, None, model)
                    evict_run = run
                decoded = greedy(model, tokenizer, copied, prefilled, evict_run, sampling)
                rows.append(
                    {
                        "setting": name,
                        "length": n,
                        "depth": d,
                        "prompt_tokens": prompt.length,
                        "answer": decoded.text,
                        "rouge1": rouge1_recall(decoded.text, case.answer),
                        "hit": contains(decoded.text, case.answer),
                    }
                )
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps({"probe": args.probe, "rows": rows}, indent=1))
    print(f"{'setting':<36} {'hits':>6} {'ROUGE-1':>8}")
    for name in names:
        mine = [r for r in rows if r["setting"] == name and r["length"] in lengths and r["depth"] in depths]
        hits = sum(r["hit"] for r in mine)
        print(f"{name:<36} {hits:>3}/{len(mine):<2} {sum(r['rouge1'] for r in mine) / len(mine):>8.3f}")
    print(f"Saved {args.out}")


if __name__ == "__main__":
    main()
