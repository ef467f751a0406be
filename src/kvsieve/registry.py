"""The method registry: every name kvsieve knows, and the stages it stands for.

A name means the same thing in every entry point: `kvsieve generate --method NAME`, the
evaluations (`niah`, `ppl`, `bench` and its worker processes), `report`, the Python API
(`kvsieve.method(NAME)`) and the server. Any field of a preset can be changed with a setting
(`--set compress.budget=0.25`, or `spec.with_setting(...)`).

Adding a method: write its component in its own module (a KV policy in `compress/policies/`,
registered with `@component`), import it here and add one `register(...)` line. The CLI, the
evaluations and `kvsieve methods` pick it up from the registry.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import replace
from typing import Any

from kvsieve.attention.critiprefill import CritiPrefill
from kvsieve.compress.policies.a2sf import A2SF
from kvsieve.compress.policies.collie import Collie  # noqa: F401  (registers the 'collie' policy)
from kvsieve.compress.policies.expected_attention import ExpectedAttention
from kvsieve.compress.policies.h2o import H2O
from kvsieve.compress.policies.knorm import KNorm
from kvsieve.compress.policies.kvzip import KVzip
from kvsieve.compress.policies.local import LocalWindow
from kvsieve.compress.policies.pyramidkv import PyramidKV
from kvsieve.compress.policies.snapkv import SnapKV
from kvsieve.compress.policies.streaming import StreamingLLM
from kvsieve.compress.policies.tova import TOVA
from kvsieve.compress.stages import Compress, Evict
from kvsieve.errors import KvsieveError
from kvsieve.feed.chunked import ChunkedPrefill
from kvsieve.feed.full import FullPrefill
from kvsieve.select.gemfilter import GemFilter
from kvsieve.spec import MethodSpec

REGISTRY: dict[str, MethodSpec] = {}


def register(spec: MethodSpec) -> MethodSpec:
    """Add a preset under `spec.name` (a name is registered once)."""
    if spec.name in REGISTRY:
        raise KvsieveError(f"A method named '{spec.name}' is already registered.")
    REGISTRY[spec.name] = spec
    return spec


def method(name: str | MethodSpec, settings=()) -> MethodSpec:
    """The preset `name` (or a spec as given) with `settings` applied ({path: value} or pairs)."""
    if isinstance(name, MethodSpec):
        spec = name
    elif name in REGISTRY:
        spec = REGISTRY[name]
    else:
        raise KvsieveError(f"Unknown method '{name}'; choose one of: {', '.join(REGISTRY)} (see `kvsieve methods`).")
    return spec.with_settings(settings)


def parse_names(text: str | Sequence[str]) -> list[str]:
    """Comma-separated method names, checked against the registry, duplicates refused."""
    names = [m.strip() for m in text.split(",")] if isinstance(text, str) else list(text)
    names = [m for m in names if m]
    if not names:
        raise KvsieveError(f"No methods given; choose from {', '.join(REGISTRY)}.")
    if unknown := [m for m in names if m not in REGISTRY]:
        raise KvsieveError(f"Unknown method(s) {', '.join(unknown)}; choose from {', '.join(REGISTRY)}.")
    if len(set(names)) != len(names):
        raise KvsieveError(f"Methods are listed twice in '{','.join(names)}'; list each once.")
    return names


def methods(names: str | Sequence[str], settings: Iterable[tuple[str, Any]] = ()) -> dict[str, MethodSpec]:
    """{name: spec} for the listed presets, each setting applied where the method has the field.

    What an evaluation's `--methods snapkv,h2o --set compress.budget=512` means: a setting applies to every listed
    method that has that field and must apply to at least one, so this changes SnapKV's compression and leaves
    H2O's eviction budget alone."""
    settings = list(settings)
    # Whole stages first (`--set evict=a2sf`), so that their fields (`evict.budget`) exist for the rest.
    stages = [(p, v) for p, v in settings if "." not in p]
    settings = [(p, v) for p, v in settings if "." in p]
    specs = {name: method(name, stages) for name in parse_names(names)}
    for path, _ in settings:
        if not any(spec.has(path) for spec in specs.values()):
            raise KvsieveError(
                f"No listed method ({', '.join(specs)}) has the field '{path}'; see `kvsieve methods` for each "
                "method's fields."
            )
    return {name: spec.with_settings([(p, v) for p, v in settings if spec.has(p)]) for name, spec in specs.items()}


