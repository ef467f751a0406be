"""Recorded filter layers: what `kvsieve calibrate` measured per model, read back on request.

Kept apart from both the selector and the calibration so that neither imports the other: the
calibration writes here, and `GemFilter(layer="calibrated")` reads here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from transformers import PreTrainedModel

from kvsieve.paths import cache_dir


def calibration_file() -> Path:
    return cache_dir() / "calibration.json"


def model_key(model: PreTrainedModel) -> str:
    """Identity under which a model's calibration is stored (its load path or name)."""
    return str(getattr(model.config, "name_or_path", "") or model.config.model_type)


def load_all() -> dict[str, Any]:
    path = calibration_file()
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def calibrated_layer(model: PreTrainedModel) -> int | None:
    """The filter layer `kvsieve calibrate` recorded for this model, if any."""
    entry = load_all().get(model_key(model))
    return None if entry is None else int(entry["layer"])


def record(model: PreTrainedModel, entry: dict[str, Any]) -> None:
    """Remember a calibration result (with its recommended 'layer') for `model`."""
    entries = load_all()
    entries[model_key(model)] = entry
    path = calibration_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(entries, indent=1))
