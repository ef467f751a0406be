"""Method names used by the evaluations (niah, ppl, bench, report) and the stages they stand for.

One `MethodOptions` is shared by every configuration of a run, so a needle grid, a perplexity
run and a benchmark made with the same options compare the same configurations. To add a
method to the evaluations, give it a name in METHOD_NAMES and a branch in `stages`/`describe`.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvsieve.errors import KvsieveError

SELECTORS = ("full", "gemfilter", "critiprefill")
CHUNKED = ("fm", "im", "imdc")
KV = ("snapkv", "h2o", "a2sf", "streaming", "local")
METHOD_NAMES = (*SELECTORS, *CHUNKED, *KV)


@dataclass(frozen=True)
class MethodOptions:
    """Settings of every method in a run (defaults: the papers' and the CLI's).

    k, layer: GemFilter; fusion_alpha: CritiPrefill (segment 512, block 32, budget 1024);
    chunk, memory, schedule, pruner: FM / IM / IMDC; budget (count or fraction), alpha: KV methods.
    """

    k: int | float = 1024
    layer: int | None = None
    fusion_alpha: float = 0.25
    chunk: int = 1024
    memory: int = 1024
    schedule: str | None = None
    pruner: str = "snapkv"
    budget: int | float = 1024
    alpha: float = 0.2

    def stages(self, method: str) -> dict:
        """The pipeline stages (keyword arguments of `kvsieve.run`) that `method` stands for.

        full: nothing; gemfilter: GemFilter(k, layer); critiprefill: the CritiPrefill kernel;
        fm / im / imdc: a chunked feed; snapkv compresses the cache to `budget` after a full
        prefill; h2o, a2sf, streaming and local evict to `budget` right after prefill and after
        every decoding step (one Evict stage: its start is the one-shot compression).
        """
        from kvsieve.attention.critiprefill import CritiPrefill
        from kvsieve.compress.methods import make_method, supports_decode
        from kvsieve.compress.stages import Compress, Evict
        from kvsieve.feed.chunked import make_feed
        from kvsieve.select.gemfilter import GemFilter

        if method == "full":
            return {}
        if method == "gemfilter":
            return {"select": GemFilter(k=self.k, layer=self.layer)}
        if method == "critiprefill":
            return {"attention": CritiPrefill(alpha=self.fusion_alpha)}
        if method in CHUNKED:
            pruner = make_method(self.pruner, alpha=self.alpha)
            return {
                "feed": make_feed(method, chunk=self.chunk, memory=self.memory, schedule=self.schedule, pruner=pruner)
            }
        if method in KV:
            kv_method = make_method(method, alpha=self.alpha)
            if supports_decode(kv_method):
                return {"evict": Evict(kv_method, self.budget)}
            return {"compress": Compress(kv_method, self.budget)}
        raise KvsieveError(f"Unknown method '{method}'; choose from {', '.join(METHOD_NAMES)}.")

    def describe(self, method: str) -> str:
        """One line saying how `method` is configured in this run (for reports and plot titles)."""
        if method == "full":
            return "full attention, one-pass prefill"
        if method == "gemfilter":
            layer = "calibrated layer" if self.layer is None else f"layer {self.layer}"
            return f"GemFilter k={self.k}, {layer}"
        if method == "critiprefill":
            return f"CritiPrefill segment 512, block 32, budget 1024, fusion alpha {self.fusion_alpha}"
        if method in CHUNKED:
            schedule = "" if method == "fm" else f", {self.schedule or 'linear'} schedule"
            return f"{method.upper()} chunk {self.chunk}, memory {self.memory}{schedule}, {self.pruner} pruner"
        if method == "snapkv":
            return f"SnapKV once after prefill, budget {self.budget}"
        if method == "a2sf":
            return f"A2SF alpha {self.alpha}, budget {self.budget}, evicting every step"
        if method in KV:
            return f"{method} budget {self.budget}, evicting every step"
        raise KvsieveError(f"Unknown method '{method}'; choose from {', '.join(METHOD_NAMES)}.")


def parse_methods(text: str | list[str]) -> list[str]:
    """Comma-separated method names, checked, duplicates refused."""
    names = [m.strip() for m in text.split(",")] if isinstance(text, str) else list(text)
    names = [m for m in names if m]
    if not names:
        raise KvsieveError(f"No methods given; choose from {', '.join(METHOD_NAMES)}.")
    if unknown := [m for m in names if m not in METHOD_NAMES]:
        raise KvsieveError(f"Unknown method(s) {', '.join(unknown)}; choose from {', '.join(METHOD_NAMES)}.")
    if len(set(names)) != len(names):
        raise KvsieveError(f"Methods are listed twice in '{','.join(names)}'; list each once.")
    return names


def check_lengths(methods: list[str], lengths: list[int], extra: int, max_positions: int) -> None:
    """Refuse lengths a configuration cannot run: only chunked feeds go beyond the model's context.

    `extra` is the positions needed after the prompt (tokens to generate or score).
    """
    if not lengths or any(n < 1 for n in lengths):
        raise KvsieveError(f"Lengths must be positive token counts, got {lengths}.")
    too_long = [n for n in lengths if n + extra > max_positions]
    bounded = [m for m in methods if m not in CHUNKED]
    if too_long and bounded:
        raise KvsieveError(
            f"Length(s) {too_long} plus {extra} generated tokens exceed the model's {max_positions} positions, "
            f"which {', '.join(bounded)} need. Use shorter lengths or only the chunked feeds (fm, im, imdc)."
        )
