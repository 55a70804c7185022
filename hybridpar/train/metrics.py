"""RUN_DIR/metrics.jsonl, one JSON object per logged step, and what the records tell: model
FLOPs and MFU, every rank's peak memory, and copies to TensorBoard / Weights & Biases.

    at the start   every rank: the job's peak FLOP/s (GPU: the table of `hybridpar.flops`,
                   CPU: each rank's fp32 matmul, measured at once, summed); the reporting
                   rank: model FLOPs per token from the config (a meta build)
    at a log step  every rank: its peak memory, gathered to the reporting rank (the only
                   host syncs, and only then); the reporting rank: the record with
                   ``mfu``, ``host_peak_mib`` and ``device_peak_mib`` (CUDA), written to
                   metrics.jsonl, then TensorBoard and W&B when [logging] asks
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from hybridpar.io.files import atomic_write_text

if TYPE_CHECKING:
    from hybridpar.train.configs.config import Config

__all__ = ["MetricsLog", "ScalarSinks", "gather_peak_memory", "host_peak_bytes",
           "job_peak_flops", "model_flops", "read_metrics", "scalars"]

log = logging.getLogger(__name__)


def read_metrics(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The records of a metrics file (an unfinished last line, cut by a crash, is dropped)."""
    file = Path(path)
    if not file.is_file():
        return []
    records = []
    for line in file.read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


