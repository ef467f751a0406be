"""Memory schedules and chunk sizes for chunked prefill with a compressed memory (IMDC: "Memorize Step
by Step", Zeng et al., EMNLP 2024).

Notation of the paper (section 3): the prompt of L tokens is fed in n chunks. After step i the
memory holds m_i KV entries per layer and KV head (the sink tokens are not counted); at step i
the model attends over the memory of step i - 1 plus the chunk c_i. So m_{n-1} is what decoding
starts from, and the largest attention at step i > 0 is m_{i-1} + c_i keys (plus sinks).

- FM (fixed-size memory): m_i = m_max at every step, chunks of c tokens.
- IM (incremental memory): m_i grows from m_0 = m_max / n (section 4.1) to m_{n-1} = m_max along
  a linear (eq. 1), square (eq. 8) or sqrt (eq. 9) curve; square-sqrt uses square in the lower
  half of the layers and sqrt in the upper half (appendix A.1); adaptive scales the linear size
  of each layer by its memory retention ratio (eq. 2-3).
- IMDC (decremental chunk): c_0 = c, then c_i = c + m_hat - m_{i-1} (eq. 7), so that memory +
  chunk is constant after step 0 (eq. 6) and the average chunk stays c (eq. 5).

Sizes are whole tokens: real values are rounded half up and memory sizes are kept within
[1, m_max] (m_0 = m_max / n would round to 0 when there are more chunks than memory slots).
Everything here is a pure function of sizes, so it is easy to test against hand-computed values.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from kvsieve.errors import KvsieveError

SCHEDULES = ("fixed", "linear", "sqrt", "square", "square-sqrt", "adaptive")
CURVES = ("linear", "sqrt", "square")


def _round(value: float) -> int:
    """Round half up (Python's round() rounds half to even)."""
    return math.floor(value + 0.5)


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise KvsieveError(f"{name} must be a whole number >= 1, got {value!r}.")


def num_chunks(length: int, chunk: int) -> int:
    """n = ceil(L / c): how many chunks of (average) size c a prompt of L tokens is fed in."""
    _check_positive(length=length, chunk=chunk)
    return -(-length // chunk)


def fixed_memory(n: int, memory: int) -> list[int]:
    """FM: m_i = m_max for every step i (the baseline of the paper, section 4.1)."""
    _check_positive(n=n, memory=memory)
    return [memory] * n


def incremental_memory(n: int, memory: int, curve: str = "linear", initial: float | None = None) -> list[int]:
    """IM: m_i from m_0 to m_{n-1} = m_max along `curve`, for i = 0 .. n-1.

    linear (eq. 1):  m_i = (m_max - m_0) * i / (n - 1) + m_0
    square (eq. 8):  m_i = (m_max - m_0) * i^2 / (n - 1)^2 + m_0
    sqrt   (eq. 9):  m_i = (m_max - m_0) * sqrt(i) / sqrt(n - 1) + m_0

    m_0 = m_max / n unless `initial` is given (section 4.1); with the default, linear is simply
    m_i = m_max * (i + 1) / n. One chunk (n = 1) is its own last step: [m_max].
    """
    _check_positive(n=n, memory=memory)
    if curve not in CURVES:
        raise KvsieveError(f"Unknown memory curve '{curve}'; choose one of: {', '.join(CURVES)}.")
    m0 = memory / n if initial is None else float(initial)
    if n == 1:
        return [memory]
    growth = {"linear": lambda t: t, "square": lambda t: t * t, "sqrt": math.sqrt}[curve]
    sizes = [(memory - m0) * growth(i / (n - 1)) + m0 for i in range(n)]
    return [min(memory, max(1, _round(size))) for size in sizes]


def square_sqrt_curves(num_layers: int) -> list[str]:
    """SQUARE-SQRT (appendix A.1): square in the lower layers, sqrt in the higher ones.

    The lower half of the layers (j < N // 2) use square and the upper half sqrt; with an odd
    layer count the middle layer uses linear, so that, as the paper notes for a square/sqrt pair,
    the total memory over all layers matches LINEAR's.
    """
    _check_positive(num_layers=num_layers)
    half = num_layers // 2
    return ["square"] * half + ["linear"] * (num_layers - 2 * half) + ["sqrt"] * half


def layer_memory(schedule: str, n: int, memory: int, num_layers: int) -> list[list[int]]:
    """Memory size per step and layer, [step][layer], for `schedule`.

    fixed: m_max; linear / sqrt / square: eq. 1 / 9 / 8 for every layer; square-sqrt: per layer
    (`square_sqrt_curves`); adaptive: the linear sizes b_i^j that eq. 3 scales at run time with
    the measured retention ratios (see `adaptive_memory`).
    """
    _check_positive(num_layers=num_layers)
    if schedule not in SCHEDULES:
        raise KvsieveError(f"Unknown memory schedule '{schedule}'; choose one of: {', '.join(SCHEDULES)}.")
    if schedule == "fixed":
        per_step = fixed_memory(n, memory)
        return [[m] * num_layers for m in per_step]
    if schedule == "square-sqrt":
        curves = {curve: incremental_memory(n, memory, curve) for curve in CURVES}
        layer_curves = square_sqrt_curves(num_layers)
        return [[curves[curve][i] for curve in layer_curves] for i in range(n)]
    per_step = incremental_memory(n, memory, "linear" if schedule == "adaptive" else schedule)
    return [[m] * num_layers for m in per_step]


def retention_ratio(kept: torch.Tensor, memory_start: int, memory_stop: int, sinks: int = 0) -> float:
    """Eq. 2: p_i^j = |M_{i-1}^j ∩ M_i^j| / |M_i^j| for one layer, averaged over its KV heads.

    `kept` (kv_heads, k) are the positions kept from the step's keys [sinks | memory | chunk];
    the previous memory M_{i-1} is [memory_start, memory_stop); the first `sinks` kept positions
    are sink tokens, outside the memory on both sides of the ratio.
    """
    memory_kept = kept[:, sinks:]
    if memory_kept.shape[1] == 0:
        return 0.0
    retained = (memory_kept >= memory_start) & (memory_kept < memory_stop)
    return float(retained.float().mean())


def adaptive_memory(base: Sequence[int], retention: Sequence[float]) -> list[int]:
    """Eq. 3 for a step i > 0: m_i^j = p_j / sum_j(p_j) * N * b_i^j (at i = 0, m_0^j = b_0^j).

    `base` are the linear sizes b_i^j of the N layers and `retention` their retention ratios p_j
    (eq. 2). Layers that keep more of their memory get more of it; the total over the layers stays
    that of the linear schedule (up to rounding). When no layer retained anything the linear
    sizes are returned. Sizes are at least 1; one layer may get more than m_max.
    """
    if len(base) != len(retention):
        raise KvsieveError(f"Got {len(base)} layer sizes but {len(retention)} retention ratios.")
    total = sum(retention)
    if total <= 0:
        return list(base)
    layers = len(base)
    return [max(1, _round(p / total * layers * b)) for p, b in zip(retention, base, strict=True)]


def fixed_chunks(length: int, chunk: int) -> list[int]:
    """FM and IM: chunks of c tokens, the last one holding the rest (n = ceil(L / c) chunks)."""
    n = num_chunks(length, chunk)
    return [chunk] * (n - 1) + [length - chunk * (n - 1)]


def decremental_chunks(length: int, chunk: int, memory: Sequence[int]) -> list[int]:
    """IMDC chunk sizes (eq. 5-7) for the per-step memory sizes m_0 .. m_{n-1}.

    c_0 = c and c_i = c + m_hat - m_{i-1} for i > 0 (eq. 7), m_hat = mean(m_0 .. m_{n-2}), so the
    attention length c_i + m_{i-1} is the same constant for every i > 0 (eq. 6) and the chunks
    average c (eq. 5). When L is not n * c, the chunks after the first share L - c: c is replaced
    by their average (L - c) / (n - 1), which is eq. 7 exactly when L = n * c. As whole tokens,
    c_i + m_{i-1} is K or K + 1 (the spare tokens go to the earliest steps). A chunk that eq. 7
    would make smaller than one token (memory much larger than the chunk) is one token, and the
    constant rises so that the sizes still sum to L. Returns n sizes summing to L.
    """
    n = len(memory)
    _check_positive(length=length, chunk=chunk, n=n)
    if length < n:
        raise KvsieveError(f"Cannot split {length} tokens into {n} chunks; use a larger chunk size.")
    if n == 1:
        return [length]
    first = min(chunk, length - (n - 1))
    rest = length - first
    previous = list(memory[:-1])  # m_0 .. m_{n-2}: the memory each later chunk attends with

    def total(k: int) -> int:
        return sum(max(1, k - m) for m in previous)

    # The largest whole constant K with sum(max(1, K - m_{i-1})) <= L - c_0 (monotone in K).
    low, high = 0, rest + max(previous) + 1
    while low < high:
        mid = (low + high + 1) // 2
        if total(mid) <= rest:
            low = mid
        else:
            high = mid - 1
    sizes = [max(1, low - m) for m in previous]
    spare = rest - sum(sizes)
    for i, m in enumerate(previous):
        if spare == 0:
            break
        if low - m >= 1:
            sizes[i] += 1
            spare -= 1
    return [first, *sizes]
