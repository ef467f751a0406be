"""KV pruning methods: which scorer each uses and which positions it always keeps.

A method is a small frozen dataclass with
- `prefill_scores(query, key, scaling)`: (kv_heads, n) scores from the prompt's queries, or None
  for position-only methods (StreamingLLM, local window);
- `step_alpha`: how per-step eviction accumulates each new attention row (score <- alpha * score
  + row), or None when the method has no per-step rule (SnapKV is one-shot);
- `protected(budget)`: (sinks, recent) positions kept regardless of score.
To add a method, write one more dataclass here and list it in METHODS.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvsieve.compress.scorers import accumulated_attention, window_attention
from kvsieve.errors import KvsieveError


def _check_kernel(kernel: int) -> None:
    if kernel < 1 or kernel % 2 == 0:
        raise KvsieveError(f"Pooling kernel must be an odd number >= 1, got {kernel}.")


@dataclass(frozen=True)
class SnapKV:
    """SnapKV: the last `window` prompt queries vote (pooled attention); the window is always kept."""

    window: int = 32
    kernel: int = 5
    pool: str = "avg"
    name: str = "snapkv"
    step_alpha: float | None = None
    position_only: bool = False

    def __post_init__(self) -> None:
        if self.window < 1:
            raise KvsieveError(f"SnapKV window must be at least 1, got {self.window}.")
        _check_kernel(self.kernel)
        if self.pool not in ("avg", "max"):
            raise KvsieveError(f"SnapKV pooling must be 'avg' or 'max', got '{self.pool}'.")

    def prefill_scores(self, query: torch.Tensor, key: torch.Tensor, scaling: float) -> torch.Tensor:
        return window_attention(query, key, scaling, self.window, self.kernel, self.pool)

    def protected(self, budget: int) -> tuple[int, int]:
        if self.window > budget:
            raise KvsieveError(f"SnapKV window {self.window} exceeds the budget {budget}; lower --window.")
        return 0, self.window


@dataclass(frozen=True)
class H2O:
    """H2O: accumulated attention over all queries; half the budget recent, half heavy hitters."""

    name: str = "h2o"
    step_alpha: float | None = 1.0
    position_only: bool = False

    def prefill_scores(self, query: torch.Tensor, key: torch.Tensor, scaling: float) -> torch.Tensor:
        return accumulated_attention(query, key, scaling, alpha=1.0)

    def protected(self, budget: int) -> tuple[int, int]:
        return 0, budget // 2


@dataclass(frozen=True)
class A2SF:
    """A2SF: accumulated attention with forgetting factor alpha (eq. 5/6); the whole budget goes to
    the score, as in the paper. `recent` > 0 gives the authors' later one-shot variant's recent tail.
    """

    alpha: float = 0.2
    recent: int = 0
    name: str = "a2sf"
    position_only: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.alpha <= 1:
            raise KvsieveError(f"A2SF forgetting factor alpha must be within [0, 1], got {self.alpha}.")
        if self.recent < 0:
            raise KvsieveError(f"A2SF recent tail must be >= 0, got {self.recent}.")

    @property
    def step_alpha(self) -> float:
        return self.alpha

    def prefill_scores(self, query: torch.Tensor, key: torch.Tensor, scaling: float) -> torch.Tensor:
        return accumulated_attention(query, key, scaling, alpha=self.alpha)

    def protected(self, budget: int) -> tuple[int, int]:
        if self.recent > budget:
            raise KvsieveError(f"A2SF recent tail {self.recent} exceeds the budget {budget}.")
        return 0, self.recent


@dataclass(frozen=True)
class StreamingLLM:
    """StreamingLLM: `sinks` first tokens plus the most recent ones."""

    sinks: int = 4
    name: str = "streaming"
    step_alpha: float | None = None
    position_only: bool = True

    def __post_init__(self) -> None:
        if self.sinks < 0:
            raise KvsieveError(f"StreamingLLM sink count must be >= 0, got {self.sinks}.")

    def prefill_scores(self, query: torch.Tensor, key: torch.Tensor, scaling: float) -> None:
        return None

    def protected(self, budget: int) -> tuple[int, int]:
        if self.sinks > budget:
            raise KvsieveError(f"StreamingLLM keeps {self.sinks} sink tokens, more than the budget {budget}.")
        return self.sinks, budget - self.sinks


@dataclass(frozen=True)
class LocalWindow:
    """Local window: only the most recent tokens."""

    name: str = "local"
    step_alpha: float | None = None
    position_only: bool = True

    def prefill_scores(self, query: torch.Tensor, key: torch.Tensor, scaling: float) -> None:
        return None

    def protected(self, budget: int) -> tuple[int, int]:
        return 0, budget


Method = SnapKV | H2O | A2SF | StreamingLLM | LocalWindow
METHODS = {"snapkv": SnapKV, "h2o": H2O, "a2sf": A2SF, "streaming": StreamingLLM, "local": LocalWindow}


def supports_decode(method: Method) -> bool:
    """Whether `method` has a per-step eviction rule."""
    return method.position_only or method.step_alpha is not None


def make_method(
    name: str,
    *,
    alpha: float = 0.2,
    window: int = 32,
    kernel: int = 5,
    pool: str = "avg",
    sinks: int = 4,
    recent: int = 0,
) -> Method:
    """Build a method by name from the options the CLI and benchmarks expose."""
    options = {
        "snapkv": {"window": window, "kernel": kernel, "pool": pool},
        "h2o": {},
        "a2sf": {"alpha": alpha, "recent": recent},
        "streaming": {"sinks": sinks},
        "local": {},
    }
    if name not in options:
        raise KvsieveError(f"Unknown KV method '{name}'; choose one of: {', '.join(METHODS)}.")
    return METHODS[name](**options[name])