register(MethodSpec("full", "full attention, one-pass prefill (the baseline)", feed=FullPrefill()))
# Preset rule: a registered name is the best configuration measured at its stated budget on the project's
# needle and passkey probes (docs/RESULTS.md, docs/STUDIES.md); where that differs from the paper, the
# paper's exact configuration is registered as NAME-paper. Each summary ends with its provenance. The
# component classes keep the papers' values as their defaults.
TUNED = "kvsieve's tuning, docs/STUDIES.md"
GEMFILTER = GemFilter(queries=32, softmax=True, block=64)
register(
    MethodSpec(
        "gemfilter",
        f"GemFilter: early-layer selection of k tokens (32 voting queries, whole blocks), then a short prefill "
        f"[{TUNED}]",
        select=GEMFILTER,
    )
)
register(
    MethodSpec(
        "gemfilter-paper",
        "GemFilter as its paper runs it: the last query's raw q.k votes, single tokens [paper]",
        select=GemFilter(),
    )
)
register(MethodSpec("critiprefill", "CritiPrefill: block-sparse prefill attention [paper]", attention=CritiPrefill()))
register(
    MethodSpec(
        "critiprefill-code",
        "CritiPrefill as its reference code runs it: budget 2048, fusion 0.75 on the current layer, dense below 4096 "
        "[authors' code]",
        attention=CritiPrefill(budget=2048, alpha=0.75, dense_prefix=4096),
    )
)
# The chunked feeds: the IMDC authors' pruner (Collie, every query of a chunk votes) is the component's
# default and the -paper presets'; the tuned presets rank every chunk by the question's SnapKV votes pooled
# over 63 tokens (docs/STUDIES.md, "Question-guided chunked prefill": IMDC passkeys at 16K 3 of 3, against 0 of 3).
CHUNK_PRUNER = SnapKV(pool_size=63)
for name, summary, feed in (
    ("fm", "chunked prefill with a fixed-size memory (IMDC's FM baseline)", ChunkedPrefill()),
    ("im", "chunked prefill, incremental memory (IM)", ChunkedPrefill(schedule="linear")),
    (
        "imdc",
        "chunked prefill, incremental memory and decremental chunks (IMDC)",
        ChunkedPrefill(schedule="linear", decremental=True),
    ),
):
    register(
        MethodSpec(
            name,
            f"{summary}, every chunk pruned by the question's votes (SnapKV, pooled over 63 tokens) [{TUNED}]",
            feed=replace(feed, pruner=CHUNK_PRUNER),
        )
    )
    register(
        MethodSpec(
            f"{name}-paper",
            f"{summary} as the authors run it: pruned by the chunk's own votes (Collie) [authors' code]",
            feed=replace(feed, question_guided=False),
        )
    )
register(
    MethodSpec(
        "snapkv",
        f"SnapKV: compress once after prefill (votes pooled over 63 tokens) [{TUNED}]",
        compress=Compress(SnapKV(pool_size=63)),
    )
)
register(
    MethodSpec("snapkv-paper", "SnapKV as its paper runs it: votes pooled over 5 tokens [paper]", compress=Compress())
)
register(
    MethodSpec(
        "pyramidkv",
        "PyramidKV: SnapKV's votes, budgets falling linearly from the first layer to the last (beta 20) [paper]",
        compress=Compress(PyramidKV()),
    )
)
register(
    MethodSpec(
        "expected-attention",
        "Expected Attention: the attention future queries are expected to pay, times ||v||; no question needed [paper]",
        compress=Compress(ExpectedAttention()),
    )
)
register(
    MethodSpec(
        "kvzip",
        "KVzip: what the model attends to while repeating the context, a second pass; no question needed [paper]",
        compress=Compress(KVzip()),
    )
)
# KVzip with an entry scored by its 5 neighbours' best: SmolLM2 writes a number one token a digit, and the plain scores
# kept needles with digits missing (docs/METHODS.md, "How the question-agnostic rows lose").
register(
    MethodSpec(
        "kvzip-pooled",
        f"KVzip, each entry scored by the best of its 5 neighbours, so a needle's tokens stay together [{TUNED}]",
        compress=Compress(KVzip(pool_size=5)),
    )
)
# AdaKV's per-head budgets over the tuned SnapKV's and Expected Attention's scores: a layer's heads share its budget,
# each holding its own count in a segmented cache (`kvsieve.kv.heads`).
register(
    MethodSpec(
        "adakv",
        f"AdaKV: SnapKV's votes, the layer's budget shared among its KV heads (floor 0.2 each) [{TUNED}]",
        compress=Compress(SnapKV(pool_size=63), head_budgets=True),
    )
)
register(
    MethodSpec(
        "adakv-expected-attention",
        "AdaKV's per-head budgets over Expected Attention's scores; no question needed [paper]",
        compress=Compress(ExpectedAttention(), head_budgets=True),
    )
)
register(MethodSpec("h2o", "H2O: heavy hitters + recent half, evicting every step [paper]", evict=Evict(H2O())))
register(
    MethodSpec(
        "a2sf",
        f"A2SF: accumulated attention, forgetting factor 0.9, scores pooled over 63 tokens, every step [{TUNED}]",
        evict=Evict(A2SF(alpha=0.9, pool_size=63)),
    )
)
register(
    MethodSpec(
        "a2sf-paper",
        "A2SF as its paper runs it: forgetting factor 0.2, no recent window, no pooling [paper]",
        evict=Evict(A2SF()),
    )
)
register(
    MethodSpec("streaming", "StreamingLLM: sinks + recent window, every step [paper]", evict=Evict(StreamingLLM()))
)
register(MethodSpec("local", "local window: the newest tokens, every step [baseline]", evict=Evict(LocalWindow())))
register(MethodSpec("tova", "TOVA: the newest query's attention, every step [paper]", evict=Evict(TOVA())))
register(
    MethodSpec("knorm", "KNorm: lowest key norms, compressed once after prefill [paper]", compress=Compress(KNorm()))
)
# Combined methods build on the tuned presets' stages: a cheaper first pass for GemFilter, or a smaller
# cache after its short prefill.
register(
    MethodSpec(
        "gemfilter-critiprefill",
        "GemFilter whose early-layer pass (and short prefill) runs CritiPrefill's block-sparse attention "
        "[kvsieve's combination]",
        select=GEMFILTER,
        attention=CritiPrefill(),
    )
)
register(
    MethodSpec(
        "gemfilter-snapkv",
        "GemFilter keeps 2048 tokens, SnapKV compresses their cache to 1024 [kvsieve's combination]",
        select=GemFilter(k=2048, queries=32, softmax=True, block=64),
        compress=Compress(SnapKV(pool_size=63)),
    )
)
