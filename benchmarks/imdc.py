"""FM vs IM vs IMDC ("Memorize Step by Step", Zeng et al., EMNLP 2024) on the default model: perplexity, passkeys.

    python benchmarks/imdc.py --ppl-length 16384 --passkey-length 16384 --chunk 1024 --memory 1024 \\
        --schedule linear --out runs/imdc.json

Speed and peak memory are measured by `kvsieve bench --methods fm,im,imdc --baseline fm` (one
process per run, configurations interleaved, ratios within a repeat).

Configurations: fm = fixed memory m_max; im = `--schedule` growing from m_max / n to m_max;
imdc = im with decremental chunks (eq. 7). All use the same pruner, chunk, memory and 4 sinks.

Parts (`--parts`, default both):
- ppl: perplexity of `--ppl-length` tokens of the essays. The paper's last-position logits per
  chunk cannot score a text, and full-length logits would defeat the bounded memory, so every
  chunk goes through the LM head on its own forward (`ChunkedPrefill.prefill(chunk_logits=...)`):
  the logits of chunk i score the chunk's next tokens (its last position scores the next chunk's
  first token) given the memory it attended over; all L - 1 predictions are scored and only one
  chunk's logits exist at a time. When the text fits the model's context, "full" is the same loop
  with a memory that keeps every token (exact full attention, still chunk-level logits).
- passkey: IMDC's passkey probe (kvsieve.data.passkey_case) at `--passkey-length` prompt
  tokens and `--depths`, greedy answers scored by whole-word match.

Lengths far beyond the model's 8K context are fine for the chunked feeds (positions are
re-encoded every step); "full" is only added where the prompt fits.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from kvsieve.eval.perplexity import essay_ids
from kvsieve.feed.chunked import ChunkedPrefill
from kvsieve.registry import method

CONFIGS = ("fm", "im", "imdc")


def config_feed(name: str, options: dict, length: int) -> ChunkedPrefill:
    """The feed of a configuration; "full" is a chunked feed whose memory keeps every token."""
    pruner = {"feed.pruner": options["pruner"]} if options["pruner"] else {}  # None: the preset's own
    if options["window"] is not None:
        pruner["feed.pruner.window"] = options["window"]
    if name == "full":
        return method("fm", {**pruner, "feed.chunk": options["chunk"], "feed.memory": 2 * length}).feed
    settings = {**pruner, "feed.chunk": options["chunk"], "feed.memory": options["memory"]}
    if name != "fm":
        settings["feed.schedule"] = options["schedule"]
    return method(name, settings).feed


def perplexity(model, ids: torch.Tensor, feed: ChunkedPrefill) -> dict:
    """exp(mean NLL) of ids[1:], each chunk scored with the logits of its own forward."""
    total = torch.zeros((), dtype=torch.float64)
    targets = ids[0]

    def score(logits: torch.Tensor, start: int) -> None:
        nonlocal total
        stop = min(start + logits.shape[0], targets.shape[0] - 1)
        if stop <= start:
            return
        log_probs = torch.log_softmax(logits[: stop - start].float(), dim=-1)
        total += -log_probs.gather(1, targets[start + 1 : stop + 1, None]).sum().double()

    start = time.perf_counter()
    prefilled = feed.prefill(model, ids, chunk_logits=score)
    nll = float(total) / (ids.shape[1] - 1)
    return {
        "ppl": math.exp(nll),
        "nll": nll,
        "tokens": ids.shape[1],
        "steps": prefilled.details["steps"],
        "seconds": time.perf_counter() - start,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="ppl,passkey", help="ppl, passkey")
    parser.add_argument("--configs", default=",".join(CONFIGS), help="fm,im,imdc")
    parser.add_argument("--ppl-length", type=int, default=16384, help="essay tokens scored for perplexity")
    parser.add_argument("--passkey-length", type=int, default=16384, help="prompt tokens of the passkey probe")
    parser.add_argument("--depths", default="0,0.25,0.5,0.75,1", help="passkey depths")
    parser.add_argument("--chunk", type=int, default=1024)
    parser.add_argument("--memory", type=int, default=1024)
    parser.add_argument("--schedule", default="linear", help="IM / IMDC memory schedule")
    parser.add_argument(
        "--pruner",
        default=None,
        help="collie (the IMDC authors' pruner), snapkv, streaming, a2sf, h2o, local (default: the presets' own, "
        "SnapKV pooled over 63 tokens)",
    )
    parser.add_argument("--window", type=int, help="SnapKV observation window (a SnapKV pruner only; default 32)")
    parser.add_argument("--model", help="local model folder or .gguf (default: embedded SmolLM2)")
    parser.add_argument("--out", type=Path, default=Path("runs/imdc.json"))
    args = parser.parse_args()
    from kvsieve import Sampling, generate, load_model
    from kvsieve.data import prompt_case
    from kvsieve.eval.grading import contains

    configs = args.configs.split(",")
    parts = args.parts.split(",")
    if unknown := set(configs) - set(CONFIGS):
        parser.error(f"unknown configurations {sorted(unknown)}; choose from {list(CONFIGS)}")
    if unknown := set(parts) - {"ppl", "passkey"}:
        parser.error(f"unknown parts {sorted(unknown)}; choose from ppl, passkey")
    options = {
        "chunk": args.chunk,
        "memory": args.memory,
        "schedule": args.schedule,
        "pruner": args.pruner,
        "window": args.window,
    }
    for name in configs:
        config_feed(name, options, args.ppl_length)  # fail fast on bad options
    report: dict = {"options": options, "configs": configs}
    args.out.parent.mkdir(parents=True, exist_ok=True)

    if "ppl" in parts or "passkey" in parts:
        model, tokenizer = load_model(args.model)
        max_positions = model.config.max_position_embeddings
    if "ppl" in parts:
        ids = essay_ids(tokenizer, args.ppl_length)
        names = configs + (["full"] if args.ppl_length <= max_positions else [])
        print(f"perplexity: {args.ppl_length} essay tokens, chunk-level logits", flush=True)
        report["ppl"] = {}
        with torch.no_grad():
            for name in names:
                row = perplexity(model, ids, config_feed(name, options, args.ppl_length))
                report["ppl"][name] = row
                print(f"  {name:<5} ppl {row['ppl']:.3f}  ({row['steps']} steps, {row['seconds']:.1f} s)", flush=True)
        args.out.write_text(json.dumps(report, indent=1))
    if "passkey" in parts:
        depths = [float(d) for d in args.depths.split(",")]
        names = configs + (["full"] if args.passkey_length <= max_positions else [])
        print(f"passkey: {args.passkey_length} prompt tokens, depths {depths}", flush=True)
        rows = []
        for depth in depths:
            case, _ = prompt_case(tokenizer, "passkey", args.passkey_length, depth)
            for name in names:
                feed = config_feed(name, options, args.passkey_length)
                result = generate(model, tokenizer, case.context, case.question, feed=feed, sampling=Sampling(16))
                hit = contains(result.text, case.answer)
                rows.append({"config": name, "depth": depth, "answer": result.text, "key": case.answer, "hit": hit})
                print(f"  depth {depth:.2f} {name:<5} {'hit ' if hit else 'miss'} {result.text.strip()[:40]!r}")
        report["passkey"] = rows
        for name in names:
            mine = [r for r in rows if r["config"] == name]
            print(f"  {name:<5} {sum(r['hit'] for r in mine)}/{len(mine)} keys retrieved")
        args.out.write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
