"""hybridpar: pipeline x tensor x data parallel training for PyTorch."""

from torchgpipe.checkpoint import is_checkpointing, is_recomputing

from hybridpar import nn
from hybridpar.balance import balance_by_params, balance_by_size, balance_by_time, balance_uniform
from hybridpar.comm.p2p import comm_stats, reset_comm_stats
from hybridpar.launch import SpawnError, SpawnTimeout, spawn
from hybridpar.pipe import HybridPipe, TokenMean
from hybridpar.pipeline.runtime.executor import PipelineError, current_microbatch
from hybridpar.sharded.attrs import (
    get_parallel_dim,
    register_parallel_attribute,
    register_parallel_dim,
)
from hybridpar.tensor_parallel.plans.strategy import shard
from hybridpar.tensor_parallel.random import get_rng_tracker, model_parallel_manual_seed
from hybridpar.tensor_parallel.state import (
    collect_state_dict,
    register_ddp_parameters_to_ignore,
    relocate_state_dict,
    slice,
)
from hybridpar.topology import ParallelDims, Topology, current_topology, init, shutdown

__version__ = "0.1.0"

__all__ = [
    "HybridPipe",
    "ParallelDims",
    "PipelineError",
    "SpawnError",
    "SpawnTimeout",
    "TokenMean",
    "Topology",
    "__version__",
    "balance_by_params",
    "balance_by_size",
    "balance_by_time",
    "balance_uniform",
    "collect_state_dict",
    "comm_stats",
    "current_microbatch",
    "current_topology",
    "get_parallel_dim",
    "get_rng_tracker",
    "init",
    "is_checkpointing",
    "is_recomputing",
    "model_parallel_manual_seed",
    "nn",
    "register_ddp_parameters_to_ignore",
    "register_parallel_attribute",
    "register_parallel_dim",
    "relocate_state_dict",
    "reset_comm_stats",
    "shard",
    "shutdown",
    "slice",
    "spawn",
]
