"""Chunked prefill with a compressed KV memory: FM, IM and IMDC, section 3 of "Memorize Step by Step:
Efficient Long-Context Prefilling with Incremental Memory and Decremental Chunk" (Zeng et al., EMNLP 2024).

The prompt is fed chunk by chunk. At every step the model attends over
[sinks | memory | chunk]; then each layer's keys are scored with the pruner's scorer from the
chunk's own queries (per KV head: query head h votes for KV head h // n_rep) and pruned back to
the sinks plus that step's memory size. The last chunk is compressed too, so decoding starts
from sinks + m_{n-1} entries per layer. Memory sizes and chunk sizes come from
`kvsieve.feed.schedules` (FM: fixed; IM: eq. 1, 8, 9, appendix A.1, eq. 2-3; IMDC: eq. 5-7).

Positions (section 4.1: "encode position embedding for memory and chunk at each iteration
independently"). Every step places its keys contiguously:

    sinks at 0 .. s-1,  layer j's memory at P - M_j .. P - 1,  chunk at P .. P + c_i - 1,
    with P = s + max_j M_j.

Layers whose memory is smaller than the largest (square-sqrt, adaptive) are right-aligned: their
memory ends where the chunk starts, so the chunk sees its most recent memory at distance 1 in
every layer and the gap, if any, sits after the sinks. The largest position is s + max M + c_i,
however long the prompt, which is why prompts far beyond the model's trained context work
(section 4.6). After pruning, the cached post-RoPE keys are moved to their next-step positions by
rotating them by the position difference, since RoPE composes: R(a + b) = R(a) R(b). The cos/sin
of the differences come from the model's own rotary embedding (`architecture(model).rotary_emb`,
divided by its attention scaling so the magnitude is applied once) and the keys are rotated with
the rotate_half formula (`kvsieve.kv.cache.rerotate_keys`); values carry no position. The final cache stays in the
last step's frame and decoding continues at `next_position` = P + c_{n-1}, right after the last chunk.

Adaptive memory (eq. 2-3): the paper defines the retention ratio p_i^j = |M_{i-1} ∩ M_i| / |M_i|
but M_i depends on the size eq. 3 is choosing. Here it is measured from the chunk's attention at
the same step: each layer provisionally keeps its linear size b_i^j by the pruner's scores, p_i^j
is the share of that provisional memory that came from the previous memory (averaged over KV
heads), and eq. 3 then sets m_i^j = p_j / sum(p) * N * b_i^j before the real pruning. The total
over the layers is linear's; one layer can hold more than m_max.

A memory smaller than the pruner's protected tail (a SnapKV window early in IM) keeps the most
recent tokens of that tail.

Peak memory is bounded by the schedule, not the prompt length: the model holds at most
sinks + memory + chunk keys per layer, scores are (kv_heads, sinks + memory + chunk), only the
last chunk goes through the LM head (logits_to_keep=1), and no full-length tensor is built.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch
from transformers import Cache, DynamicCache, PreTrainedModel

from kvsieve.attention import attention_hooks
from kvsieve.compress.policies.collie import Collie
from kvsieve.compress.policy import Policy, observed_scores
from kvsieve.compress.scorers import keep_indices
from kvsieve.compress.stages import score_observers
from kvsieve.errors import KvsieveError
from kvsieve.feed import FeedOutput
from kvsieve.feed.question import ask_question
from kvsieve.feed.schedules import (
    SCHEDULES,
    adaptive_memory,
    decremental_chunks,
    fixed_chunks,
    layer_memory,
    num_chunks,
    retention_ratio,
)
from kvsieve.kv.cache import budgeted_layers, is_windowed, prune_layer, rerotate_keys, rotation_table, table_turn
from kvsieve.models import Rotary, architecture, with_cache
from kvsieve.spec import component, option

# chunk_logits(logits (c_i, vocab) of the chunk's tokens, index of the chunk's first token)
ChunkLogits = Callable[[torch.Tensor, int], None]


def _frame(sinks: int, memory: int, chunk_start: int, device: torch.device) -> torch.Tensor:
    """Positions of [sinks | memory]: sinks at 0 .. s-1, the memory right-aligned to end at chunk_start - 1."""
    return torch.cat(
        [torch.arange(sinks, device=device), torch.arange(chunk_start - memory, chunk_start, device=device)]
    )


@dataclass(frozen=True)
class _Layers:
    """Layers a chunk's step moves together (`ChunkedRun._groups`): their keys' positions after the pass (n,), shared,
    and their prompt indices (layers, kv_heads, n)."""

    layers: list[int]
    rotary: Rotary
    windowed: bool
    positions: torch.Tensor
    origin: torch.Tensor


def _recent(pruner: Policy, budget: int) -> int:
    """How many most recent keys the pruner always keeps at `budget`, never more than the budget.

    Position-only pruners (StreamingLLM, local window) keep the most recent `budget`; the feed's
    own sinks replace StreamingLLM's. A SnapKV window or A2SF recent tail larger than an early,
    small IM memory is cut to the memory size.
    """
    if pruner.position_only:
        return budget
    try:
        return min(pruner.protected(budget)[1], budget)
    except KvsieveError:
        return budget


def _rank_ties(scores: torch.Tensor) -> torch.Tensor:
    """Replace +inf ("always keep", e.g. SnapKV's window) by finite scores above every other, newer
    tokens higher, so that a memory smaller than the window keeps the window's most recent tokens.
    `scores` is one layer's (kv_heads, n), or several layers' (layers, kv_heads, n), each ranked by its own top.
    Computed without reading values back to the host (no device synchronisation)."""
    infinite = torch.isinf(scores) & (scores > 0)
    top = scores.masked_fill(infinite, float("-inf")).amax(dim=(-2, -1), keepdim=True)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    order = torch.arange(scores.shape[-1], dtype=scores.dtype, device=scores.device)
    return torch.where(infinite, top + 1 + order, scores)


@component("chunked", "feed")
@dataclass(frozen=True)
class ChunkedPrefill:
    """Feed the prompt in chunks with a KV memory pruned by `pruner` at every step (FM / IM / IMDC).

    chunk: chunk size c (IMDC: the first chunk and the average, eq. 5).
    memory: maximum memory m_max per layer and KV head, reached at the last step.
    schedule: "fixed" (FM) or an incremental one (IM): "linear" (eq. 1), "sqrt" (eq. 9),
        "square" (eq. 8), "square-sqrt" (appendix A.1, per layer), "adaptive" (eq. 2-3, per layer).
    decremental: IMDC's decremental chunk (eq. 7); needs an incremental schedule.
    pruner: the KV policy that scores memory + chunk: by default Collie, the IMDC authors' own
        pruner (every query of the chunk votes, pooled after the sinks, divided by how many queries
        see the key; its column sums come out of the chunk's attention pass, so it costs no second
        pass); or SnapKV (window attention of the chunk's last queries, pooled, window kept),
        A2SF / H2O (accumulated attention of the chunk's queries), TOVA (the chunk's last query),
        KNorm (key norms), StreamingLLM / LocalWindow (recency). docs/STUDIES.md ("Chunked feeds:
        the authors' pruner") has the measurements that made Collie the default.
    sinks: first tokens always kept, outside the memory budget (4 in the paper).
    trace: record, per step and layer, the prompt index and position of every attention key in
        the history (tests, or the paper's memory maps of Figures 1b and 6); off by default, as it
        grows with the prompt.
    question_guided: when `prefill` is given the prompt's question (its tail: chat's last message,
        a probe's question), every step but the last also runs the question's tokens after the
        chunk (at the positions that follow it), ranks memory + chunk by the pruner's scores from
        the question's queries instead of the chunk's own, and drops the question's KV entries
        again: the memory keeps what the question asks for, as SnapKV's observation window does in
        one pass. The cost is the question's length per step. The last chunk holds the question
        itself; a pruner that scores by the last queries (SnapKV) then ranks by the question too,
        one whose every query votes (Collie) by the whole last chunk. Beyond the paper, which
        prunes by the chunk alone.

    `prefill` returns, besides the cache, `kept_positions[j]` (kv_heads, k): the positions the
    last step kept from its keys (what a decoding-eviction stage that observed the last step must
    gather its scores with), `token_indices[j]`: the prompt indices of the final cache entries, and
    `history`: one small record per step (chunk, position, memory sizes, key counts, cache lengths).

    `FeedOutput.details`: steps, chunk_sizes, memory_sizes (per step, the largest layer's target),
    layer_memory_sizes (per step and layer, only when layers differ), attention_kv (per step,
    the largest sinks + memory + chunk attended over), max_position, kv_cache (final length).
    """

    chunk: int = option(1024, "chunk size c in tokens (IMDC: the first and the average chunk, eq. 5)")
    memory: int = option(1024, "maximum memory m_max per layer and KV head, reached at the last step")
    schedule: Literal["fixed", "linear", "sqrt", "square", "square-sqrt", "adaptive"] = option(
        "fixed", "memory growth: fixed (FM) or linear / sqrt / square / square-sqrt / adaptive (IM)"
    )
    decremental: bool = option(False, "IMDC's decremental chunks (eq. 7); needs an incremental schedule")
    pruner: Policy = option(
        help="the KV policy that prunes memory + chunk at every step (default: the IMDC authors' collie)",
        kind="policy",
        factory=Collie,
    )
    sinks: int = option(4, "first tokens always kept, outside the memory (paper 4)")
    trace: bool = option(False, "record every step's key positions in the history (tests, memory maps)")
    question_guided: bool = option(
        True, "when the prompt ends in a question, it ranks every chunk's pruning (beyond the paper)"
    )
    one_pass: ClassVar[bool] = False

    def __post_init__(self) -> None:
        for label, value in (("chunk", self.chunk), ("memory", self.memory)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise KvsieveError(f"Chunked prefill needs {label} >= 1 (tokens), got {value!r}.")
        if isinstance(self.sinks, bool) or not isinstance(self.sinks, int) or self.sinks < 0:
            raise KvsieveError(f"The sink count must be a whole number >= 0, got {self.sinks!r}.")
        if self.memory < self.sinks:
            raise KvsieveError(
                f"Memory {self.memory} is smaller than the {self.sinks} sink tokens; "
                "raise feed.memory or lower feed.sinks."
            )
        if self.schedule not in SCHEDULES:
            raise KvsieveError(f"Unknown memory schedule '{self.schedule}'; choose one of: {', '.join(SCHEDULES)}.")
        if self.decremental and self.schedule == "fixed":
            raise KvsieveError(
                "Decremental chunks (IMDC) need an incremental memory schedule: set feed.schedule to linear, sqrt, "
                "square, square-sqrt or adaptive, or drop decremental for fixed-size memory (FM)."
            )
        if not isinstance(self.pruner, Policy):
            raise KvsieveError(
                f"{self.pruner!r} is not a KV policy; use one of the registered policies (kvsieve methods)."
            )
        if self.pruner.budgets_per_layer:
            raise KvsieveError(
                f"The chunked feed's memory is one size in every layer, and {self.pruner.name} gives each layer a "
                "budget of its own; prune the memory with another policy (snapkv, h2o, collie, ...), or use "
                f"{self.pruner.name} in the compress stage."
            )
        if "second_pass" in self.pruner.reads:
            raise KvsieveError(
                f"{self.pruner.name} scores a second pass over a whole cache, which a chunk's memory is not; prune "
                "the memory with another policy (snapkv, h2o, collie, ...), or use "
                f"{self.pruner.name} in the compress stage."
            )

    @property
    def name(self) -> str:
        """'fm' (fixed memory), 'im' (incremental memory) or 'imdc' (with decremental chunks)."""
        if self.decremental:
            return "imdc"
        return "fm" if self.schedule == "fixed" else "im"

    def plan(self, length: int, num_layers: int) -> tuple[list[int], list[list[int]]]:
        """Chunk sizes (n) and memory sizes [step][layer] for a prompt of `length` tokens.

        For adaptive the memory sizes are eq. 3's linear base; the feed scales them at run time.
        IMDC takes each step's mean memory over the layers for eq. 7 (the total KV over the
        layers is then constant after step 0).
        """
        n = num_chunks(length, self.chunk)
        memory = layer_memory(self.schedule, n, self.memory, num_layers)
        if not self.decremental:
            return fixed_chunks(length, self.chunk), memory
        mean = [round(sum(step) / len(step)) for step in memory]
        return decremental_chunks(length, self.chunk, mean), memory

    def prefill(
        self,
        model: PreTrainedModel,
        ids: torch.Tensor,
        chunk_logits: ChunkLogits | None = None,
        question: int = 0,
    ) -> FeedOutput:
        """Prefill `ids` (1, L) chunk by chunk; return the compressed cache and the last token's logits.

        `chunk_logits`, when given, receives every chunk's logits (c_i, vocab) and the index of
        its first token (chunk-level perplexity); the chunks then go through the LM head in full,
        otherwise only the last chunk's last position does. `question`: how many of the last
        tokens are the prompt's question, which guides every step's pruning (`question_guided`).
        """
        if ids.ndim != 2 or ids.shape[0] != 1 or ids.shape[1] < 1:
            raise KvsieveError(f"Chunked prefill takes ids of shape (1, L) with L >= 1, got {tuple(ids.shape)}.")
        return ChunkedRun(self, model, ids.to(model.device), chunk_logits, question).run()

    def step_budgets(
        self,
        cache: Cache,
        step: int,
        base: list[int],
        scores: dict[int, torch.Tensor],
        sinks: int,
        memory: list[int],
        new_sinks: int,
    ) -> list[int]:
        """This step's memory size per layer: the schedule's, or for adaptive eq. 3 with eq. 2 measured now.

        Adaptive (step > 0): each layer provisionally keeps its linear size b_i^j by the chunk's
        scores; the share of that provisional memory that comes from the previous memory is the
        layer's retention ratio p_i^j (eq. 2, averaged over KV heads), and eq. 3 rescales b_i^j.
        """
        if self.schedule != "adaptive" or step == 0:
            return list(base)
        layers = budgeted_layers(cache)  # a windowed layer keeps its window: no share of the memory
        retention = []
        for j in layers:
            layer_scores = self._layer_scores(cache, scores, [j])[0]
            kept = keep_indices(layer_scores, new_sinks + base[j], self.sinks, _recent(self.pruner, base[j]))
            retention.append(retention_ratio(kept, sinks, sinks + memory[j], new_sinks))
        sizes = list(base)
        for j, size in zip(layers, adaptive_memory([base[j] for j in layers], retention), strict=True):
            sizes[j] = size
        return sizes

    def _layer_scores(self, cache: Cache, scores: dict[int, torch.Tensor], layers: list[int]) -> torch.Tensor:
        """The pruner's (len(layers), kv_heads, n) scores of those layers' keys (`observed_scores`), stacked (the
        layers hold as many entries), protected ones ranked by recency per layer (`_rank_ties`)."""
        stacked = torch.stack([observed_scores(scores, j, cache.layers[j].keys, self.pruner) for j in layers])
        return _rank_ties(stacked.float())

    def prune(
        self, cache: Cache, scores: dict[int, torch.Tensor], budgets: list[int], sinks: int
    ) -> list[torch.Tensor]:
        """Keep per layer and KV head the sinks and the best `budgets[j]` memory entries; return the kept positions.

        The layers that hold as many entries and keep as many are chosen together, their scores stacked: one
        ranking for all of them (each layer's rows ranked as alone), then one gather per layer."""
        kept: dict[int, torch.Tensor] = {}
        groups: dict[tuple[int, int], list[int]] = {}
        for j, budget in enumerate(budgets):
            keys = cache.layers[j].keys
            kv_heads, n = keys.shape[1], keys.shape[2]
            if n <= sinks + budget or is_windowed(cache.layers[j]):
                kept[j] = torch.arange(n, device=keys.device).expand(kv_heads, n)
            else:
                groups.setdefault((n, budget), []).append(j)
        for (_, budget), layers in groups.items():
            ranked = self._layer_scores(cache, scores, layers)  # (layers, kv_heads, n)
            chosen = keep_indices(ranked.flatten(0, 1), sinks + budget, self.sinks, _recent(self.pruner, budget))
            for j, indices in zip(layers, chosen.view(len(layers), -1, sinks + budget).unbind(0), strict=True):
                prune_layer(cache, j, indices)
                kept[j] = indices
        return [kept[j] for j in range(len(budgets))]


class ChunkedRun:
    """One prompt through a `ChunkedPrefill` (its `prefill`): the cache, and what the steps carry from one to the
    next (each layer's memory size and its entries' prompt indices, the sinks, the history)."""

    def __init__(
        self,
        feed: ChunkedPrefill,
        model: PreTrainedModel,
        ids: torch.Tensor,
        chunk_logits: ChunkLogits | None,
        question: int,
    ):
        self.feed, self.model, self.ids, self.chunk_logits = feed, model, ids, chunk_logits
        self.arch = architecture(model)
        layers, self.length, self.device = self.arch.num_layers, ids.shape[1], model.device
        self.sizes, self.targets = feed.plan(self.length, layers)
        self.cache = DynamicCache(config=model.config)
        self.windowed = set(range(layers)) - set(self.arch.global_layers)  # bounded by their window: never pruned
        self.scores: dict[int, torch.Tensor] = {}  # the pruner's scores of each layer's keys in this chunk's pass
        self.memory = [0] * layers  # memory entries per layer, sinks excluded
        heads = self.arch.num_kv_heads
        self.origin = [torch.empty(heads, 0, dtype=torch.long, device=self.device) for _ in range(layers)]
        self.sinks, self.start = 0, 0  # sink entries in the cache; prompt index of the chunk's first token
        self.history: list[dict[str, Any]] = []
        self.final_kept: list[torch.Tensor] = []
        self.step_memory: list[list[int]] = []
        self.attention_kv: list[int] = []
        self.logits, self.next_position, self.max_position = None, self.length, 0
        guided = feed.question_guided and not feed.pruner.position_only and 0 < question < self.length
        self.asked = ids[:, self.length - question :] if guided else None
        self.observers = score_observers(feed.pruner, self.scores, arch=self.arch)

    def run(self) -> FeedOutput:
        with torch.no_grad():
            for step, size in enumerate(self.sizes):
                self._step(step, size, last=step == len(self.sizes) - 1)
        return self._result()

    def _forward(self, chunk_ids: torch.Tensor, chunk_positions: torch.Tensor, end: int, last: bool) -> None:
        """The chunk's forward pass over [sinks | memory], scored by the pruner's observers unless the question
        scores this step (`ask_question`); stages that score only the feed's final cache (compress, evict) skip
        earlier passes. Only the last chunk goes through the LM head (all chunks with `chunk_logits`). `end`: the
        position after the chunk's last."""
        model, cache = self.model, self.cache
        ask = self.asked is not None and not last
        self.scores.clear()
        with attention_hooks(observers=() if ask else self.observers, intermediate=not last):
            if last or self.chunk_logits is not None:
                out = model(
                    input_ids=chunk_ids,
                    position_ids=chunk_positions[None],
                    **with_cache(model, cache),
                    use_cache=True,
                    logits_to_keep=0 if self.chunk_logits is not None else 1,
                )
                if self.chunk_logits is not None:
                    self.chunk_logits(out.logits[0], self.start)
                self.logits = out.logits[0, -1]
            else:  # no LM head at all before the last chunk
                model.model(
                    input_ids=chunk_ids,
                    position_ids=chunk_positions[None],
                    **with_cache(model.model, cache),
                    use_cache=True,
                )
        if ask:
            ask_question(model, cache, self.asked, end, self.observers, self.scores)

    def _step(self, step: int, size: int, last: bool) -> None:
        feed, cache = self.feed, self.cache
        memory, sinks, start = self.memory, self.sinks, self.start
        position = sinks + max(memory)  # P: the chunk starts right after the longest memory
        self._forward(
            self.ids[:, start : start + size],
            torch.arange(position, position + size, device=self.device),
            position + size,
            last,
        )
        self.attention_kv.append(max(sinks + m + size for m in memory))
        self.max_position = max(self.max_position, position + size - 1)
        self.start = start + size
        new_sinks = min(feed.sinks, self.start)
        budgets = feed.step_budgets(cache, step, self.targets[step], self.scores, sinks, memory, new_sinks)
        kept = feed.prune(cache, self.scores, budgets, new_sinks)
        new_memory = [0 if j in self.windowed else k.shape[1] - new_sinks for j, k in enumerate(kept)]
        next_chunk = new_sinks + max(new_memory)
        groups = self._groups(kept, position, size, start)
        for group in groups:
            indices = torch.stack([kept[j] for j in group.layers])  # (layers, kv_heads, k)
            for j, origin in zip(group.layers, group.origin.gather(2, indices).unbind(0), strict=True):
                self.origin[j] = origin
            if not last:  # the final cache stays in the last step's frame
                self._move(group, indices, position + size, new_sinks, next_chunk)
        self.step_memory.append(budgets)
        record: dict[str, Any] = {
            "step": step,
            "start": start,
            "chunk": size,
            "position": position,
            "memory": budgets,
            "keys": [sinks + m + size for m in memory],
            "cache_lengths": [cache.layers[j].keys.shape[2] for j in range(len(memory))],
        }
        if feed.trace:  # each layer's keys as the pass saw them: prompt indices (kv_heads, n), positions (n,)
            placed = {j: (g.origin[i], g.positions) for g in groups for i, j in enumerate(g.layers)}
            layers = range(len(kept))
            record.update(tokens=[placed[j][0] for j in layers], positions=[placed[j][1] for j in layers], kept=kept)
        self.history.append(record)
        if last:
            self.final_kept = kept
            self.next_position = position + size
        self.sinks, self.memory = new_sinks, new_memory

    def _groups(self, kept: list[torch.Tensor], position: int, size: int, start: int) -> list[_Layers]:
        """The layers whose keys sit at the same positions after this step's pass, keep as many and share a rotary
        embedding, with those positions and their keys' prompt indices: [sinks | memory | chunk] for a layer whose
        memory held m entries, the last n in time order for a windowed layer holding n."""
        sinks, heads, device = self.sinks, self.arch.num_kv_heads, self.device
        members: dict[tuple[Any, ...], list[int]] = {}
        for j, indices in enumerate(kept):
            held = ("window", self.cache.layers[j].keys.shape[2]) if j in self.windowed else ("memory", self.memory[j])
            members.setdefault((held, indices.shape[1], self.arch.rotary(j)), []).append(j)
        chunk_positions = torch.arange(position, position + size, device=device)
        chunk_origin = torch.arange(start, start + size, device=device)
        groups = []
        for (held, _, rotary), layers in members.items():
            kind, n = held
            if kind == "window":
                positions = torch.arange(position + size - n, position + size, device=device)
                origin = torch.arange(start + size - n, start + size, device=device).expand(len(layers), heads, n)
            else:
                positions = torch.cat([_frame(sinks, n, position, device), chunk_positions])
                past = torch.stack([self.origin[j] for j in layers])
                origin = torch.cat([past, chunk_origin.expand(len(layers), heads, size)], dim=2)
            groups.append(_Layers(layers, rotary, kind == "window", positions, origin))
        return groups

    def _move(self, group: _Layers, indices: torch.Tensor, end: int, sinks: int, next_chunk: int) -> None:
        """Re-rotate the group's kept keys (`indices`, (layers, kv_heads, k)) to their places before the next chunk:
        [sinks | memory], the memory right-aligned to end before `next_chunk`; a windowed layer's entries as one
        block, to end right before the next chunk (their distances kept). Rotating by a zero delta is exact, so every
        layer is rotated without asking the device. The deltas are made once for the group; their angles come from
        one table of every delta possible here (`rotation_table`: keys sat at 0 .. end - 1, `end` the chunk's end,
        and go to 0 .. next_chunk - 1), read per layer."""
        count, device = indices.shape[2], self.device
        if group.windowed:
            target = torch.arange(next_chunk - count, next_chunk, device=device)
        else:
            target = _frame(sinks, count - sinks, next_chunk, device)
        deltas = target - group.positions[indices]  # (layers, kv_heads, k), each in 1 - end .. next_chunk - 1
        table = rotation_table(1 - end, next_chunk, group.rotary, device)
        offsets = deltas + (end - 1)
        for i, j in enumerate(group.layers):
            turn = table_turn(table, offsets[i])
            self.cache.layers[j].keys = rerotate_keys(self.cache.layers[j].keys, deltas[i], group.rotary, turn)

    def _result(self) -> FeedOutput:
        feed, step_memory = self.feed, self.step_memory
        details: dict[str, Any] = {
            "schedule": feed.schedule,
            "pruner": feed.pruner.name,
            "steps": len(self.sizes),
            "chunk_sizes": self.sizes,
            "memory_sizes": [max(step) for step in step_memory],
            "attention_kv": self.attention_kv,
            "max_position": self.max_position,
            "kv_cache": max(self.sinks + m for m in self.memory),
            "question_tokens": self.asked.shape[1] if self.asked is not None else 0,  # 0: pruned by the chunks alone
        }
        if any(min(step) != max(step) for step in step_memory):
            details["layer_memory_sizes"] = step_memory
        return FeedOutput(
            cache=self.cache,
            last_logits=self.logits,
            next_position=self.next_position,
            details=details,
            kept_positions=self.final_kept,
            token_indices=self.origin,
            history=self.history,
        )


__all__ = ["SCHEDULES", "ChunkedPrefill", "rerotate_keys"]
