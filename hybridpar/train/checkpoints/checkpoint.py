"""Checkpoint folders of a run: written whole or not at all, found, pruned, loaded with checks.

    RUN_DIR/checkpoints/
        step-100/          complete: renamed from .partial once every rank has written
            .metadata      DCP's index, written last by DCP itself
            __0_0.distcp   the tensors, one file per writing rank
        .step-200.partial  a save in progress, or cut short by a crash: never loaded

A save writes into ``.step-N.partial`` and global rank 0 renames it to ``step-N`` after DCP's
closing collective, so a crash at any point leaves the previous checkpoint as the latest.
A folder named ``step-N`` without ``.metadata`` (a copy cut short) is skipped with a warning.
After a save, rank 0 deletes partial folders and all but the newest `keep` complete ones.

Before a load, every ``.distcp`` file the index names must exist and be as long as the index
says (a missing or truncated file is a `CheckpointError` naming it, on every rank); whatever
else DCP fails on (a `CheckpointException`, which is not an `Exception`) becomes a
`CheckpointError` too. Tensors are read with ``torch.load(weights_only=True)``; the
``.metadata`` index itself is a pickle DCP writes and reads: load only checkpoints you trust.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from collections.abc import Mapping
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from hybridpar.comm.agreement import fail_together
from hybridpar.io.files import fsync_dir
from hybridpar.train.checkpoints.shards import Entry, ShardLoadPlanner, ShardSavePlanner

__all__ = ["CheckpointError", "check_files", "checkpoint_steps", "dcp_failure",
           "latest_checkpoint", "load_checkpoint", "prune_checkpoints", "read_metadata",
           "save_checkpoint"]

log = logging.getLogger(__name__)

_COMPLETE = re.compile(r"step-(0|[1-9]\d*)")   # no leading zeros: one name per step
_PARTIAL = re.compile(r"\.step-(\d+)\.partial")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded: missing, incomplete, or from another model."""


def _is_complete(path: Path) -> bool:
    return (path / ".metadata").is_file()


def checkpoint_steps(root: str | os.PathLike[str]) -> list[int]:
    """The steps of the complete checkpoints under `root` (RUN_DIR/checkpoints), ascending."""
    folder = Path(root)
    if not folder.is_dir():
        return []
    steps = []
    for path in folder.iterdir():
        match = _COMPLETE.fullmatch(path.name)
        if not match or not path.is_dir():
            if re.fullmatch(r"step-0\d+", path.name):
                log.warning("ignoring checkpoint %s: rename it to step-%d (no leading zeros)",
                            path, int(path.name[5:]))
            continue
        if _is_complete(path):
            steps.append(int(match.group(1)))
        else:
            log.warning("ignoring incomplete checkpoint %s: it has no .metadata", path)
    return sorted(steps)


def latest_checkpoint(root: str | os.PathLike[str]) -> Path | None:
    """The newest complete checkpoint folder under `root`, or None."""
    steps = checkpoint_steps(root)
    return Path(root) / f"step-{steps[-1]}" if steps else None


def prune_checkpoints(root: str | os.PathLike[str], *, keep: int) -> list[Path]:
    """Delete partial folders and all but the newest `keep` (>= 1) complete ones; the deleted."""
    if keep < 1:
        raise ValueError(f"keep must be >= 1 (the newest checkpoint is never deleted), got {keep}")
    folder = Path(root)
    if not folder.is_dir():
        return []
    doomed = [folder / f"step-{s}" for s in checkpoint_steps(folder)[:-keep]]
    doomed += [p for p in folder.iterdir() if _PARTIAL.fullmatch(p.name) or (
        _COMPLETE.fullmatch(p.name) and p.is_dir() and not _is_complete(p))]
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
    return doomed


def save_checkpoint(root: str | os.PathLike[str], step: int, state: Mapping[str, Entry], *,
                    keep: int) -> Path:
    """Write `state` as ``root/step-<step>`` on every rank (a collective); prune to `keep`."""
    folder = Path(root)
    final, partial = folder / f"step-{step}", folder / f".step-{step}.partial"
    rank = dist.get_rank()
    if rank == 0:
        folder.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)
    dist.barrier()
    try:
        dcp.save(dict(state), checkpoint_id=partial, planner=ShardSavePlanner())
    except CheckpointException as e:   # raised on every rank alike: remove what was written
        if rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
        raise CheckpointError(f"saving checkpoint step-{step} in {folder} failed: "
                              f"{dcp_failure(e)}; nothing was kept (the previous checkpoint "
                              "stays the latest): check the disk space and permissions") from None
    if rank == 0:
        shutil.rmtree(final, ignore_errors=True)  # a stale copy of this step
        os.replace(partial, final)
        fsync_dir(folder)
        prune_checkpoints(folder, keep=keep)
    dist.barrier()
    return final


