"""`kvsieve.linear`, now `kvsieve.kernels.products` (its `warm_up`: `kvsieve.kernels.native.build_kernels`): this name
works in this release only (CHANGELOG.md)."""

from kvsieve.kernels.native import build_kernels as warm_up  # noqa: F401
from kvsieve.kernels.products import *  # noqa: F403
from kvsieve.spec import warn_renamed

warn_renamed("kvsieve", "kvsieve.linear", "kvsieve.kernels.products")
