"""The `select` stage: which prompt tokens are prefilled at all.

A selector looks at the whole prompt and returns the sorted indices of the tokens to keep; the
pipeline then prefills only those, with fresh positions 0..k-1. To add a selector, write a frozen
dataclass registered with `@component(tag, "select")` that has a `name` and a `select()` method
returning a `Selection`, next to `gemfilter.py`, and name a preset in `kvsieve/registry.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from transformers import Cache, PreTrainedModel

from kvsieve.prompt import Prompt


@dataclass
class Selection:
    """Sorted, unique indices into the prompt, and what the selector did."""

    indices: torch.Tensor
    details: dict[str, Any] = field(default_factory=dict)


class Selector(Protocol):
    """`select` chooses from the whole prompt; with `cache` (layers of the prompt's first tokens that
    `first_pass` left there) it runs only the rest, so a stored document's pass is not run again."""

    name: str

    def select(self, model: PreTrainedModel, prompt: Prompt, cache: Cache | None = None) -> Selection: ...

    def first_pass(self, model: PreTrainedModel, ids: torch.Tensor, cache: Cache) -> None: ...
