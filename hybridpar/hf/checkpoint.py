"""Hugging Face checkpoint directories (``*.safetensors``, sharded or not) in Sequential names."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torch import Tensor

from hybridpar.hf.keys import key_map, sequential_state_dict
from hybridpar.moe.hub_names import piece_view

__all__ = ["checkpoint_config", "load_hf_checkpoint", "save_hf_checkpoint"]

_INDEX = "model.safetensors.index.json"


def _files(directory: Path) -> list[Path]:
    """The weight files: the index's (sharded), else every ``*.safetensors`` in the directory."""
    index = directory / _INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [directory / name for name in sorted(set(weight_map.values()))]
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        found = ", ".join(sorted(p.name for p in directory.iterdir())) or "nothing"
        raise FileNotFoundError(
            f"{directory} holds no *.safetensors weights (found: {found}); pickled "
            "pytorch_model.bin checkpoints are not read: save them with "
            "save_pretrained(..., safe_serialization=True)")
    return files


def checkpoint_config(directory: Path, config: Any = None) -> Any:
    """`config`, or the checkpoint directory's ``config.json``; FileNotFoundError when
    `directory` is not a directory or has no config to read."""
    if not directory.is_dir():
        raise FileNotFoundError(f"{directory} is not a directory (a local checkpoint saved by "
                                "save_pretrained)")
    if config is None:
        config_file = directory / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"{config_file} is missing; pass config=")
        config = json.loads(config_file.read_text())
    return config


def load_hf_checkpoint(directory: str | Path, *, config: Any = None) -> dict[str, Tensor]:
    """The weights of a local Hugging Face checkpoint directory, under the Sequential's names.

    Reads ``model.safetensors`` or the shards listed in ``model.safetensors.index.json``, onto
    the CPU, and maps the names with `sequential_state_dict` (a tied head left out of the files
    is the embedding's tensor). `config` defaults to the directory's ``config.json``. The result
    loads into ``to_sequential(model)`` or into a pipe of any layout with
    ``pipe.load_consolidated_state_dict``.
    """
    from safetensors.torch import load_file

    directory = Path(directory)
    config = checkpoint_config(directory, config)
    state: dict[str, Tensor] = {}
    for path in _files(directory):
        state.update(load_file(str(path), device="cpu"))
    return sequential_state_dict(state, config)


def save_hf_checkpoint(state_dict: Mapping[str, Tensor], config: Any,
                       directory: str | Path) -> None:
    """Write a Sequential state dict as a Hugging Face checkpoint (``from_pretrained`` reads it).

    `config` is the model's `PretrainedConfig` (written as ``config.json``). One
    ``model.safetensors`` file, the names and per-expert tensors as ``save_pretrained``
    writes them (`KeyMap.saved`), without the tied head.
    """
    from safetensors.torch import save_file

    names = key_map(config)
    head = names.tied[0] if names.tied is not None else None
    hf = {saved: v if piece is None else piece_view(v, piece)
          for k, v in state_dict.items() if names.to_hf(k) != head
          for saved, piece in names.saved(names.to_hf(k), v.shape[0] if v.dim() else 0)}
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(directory)
    save_file({k: v.detach().cpu().contiguous() for k, v in hf.items()},
              str(directory / "model.safetensors"), metadata={"format": "pt"})
