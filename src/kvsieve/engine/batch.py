"""Continuous batching: the decoding steps of every running request as one forward pass.

Requests differ in cache length (per layer, after their own compression), logical position,
method and eviction budget. The batch keeps every running request's cache in one key and one
value table (`kv.tables`), (layers, rows, kv_heads, capacity, head_dim): row b's entries of
layer j are columns 0 .. n - 1 of `table[j, b]`, padded on the right up to the longest row. Each row's cache layers are
`DecodeBuffer`s over its slices of the tables. A hybrid model's sliding layers are kept apart, in ring tables as
wide as their window (`WindowBuffer`: a step's entry replaces the oldest once the window is full), so the global
tables, their padding and their evictions hold the global layers alone. A step

1. feeds each row's next token at its own logical position (position ids per row),
2. writes each row's new key and value at its own next column, in place (no copy of the caches
   per step, which at 8 requests of 2K tokens would cost several times the forward pass), while
   kvsieve's attention masks the padding of rows shorter than the longest
   (the forward's `key_lengths`) and the rows' eviction observers each see their own query
   and keys,
3. lets each row's eviction compact that row in place (`EvictRun.after_step` on the row's buffers:
   at most the evicted count of entries moves per layer and KV head).

One request alone is the same step with one row and no padding: the fastest batch-1 path. While a row's KV heads
hold their own counts (per-head budgets, `kv.heads`), the global layers' tables are segmented (`kv.tables`): each
row's heads hold exactly their entries plus room, the step writes after each head's own and the attention reads the
segments; such a batch takes no evicting row (the scheduler holds those until it is padded again) and no static
step. In both, an
eviction whose step rule reads only the new query's attention (H2O, A2SF, TOVA) takes it from the step's own
attention (`AttentionRows`: the CPU kernel's one pass over the keys). A row keeps its columns
while others join and leave, so its eviction's record of entry ages stays valid; the tables are
rebuilt (one copy of the live entries) only when rows join or leave, or when the longest row
outgrows the capacity, then with room for `SPARE` more steps. A row that leaves takes a copy of
its entries with it (its request's result keeps its cache), and the tables' memory is freed.

While every row is `steady` (it evicts nothing, or it evicts one entry per step from a cache at its
budget), the step is a static one (`engine.static_step`): every number it depends on is a tensor, and
on CUDA it is captured once per generation of the tables as a CUDA graph and replayed (`static=None`:
on CUDA unless the switch `cuda_graphs` is off). The rows' buffers then learn of the entries written in the
tables lazily (`_settle`), before anything reads them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from transformers import Cache, DynamicCache, PreTrainedModel

from kvsieve import fast_paths
from kvsieve.attention import AttentionRows, attention_hooks
from kvsieve.compress.stages import EvictRun
from kvsieve.engine.static_step import StaticStep, steady
from kvsieve.errors import KvsieveError
from kvsieve.kernels.native import build_kernels
from kvsieve.kv.cache import kv_entries
from kvsieve.kv.heads import is_segmented
from kvsieve.kv.tables import BatchTables
from kvsieve.models import with_cache

SPARE = 128  # columns of room for new tokens when the tables are (re)allocated
# Rows up to which a CPU batch takes compiled steps (`compiled`; the products' C++ kernel, which the step calls for
# several rows, takes up to 8). SmolLM2, full attention at 2K, ordinary -> compiled: 4 rows 55.8 -> 43.9 ms, 8 rows
# 85.9 -> 70.2; int8 weights 41.8 -> 31.1 and 62.8 -> 51.3 (docs/STUDIES.md).
COMPILED_ROWS = 8


@dataclass
class Row:
    """One request in the batch: the token it feeds next, that token's logical position, its eviction."""

    token: int
    position: int
    evict: EvictRun | None = None


def cuda_graphs_enabled(model: PreTrainedModel) -> bool:
    """Whether `model`'s decoding steps are captured as CUDA graphs by default: on CUDA, unless the switch
    `cuda_graphs` is off (`kvsieve.fast_paths`; a model whose forward cannot be captured is also detected and
    decoded eagerly, with a warning)."""
    return model.device.type == "cuda" and fast_paths.current().cuda_graphs


