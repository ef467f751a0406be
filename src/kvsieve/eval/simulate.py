"""A2SF's evaluation protocol: eviction replayed at every position of a teacher-forced pass.

`SimulatedEviction` is a prefill attention. For each layer it walks the sequence row by
row as if it were being generated: row i attends only to the tokens the policy still holds
(plus itself), the policy then folds that row into its running score and evicts down to the
budget. Nothing evicted ever comes back. The model's log-likelihood of real text under this
attention measures a policy's effect on quality; `cosine` reproduces the A2SF paper's Table 2:
the cosine similarity between each row's attention under the policy and under ideal pruning
(softmax over the row's own top-`budget` logits), averaged over the rows where pruning is active.
"""

from __future__ import annotations

import math

import torch
from transformers import PreTrainedModel

from kvsieve.attention import attention_hooks
from kvsieve.attention.dense import bottom_right_causal_mask
from kvsieve.compress.policy import Policy
from kvsieve.errors import KvsieveError
from kvsieve.models import logit_scale


class SimulatedEviction:
    """Prefill attention replaying per-step eviction with `method` at `budget` tokens per KV head."""

    def __init__(self, method: Policy, budget: int, chunk: int = 256) -> None:
        if not (method.position_only or method.step_alpha is not None):
            raise KvsieveError(
                f"{method.name} has no accumulating per-step rule to simulate; use h2o, a2sf, streaming or local."
            )
        if budget < 1:
            raise KvsieveError(f"Budget must be at least 1 token, got {budget}.")
        self.method, self.budget, self.chunk = method, budget, chunk
        self.protected = method.protected(budget)
        self.cosine_sum, self.cosine_rows = 0.0, 0
        self.kept: torch.Tensor | None = None  # (kv_heads, n) what the last layer still held at the end

    @property
    def cosine(self) -> float:
        """Mean cosine similarity to ideal pruning over pruned rows, heads and layers (nan if none)."""
        return self.cosine_sum / self.cosine_rows if self.cosine_rows else math.nan

    def __call__(
        self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float | None
    ) -> torch.Tensor:
        _, heads, n, dim = query.shape
        kv_heads = key.shape[1]
        if key.shape[2] != n:
            raise KvsieveError("Simulated eviction needs the whole sequence in one pass (no cache, no chunks).")
        scale = logit_scale(dim, scaling)
        n_rep = heads // kv_heads
        q = query[0].float().view(kv_heads, n_rep, n, dim)
        k, v = key[0].float(), value[0].float()
        device = query.device
        kept = torch.zeros(kv_heads, n, dtype=torch.bool, device=device)
        state = torch.zeros(kv_heads, n, device=device)
        out = torch.empty(kv_heads, n_rep, n, dim, device=device)
        alpha = self.method.step_alpha
        sinks, recent = self.protected
        heads_index = torch.arange(kv_heads, device=device)
        for start in range(0, n, self.chunk):
            stop = min(start + self.chunk, n)
            logits = torch.einsum("grcd,gnd->grcn", q[:, :, start:stop], k[:, :stop]) * scale
            logits = logits.masked_fill(~bottom_right_causal_mask(stop - start, stop, device), float("-inf"))
            probs = torch.empty_like(logits)  # (g, r, c, stop): each row's attention under the policy
            for i in range(start, stop):
                kept[:, i] = True
                row = logits[:, :, i - start, : i + 1].masked_fill(~kept[:, None, : i + 1], float("-inf"))
                p = row.softmax(-1)
                probs[:, :, i - start, : i + 1] = p
                probs[:, :, i - start, i + 1 :] = 0
                if alpha is not None:
                    state[:, : i + 1] = alpha * state[:, : i + 1] + p.sum(1)
                if i + 1 > self.budget:
                    # One new token per step, so exactly one eviction per KV head: the lowest-scored
                    # unprotected entry (sinks = first positions, recent = newest positions).
                    candidates = state[:, : i + 1].masked_fill(~kept[:, : i + 1], float("inf"))
                    candidates[:, :sinks] = float("inf")
                    if recent:
                        candidates[:, max(i + 1 - recent, 0) :] = float("inf")
                    kept[heads_index, candidates.argmin(1)] = False
            out[:, :, start:stop] = probs @ v[:, None, :stop]
            self._compare_with_ideal(logits, probs, start)
        self.kept = kept
        return out.view(heads, n, dim).to(query.dtype)[None]

    def _compare_with_ideal(self, logits: torch.Tensor, probs: torch.Tensor, start: int) -> None:
        """Cosine of each pruned row's attention to ideal pruning (softmax over its top-budget logits)."""
        rows = torch.arange(start, start + logits.shape[2], device=logits.device)
        pruned = rows + 1 > self.budget
        if not pruned.any():
            return
        logits, probs = logits[:, :, pruned], probs[:, :, pruned]
        top = logits.topk(min(self.budget, logits.shape[-1]), dim=-1).indices
        ideal = torch.full_like(logits, float("-inf")).scatter(-1, top, logits.gather(-1, top)).softmax(-1)
        cosine = torch.nn.functional.cosine_similarity(probs, ideal, dim=-1)
        self.cosine_sum += float(cosine.sum())
        self.cosine_rows += cosine.numel()


def sequence_nll(
    model: PreTrainedModel, ids: torch.Tensor, replay: SimulatedEviction | None = None, chunk: int = 512
) -> torch.Tensor:
    """Teacher-forced negative log-likelihood of ids[1:] (n - 1,), under `replay` if given.

    Logits are computed in chunks of positions, never for the whole sequence at once.
    """
    ids = ids.to(model.device)
    with torch.no_grad(), attention_hooks(prefill=replay):
        hidden = model.model(input_ids=ids, use_cache=False).last_hidden_state[0, :-1]
        head = model.get_output_embeddings()
        targets = ids[0, 1:]
        parts = [
            torch.nn.functional.cross_entropy(
                head(hidden[s : s + chunk]).float(), targets[s : s + chunk], reduction="none"
            )
            for s in range(0, hidden.shape[0], chunk)
        ]
    return torch.cat(parts)


def compare_policies(
    model: PreTrainedModel, ids: torch.Tensor, methods: dict[str, Policy], budget: int | float
) -> list[dict]:
    """Perplexity and Table-2 cosine of each policy on `ids`, with full attention as the first row."""
    from tqdm import tqdm

    from kvsieve.kv.cache import resolve_budget

    count, _ = resolve_budget(budget, ids.shape[1])
    full = sequence_nll(model, ids).mean().item()
    rows = [{"method": "full", "budget": ids.shape[1], "nll": full, "ppl": math.exp(full), "cosine": 1.0}]
    for label, method in tqdm(methods.items(), desc="simulating", unit="policy"):
        replay = SimulatedEviction(method, count)
        nll = sequence_nll(model, ids, replay).mean().item()
        rows.append({"method": label, "budget": count, "nll": nll, "ppl": math.exp(nll), "cosine": replay.cosine})
    return rows
