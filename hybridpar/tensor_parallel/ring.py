"""Moved to `hybridpar.tensor_parallel.feature.ring`; this old path re-exports it."""

from hybridpar.tensor_parallel.feature.ring import *  # noqa: F403
from hybridpar.tensor_parallel.feature.ring import __all__  # noqa: F401
