"""`kvsieve.eval.scoring`, now `kvsieve.eval.grading` (`kvsieve.select.scoring` is GemFilter's attention scores): this
name works in this release only (CHANGELOG.md)."""

from kvsieve.eval.grading import *  # noqa: F403
from kvsieve.spec import warn_renamed

warn_renamed("kvsieve", "kvsieve.eval.scoring", "kvsieve.eval.grading")
