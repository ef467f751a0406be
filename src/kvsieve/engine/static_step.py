"""A decoding step whose every number lives in a tensor, so that a GPU can record it once and replay it.

On a GPU a small model's decoding step is bound by the host, not by memory: SmolLM2-135M's step
launches hundreds of small kernels, and the H200 spent 19-24 ms per step launching them against
0.08 ms of weight reading (docs/STUDIES.md, decoding). A CUDA graph records the kernels once and
replays them with one launch. It replays the same kernels on the same memory, so nothing a step
does may depend on a Python number that changes between steps. The batch's step (`engine.batch`)
differs from one step to the next only in such numbers: each row's token, position and cache
length per layer. Here they are tensors:

- `ids` (rows, 1) and `positions` (rows, 1): each row's token and logical position;
- `lengths` and `columns` (layers, rows): each row's entries in each layer, and the column where its next entry
  goes (the same column but in a hybrid model's full ring of a sliding layer, where it wraps round the window);
- each layer writes its rows' new keys and values into its tables at `columns` and attends over the tables'
  whole capacity, the columns from `lengths + 1` (at most the window) on masked as padding (the batch's padded
  attention, the forward's `key_lengths`, whose logits are float32);
- the step advances `positions`, `lengths` and `columns` itself, so a replay needs only the tokens copied in.

A row that evicts joins in its steady state (`steady`): its cache at the budget, evicting one entry per
KV head every step (`evict.interval` 1, no re-encoding). Its new entry goes at column `budget`, the
eviction moves the newest entry into the victim's slot, and the row is back at `budget` entries: its
global layers' `columns` stay where they are, and every Python number its eviction reads (lengths, budget) is the
same at every step. The rest of its state is tensors that the step updates in place: the entries' ages
(`EvictRun.buffers`, `EntryTables`), the clock, and its running scores, which the observers
make anew each step and the eviction writes back into the tensors the step read them from. That eviction
(`EvictRun.steady_step`: every layer's victims at once, in `steady_eviction`'s tensor operators, which a GPU
records with the step, or in one pass of a CPU kernel) drops exactly the entries `EvictRun.after_step` would.

On CUDA the step is run once eagerly on a side stream (it is the step, and it warms the allocator
and cuBLAS), then captured; every later step replays the graph. The capture is valid for one
generation of the tables (their memory and capacity): the batch drops it when rows join or leave, when
the tables grow (every `SPARE` steps) or when a step has to run eagerly. The capacity is the shape
bucket: a cache growing by one entry a step is captured again once per `SPARE` steps, not every step.
The same step's forward pass can be compiled whole (`compiled_steps`, `DecodeBatch(compiled=True)`, the CLI's
`--compile-steps`): inductor fuses the norms, rotary embedding, products and attention of every layer and the Python
between them goes. On the CPU, where there is no graph to replay, that removes the Python; on CUDA the compiled step
is what gets captured, with fewer and fused kernels to replay (an H100, SmolLM2's architecture in bfloat16: 3.9 ->
1.6 ms a step for one row at 2K, docs/STUDIES.md). Every number being a tensor is what lets one graph serve every
step: the capacity is a dynamic size, so the tables' growth compiles nothing new; so is the number of rows past one
(dynamo compiles one row apart). An evicting row's observers (its policy's per-step scores, `observe_rows`; from the
attention's own probabilities, `AttentionRows` and `observe_attention_rows`, where its policy's rule reads only
those) are traced into the compiled forward as its hooks; its eviction (`EvictRun.steady_step`) runs after it.
Each policy, and each mix of policies in a batch, is a graph of its own, compiled at its first steady step. A static
step's first compiled step goes through dynamo; from its second on it calls the compiled code that dynamo's guards
choose for the second step's arguments directly (`Compiled.bound`): nothing the guards check changes within one
static step (its tables, shapes, rows and the Python values the trace read; an evicting row's scores are carried
back into the same tensors), and a new static step, when rows join or leave or the tables grow, checks them again.
Without a graph the compiled step serves up to `engine.batch.COMPILED_ROWS` rows; captured, any number (a batch with
an evicting row is captured uncompiled on CUDA: that mix has not run on a GPU yet). Eagerly, the same step is what
the tests check against the batch's ordinary step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch
from transformers import Cache, DynamicCache, PreTrainedModel

from kvsieve.attention import NO_HOOKS, AttentionRows, Hooks, Observer, attention_hooks
from kvsieve.compiled import Compiled
from kvsieve.compress.stages import EvictRun, observe_attention_rows, observe_rows
from kvsieve.kv.tables import ScatterLayer
from kvsieve.models import with_cache

log = logging.getLogger("kvsieve.engine")


def model_step(
    model: PreTrainedModel,
    ids: torch.Tensor,
    positions: torch.Tensor,
    cache: dict[str, Cache],
    key_lengths: torch.Tensor,
    hooks: Hooks | None = None,
) -> torch.Tensor:
    """The forward pass of a static step: each row's token `ids` (rows, 1) at `positions` (rows, 1), written into
    `cache` (`with_cache`'s keyword) and attending over `key_lengths[layer, row]` keys; (rows, vocab) logits.
    `hooks`: the attention's (`kvsieve.attention.NO_HOOKS` when compiled), None for the context's."""
    out = model(input_ids=ids, position_ids=positions, **cache, use_cache=True, logits_to_keep=1,
                key_lengths=key_lengths, kvsieve_hooks=hooks)  # fmt: skip
    return out.logits[:, -1]


# Guards dynamo may skip on a model's modules: that no hook was registered, that an attribute is absent, a
# module's type. A step checks thousands of guards (most of them these, one set per module); the guards on what
# the graph depends on (modules' integer constants, parameters' dtypes and shapes) stay, so a model the graph does
# not fit is compiled anew. One with other weights reuses it with its own (parameters and float constants are
# the graph's inputs).
SKIPPED_MODULE_GUARDS = frozenset(
    {"EMPTY_NN_MODULE_HOOKS_DICT", "NOT_PRESENT_IN_GENERIC_DICT", "DICT_NOT_CONTAINS", "TYPE_MATCH", "HASATTR"}
)


def step_guards(entries: list) -> list[bool]:
    """dynamo's `guard_filter_fn` for the compiled step: every guard but `SKIPPED_MODULE_GUARDS` on modules."""
    return [
        not (entry.guard_type in SKIPPED_MODULE_GUARDS and entry.orig_guard.source.is_unspecialized_nn_module())
        for entry in entries
    ]


# The CPU's compiled step (`DecodeBatch(compiled=True)`). Without inductor's size asserts: its wrapper checked the
# size and strides of every input (373 checks a step for SmolLM2), which dynamo's tensor guards check before the
# graph runs (one row, full attention at 2K, fast memory phase, alternated stretch by stretch: 19.5 -> 18.8 ms,
# docs/STUDIES.md).
compiled_steps = Compiled("decoding step", model_step, options={"guard_filter_fn": step_guards, "size_asserts": False})


def steady(evict: EvictRun | None, cache: Cache) -> bool:
    """Whether a row with this eviction (None: none) can take static steps: it evicts nothing, or it is `steady`
    (`EvictRun.steady`: at its budget, evicting one entry per KV head every step, in place)."""
    return evict is None or evict.steady(cache)


class StaticStep:
    """One generation of the batch tables' decoding step, in tensors; captured as a CUDA graph with `capture`."""

    def __init__(
        self,
        model: PreTrainedModel,
        keys: torch.Tensor,
        values: torch.Tensor,
        rows: list[tuple[EvictRun | None, Cache]],
        *,
        capture: bool,
        compiled: bool = False,
        layers: list[tuple[tuple[torch.Tensor, torch.Tensor], int]] | None = None,
        windows: list[int | None] | None = None,
    ):
        """`keys`/`values` are the batch's global tables (global layers, rows, kv_heads, capacity, d), `rows` each
        row's eviction (or None) and own cache, every one `steady`; `load` then sets where each row stands. `layers`:
        each model layer's tables (keys, values) and its slot in them (None: layer j at slot j of `keys`/`values`),
        `windows` each layer's sliding window (None: global), whose ring of that many columns a step writes round.
        `capture`: record a CUDA graph at the first run; `compiled`: run the forward pass through `compiled_steps`,
        the evicting rows' observers traced into it (their eviction, `EvictRun.steady_step`, runs after it)."""
        self.model, self.keys, self.values, self.capture = model, keys, values, capture
        # On CUDA a batch with an evicting row is captured uncompiled: its compiled observers were not yet run on a GPU.
        self.compiled = compiled and not (capture and any(evict is not None for evict, _ in rows))
        count, device = keys.shape[1], keys.device
        layers = layers if layers is not None else [((keys, values), j) for j in range(keys.shape[0])]
        windows = windows if windows is not None else [None for _ in layers]
        self.evicting = [(i, evict, cache) for i, (evict, cache) in enumerate(rows) if evict is not None]
        self.advance = [0 if evict is not None else 1 for evict, _ in rows]  # columns a row gains per step (global)
        # Per layer and row, the entries a step adds (a sliding layer's ring: one, also for an evicting row), and the
        # most a layer holds: its window, or no limit. A ring's next column wraps round at its window.
        self.step_lengths = torch.tensor(
            [[1] * count if window is not None else self.advance for window in windows], device=device
        )
        unlimited = torch.iinfo(torch.long).max // 2
        self.limits = torch.tensor([[window or unlimited] for window in windows], device=device)
        self.steady = []  # per evicting row: its row in the tables, its eviction and the tensors its scores go to
        for i, evict, _ in self.evicting:  # scores in tensors of their own, which its eviction refills every step
            self.steady.append((i, evict, evict.carried_scores()))
        groups: dict[tuple, list[tuple[int, EvictRun]]] = {}  # rows of one policy and budget score together
        for i, evict, _ in self.evicting:
            groups.setdefault((evict.config.policy, evict.budget), []).append((i, evict))
        scored = [
            (torch.tensor([i for i, _ in members], device=device), [evict for _, evict in members], budget)
            for (_, budget), members in groups.items()
        ]
        # a policy whose step rule reads only the new query's attention takes it from the attention's own pass
        self.attention_groups = [g for g in scored if g[1][0].reads_attention]
        self.groups = [g for g in scored if not g[1][0].reads_attention]
        self.ids = torch.zeros(count, 1, dtype=torch.long, device=device)
        self.positions = torch.zeros(count, 1, dtype=torch.long, device=device)
        self.lengths = torch.zeros(len(layers), count, dtype=torch.long, device=device)  # entries before the step
        self.columns = torch.zeros(len(layers), count, dtype=torch.long, device=device)  # where its entry goes
        self.row_ids = torch.arange(count, device=device)  # the cache layers' indices into the tables
        self.slots = torch.tensor([slot for _, slot in layers], device=device).view(-1, 1).expand(len(layers), count)
        self.cache = DynamicCache(config=model.config)
        indices = (self.slots, self.row_ids, self.columns)
        self.cache.layers = [ScatterLayer(j, tables, slot, indices) for j, (tables, slot) in enumerate(layers)]
        self.graph: torch.cuda.CUDAGraph | None = None
        self.compiled_calls = 0  # compiled steps run
        # from the second compiled step on, the code dynamo's guards chose, called without them (`Compiled.bound`)
        self.unguarded: Callable[..., torch.Tensor] | None = None
        self.logits: torch.Tensor | None = None  # the graph's output, overwritten by every replay
        self.capture_seconds = 0.0

    def load(self, positions: list[int], lengths: list[list[int]], columns: list[list[int]]) -> None:
        """Each row's next position, and per layer each row's entry count and the column its next entry takes
        (the same but in a full ring). The numbers go through host tensors copied into the step's own (on the
        model's device)."""
        self.positions.copy_(torch.tensor(positions).view(-1, 1))
        self.lengths.copy_(torch.tensor(lengths))
        self.columns.copy_(torch.tensor(columns))

    def run(self, tokens: list[int]) -> torch.Tensor:
        """One step with each row feeding `tokens[row]`: (rows, vocab) logits. The first run on CUDA captures
        the step; a failed capture is logged and the step's eager result returned, with `graph` left None."""
        self.ids.copy_(torch.tensor(tokens).view(-1, 1))  # a host tensor copied into the step's own
        if self.graph is not None:
            self.graph.replay()
            return self.logits.clone()
        if not self.capture:
            return self._forward()
        return self._capture()

    def _forward(self) -> torch.Tensor:
        lengths = torch.minimum(self.lengths + 1, self.limits)  # each row's keys once this step's entry is written
        # made for each step: the step holding its own bound methods would keep it alive until a garbage collection
        observers: list[Observer | AttentionRows] = [self._observe] if self.groups else []
        if self.attention_groups:
            observers.append(AttentionRows(self._observe_attention))
        with torch.no_grad(), attention_hooks(observers=observers):
            arguments = (self.model, self.ids, self.positions, with_cache(self.model, self.cache), lengths)
            hooks = Hooks(observers=tuple(observers)) if observers else NO_HOOKS  # a compiled forward reads no context
            logits = None
            if self.compiled:
                if self.compiled_calls == 1:  # bound at the second step: evicting rows' scores are carried back by then
                    self.unguarded = compiled_steps.bound(*arguments, hooks)
                logits = (self.unguarded or compiled_steps)(*arguments, hooks)
                self.compiled_calls += 1
            if logits is None:  # not compiled, or compiling failed
                logits = model_step(*arguments)
            for row, evict, carried in self.steady:  # one entry per KV head out: back at `budget`
                evict.steady_step(self.keys, self.values, row, carried)
        self.columns.add_(self.step_lengths).remainder_(self.limits)
        self.lengths.add_(self.step_lengths).clamp_(max=self.limits)
        self.positions.add_(1)
        return logits

    def _observe(self, layer: int, query: torch.Tensor, key: torch.Tensor) -> None:
        """Each evicting row's eviction observes its own query and its own keys (its `budget` entries and the new
        one); rows of one policy and budget at once (`observe_rows`)."""
        for rows, runs, budget in self.groups:
            observe_rows(runs, layer, query.index_select(0, rows), key.index_select(0, rows)[:, :, : budget + 1])

    def _observe_attention(self, layer: int, probs: torch.Tensor, kv_heads: int) -> None:
        """Each evicting row whose policy `step_reads_attention` takes its step's attention over its own keys (its
        `budget` entries and the new one) from the attention's probabilities (rows, h, capacity)."""
        for rows, runs, budget in self.attention_groups:
            observe_attention_rows(runs, layer, probs.index_select(0, rows)[:, :, : budget + 1], kv_heads)

    def _capture(self) -> torch.Tensor:
        """Run the step eagerly on a side stream, then record it. The graph takes a memory pool of its own: a
        pool shared with an earlier capture of the batch (`graph_pool_handle`) broke the next capture once that
        graph was freed (PyTorch 2.11, H100: the allocator's `use_count > 0` assertion) and the batch then
        decoded eagerly. A step's own memory is small (its activations and logits); it goes with the step."""
        start = time.perf_counter()
        device = self.keys.device
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            logits = self._forward().clone()  # this step, run eagerly (the graph's recording does not run it)
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                self.logits = self._forward()
        except Exception as error:  # e.g. a model whose forward reads a tensor on the host (a sync)
            log.warning("decoding without a CUDA graph: capturing the step failed (%s)", error)
            self.capture = False
            return logits
        self.graph = graph
        self.capture_seconds = time.perf_counter() - start
        rows, capacity = self.keys.shape[1], self.keys.shape[3]
        log.info("captured the decoding step of %d rows x %d columns in %.2f s", rows, capacity, self.capture_seconds)
        return logits
