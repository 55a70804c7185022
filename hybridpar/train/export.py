"""`hybridpar export`: a checkpoint folder (any layout), or a live pipe, as the plain
single-device state dict or as a Hugging Face checkpoint, written one tensor at a time.

    export_plain       checkpoint -> OUT/: safetensors files of at most `max_shard_size` bytes
                       (+ index), the unsharded nn.Sequential's names (`hybridpar.io.weight_files`)
    export_hf          checkpoint of an ``hf:<family>`` run -> OUT/: the same files under
                       Hugging Face's names, without a tied head, config.json and the
                       tokenizer of a run from model.pretrained
    export_pipe        a HybridPipe, on every rank -> OUT/ of either kind: each tensor gathered
                       to rank 0 alone (`consolidate.stream_state_dict`) and written
    export_checkpoint  checkpoint -> OUT.pt: one ``torch.save`` file (the whole model in this
                       process: for models that fit it)
    load_exported      any plain export (a folder, its index, a .safetensors or .pt file)

A folder export holds at most one file being filled and one tensor; it is assembled beside
OUT and renamed into place, so OUT is whole or absent (an existing OUT is refused).
"""

from __future__ import annotations

import json
import os
import re
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from hybridpar.comm.agreement import fail_together
from hybridpar.io.files import atomic_write
from hybridpar.io.weight_files import (
    DEFAULT_MAX_SHARD_SIZE,
    Written,
    parse_size,
    read_weights,
    write_shards,
)
from hybridpar.train.checkpoints.checkpoint import (
    CheckpointError,
    allocate_like,
    check_files,
    dcp_failure,
    read_metadata,
)
from hybridpar.train.checkpoints.shards import ShardLoadPlanner, read_ties

if TYPE_CHECKING:
    from hybridpar.pipe import HybridPipe

__all__ = ["Written", "export_checkpoint", "export_hf", "export_pipe", "export_plain",
           "load_exported", "read_state"]

def _layer_order(key: str) -> tuple[int, str]:
    head = re.match(r"(\d+)\.", key)
    return (int(head.group(1)) if head else -1, key)


class _CachedReader(FileSystemReader):
    """DCP's file reader with the index read once (a load per tensor would reread it)."""

    def __init__(self, path: str, metadata: Metadata) -> None:
        super().__init__(path)
        self._index = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self._index


class _Checkpoint:
    """A checkpoint's model tensors, read whole one at a time (or all at once), in one
    process: `names` in layer order, every name of a tie included."""

    def __init__(self, checkpoint: str | os.PathLike[str]) -> None:
        self.path = str(checkpoint)
        self.metadata = read_metadata(checkpoint)
        entries = self.metadata.state_dict_metadata
        keys = [k.removeprefix("model/") for k in entries if k.startswith("model/")]
        if not keys:
            raise CheckpointError(f"{checkpoint} holds no model tensors; is it a hybridpar "
                                  "checkpoint (RUN_DIR/checkpoints/step-N)?")
        check_files(checkpoint, self.metadata)
        ties = [k for k in entries if k.startswith("tied/")]
        #: ``{name: canonical name}``: a tie is saved once, under its canonical name
        self.aliases = read_ties(self.load(ties)) if ties else {}
        self.names = sorted([*keys, *self.aliases], key=_layer_order)

    def nbytes(self, name: str) -> int:
        dtype, shape = self.info(name)
        return shape.numel() * dtype.itemsize

    def info(self, name: str) -> tuple[torch.dtype, torch.Size]:
        meta = self.metadata.state_dict_metadata["model/" + self.aliases.get(name, name)]
        assert isinstance(meta, TensorStorageMetadata)
        return meta.properties.dtype, meta.size

    def tensor(self, name: str) -> Tensor:
        key = "model/" + self.aliases.get(name, name)
        return self.load([key])[key]

    def load(self, keys: list[str]) -> dict[str, Tensor]:
        state = allocate_like(self.metadata, keys)
        try:
            with warnings.catch_warnings():   # DCP warns that it runs without a process group
                warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
                dcp.load(state, storage_reader=_CachedReader(self.path, self.metadata),
                         planner=ShardLoadPlanner(), no_dist=True)
        except CheckpointException as e:
            raise CheckpointError(f"{self.path} cannot be read ({dcp_failure(e)}); its files "
                                  "are damaged: restore them or export an earlier "
                                  "step-N") from None
        return state


def read_state(checkpoint: str | os.PathLike[str]) -> dict[str, Tensor]:
    """A checkpoint's model tensors (any layout) as the plain model's ``{name: tensor}``.

    Every name of a tied parameter gets its tensor. Runs in one process (no process group)
    and holds the whole model: `export_plain` writes it one tensor at a time.
    """
    source = _Checkpoint(checkpoint)
    canonical = [n for n in source.names if n not in source.aliases]
    state = source.load(["model/" + n for n in canonical])
    plain = {n: state["model/" + n] for n in canonical}
    for alias, name in source.aliases.items():   # saved once: every name gets it
        plain[alias] = plain[name]
    return {n: plain[n] for n in source.names}


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
        atomic_write(target, lambda tmp: _torch_save(plain, tmp))
    except OSError as e:
        raise ValueError(f"cannot write {out}: {e.strerror or e}") from None
    return plain


