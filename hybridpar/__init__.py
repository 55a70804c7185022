"""hybridpar: pipeline x tensor x data parallel training for PyTorch."""

from torchgpipe.checkpoint import is_checkpointing, is_recomputing

from hybridpar.comm import comm_stats, reset_comm_stats
from hybridpar.launch import SpawnError, SpawnTimeout, spawn
from hybridpar.pipe import HybridPipe
from hybridpar.pipeline.executor import PipelineError, current_microbatch
from hybridpar.topology import ParallelDims, Topology, current_topology, init, shutdown

__version__ = "0.1.0"

__all__ = [
    "HybridPipe",
    "ParallelDims",
    "PipelineError",
    "SpawnError",
    "SpawnTimeout",
    "Topology",
    "__version__",
    "comm_stats",
    "current_microbatch",
    "current_topology",
    "init",
    "is_checkpointing",
    "is_recomputing",
    "reset_comm_stats",
    "shutdown",
    "spawn",
]
