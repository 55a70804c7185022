"""`hybridpar export`: a checkpoint folder as the plain single-device state dict (one file),
or, for ``model.name = "hf:<family>"`` runs, as a Hugging Face checkpoint directory."""

from __future__ import annotations

import json
import os
import re
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import Tensor
from torch.distributed.checkpoint.api import CheckpointException

from hybridpar.files import atomic_write
from hybridpar.train.checkpoint import (
    CheckpointError,
    allocate_like,
    check_files,
    dcp_failure,
    read_metadata,
)
from hybridpar.train.shards import ShardLoadPlanner, read_ties

__all__ = ["export_checkpoint", "export_hf", "load_exported", "read_state"]


def _layer_order(key: str) -> tuple[int, str]:
    head = re.match(r"(\d+)\.", key)
    return (int(head.group(1)) if head else -1, key)


def read_state(checkpoint: str | os.PathLike[str]) -> dict[str, Tensor]:
    """A checkpoint's model tensors (any layout) as the plain model's ``{name: tensor}``.

    Every name of a tied parameter gets its tensor. Runs in one process (no process group).
    """
    metadata = read_metadata(checkpoint)
    keys = [k for k in metadata.state_dict_metadata if k.startswith("model/")]
    ties = [k for k in metadata.state_dict_metadata if k.startswith("tied/")]
    if not keys:
        raise CheckpointError(f"{checkpoint} holds no model tensors; is it a hybridpar "
                              "checkpoint (RUN_DIR/checkpoints/step-N)?")
    check_files(checkpoint, metadata)
    state = allocate_like(metadata, keys + ties)
    try:
        with warnings.catch_warnings():  # DCP warns that it runs without a process group: asked
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
            dcp.load(state, checkpoint_id=str(checkpoint), planner=ShardLoadPlanner(),
                     no_dist=True)
    except CheckpointException as e:
        raise CheckpointError(f"{checkpoint} cannot be read ({dcp_failure(e)}); its files are "
                              "damaged: restore them or export an earlier step-N") from None
    plain = {k.removeprefix("model/"): v for k, v in state.items() if k.startswith("model/")}
    for alias, canonical in read_ties(state).items():   # saved once: every name gets it
        plain[alias] = plain[canonical]
    return dict(sorted(plain.items(), key=lambda kv: _layer_order(kv[0])))


def export_checkpoint(checkpoint: str | os.PathLike[str], out: str | os.PathLike[str]
                      ) -> dict[str, Tensor]:
    """Gather a checkpoint's model tensors (any layout) into `out` with `torch.save`.

    The file holds ``{name: tensor}`` with the names and full shapes of the unsharded
    `nn.Sequential`'s ``state_dict()``, so ``model.load_state_dict(torch.load(out,
    weights_only=True))`` works on the plain model. Runs in one process (no process group).
    Written to a temporary file first, so `out` is either the old file or the whole new one.
    """
    target = Path(out)
    if target.is_dir():
        raise ValueError(f"{out} is a folder; give the path of the .pt file to write")
    plain = read_state(checkpoint)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)   # only once the checkpoint read
        atomic_write(target, lambda tmp: torch.save(plain, tmp))
    except OSError as e:
        raise ValueError(f"cannot write {out}: {e.strerror or e}") from None
    return plain


def _run_model(checkpoint: Path, config: str | os.PathLike[str] | None) -> dict[str, Any]:
    """The ``[model]`` table of the run that wrote `checkpoint` (its RUN_DIR/config.json)."""
    file = Path(config) if config is not None else checkpoint.parent.parent / "config.json"
    if not file.is_file():
        raise ValueError(f"{file}: no run config; --format hf reads the model from the run's "
                         "config.json (RUN_DIR/checkpoints/step-N -> RUN_DIR/config.json): "
                         "pass --config RUN_DIR/config.json")
    model = json.loads(file.read_text(encoding="utf-8")).get("model", {})
    if not isinstance(model, dict) or not str(model.get("name", "")).startswith("hf:"):
        raise ValueError(f"--format hf exports Hugging Face models (model.name = 'hf:...'); "
                         f"the run in {file} trained model {model.get('name')!r}: export it "
                         "as a .pt state dict (without --format hf)")
    return model


def export_hf(checkpoint: str | os.PathLike[str], out: str | os.PathLike[str], *,
              config: str | os.PathLike[str] | None = None) -> dict[str, Tensor]:
    """Write an ``hf:<family>`` run's checkpoint as a Hugging Face checkpoint directory.

    ``config.json`` + ``model.safetensors`` (`hybridpar.hf.save_hf_checkpoint`), which
    ``AutoModelForCausalLM.from_pretrained(out)`` loads. The directory is written next to
    `out` and renamed into place: `out` is whole or absent (an existing `out` is refused).
    """
    from hybridpar.hf import save_hf_checkpoint
    from hybridpar.models.hf import hf_config

    target = Path(out)
    if target.exists():
        raise ValueError(f"{out} exists; give a new directory for the Hugging Face checkpoint")
    model = _run_model(Path(checkpoint), config)
    options = {k: v for k, v in model.items() if k != "name"}
    plain = read_state(checkpoint)
    hf = hf_config(str(model["name"]).removeprefix("hf:"), options)
    try:
        atomic_write(target, lambda tmp: save_hf_checkpoint(plain, hf, tmp))
    except OSError as e:
        raise ValueError(f"cannot write {out}: {e.strerror or e}") from None
    return plain


def load_exported(path: str | os.PathLike[str]) -> dict[str, Tensor]:
    """Read an exported state dict (``weights_only=True``: tensors only, no code)."""
    value = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(value, dict) or not all(isinstance(v, Tensor) for v in value.values()):
        raise ValueError(f"{path} is not a state dict of tensors")
    return value
