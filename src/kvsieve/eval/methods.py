"""The methods of an evaluation run (niah, ppl, bench, report), built from the one registry.

A run names registered methods (`--methods snapkv,h2o`) and settings (`--set compress.budget=0.25`).
A setting applies to every listed method that has that field and must apply to at least one, so
`--set compress.budget=512` with `snapkv,h2o` changes SnapKV's compression and leaves H2O's
eviction budget alone. The result files record the exact spec of every method.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from kvsieve.errors import KvsieveError
from kvsieve.pipeline import positions_needed
from kvsieve.registry import REGISTRY, method
from kvsieve.spec import MethodSpec


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


def build_specs(names: str | Sequence[str], settings: Iterable[tuple[str, Any]] = ()) -> dict[str, MethodSpec]:
    """{name: spec} for the listed methods, each setting applied where the method has the field."""
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


def specs_from_settings(recorded: Mapping[str, Any]) -> dict[str, MethodSpec]:
    """The specs a result file recorded under settings['methods'] ({name: spec dict})."""
    return {name: MethodSpec.from_dict(data) for name, data in recorded.items()}


def check_lengths(specs: Mapping[str, MethodSpec], lengths: list[int], extra: int, max_positions: int) -> None:
    """Refuse lengths a configuration cannot run: only chunked feeds go beyond the model's context.

    `extra` is the positions needed after the prompt (tokens to generate or score).
    """
    if not lengths or any(n < 1 for n in lengths):
        raise KvsieveError(f"Lengths must be positive token counts, got {lengths}.")
    over = {n: [name for name, spec in specs.items() if positions_needed(spec.stages(), n, extra) > max_positions]
            for n in lengths}  # fmt: skip
    too_long = [n for n, names in over.items() if names]
    if too_long:
        limited = sorted({name for n in too_long for name in over[n]})
        raise KvsieveError(
            f"Length(s) {too_long} plus {extra} generated tokens exceed the model's {max_positions} positions, "
            f"which {', '.join(limited)} need. Use shorter lengths or only chunked feeds (fm, im, imdc)."
        )