def _torch_save(value: object, path: Path) -> None:
    """``torch.save`` through a Python file, so that a failed write (disk full, a file-size
    limit) is the `OSError` it was: torch's own writer raises ``RuntimeError: [enforce fail at
    inline_container.cc:672] . unexpected pos``, with the `OSError` only as its context."""
    try:
        with open(path, "wb") as f:
            torch.save(value, f)
    except RuntimeError as e:
        cause: BaseException | None = e
        while cause is not None and not isinstance(cause, OSError):
            cause = cause.__cause__ or cause.__context__
        if cause is None:
            raise
        raise cause from None


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
                         "as the plain state dict (without --format hf)")
    return model


def _new_folder(out: str | os.PathLike[str]) -> Path:
    """`out` as the folder to create; refused if anything is there (nothing is replaced)."""
    target = Path(out)
    if target.is_dir():
        raise ValueError(f"{out} is a folder that exists; give a new folder for the "
                         "safetensors files (nothing is replaced), or give the path of the .pt "
                         "file to write")
    if target.exists():
        raise ValueError(f"{out} exists; give a new folder for the safetensors files")
    return target


def _need_safetensors() -> None:
    try:
        import safetensors.torch  # noqa: F401
    except ImportError:
        raise ImportError("a folder export writes safetensors files: pip install safetensors "
                          "(or hybridpar[hf]), or export to one OUT.pt file") from None


def _named(error: BaseException | None, target: Path | None) -> BaseException | None:
    """A failed write (an `OSError`) as the `ValueError` ``cannot write OUT: ...`` (exit 2)."""
    if isinstance(error, OSError) and target is not None:
        return ValueError(f"cannot write {target}: {error.strerror or error}")
    return error


def _raise(error: BaseException | None) -> None:
    if error is not None:
        raise error


def _write(target: Path | None, sizes: list[tuple[str, int]],
           tensors: Iterator[Tensor | None], *, max_shard_size: int,
           extra: Callable[[Path], object] | None = None,
           agree: Callable[[BaseException | None], None] = _raise) -> Written:
    """`write_shards`, a failed write named as `_named` says."""
    return write_shards(target, sizes, tensors, max_shard_size=max_shard_size, extra=extra,
                        agree=lambda error: agree(_named(error, target)))


def export_plain(checkpoint: str | os.PathLike[str], out: str | os.PathLike[str], *,
                 max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE) -> Written:
    """Write a checkpoint's model tensors (any layout) into the new folder `out`, one at a time.

    Safetensors files of at most `max_shard_size` bytes (`hybridpar.io.weight_files`: one is
    ``model.safetensors``, more come with ``model.safetensors.index.json``) holding the names
    and full shapes of the unsharded `nn.Sequential`'s ``state_dict()``, every name of a tie
    included: ``model.load_state_dict(load_exported(out))`` loads it, and ``--init-from OUT``
    starts a run from it (each rank reading its stages' keys and tp slices alone).
    Runs in one process (no process group); holds one file's tensors at most.
    """
    size = parse_size(max_shard_size)
    target = _new_folder(out)
    source = _Checkpoint(checkpoint)
    _need_safetensors()
    sizes = [(n, source.nbytes(n)) for n in source.names]
    try:
        target.parent.mkdir(parents=True, exist_ok=True)   # only once the checkpoint read
    except OSError as e:
        raise ValueError(f"cannot write {out}: {e.strerror or e}") from None
    return _write(target, sizes, (source.tensor(n) for n in source.names),
                  max_shard_size=size)


def _hf_names(names: list[str], config: Any) -> list[tuple[str, str]]:
    """``(Hugging Face name, Sequential name)`` of each tensor a Hugging Face checkpoint holds:
    all but a tied head (``save_pretrained`` leaves it out)."""
    from hybridpar.hf import key_map

    keys = key_map(config)
    head = keys.tied[0] if keys.tied is not None else None
    return [(keys.to_hf(n), n) for n in names if keys.to_hf(n) != head]


def export_hf(checkpoint: str | os.PathLike[str], out: str | os.PathLike[str], *,
              config: str | os.PathLike[str] | None = None,
              max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE) -> Written:
    """Write an ``hf:<family>`` run's checkpoint as a Hugging Face checkpoint folder.

    ``config.json`` and the weights under Hugging Face's names as `export_plain` writes them
    (at most `max_shard_size` bytes a file, the index when there are several, no tied head),
    which ``AutoModelForCausalLM.from_pretrained(out)`` loads. A run from ``model.pretrained``
    also gets that folder's tokenizer files and ``generation_config.json`` (those it has), so
    ``AutoTokenizer.from_pretrained(out)`` loads too. `config`: the run's config.json (default
    RUN_DIR/config.json). Holds one file's tensors at most.
    """
    from hybridpar.hf.keys import as_saved
    from hybridpar.models.hf import hf_config

    size = parse_size(max_shard_size)
    target = _new_folder(out)
    model = _run_model(Path(checkpoint), config)
    options = {k: v for k, v in model.items() if k not in ("name", "init")}   # the run's keys
    source = _Checkpoint(checkpoint)
    hf = hf_config(str(model["name"]).removeprefix("hf:"), options)
    entries = _hf_names(source.names, hf)
    _need_safetensors()
    pretrained = model.get("pretrained")

    def extra(folder: Path) -> None:
        hf.save_pretrained(folder)
        if isinstance(pretrained, str):
            _copy_tokenizer(Path(pretrained), folder)

    sizes, tensors = as_saved(entries, [source.info(n) for _, n in entries],
                               (source.tensor(n) for _, n in entries), hf)
    return _write(target, sizes, tensors, max_shard_size=size, extra=extra)


