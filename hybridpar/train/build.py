"""What a run builds on each rank from its config: the topology, this rank's HybridPipe stage
(from the seed), and the optimizer over its shards."""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hybridpar.optim import pipe_optimizer
from hybridpar.pipe import HybridPipe
from hybridpar.pipe.token_mean import TokenMean
from hybridpar.precision import PARAM_DTYPES, check_dtype_runs
from hybridpar.tensor_parallel.random import model_parallel_manual_seed
from hybridpar.topology import Topology, current_topology, init
from hybridpar.train.configs.config import Config
from hybridpar.train.configs.model_build import build_model
from hybridpar.train.configs.optimizer import optimizer_class as configured_optimizer
from hybridpar.train.configs.optimizer import optimizer_options

__all__ = ["HOST_MEMORY_BUDGET", "build_optimizer", "build_pipe", "cap_host_memory", "loss_rank",
           "token_mean_loss", "topology_for"]

log = logging.getLogger(__name__)

#: the environment variable `cap_host_memory` reads: a size ("300MiB") or bytes
HOST_MEMORY_BUDGET = "HYBRIDPAR_HOST_MEMORY_BUDGET"


def topology_for(config: Config) -> Topology:
    """The current topology if it matches the config's layout, else `hybridpar.init` it."""
    par = config.parallel
    if dist.is_initialized():
        with contextlib.suppress(RuntimeError):
            topo = current_topology()
            if (topo.pp, topo.tp, topo.ep) == (par.pp, par.tp, par.ep) \
                    and par.dp in (None, topo.dp):
                return topo
    return init(pp=par.pp, tp=par.tp, dp=par.dp, ep=par.ep, timeout=par.timeout)


def cap_host_memory() -> int | None:
    """With ``HYBRIDPAR_HOST_MEMORY_BUDGET=SIZE`` set (``"300MiB"``, bytes), cap this process's
    address space at its size now + SIZE (``setrlimit(RLIMIT_AS)``); the cap in bytes, or None.

    `build_pipe` calls it once the model is built on ``meta`` (its libraries imported, no
    weights yet; a model its builder makes whole is counted in "now"): the rank's shard,
    what it reads of a checkpoint, gradients, optimizer state, activations and checkpoint
    saves must then fit in SIZE, or the rank fails at the allocation that went past it
    (torch: "DefaultCPUAllocator: can't allocate memory"; Python: `MemoryError`), and the
    run with it, instead of the kernel's OOM killer ending some process of the machine.
    It caps address space, not resident memory, so it is for CPU ranks: CUDA maps far more
    than it uses, glibc reserves 64 MiB per malloc arena (set ``MALLOC_ARENA_MAX=2`` with
    it), and a safetensors file being read is mapped whole (keep checkpoint files smaller
    than SIZE). Linux only (tests/test_run_memory_limit.py trains a model larger than SIZE).
    """
    from hybridpar.io.weight_files import parse_size

    text = os.environ.get(HOST_MEMORY_BUDGET, "").strip()
    if not text:
        return None
    try:
        budget = parse_size(text)
    except ValueError:
        raise ValueError(f"{HOST_MEMORY_BUDGET}={text!r} is not a size: give bytes or a size "
                         "such as '300MiB'") from None
    import resource

    status = Path("/proc/self/status").read_text().splitlines()
    size = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmSize:"))
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    cap = size + budget if hard == resource.RLIM_INFINITY else min(size + budget, hard)
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    log.info("%s=%s: address space capped at %.0f MiB (%.0f MiB now)", HOST_MEMORY_BUDGET,
             text, cap / 2**20, size / 2**20)
    return cap


def token_mean_loss(loss: Any) -> TokenMean:
    """The model's loss as the token mean of each global batch (a folder of conversations:
    `hybridpar.pipe.token_mean`); the loss must take ``reduction="sum"``, as `gpt_loss` and
    `next_token_loss` do: a ValueError otherwise, on every rank."""
    try:
        takes = "reduction" in inspect.signature(loss).parameters
    except (TypeError, ValueError):
        takes = False
    if not takes:
        raise ValueError(f"data.path holds conversations with a loss mask, and the model's "
                         f"loss {getattr(loss, '__name__', loss)!r} takes no reduction: "
                         "training on a loss mask sums each micro-batch's token losses "
                         "(reduction='sum') and divides by the batch's counted tokens; give "
                         "the loss a reduction keyword, as hybridpar.models.gpt_loss has")
    return TokenMean(functools.partial(loss, reduction="sum"))


def loss_rank(topo: Topology) -> int:
    """The rank that reports: last stage, tp rank 0, dp rank 0 (not necessarily rank 0)."""
    return topo.global_rank(0, topo.pp - 1, 0)