class MetricsLog:
    """Appends records to a JSON-lines file; on resume keeps only those of steps <= `after`.

    A run resumed from the checkpoint of step k logs steps k+1.. again, so the records a
    crashed run wrote after its last checkpoint are dropped first (the file is rewritten
    through a temporary file and `os.replace`, never left half-written).
    """

    def __init__(self, path: str | os.PathLike[str], *, after: int = 0) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        kept = [r for r in read_metrics(self.path) if int(r.get("step", 0)) <= after]
        atomic_write_text(self.path, "".join(json.dumps(r) + "\n" for r in kept))
        self._file = open(self.path, "a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        """Append one record as a line and flush it."""
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


# model FLOPs and the peak -------------------------------------------------------------------

def model_flops(config: Config) -> tuple[float | None, str]:
    """(model FLOPs of one item's forward + backward, how they were counted) of `config`'s
    model, counted on a `meta` build of the whole model (no tp, no storage).

    An item is a token (gpt, ``hf:`` families, a user's builder) or a sample (mlp, unet).
    gpt: 6 N + 12 L h s (`hybridpar.flops`); ``hf:`` families: the same with L and h from
    the Hugging Face config; any other token model: 6 N (attention unknown); mlp: 6 N per
    sample; a model with convolutions (unet), or one that will not build on meta: None.
    """
    from hybridpar.flops import flops_per_token, matmul_params
    from hybridpar.models.registry import build, takes_tokens

    name, seq = config.model.name, int(config.data.seq_len or 1)
    try:
        with torch.device("meta"):
            model, _ = build(name, **config.model.args)
    except Exception as e:   # a user's builder that needs storage: no MFU, the run goes on
        log.info("MFU: model %r does not build on meta (%s); no mfu in metrics.jsonl", name, e)
        return None, "unknown"
    if any(isinstance(m, torch.nn.modules.conv._ConvNd) for m in model.modules()):
        return None, "unknown (convolutions)"
    n = matmul_params([model])
    if not takes_tokens(name):
        return 6.0 * n, "6N per sample"
    if name == "gpt":
        args = config.model.args
        return flops_per_token(n, int(args["n_layer"]), int(args["n_embd"]), seq), "6N+12Lhs"
    if name.startswith("hf:"):
        from hybridpar.hf import config_of

        hf = config_of(model)
        blocks, hidden = getattr(hf, "num_hidden_layers", None), getattr(hf, "hidden_size", None)
        if blocks and hidden:
            return flops_per_token(n, int(blocks), int(hidden), seq), "6N+12Lhs"
    return flops_per_token(n, 0, 0, seq), "6N"


def job_peak_flops(device: torch.device, world: int) -> tuple[float | None, str]:
    """(the job's peak FLOP/s, its source), called by every rank at once.

    CUDA: the device name's dense bf16 peak (`hybridpar.flops.PEAK_BF16`, whatever
    ``train.precision``) times the ranks; None for a GPU not in the table. CPU: every rank
    times an fp32 matmul at the same moment (`cpu_matmul_peak`: ranks sharing cores share
    them here too) and the rates are summed over the job (one all-reduce, at the start).
    """
    from hybridpar.flops import cpu_matmul_peak, peak_bf16

    if device.type == "cuda":
        peak, label = peak_bf16(torch.cuda.get_device_name(device))
        return (None if peak is None else peak * world), label
    together = dist.is_initialized() and world > 1
    if together:
        dist.barrier()   # every rank measures at once, sharing the cores
    rate = torch.tensor([cpu_matmul_peak()], dtype=torch.float64)
    if together:
        dist.all_reduce(rate)
    return float(rate[0]), "measured fp32 matmul"


# peak memory --------------------------------------------------------------------------------

def host_peak_bytes() -> int:
    """This process's peak resident memory: VmHWM of /proc/self/status (Linux), else
    ru_maxrss."""
    status = Path("/proc/self/status")
    if status.is_file():
        for line in status.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def gather_peak_memory(device: torch.device, dst: int) -> dict[str, list[float]] | None:
    """Every rank's peak memory in MiB, by global rank, on rank `dst` (None elsewhere):
    ``host_peak_mib`` (VmHWM) and, on CUDA, ``device_peak_mib``
    (`torch.cuda.max_memory_allocated`). A collective: every rank calls it, at log steps."""
    mine = [host_peak_bytes() / 2**20]
    if device.type == "cuda":
        mine.append(torch.cuda.max_memory_allocated(device) / 2**20)
    local = torch.tensor(mine, dtype=torch.float64, device=device)          # (k,)
    world = dist.get_world_size() if dist.is_initialized() else 1
    table: list[torch.Tensor] | None = [local]
    if world > 1:
        rank = dist.get_rank()
        table = [torch.empty_like(local) for _ in range(world)] if rank == dst else None
        dist.gather(local, table, dst=dst)
        if rank != dst:
            return None
    assert table is not None
    values = torch.stack(table).cpu().tolist()                              # (world, k)
    out = {"host_peak_mib": [round(v[0], 1) for v in values]}
    if device.type == "cuda":
        out["device_peak_mib"] = [round(v[1], 1) for v in values]
    return out


# TensorBoard and Weights & Biases -----------------------------------------------------------

def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The plottable numbers of a record, flat: its number fields, and the largest rank's
    ``host_peak_mib`` / ``device_peak_mib`` (step and the comm table left out)."""
    out: dict[str, float] = {}
    for key, value in record.items():
        if key == "step" or isinstance(value, bool):
            continue
        if isinstance(value, int | float):
            out[key] = float(value)
        elif isinstance(value, list) and value and key.endswith("_mib"):
            out[key] = float(max(value))
    return out


class ScalarSinks:
    """TensorBoard (RUN_DIR/tensorboard) and W&B (RUN_DIR/wandb) copies of the records, as
    [logging] asks; the reporting rank makes one. A missing package is an ImportError that
    names it (the config loader reports it first, before any worker starts)."""

    def __init__(self, config: Config, run_dir: Path) -> None:
        opts = config.logging
        self.tb: Any = None
        self.wandb: Any = None
        if opts.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise ImportError("logging.tensorboard = true needs the tensorboard package: "
                                  "pip install -e '.[log]'") from None
            self.tb = SummaryWriter(log_dir=str(run_dir / "tensorboard"))
        if opts.wandb:
            try:
                import wandb
            except ImportError:
                raise ImportError("logging.wandb = true needs the wandb package: pip install "
                                  "wandb (or set logging.wandb = false)") from None
            (run_dir / "wandb").mkdir(parents=True, exist_ok=True)
            self.wandb = wandb.init(project=opts.wandb_project, name=config.name,
                                    dir=str(run_dir), mode=opts.wandb_mode,
                                    config=config.to_dict())

    def write(self, record: dict[str, Any]) -> None:
        values, step = scalars(record), int(record["step"])
        if self.tb is not None:
            for key, value in values.items():
                self.tb.add_scalar(key, value, step)
            self.tb.flush()
        if self.wandb is not None:
            self.wandb.log(values, step=step)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()
