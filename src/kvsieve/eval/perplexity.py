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
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from kvsieve.engine import forced_logits, prefill
from kvsieve.errors import KvsieveError
from kvsieve.eval import records
from kvsieve.eval.methods import check_lengths
from kvsieve.models import architecture
from kvsieve.prompt import Prompt
from kvsieve.spec import MethodSpec


def continuation_nll(model: PreTrainedModel, ids: torch.Tensor, context_len: int, spec: MethodSpec) -> dict[str, Any]:
    """Mean NLL of ids[context_len:] given ids[:context_len] prefilled through `spec`'s stages.

    ids is (1, n). Returns nll, ppl, the scored token count, time to first token and cache size.
    """
    tokens = ids.shape[1] - context_len
    if context_len < 1 or tokens < 1:
        raise KvsieveError(f"Need a context and at least one token to score; got {context_len} and {tokens}.")
    prompt = Prompt(ids=ids[:, :context_len], context_start=0, context_len=context_len)
    targets = ids[0, context_len:].to(model.device)
    with torch.no_grad():
        done = prefill(model, prompt, method=spec, reserve=tokens)
        logits = forced_logits(model, done, targets)
        nll = torch.nn.functional.cross_entropy(logits.float(), targets).item()
    return {
        "nll": nll,
        "ppl": math.exp(nll),
        "tokens": tokens,
        "ttft_s": done.seconds,
        "kv_length": done.kv_length,
    }


def essay_ids(tokenizer: PreTrainedTokenizerBase, count: int) -> torch.Tensor:
    """The first `count` tokens of the essays haystack as (1, count) ids."""
    from kvsieve.data import haystack_ids

    ids = haystack_ids(tokenizer, count)
    if len(ids) < count:
        raise KvsieveError(f"The essays have {len(ids)} tokens, fewer than the {count} this run needs.")
    return torch.tensor([ids[:count]], device="cpu")  # host ids; moved to the model by the pipeline


def run_perplexity(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    specs: Mapping[str, MethodSpec],
    lengths: Sequence[int],
    out: Path,
    *,
    tokens: int = 192,
    model_name: str | None = None,
    fresh: bool = False,
) -> dict[str, Any]:
    """Continuation perplexity of every (length, method) not yet in `out`, saving after each."""
    if tokens < 2:
        raise KvsieveError(f"Score at least 2 continuation tokens, got {tokens}.")
    check_lengths(specs, list(lengths), tokens, architecture(model).max_positions)
    methods = list(specs)
    settings = {
        "methods": {name: spec.to_dict() for name, spec in specs.items()},
        "tokens": tokens,
        "text_end": max(lengths),
        **records.model_settings(model, model_name),
    }
    document = records.open_results(out, "ppl", settings, fresh=fresh)
    end = max(lengths)
    ids = essay_ids(tokenizer, end + tokens)
    done = {(r["method"], r["length"]) for r in document["rows"]}
    todo = [(n, m) for n in lengths for m in methods if (m, n) not in done]
    for length, method in tqdm(todo, desc="perplexity", unit="run"):
        row = continuation_nll(model, ids[:, end - length :], length, specs[method])
        document["rows"].append({"method": method, "length": length, **row})
        records.save(out, document)
    if not todo:
        records.save(out, document)
    return document
