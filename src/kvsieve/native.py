"""`kvsieve.native`, now `kvsieve.kernels.native`: this name works in this release only (CHANGELOG.md)."""

from kvsieve.kernels.native import *  # noqa: F403
from kvsieve.kernels.native import build, load  # noqa: F401
from kvsieve.kernels.native import build_kernels as warm_up  # noqa: F401
from kvsieve.spec import warn_renamed

warn_renamed("kvsieve", "kvsieve.native", "kvsieve.kernels.native")
