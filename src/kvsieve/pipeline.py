"""`kvsieve.pipeline` moved into the engine: its public names are `kvsieve.engine`'s (`prefill`, `PrefillResult`, ...).

This alias answers the old path in this release only, warning (CHANGELOG.md).
"""

import kvsieve.engine as _engine
from kvsieve.spec import warn_renamed


def __getattr__(name: str) -> object:
    value = getattr(_engine, name)
    warn_renamed("kvsieve", f"pipeline.{name}", f"engine.{name}")
    return value
