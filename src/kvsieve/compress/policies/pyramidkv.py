"""PyramidKV (Cai et al. 2024, "PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information Funneling",
arXiv 2406.02069): SnapKV's scores, with more of the budget for the lower layers.

Attention is spread over the whole prompt in the lower layers and funnels onto a few tokens in the upper ones, so
the paper keeps many entries low and few high: per layer, the observation window plus a share that falls linearly
from the first budgeted layer to the last. With the stage's budget B per layer (window w included) and L budgeted
layers, the top layer keeps (B - w) / beta besides its window, the bottom one 2 (B - w) minus that, so the layers
keep B on average, as in the authors' `PyramidKVCluster`. A layer whose share exceeds the prompt keeps all of it.
One-shot (the compress stage); a hybrid model's sliding layers are never budgeted and take no share.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvsieve.compress.policies.snapkv import SnapKV
from kvsieve.errors import KvsieveError
from kvsieve.spec import component, option


@component("pyramidkv", "policy")
@dataclass(frozen=True)
class PyramidKV(SnapKV):
    """SnapKV's votes; budgets falling linearly from the first layer to the last, `budget` on average."""

    beta: int = option(20, "the top layer keeps 1/beta of the average share besides its window (paper: 20)")

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.beta, bool) or not isinstance(self.beta, int) or self.beta < 1:
            raise KvsieveError(f"PyramidKV beta must be a whole number >= 1, got {self.beta!r}.")

    def layer_budget(self, budget: int, layer: int, layers: list[int]) -> int:
        if len(layers) < 2 or budget <= self.window:
            return budget
        share = budget - self.window  # the average entries kept besides the window
        least = share // self.beta
        most = 2 * share - least
        step = (most - least) // (len(layers) - 1)
        return self.window + most - layers.index(layer) * step
