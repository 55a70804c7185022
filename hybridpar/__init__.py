"""hybridpar: pipeline x tensor x data parallel training for PyTorch."""

from hybridpar.launch import SpawnError, SpawnTimeout, spawn
from hybridpar.topology import ParallelDims, Topology, current_topology, init, shutdown

__version__ = "0.1.0"

__all__ = [
    "ParallelDims",
    "SpawnError",
    "SpawnTimeout",
    "Topology",
    "__version__",
    "current_topology",
    "init",
    "shutdown",
    "spawn",
]
