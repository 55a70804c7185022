"""Per-rank loading of safetensors weights: this rank's tensors, of a tp shard its slice.

Two sources, one reader (`load_slices`, which takes how names are found: `FileNames`):
`load_hf_shards` (a Hugging Face checkpoint, its names mapped) and `load_plain_shards`
(`hybridpar export`'s plain names, every name of a tie written).

    for every tensor of the rank's state dict (layout-free Sequential names)
      name     HF: `key_map(config).to_hf(name)` as saved (renames undone), else as the
               model names it; else a tie's other names (a tied head left out of the files
               is the embedding's tensor); else a bare decoder's name; else, for fused
               experts, each expert's parts (`hybridpar.moe.hub_names`)
               plain: the name itself; else a tie's other names
      file     ``model.safetensors.index.json``'s ``weight_map``, else the ``*.safetensors``
               (each file's header) that holds it
      read     replicated:  ``get_tensor(name)``                            the whole tensor
               tp-sharded:  ``get_slice(name)[..., a:b, ...]`` for each     its slice only
                            range of `shard_ranges(param)` (one; one per
                            part of a fused q | k | v)
               ep-sharded:  ``get_slice(name)[a:b]``, or the per-expert     its experts only
                            tensors of experts a .. b - 1
      store    copied into the parameter's own storage, range by range; the copy casts
               (a bf16 file into float32 parameters: no full-size temporary)

Peak host memory beyond the model's storage: one tensor (or its slice) in the file's dtype,
and that tensor's pages of the memory-mapped file (a file is opened for each tensor, so its
pages are unmapped after it). Every rank reads only its own keys; a tensor tied across
stages is read by each stage that holds a copy. Everything is checked before anything is
read (every key found, every shape the model's, no key the model lacks, no integer or bool
where the model has floats, every file a whole safetensors file), every parameter is checked
finite as it is read (`hybridpar.io.weight_checks`), and an error is raised on every rank
(`fail_together`), naming the key and the file(s).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from hybridpar.comm.agreement import fail_together
from hybridpar.hf.checkpoint import _INDEX, _files, checkpoint_config
from hybridpar.hf.keys import FileNames, hf_file_names, plain_file_names
from hybridpar.io.weight_checks import check_finite, check_kind
from hybridpar.moe.hub_names import piece_view
from hybridpar.sharded.attrs import expert_slice
from hybridpar.tensor_parallel.state import ShardRanges, full_shape, module_group, shard_ranges

__all__ = ["ShardLoad", "init_for_loading", "load_hf_shards",
           "load_plain_shards", "load_slices"]

_ERRORS = (FileNotFoundError, ValueError, OSError, RuntimeError)   # raised on every rank


@dataclass(frozen=True)
class ShardLoad:
    """What `load_hf_shards` did on this rank."""

    tensors: int            # tensors written (a parameter held under several names: once)
    bytes_read: int         # bytes read from the files, in the files' dtypes
    files: tuple[str, ...]  # the weight files this rank read from


@dataclass
class _Entry:
    """One tensor to load: where it comes from and which part of it this rank holds."""

    key: str                         # Sequential name
    tensor: Tensor                   # the parameter (or buffer) itself
    hf: str                          # its name in the file
    file: Path
    where: ShardRanges | None        # None: the whole tensor
    expected: tuple[int, ...]        # the full shape the model wants
    param: bool                      # a parameter (checked finite), not a buffer


@torch.no_grad()
def init_for_loading(module: nn.Module) -> None:
    """``HybridPipe(..., init_fn=init_for_loading)`` for a `meta`-built `to_sequential` model
    that `load_hf_shards` fills next: every parameter zero (no random draws, and none of the
    full-layer temporaries `init_fn` draws a tp layer's slice from), the rotary buffers of
    each `DecoderBlock` computed (``inv_freq``: not in the files). `load_hf_shards` refuses a
    checkpoint that lacks any parameter, so no zero is left."""
    from hybridpar.hf.blocks import DecoderBlock

    if isinstance(module, DecoderBlock):
        module.reset_parameters()
    for param in module.parameters(recurse=False):
        param.zero_()


def _safe_open(path: Path) -> Any:
    """``safe_open(path)`` (the tests wrap it to count the bytes read)."""
    from safetensors import safe_open

    return safe_open(str(path), framework="pt")


@contextmanager
def _opened(path: Path) -> Iterator[Any]:
    """A weights file opened (its header read; the data mapped, not read); a `ValueError`
    naming the file when it is not a whole safetensors file."""
    from safetensors import SafetensorError

    if not path.is_file():
        raise FileNotFoundError(f"weights file {path} is missing")
    try:
        handle = _safe_open(path)
    except SafetensorError as e:
        raise ValueError(f"{path} is not a whole safetensors file ({e}): a truncated download, "
                         "or another format (pickled .bin / .pt checkpoints are not read: save "
                         "with save_pretrained(..., safe_serialization=True))") from None
    with handle as f:
        try:
            yield f
        except SafetensorError as e:
            raise ValueError(f"reading {path}: {e}") from None


def _index_map(index: Path) -> tuple[dict[str, Path], str]:
    """``{name: file}`` from a ``model.safetensors.index.json`` (files beside it)."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        return {str(k): index.parent / str(v) for k, v in weight_map.items()}, str(index)
    except (ValueError, KeyError, TypeError, AttributeError):
        raise ValueError(f"{index} is not a safetensors index (a JSON object whose "
                         "'weight_map' maps tensor names to files)") from None


def _header_map(files: list[Path]) -> tuple[dict[str, Path], str]:
    """``{name: file}`` from the files' headers (the first file that holds a name)."""
    out: dict[str, Path] = {}
    for path in files:
        with _opened(path) as f:
            for name in f.keys():
                out.setdefault(name, path)
    return out, ", ".join(str(p) for p in files)


def _weight_map(directory: Path) -> tuple[dict[str, Path], str]:
    """``{file name: file}`` of every tensor of the checkpoint, and where that was looked up."""
    index = directory / _INDEX
    if index.is_file():
        return _index_map(index)
    return _header_map(_files(directory))


def _tp_groups(module: nn.Module) -> dict[int, ProcessGroup | None]:
    """The tp group of every parameter (its layer's ``group``; else the pipe topology's)."""
    topology = getattr(module, "topology", None)
    fallback = topology.tp_group if topology is not None and topology.tp > 1 else None
    groups: dict[int, ProcessGroup | None] = {}
    for sub in module.modules():
        group = module_group(sub)
        for param in sub.parameters(recurse=False):
            groups.setdefault(id(param), fallback if group is None else group)
    return groups


def _names_of_ties(module: nn.Module, state: Mapping[str, Tensor]) -> dict[str, list[str]]:
    """``{name: the other names of the same tensor}``: held twice on this rank, or tied across
    stages (`HybridPipe.tied_aliases`)."""
    by_tensor: dict[int, list[str]] = {}
    for key, value in state.items():
        by_tensor.setdefault(id(value), []).append(key)
    groups = [names for names in by_tensor.values() if len(names) > 1]
    aliases: Mapping[str, str] = getattr(module, "tied_aliases", None) or {}
    canonical: dict[str, list[str]] = {}
    for alias, name in aliases.items():
        canonical.setdefault(name, [name]).append(alias)
    groups += list(canonical.values())
    out: dict[str, dict[str, None]] = {}
    for names in groups:
        for name in names:
            out.setdefault(name, {}).update(dict.fromkeys(n for n in names if n != name))
    return {name: list(others) for name, others in out.items()}


def _plan(module: nn.Module, files: Mapping[str, Path], looked_in: str, names: FileNames
          ) -> list[_Entry]:
    """Every tensor this rank loads, checked against the files' headers (nothing read)."""
    state = module.state_dict(keep_vars=True)
    params = {id(p) for p in module.parameters()}
    groups = _tp_groups(module)
    ties = _names_of_ties(module, state)

    # every stage's keys (a HybridPipe notes the whole model's), to refuse a file's extra keys
    model_keys = list(getattr(module, "_state_keys", None) or state)
    unexpected = names.unexpected(model_keys, files)
    if unexpected:
        raise ValueError(f"{looked_in} holds {len(unexpected)} tensor(s) the model built from "
                         f"{names.model} does not have, e.g. {', '.join(unexpected[:3])}: "
                         f"{names.extra_hint}")

    entries: list[_Entry] = []
    missing: list[str] = []
    seen: set[int] = set()
    for key, tensor in state.items():
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        param = id(tensor) in params
        experts = expert_slice(tensor)       # expert parallelism: (first, E) of its slice
        held = tensor.shape[0] if tensor.dim() else 0
        first = experts[0] if experts is not None else 0
        ours = range(first, first + held)    # the experts (dim 0 rows) this rank holds
        name = next((h for h in names.candidates(key, ties.get(key, [])) if h in files), None)
        pieces = names.pieces(key, ours) if name is None else None
        if pieces is not None:               # experts stored one by one: this rank's only
            for file_name, piece in pieces:
                if file_name not in files:
                    missing.append(f"{file_name} (expert {piece.expert} of the model's {key})")
                    continue
                view = piece_view(tensor.detach(), piece, first)
                entries.append(_Entry(key, view, file_name, files[file_name], None,
                                      tuple(view.shape), param))
            continue
        if name is None:
            if param:      # a buffer not in the files keeps its init (inv_freq)
                missing.append(names.describe(key))
            continue
        group = groups.get(id(tensor))
        where = shard_ranges(tensor, group)
        expected = tuple(full_shape(tensor, group) if where is not None else tensor.shape)
        if experts is not None:              # its slice of the fused (E, ...) tensor
            where = ShardRanges(0, [(ours.start, ours.stop)])
            expected = (experts[1], *tensor.shape[1:])
        entries.append(_Entry(key, tensor, name, files[name], where, expected, param))
    if missing:
        raise ValueError(f"{len(missing)} tensor(s) this rank needs are not in the checkpoint: "
                         f"{', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}; looked "
                         f"in {looked_in}")

    for path, mine in _by_file(entries).items():          # the headers: names, shapes
        with _opened(path) as f:
            held = set(f.keys())
            for e in mine:
                if e.hf not in held:
                    raise ValueError(f"{path} does not hold {e.hf} (the model's {e.key}), "
                                     f"though {looked_in} names it there")
                header = f.get_slice(e.hf)
                check_kind(e.hf, str(path), header.get_dtype(), e.tensor)
                shape = tuple(header.get_shape())
                if shape != e.expected:
                    raise ValueError(
                        f"{e.hf} in {path} has shape {shape} but the model built from "
                        f"{names.model} expects {e.expected} for {e.key}: {names.shape_hint}")
    return entries


def _by_file(entries: list[_Entry]) -> dict[Path, list[_Entry]]:
    out: dict[Path, list[_Entry]] = {}
    for e in entries:
        out.setdefault(e.file, []).append(e)
    return out


@torch.no_grad()
def _read(f: Any, e: _Entry) -> int:
    """Copy entry `e` from open file `f` into its tensor's storage; the bytes read."""
    if e.where is None:
        value = f.get_tensor(e.hf)
        e.tensor.copy_(value.to(e.tensor.device))
        return value.numel() * value.element_size()
    dim, ranges = e.where
    if sum(b - a for a, b in ranges) != e.tensor.shape[dim]:
        raise RuntimeError(f"{e.key}: ranges {ranges} of dim {dim} do not cover its shard of "
                           f"shape {tuple(e.tensor.shape)}")
    tensor_slice, offset, read = f.get_slice(e.hf), 0, 0
    for a, b in ranges:
        piece = tensor_slice[(slice(None),) * dim + (slice(a, b),)]   # only [a, b) of dim
        e.tensor.narrow(dim, offset, b - a).copy_(piece.to(e.tensor.device))
        offset += b - a
        read += piece.numel() * piece.element_size()
    return read


def load_hf_shards(module: nn.Module, directory: str | Path, *, config: Any = None
                   ) -> ShardLoad:
    """Load a local Hugging Face checkpoint directory into `module`, reading only its part.

    `module`: a `HybridPipe` over a `to_sequential` model (built on `meta` and materialized
    with `init_fn`, or built whole), or such a Sequential itself. Every rank reads the keys of
    its own stages, and of a tp-sharded parameter only its slice (`shard_ranges`: the same
    slice `shard_of` cuts from the full tensor), straight into the parameter's storage and
    dtype. Buffers the files lack (rotary ``inv_freq``) keep their values. `directory` holds
    ``model.safetensors``, or shards and ``model.safetensors.index.json``; `config` defaults
    to its ``config.json``.

    A collective when torch.distributed is initialized: every rank calls it, and a problem
    on any rank (a missing key, a shape that does not fit, a file that is not a whole
    safetensors file) is raised on all of them, before anything is read.
    """
    directory = Path(directory)
    with fail_together(_ERRORS):
        config = checkpoint_config(directory, config)
        files, looked_in = _weight_map(directory)
    return load_slices(module, files, looked_in, hf_file_names(config))


def _export_map(path: Path) -> tuple[dict[str, Path], str]:
    """``{name: file}`` of a plain export: a folder, its index, or one ``.safetensors`` file."""
    if path.is_dir():
        index = path / _INDEX
        if index.is_file():
            return _index_map(index)
        single = path / "model.safetensors"
        if not single.is_file():
            raise FileNotFoundError(f"{path} holds neither {_INDEX} nor model.safetensors; "
                                    "give the folder `hybridpar export` wrote")
        return _header_map([single])
    if path.suffix == ".json":
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing")
        return _index_map(path)
    return _header_map([path])


def load_plain_shards(module: nn.Module, path: str | Path, *, model: str = "the config"
                      ) -> ShardLoad:
    """Load a plain export (`hybridpar export`'s safetensors: its folder, its index ``.json``
    or one ``.safetensors`` file) into `module`, reading only its part.

    The files hold the unsharded Sequential's names (every name of a tie), as `module`'s
    state dict does; otherwise as `load_hf_shards`: this rank's keys, of a tp-sharded tensor
    its slice, into the parameters' storage and dtype; a problem on any rank raised on all,
    before anything is read. `model` names the model in errors ("model 'gpt'").
    """
    with fail_together(_ERRORS):
        files, looked_in = _export_map(Path(path))
    return load_slices(module, files, looked_in, plain_file_names(model))


def load_slices(module: nn.Module, files: Mapping[str, Path], looked_in: str,
                names: FileNames) -> ShardLoad:
    """Fill `module`'s tensors (this rank's: a `HybridPipe` stage's, tp slices) from the
    safetensors `files` (``{name in the files: file}``; `looked_in` says where that map came
    from), finding names as `names` says. Every check first, on every rank together
    (`fail_together`), then one tensor (or slice) read at a time."""
    with fail_together(_ERRORS):
        entries = _plan(module, files, looked_in, names)
    read = 0
    with fail_together(_ERRORS):
        for e in entries:
            with _opened(e.file) as f:   # one tensor a time: its pages unmapped after it
                read += _read(f, e)
            if e.param:   # (after the copy: a value the model's dtype cannot hold is inf)
                check_finite(e.hf, str(e.file), e.tensor)
    return ShardLoad(tensors=len({e.key for e in entries}), bytes_read=read,
                     files=tuple(str(p) for p in _by_file(entries)))