# what a save_pretrained folder holds besides the model: its tokenizer and generation defaults
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                    "added_tokens.json", "vocab.json", "merges.txt", "tokenizer.model",
                    "chat_template.jinja", "generation_config.json")


def _copy_tokenizer(pretrained: Path, folder: Path) -> None:
    """Copy the tokenizer files of the run's ``model.pretrained`` folder (those it has) into
    the export, so that ``AutoTokenizer.from_pretrained(out)`` loads it beside the model; a
    folder no longer there is skipped with a warning (the weights do not need it)."""
    if not pretrained.is_dir():
        warnings.warn(f"model.pretrained {str(pretrained)!r} is not a folder from here, so the "
                      "export has no tokenizer; copy its tokenizer files into the export, or "
                      "export from the folder the run was started in", stacklevel=3)
        return
    for name in _TOKENIZER_FILES:
        if (pretrained / name).is_file():
            (folder / name).write_bytes((pretrained / name).read_bytes())


_SHARED = (OSError, ValueError, RuntimeError, TypeError, ImportError)


def _agree(error: BaseException | None) -> None:
    """Raise `error` (or a `RuntimeError` naming it) on every rank if any rank had one."""
    with fail_together(_SHARED):
        if error is not None:
            raise error if isinstance(error, _SHARED) else \
                RuntimeError(f"{type(error).__name__}: {error}")


def export_pipe(pipe: HybridPipe, out: str | os.PathLike[str], *, config: Any = None,
                max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE) -> Written:
    """Write a pipe's weights (any layout) into the new folder `out`; call it on every rank.

    Plain names as `export_plain` writes them, or with `config` (the model's Hugging Face
    `PretrainedConfig`) a Hugging Face checkpoint as `export_hf` writes it. Global rank 0
    writes; each tensor comes to it alone (`consolidate.stream_state_dict`: its stage's tp
    ranks gather it, the stage sends it), so rank 0 holds one file being filled and one
    tensor, and no other rank more than one full tensor. A failure (a refused `out`, a full
    disk) is raised on every rank, and nothing is left behind. Returns what was written
    (counts and `peak_bytes` on rank 0; elsewhere the file names and zeros).
    """
    from hybridpar.hf.keys import as_saved
    from hybridpar.pipe import consolidate

    size = parse_size(max_shard_size)   # (the same on every rank: fails on all alike)
    topo = pipe.topology
    writer = dist.get_rank() == topo.global_rank(0, 0, 0)
    with fail_together((ValueError, ImportError)):
        target = _new_folder(out) if writer else None
        if target is not None:
            _need_safetensors()
            try:
                target.parent.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise ValueError(f"cannot write {out}: {e.strerror or e}") from None
    keys = list(pipe._state_keys)
    entries = _hf_names(keys, config) if config is not None else [(k, k) for k in keys]
    stage_keys, aliases = pipe._stage_keys, pipe.tied_aliases
    with pipe._communicating("export_pipe"):
        layout = consolidate.state_layout(pipe, topo, stage_keys=stage_keys)
        sizes = [(name, layout[aliases.get(k, k)].nbytes) for name, k in entries]
        stream = consolidate.stream_state_dict(pipe, topo, keys=[k for _, k in entries],
                                               stage_keys=stage_keys, aliases=aliases,
                                               layout=layout)
        if config is not None:
            sizes, stream = as_saved(entries, [layout[aliases.get(k, k)] for _, k in entries],
                                      stream, config)
        return _write(target, sizes, stream, max_shard_size=size,
                      extra=config.save_pretrained if config is not None else None,
                      agree=_agree)


def load_exported(path: str | os.PathLike[str]) -> dict[str, Tensor]:
    """Read a plain export: a folder `export_plain` wrote, its index ``.json`` or one of its
    ``.safetensors`` files (`read_weights`), or a ``.pt`` file ``torch.load`` reads with
    ``weights_only=True`` (tensors only, no code), memory-mapped: a tensor's bytes are read
    when it is used, so a stage that keeps a part of the model reads that part."""
    file = Path(path)
    if file.is_dir() or file.suffix in (".safetensors", ".json"):
        return read_weights(file)
    try:
        value = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError:   # a file of torch's legacy format cannot be mapped: read it whole
        value = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(value, dict) or not all(isinstance(v, Tensor) for v in value.values()):
        raise ValueError(f"{path} is not a state dict of tensors")
    return value