def compiled_steps_enabled(model: PreTrainedModel) -> bool:
    """Whether `model`'s decoding steps run compiled by default: on a CPU or CUDA, with the switch
    `compiled_steps` on (`kvsieve.fast_paths`; the CLI's `--compile-steps`). Off by default: compiling
    SmolLM2's step takes 1.5-2.5 minutes on a 2-core machine, more than a short answer's whole decode, and
    80-90 s per graph on the H100's machine; on CUDA the compiled step is then captured as a CUDA graph."""
    return model.device.type in ("cpu", "cuda") and fast_paths.current().compiled_steps


def warm_up(model: PreTrainedModel) -> float:
    """Build now what `model`'s CPU decoding steps will run, so that no request waits for it; seconds spent:
    the C++ kernels (`kvsieve.kernels.native.build_kernels`) and, with compiled steps on, the step's two graphs (one
    row, and several: a short prompt's steps through a batch of one row, then of two)."""
    start = time.perf_counter()
    build_kernels(model)
    if compiled_steps_enabled(model):
        batch = DecodeBatch(model)
        with torch.no_grad():
            for _ in range(2):
                cache = DynamicCache(config=model.config)
                model(input_ids=torch.zeros((1, 4), dtype=torch.long, device=model.device), **with_cache(model, cache))
                batch.add(Row(0, 4), cache)
                batch.step()
                batch.step()
        batch.remove(list(batch.rows))
    return time.perf_counter() - start