def build_pipe(config: Config, topo: Topology, *, sample: Any = None) -> HybridPipe:
    """The config's model built from its seed on every rank, as this rank's HybridPipe stage.

    The zoo's models and ``hf:`` families are built on ``meta``: the pipe gives storage to
    this rank's stages and tp slices only, drawn module by module under seeds keyed by
    ``train.seed`` and their names (`hybridpar.keyed.KeyedInit`; the same values as the
    one-device model and every other layout). With ``model.pretrained`` they are zeros and
    the rotary buffers (`hybridpar.hf.init_for_loading`), and the rank reads just its tensors
    from the checkpoint (`hybridpar.hf.load_hf_shards`). A user's builder is built on
    ``meta`` too once `train.configs.builder_check` accepts it; ``model.init = "full"`` builds any
    model whole. Then the random streams are seeded again, so what the build drew
    (balance profiling) does not move dropout.
    """
    par, name = config.parallel, config.model.name
    if config.train.precision == "bf16":   # before the model is built, on every rank
        check_dtype_runs(torch.bfloat16, topo.device, what="train.precision = 'bf16'")
    extra: dict[str, Any] = dict(tp=par.tp, group=topo.tp_group) \
        if par.tp > 1 and par.tp_plan is None else {}
    if par.sequence_parallel and not name.startswith("hf:"):   # hf: HybridPipe applies it
        extra["sequence_parallel"] = True
    if par.ep > 1 and name == "gpt":   # this rank's experts (hf: HybridPipe slices them)
        extra.update(ep=par.ep, ep_group=topo.ep_group)
    pretrained = config.model.args.get("pretrained") if name.startswith("hf:") else None
    torch.manual_seed(config.train.seed)
    model_parallel_manual_seed(config.train.seed, group=topo.tp_group)
    model, loss, init = build_model(config, **extra)   # `train.configs.model_build`: meta, keyed
    cap_host_memory()   # HYBRIDPAR_HOST_MEMORY_BUDGET: what the shard and the steps may add
    # balance = "time" profiles under the precision the run trains in
    bf16 = config.train.precision == "bf16"
    with torch.autocast(topo.device.type, dtype=torch.bfloat16, enabled=bf16):
        pipe = HybridPipe(model, par.balance, chunks=par.chunks, topology=topo,
                          schedule=par.schedule, virtual_stages=par.virtual_stages,
                          checkpoint=par.checkpoint, loss_fn=loss, tp_plan=par.tp_plan,
                          deferred_batch_norm=par.deferred_batch_norm, balance_sample=sample,
                          init_fn=init, param_dtype=PARAM_DTYPES[config.train.param_dtype],
                          compile=config.train.compile,
                          sequence_parallel=par.sequence_parallel and name.startswith("hf:"))
    if pretrained is not None:
        from hybridpar.hf import load_hf_shards

        loaded = load_hf_shards(pipe, pretrained)
        log.info("model.pretrained %s: read %d tensors (%.1f MiB) on this rank", pretrained,
                 loaded.tensors, loaded.bytes_read / 2**20)
    torch.manual_seed(config.train.seed)
    model_parallel_manual_seed(config.train.seed, group=topo.tp_group)
    return pipe


def build_optimizer(pipe: HybridPipe, config: Config) -> Any:
    """The optimizer of ``[optim]`` (`train.configs.optimizer`: AdamW by default) over this
    rank's shards, with its options: weight decay on matrices, none on biases and norms; with
    ``parallel.zero`` >= 1 and dp > 1 its state (and at 2 the gradients) sharded over dp, over
    float32 master weights of bf16 ones (`hybridpar.optim.pipe_optimizer`). ``load_config``
    checked the class and options (`check_optim`)."""
    optimizer_class = configured_optimizer(config.optim.name)
    options = optimizer_options(config.optim, optimizer_class)
    params = [p for p in pipe.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    rest = [p for p in params if p.dim() < 2]
    groups = [g for g in ({"params": decay, "weight_decay": config.optim.weight_decay},
                          {"params": rest, "weight_decay": 0.0}) if g["params"]]
    if "weight_decay" not in inspect.signature(optimizer_class.__init__).parameters:
        groups = [{"params": g["params"]} for g in groups]   # (optim.weight_decay is 0 then)
    zero = config.parallel.zero
    if zero and pipe.topology.dp == 1:
        if pipe.topology.rank == 0:
            log.warning("parallel.zero = %d at dp = 1: nothing to shard, the optimizer state "
                        "is whole on every rank", zero)
        zero = 0
    return pipe_optimizer(pipe, optimizer_class, groups, zero=zero, lr=config.train.lr,
                          **options)


