"""A decoding step whose every number lives in a tensor, so that a GPU can record it once and replay it.

On a GPU a small model's decoding step is bound by the host, not by memory: SmolLM2-135M's step
launches hundreds of small kernels, and the H200 spent 19-24 ms per step launching them against
0.08 ms of weight reading (docs/STUDIES.md, issue 26). A CUDA graph records the kernels once and
replays them with one launch. It replays the same kernels on the same memory, so nothing a step
does may depend on a Python number that changes between steps. The batch's step (`engine.batch`)
differs from one step to the next only in such numbers: each row's token, position and cache
length per layer. Here they are tensors:

- `ids` (rows, 1) and `positions` (rows, 1): each row's token and logical position;
- `ends` (layers, rows): the column where each row's next entry of each layer goes;
- each layer scatters its rows' new keys and values into the batch tables at `ends` and attends over
  the tables' whole capacity, the columns from `ends + 1` on masked as padding (the batch's padded
  attention, `attention_hooks(key_lengths=...)`, whose logits are float32);
- the step advances `positions` and `ends` itself, so a replay needs only the tokens copied in.

On CUDA the step is run once eagerly on a side stream (it is the step, and it warms the allocator
and cuBLAS), then captured; every later step replays the graph. The capture is valid for one
generation of the tables (their memory and capacity): the batch drops it when rows join or leave, when
the tables grow (every `SPARE` steps) or when a step has to run eagerly. The capacity is the shape
bucket: a cache growing by one entry a step is captured again once per `SPARE` steps, not every step.
On the CPU the same step runs eagerly (capturing there gains nothing: docs/STUDIES.md) and is what
the tests check against the batch's ordinary step.
"""

from __future__ import annotations

import logging
import time

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

from kvsieve.attention import attention_hooks
from kvsieve.models import with_cache

log = logging.getLogger("kvsieve.engine")


class _ScatterLayer(DynamicLayer):
    """Layer j of the static step's cache: writes each row's new entry at its column `ends[j, row]` of the
    tables and hands the attention the tables' whole capacity."""

    def __init__(self, step: StaticStep, layer: int):
        super().__init__()
        self.step, self.layer = step, layer
        self.lazy_initialization(step.keys[layer], step.values[layer])
        self.keys, self.values = step.keys[layer], step.values[layer]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        columns = self.step.ends[self.layer].view(-1, 1, 1, 1)  # (rows, 1, 1, 1)
        self.keys.scatter_(2, columns.expand_as(key_states), key_states)
        self.values.scatter_(2, columns.expand_as(value_states), value_states)
        return self.keys, self.values


class StaticStep:
    """One generation of the batch tables' decoding step, in tensors; captured as a CUDA graph with `capture`."""

    def __init__(self, model: PreTrainedModel, keys: torch.Tensor, values: torch.Tensor, *, capture: bool):
        """`keys`/`values` are the batch tables (layers, rows, kv_heads, capacity, d); `load` then sets where
        each row stands."""
        self.model, self.keys, self.values, self.capture = model, keys, values, capture
        layers, rows = keys.shape[:2]
        self.ids = torch.zeros(rows, 1, dtype=torch.long, device=keys.device)
        self.positions = torch.zeros(rows, 1, dtype=torch.long, device=keys.device)
        self.ends = torch.zeros(layers, rows, dtype=torch.long, device=keys.device)
        self.cache = DynamicCache(config=model.config)
        self.cache.layers = [_ScatterLayer(self, j) for j in range(layers)]
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None  # the graph's output, overwritten by every replay
        self.capture_seconds = 0.0

    def load(self, positions: list[int], ends: list[list[int]]) -> None:
        """Each row's next position, and per layer each row's entry count (the column its next entry takes)."""
        self.positions.copy_(torch.tensor(positions).view(-1, 1))
        self.ends.copy_(torch.tensor(ends))

    def run(self, tokens: list[int], pool=None) -> torch.Tensor:
        """One step with each row feeding `tokens[row]`: (rows, vocab) logits. The first run on CUDA captures
        the step (into memory `pool`); a failed capture is logged and the step's eager result returned, with
        `graph` left None."""
        self.ids.copy_(torch.tensor(tokens).view(-1, 1))
        if self.graph is not None:
            self.graph.replay()
            return self.logits.clone()
        if not self.capture:
            return self._forward()
        return self._capture(pool)

    def _forward(self) -> torch.Tensor:
        lengths = self.ends + 1  # each row's keys once this step's entry is written
        with torch.no_grad(), attention_hooks(key_lengths=list(lengths)):
            out = self.model(
                input_ids=self.ids,
                position_ids=self.positions,
                **with_cache(self.model, self.cache),
                use_cache=True,
                logits_to_keep=1,
            )
        self.ends.add_(1)
        self.positions.add_(1)
        return out.logits[:, -1]

    def _capture(self, pool) -> torch.Tensor:
        start = time.perf_counter()
        device = self.keys.device
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            logits = self._forward().clone()  # this step, run eagerly (the graph's recording does not run it)
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                self.logits = self._forward()
        except Exception as error:  # e.g. a model whose forward reads a tensor on the host (a sync)
            log.warning("decoding without a CUDA graph: capturing the step failed (%s)", error)
            self.capture = False
            return logits
        self.graph = graph
        self.capture_seconds = time.perf_counter() - start
        return logits