class DecodeBatch:
    """The running requests' caches in shared tables, stepped together (one row: a lone request)."""

    def __init__(self, model: PreTrainedModel, static: bool | None = None, compiled: bool | None = None):
        """`static`: step the batch through `StaticStep` (captured as a CUDA graph on CUDA) while every row is
        `steady`; None: `cuda_graphs_enabled(model)` or `compiled`. `compiled`: static steps whose forward pass is
        compiled (evicting rows' observers in it), for up to `COMPILED_ROWS` steady rows (other batches take the
        ordinary step); on CUDA with graphs, every captured step's but where a row evicts (captured uncompiled);
        None: `compiled_steps_enabled(model)`."""
        self.model = model
        self.tables = BatchTables(model)  # every row's cache, in shared tables (`kv.tables`)
        self.compiled = compiled_steps_enabled(model) if compiled is None else compiled
        self.static = (cuda_graphs_enabled(model) or self.compiled) if static is None else static
        self.capture = cuda_graphs_enabled(model)  # off for good once a capture has failed
        self.rows: list[Row] = []
        self.static_step: StaticStep | None = None  # the current tables' static step, once one ran
        self.behind = 0  # static steps whose entries the rows' buffers do not show yet
        self.captures = 0  # CUDA graphs captured, and the seconds they took (warm-up step included)
        self.capture_seconds = 0.0

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def nbytes(self) -> int:
        """Bytes of the shared tables and rings, as allocated (`BatchTables.nbytes`)."""
        return self.tables.nbytes

    @property
    def caches(self) -> list[Cache]:
        """Each row's own cache object, its layers buffers over the tables."""
        return self.tables.caches

    def entries(self, index: int) -> int:
        """KV entries per layer and KV head that row `index` holds (its first global layer's; a model without one:
        its first ring's)."""
        if self.tables.segmented:  # per-head budgets: their mean count
            return kv_entries(self.caches[index])
        layer = self.tables.order[0]
        window = self.tables.windows[layer]
        entries = self.caches[index].layers[layer].length + self._pending(index, sliding=window is not None)
        return entries if window is None else min(entries, window)

    def add(self, row: Row, cache: Cache) -> None:
        """Join one row (`join`)."""
        self.join([(row, cache)])

    def join(self, joining: list[tuple[Row, Cache]]) -> None:
        """Join rows, each with its own cache (batch 1) prefilled for it: their entries move into the tables in one
        rebuild (rows joining one at a time would copy every earlier row's entries again), and their caches' layers
        become views of them."""
        for row, cache in joining:
            self.check(row, cache)
        evicting = any(row.evict is not None for row in [*self.rows, *(row for row, _ in joining)])
        heads = self.tables.segmented or any(
            is_segmented(layer) and not layer.equal for _, cache in joining for layer in cache.layers
        )
        if evicting and heads:
            raise KvsieveError(
                "An evicting row and a row whose KV heads hold their own counts (per-head budgets) cannot decode in "
                "one batch: the first moves entries in padded tables, the second needs segmented ones."
            )
        self._settle()
        self._rebuild(list(range(len(self.rows))), joining=[cache for _, cache in joining])
        for row, cache in joining:
            self.rows.append(row)
            if row.evict is not None:
                row.evict.in_place(cache, self.tables.of_row(len(self.rows) - 1))

    def check(self, row: Row, cache: Cache) -> None:
        """Refuse a row that cannot join: its cache must be one prefilled sequence in every layer, and an evicting
        row's global layers must hold one length (its eviction works in place)."""
        layers = cache.layers
        if any(not layer.is_initialized for layer in layers) or any(layer.keys.shape[0] != 1 for layer in layers):
            raise KvsieveError("A decoding row starts from a prefilled cache of one sequence (batch 1) in every layer.")
        budgeted = [layers[j] for j in self.tables.order if self.tables.windows[j] is None]
        if row.evict is not None and any(is_segmented(layer) for layer in budgeted):
            raise KvsieveError("An evicting row holds one count per KV head; this cache's heads hold their own.")
        if row.evict is not None and len({layer.keys.shape[2] for layer in budgeted}) > 1:
            lengths = sorted({layer.keys.shape[2] for layer in budgeted})
            raise KvsieveError(
                f"In-place eviction needs every global layer of the cache at one length, but they hold {lengths} "
                "entries."
            )

    def remove(self, rows: list[Row], keep_entries: bool | list[bool] = True) -> None:
        """Leave: the tables shrink to the other rows. Each leaving row's cache keeps a copy of its entries, or,
        where `keep_entries` (one for all, or one per row of `rows`) is False (an answer nobody reads again), is
        emptied, so that no view of the old tables outlives them and no copy is made."""
        keep = [i for i, row in enumerate(self.rows) if all(row is not r for r in rows)]
        if len(keep) == len(self.rows):
            return
        kept = keep_entries if isinstance(keep_entries, list) else [keep_entries] * len(rows)
        emptied = {id(row) for row, k in zip(rows, kept, strict=True) if not k}
        self._settle()
        for i in set(range(len(self.rows))) - set(keep):
            cache = self.caches[i]
            cache.layers = [] if id(self.rows[i]) in emptied else [layer.detached() for layer in cache.layers]
            if self.rows[i].evict is not None:
                self.rows[i].evict.retable(None)
        self._rebuild(keep)
        self.rows = [self.rows[i] for i in keep]

    def step(self) -> torch.Tensor:
        """One forward pass for every row; returns (rows, vocab) logits of the next tokens."""
        device = self.model.device
        windows = self.tables.windows
        if self.tables.segmented:
            if not self.tables.has_room():
                self._rebuild(list(range(len(self))))  # room for SPARE more steps after every head
        else:
            longest = max(
                (cache.layers[j].length + self._pending(i) for i, cache in enumerate(self.caches)
                 for j in range(len(windows)) if windows[j] is None),
                default=0,
            )  # fmt: skip
            if longest + 1 > self.tables.keys.shape[3]:
                self._settle()
                self._rebuild(list(range(len(self))))  # room for SPARE more steps
        if self.static and not self.tables.segmented and (self.static_step is not None or self._steady()):
            return self._static()
        self._settle()
        self.static_step = None  # its tensors no longer say where the rows stand
        ids = torch.tensor([[row.token] for row in self.rows], device=device)
        positions = torch.tensor(
            [[row.evict.position(self.entries(i), row.position) if row.evict else row.position]
             for i, row in enumerate(self.rows)],
            device=device,
        )  # fmt: skip
        evicting = [row.evict for row in self.rows if row.evict is not None]
        if len(self.rows) == 1:
            observers, key_lengths = (evicting[0].step_observers() if evicting else []), None
        else:
            observers = []
            if any(not run.reads_attention for run in evicting):
                observers.append(self._observe)
            if any(run.reads_attention for run in evicting):
                observers.append(AttentionRows(self._observe_attention))
            key_lengths = self.tables.key_lengths(device)
        with torch.no_grad(), attention_hooks(observers=observers):
            cache = with_cache(self.model, self.tables.cache)
            out = self.model(
                input_ids=ids,
                position_ids=positions,
                **cache,
                use_cache=True,
                logits_to_keep=1,
                key_lengths=key_lengths,
            )
            for row, own in zip(self.rows, self.caches, strict=True):
                row.position += 1
                if row.evict is not None:
                    row.evict.after_step(own)
        return out.logits[:, -1]

    def _steady(self) -> bool:
        """Whether the rows can take static steps: every one `steady` (an evicting row at its budget, evicting
        every step); with compiled steps and no CUDA graph, at most `COMPILED_ROWS` of them."""
        if self.compiled and not self.capture and len(self.rows) > COMPILED_ROWS:
            return False
        return all(steady(row.evict, cache) for row, cache in zip(self.rows, self.caches, strict=True))

    def _static(self) -> torch.Tensor:
        """The step through the current tables' `StaticStep` (made, and on CUDA captured, at its first run)."""
        if self.static_step is None:
            self._settle()
            rows = [(row.evict, cache) for row, cache in zip(self.rows, self.caches, strict=True)]
            t = self.tables
            tables = [(t.keys, t.values) if window is None else t.rings for window in t.windows]
            self.static_step = StaticStep(
                self.model, t.keys, t.values, rows, capture=self.capture, compiled=self.compiled,
                layers=[(table, t.slot[j]) for j, table in enumerate(tables)], windows=t.windows,
            )  # fmt: skip
            layers = range(len(t.windows))
            self.static_step.load(
                [row.position for row in self.rows],
                [[cache.layers[j].length for cache in self.caches] for j in layers],
                [[cache.layers[j].next_column() for cache in self.caches] for j in layers],
            )
        step = self.static_step
        captured = step.graph is not None
        logits = step.run([row.token for row in self.rows])
        if not captured and step.graph is not None:
            self.captures += 1
            self.capture_seconds += step.capture_seconds
        self.capture = self.capture and step.capture
        self.behind += 1
        for row in self.rows:
            row.position += 1
        return logits

    def _pending(self, index: int, sliding: bool = False) -> int:
        """Entries that static steps wrote for row `index` and its buffers do not show yet: in a global layer none
        for an evicting row (its eviction keeps its buffers at the budget), in a `sliding` layer's ring one a step."""
        if not self.behind:
            return 0
        return self.behind if sliding else self.behind * self.static_step.advance[index]

    def _settle(self) -> None:
        """Show the rows' buffers the entries that static steps wrote into the tables."""
        if self.behind:
            for index, cache in enumerate(self.caches):
                for layer, window in zip(cache.layers, self.tables.windows, strict=True):
                    layer.advance(self._pending(index, sliding=window is not None))
            self.behind = 0

    def _observe(self, layer: int, query: torch.Tensor, key: torch.Tensor) -> None:
        """Each row's eviction observes its own query and its own (unpadded) keys (policies that score the step
        themselves)."""
        for i, (row, cache) in enumerate(zip(self.rows, self.caches, strict=True)):
            if row.evict is not None and not row.evict.reads_attention:
                row.evict.observe(layer, query[i : i + 1], key[i : i + 1, :, : cache.layers[layer].length])

    def _observe_attention(self, layer: int, probs: torch.Tensor, kv_heads: int) -> None:
        """Each row's eviction whose policy `step_reads_attention` takes its row of the step's attention over its
        own keys."""
        for i, (row, cache) in enumerate(zip(self.rows, self.caches, strict=True)):
            if row.evict is not None and row.evict.reads_attention:
                row.evict.observe_attention(layer, probs[i, :, : cache.layers[layer].length], kv_heads)

    def _rebuild(self, keep: list[int], joining: list[Cache] = ()) -> None:
        """New tables holding rows `keep` (and `joining`'s entries as the last rows) with room for SPARE more steps;
        every row's buffers and eviction move to them."""
        self.static_step = None  # recorded on the old tables
        caches = [self.caches[i] for i in keep] + list(joining)
        self.tables.rebuild(caches, SPARE)
        for b, row in enumerate(self.rows[i] for i in keep):
            if row.evict is not None:
                row.evict.retable(self.tables.of_row(b))