def read_metadata(path: str | os.PathLike[str]) -> Metadata:
    """DCP's index of a checkpoint folder (a pickle DCP writes: load only trusted folders)."""
    folder = Path(path)
    if not folder.is_dir():
        raise CheckpointError(f"{path}: no such checkpoint folder; give a complete one, "
                              "RUN_DIR/checkpoints/step-N")
    if not _is_complete(folder):
        raise CheckpointError(f"{path}: incomplete checkpoint (no .metadata); it was cut short "
                              "while saving: use an earlier step-N folder")
    try:
        return FileSystemReader(str(folder)).read_metadata()
    except Exception as e:
        raise CheckpointError(f"{path}: unreadable checkpoint index .metadata ({type(e).__name__}"
                              f": {e}); the folder is damaged: restore it, or delete it to use "
                              "an earlier step-N") from None


def check_files(path: str | os.PathLike[str], metadata: Metadata) -> None:
    """Raise `CheckpointError` if a data file the index names is missing or cut short."""
    needed: dict[str, int] = {}
    storage = getattr(metadata, "storage_data", None) or {}
    for info in storage.values():
        name = str(getattr(info, "relative_path", ""))
        end = int(getattr(info, "offset", 0)) + int(getattr(info, "length", 0))
        needed[name] = max(needed.get(name, 0), end)
    for name, length in sorted(needed.items()):
        file = Path(path) / name
        if not file.is_file():
            raise CheckpointError(f"{path} is damaged: its data file {name} is missing; restore "
                                  "it, or delete the folder to use an earlier step-N")
        size = file.stat().st_size
        if size < length:
            raise CheckpointError(f"{path} is damaged: its data file {name} is truncated "
                                  f"({size} bytes, the index needs {length}); restore it, or "
                                  "delete the folder to use an earlier step-N")


def dcp_failure(error: CheckpointException) -> str:
    """A one-line summary of DCP's per-rank failures."""
    parts = []
    for rank, (exc, _) in sorted(error.failures.items()):
        text = str(exc).strip().splitlines()
        parts.append(f"rank {rank}: {type(exc).__name__}" + (f": {text[0]}" if text else ""))
    return "; ".join(parts) or "unknown failure"


def saved_entries(metadata: Metadata, prefix: str) -> dict[str, TensorStorageMetadata]:
    """The tensors under `prefix` in a checkpoint's index."""
    return {k: v for k, v in metadata.state_dict_metadata.items()
            if k.startswith(prefix) and isinstance(v, TensorStorageMetadata)}


def check_compatible(path: str | os.PathLike[str], metadata: Metadata,
                     state: Mapping[str, Entry], *, prefix: str = "model/") -> None:
    """Raise `CheckpointError` unless the checkpoint holds every key of `state` under `prefix`
    with the same full shape (a checkpoint of another model, or of another size)."""
    saved = metadata.state_dict_metadata
    missing = [k for k in state if k.startswith(prefix) and k not in saved]
    if missing:
        raise CheckpointError(
            f"{path} does not hold this model: {len(missing)} of its tensors are missing "
            f"(first: {', '.join(m.removeprefix(prefix) for m in missing[:3])}); was it saved "
            "from another model or model config?")
    for key, value in state.items():
        if not key.startswith(prefix):
            continue
        meta = saved[key]
        if not isinstance(meta, TensorStorageMetadata) or tuple(meta.size) != tuple(value.size()):
            shape = tuple(meta.size) if isinstance(meta, TensorStorageMetadata) else "not a tensor"
            raise CheckpointError(
                f"{path} does not match this model: {key.removeprefix(prefix)} has shape "
                f"{shape} there and {tuple(value.size())} here; was it saved from another "
                "model config?")


def load_checkpoint(path: str | os.PathLike[str], state: Mapping[str, Entry]) -> None:
    """Fill `state` in place from the checkpoint folder `path` (a collective of every rank).

    Every key of `state` must be in the checkpoint; tp shards are read from whatever shards
    were saved, so the layout may differ from the saving run's.
    """
    with fail_together(CheckpointError):   # each rank checks its own keys: agree first
        metadata = read_metadata(path)
        check_files(path, metadata)
        check_compatible(path, metadata, state, prefix="model/")
        check_compatible(path, metadata, state, prefix="optim/")
        missing = [k for k in state if k not in metadata.state_dict_metadata]
        if any(k.startswith("data/") for k in missing):
            raise CheckpointError(f"{path} holds another data position ({', '.join(missing)} "
                                  "missing); was it saved with another data.source?")
        if missing:
            raise CheckpointError(f"{path} lacks {', '.join(missing[:5])}; it was not written "
                                  "by this version of hybridpar's trainer")
    try:
        dcp.load(dict(state), checkpoint_id=str(path), planner=ShardLoadPlanner())
    except CheckpointException as e:   # DCP gathers every rank's failure: raised on all
        raise CheckpointError(f"{path} cannot be read ({dcp_failure(e)}); its files are damaged: "
                              "restore them, or delete the folder to use an earlier "
                              "step-N") from None


def allocate_like(metadata: Metadata, keys: list[str]) -> dict[str, Tensor]:
    """Empty tensors shaped and typed as the checkpoint's `keys` (to load them whole)."""
    out: dict[str, Tensor] = {}
    for key in keys:
        meta = metadata.state_dict_metadata[key]
        assert isinstance(meta, TensorStorageMetadata)
        out[key] = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
    return out
