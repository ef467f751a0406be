"""Perplexity of real text under any configuration: a compressed context, then teacher forcing.

Each method handles a context the way it handles a prompt (selection, chunked feed, sparse
prefill attention, compression), then the next `tokens` tokens of the text are teacher-forced
on top of the resulting cache, under the per-step eviction rule where the method has one.
Perplexity is exp(mean NLL) of those continuation tokens, the first one predicted by the
prefill's last logits. This one protocol fits every method (GemFilter has no per-position logits
over its prompt, so a whole-text perplexity would not), and it is what a user feels: how well
the model continues after its context was compressed.

The continuation is the same text for every length: contexts are the `length` tokens right
before position max(lengths) of the essays, so longer contexts only add earlier text.
Without an eviction rule the continuation runs as one forward pass (identical to feeding it
token by token); with one, token by token so that eviction happens after every step.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from kvsieve.attention import attention_hooks
from kvsieve.decode import extend
from kvsieve.errors import KvsieveError
from kvsieve.eval import records
from kvsieve.eval.methods import MethodOptions, check_lengths
from kvsieve.models import architecture
from kvsieve.pipeline import prefill
from kvsieve.prompt import Prompt


def continuation_nll(model: PreTrainedModel, ids: torch.Tensor, context_len: int, stages: dict) -> dict[str, Any]:
    """Mean NLL of ids[context_len:] given ids[:context_len] prefilled through `stages`.

    ids is (1, n). Returns nll, ppl, the scored token count, time to first token and cache size.
    """
    tokens = ids.shape[1] - context_len
    if context_len < 1 or tokens < 1:
        raise KvsieveError(f"Need a context and at least one token to score; got {context_len} and {tokens}.")
    prompt = Prompt(ids=ids[:, :context_len], context_start=0, context_len=context_len)
    targets = ids[0, context_len:]
    with torch.no_grad():
        done = prefill(model, prompt, reserve=tokens, **stages)
        cache, position = done.prefilled.cache, done.prefilled.next_position
        logits = [done.prefilled.last_logits[None]]
        evict = stages.get("evict")
        if tokens > 1 and evict is None:
            logits.append(extend(model, cache, targets[None, :-1], position, logits_to_keep=tokens - 1))
        elif tokens > 1:
            with attention_hooks(observers=[evict.observe]):
                for step, token in enumerate(targets[:-1].tolist()):
                    logits.append(extend(model, cache, torch.tensor([[token]]), position + step))
                    evict.after_step(cache)
        nll = torch.nn.functional.cross_entropy(torch.cat(logits).float(), targets).item()
    return {
        "nll": nll,
        "ppl": math.exp(nll),
        "tokens": tokens,
        "ttft_s": done.seconds,
        "kv_length": done.kv_length,
    }


def essay_ids(tokenizer: PreTrainedTokenizerBase, count: int) -> torch.Tensor:
    """The first `count` tokens of the essays haystack as (1, count) ids."""
    from kvsieve.eval.data import haystack_text

    ids = tokenizer(haystack_text(), add_special_tokens=False)["input_ids"]
    if len(ids) < count:
        raise KvsieveError(f"The essays have {len(ids)} tokens, fewer than the {count} this run needs.")
    return torch.tensor([ids[:count]])


def run_perplexity(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    methods: Sequence[str],
    lengths: Sequence[int],
    out: Path,
    *,
    tokens: int = 192,
    options: MethodOptions | None = None,
    model_name: str | None = None,
    fresh: bool = False,
) -> dict[str, Any]:
    """Continuation perplexity of every (length, method) not yet in `out`, saving after each."""
    options = options or MethodOptions()
    if tokens < 2:
        raise KvsieveError(f"Score at least 2 continuation tokens, got {tokens}.")
    check_lengths(list(methods), list(lengths), tokens, architecture(model).max_positions)
    stages = {m: options.stages(m) for m in methods}  # validates every option before any work
    settings = {
        "methods": list(methods),
        "options": options.__dict__,
        "tokens": tokens,
        "text_end": max(lengths),
        "model": model_name,
    }
    document = records.open_results(out, "ppl", settings, fresh=fresh)
    end = max(lengths)
    ids = essay_ids(tokenizer, end + tokens)
    done = {(r["method"], r["length"]) for r in document["rows"]}
    todo = [(n, m) for n in lengths for m in methods if (m, n) not in done]
    for length, method in tqdm(todo, desc="perplexity", unit="run"):
        row = continuation_nll(model, ids[:, end - length :], length, stages[method])
        document["rows"].append({"method": method, "length": length, **row})
        records.save(out, document)
    if not todo:
        records.save(out, document)
    return document
