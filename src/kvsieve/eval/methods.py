"""The methods of an evaluation run (niah, ppl, ruler, bench, report): the specs a result file recorded, and the
lengths they can run.

The entry points build the specs from the registry (`registry.methods`, for `--methods snapkv,h2o --set ...`);
below them a method is a `MethodSpec`, and the result files record the exact spec of every method.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvsieve.engine import positions_needed
from kvsieve.errors import KvsieveError
from kvsieve.spec import MethodSpec


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
