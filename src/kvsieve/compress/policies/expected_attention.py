"""Expected Attention (Devoto, Jeblick, Jegou 2025, "Expected Attention: KV Cache Compression by Estimating Attention
from Future Queries Distribution", arXiv 2510.00636): score a key by the attention the *future* queries are expected
to pay it, without any attention matrix, so it needs no question (question-agnostic reuse).

Per query head, the queries of the pass are taken as Gaussian: mean mu and covariance Sigma of their pre-RoPE
values (the first `sinks` positions left out: outliers), both moved by the average rotation of the next `future`
positions (R_bar mu, R_bar Sigma R_bar^T). For q ~ N(mu, Sigma), E[exp(q.k s)] = exp(s k.mu + s^2/2 k^T Sigma k)
(the paper's eq. 6, s = 1/sqrt(d)); softmaxed over the keys after the sinks, averaged over the KV head's query heads,
then times the value's norm ||v||, since a key is worth what its value adds to the output (eq. 8).

The pass's queries are post-RoPE, so they are turned back rather than recomputed from the hidden states: query i of
the last q sits q - i positions before the first future one, so R_bar R(-t_i) = mean_j R(q - i + j), j < `future`,
and z_i = that rotation of q_i gives R_bar mu = mean z_i and R_bar Sigma R_bar^T = cov z_i. Rotations come from the
layer's own rotary embedding (a hybrid model's global layers have theirs), and a model that normalises its queries
before RoPE (Gemma 3's q_norm) is covered, since the queries the model actually rotates are read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvsieve.compress.policy import LayerPass, PromptScorer, Reading
from kvsieve.errors import KvsieveError
from kvsieve.kv.cache import rotation
from kvsieve.spec import component, option


@component("expected-attention", "policy")
@dataclass(frozen=True)
class ExpectedAttention(PromptScorer):
    """The attention future queries are expected to pay each key (a Gaussian of the pass's queries), times ||v||."""

    reads: ClassVar[frozenset[Reading]] = frozenset({"queries", "keys", "values", "rotary"})

    future: int = option(512, "future positions whose average rotation moves the query statistics (paper: 512)")
    sinks: int = option(4, "first positions left out of the statistics and always kept (paper: 4)")
    covariance: bool = option(True, "use the queries' covariance besides their mean (paper: yes)")
    value_norm: bool = option(True, "multiply by the value's norm (paper: yes)")

    def __post_init__(self) -> None:
        for name, least in (("future", 1), ("sinks", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise KvsieveError(f"Expected Attention's {name} must be a whole number >= {least}, got {value!r}.")

    def protected(self, budget: int) -> tuple[int, int]:
        return min(self.sinks, budget), 0

    def prompt_scores(self, seen: LayerPass) -> torch.Tensor:
        if seen.rotary is None or seen.value is None:
            raise KvsieveError("Expected Attention reads the values and the rotary embedding (score_observers).")
        mean, cov = self.future_statistics(seen)
        key = seen.key.float()
        kv_heads, n, dim = key.shape
        first = min(self.sinks, n - 1)  # keys after the sinks are softmaxed; the sinks are protected
        grouped = key[:, first:]  # (g, m, d)
        rep = mean.shape[0] // kv_heads
        mean = mean.view(kv_heads, rep, dim)
        logits = torch.einsum("gmd,grd->grm", grouped, mean) * seen.scaling
        if cov is not None:
            spread = torch.einsum("gmd,grde->grme", grouped, cov.view(kv_heads, rep, dim, dim))
            logits += 0.5 * seen.scaling**2 * (spread * grouped[:, None]).sum(-1)
        scores = logits.softmax(-1).mean(1)  # (g, m): averaged over the KV head's query heads
        if self.value_norm:
            scores = scores * seen.value[:, first:].float().norm(dim=-1)
        return torch.cat([scores.new_full((kv_heads, first), float("inf")), scores], dim=1)

    def future_statistics(self, seen: LayerPass) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Mean (h, d) and covariance (h, d, d) of the pass's queries moved to the next `future` positions (float32;
        covariance None unless `covariance`): the mean and covariance of z_i (module docstring)."""
        assert seen.rotary is not None
        query = seen.query.float()
        heads, q, dim = query.shape
        skip = max(0, min(self.sinks - (seen.key.shape[1] - q), q - 1))  # the queries at the sink positions
        cos, sin = rotation(torch.arange(1, q + self.future, device=query.device)[None], seen.rotary)
        rot = cos.shape[-1]
        # Average rotation over offsets q - i .. q - i + future - 1 for each query i: differences of running sums.
        zero = torch.zeros(1, rot, dtype=torch.float64, device=query.device)
        sums_cos = torch.cat([zero, cos[0, 0].double().cumsum(0)])  # sums_cos[k]: offsets 1 .. k
        sums_sin = torch.cat([zero, sin[0, 0].double().cumsum(0)])
        near = torch.arange(q, 0, -1, device=query.device)  # q - i, the nearest offset of query i
        far = near + self.future - 1
        mean_cos = ((sums_cos[far] - sums_cos[near - 1]) / self.future).float()[skip:]  # (q - skip, rot)
        mean_sin = ((sums_sin[far] - sums_sin[near - 1]) / self.future).float()[skip:]
        part = query[:, skip:, :rot]
        moved = part * mean_cos + part.roll(rot // 2, dims=-1) * mean_sin  # `rotation`'s signed sin
        z = torch.cat([moved, query[:, skip:, rot:]], dim=-1)  # (h, m, d); a partial rotary leaves the rest
        mean = z.mean(1)
        if not self.covariance:
            return mean, None
        centred = z - mean[:, None]
        return mean, centred.transpose(1, 2) @ centred / z.shape[1]
