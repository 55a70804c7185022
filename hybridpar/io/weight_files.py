"""Weights as safetensors files of at most N bytes with Hugging Face's index, written one tensor
at a time into a hidden folder that is renamed into place: the target is whole or absent.

    OUT/                                    (assembled in OUT/../.OUT.<pid>.tmp, then renamed)
      model-00001-of-00003.safetensors      the tensors in order, at most `max_shard_size`
      model-00002-of-00003.safetensors      bytes each (a larger tensor: a file of its own)
      model-00003-of-00003.safetensors
      model.safetensors.index.json          {"metadata": {"total_parameters": P,
                                                          "total_size": bytes},
                                             "weight_map": {name: file}}
      ...                                   what the caller adds (config.json)

One file is ``model.safetensors`` without an index, as ``save_pretrained`` writes it. The plan
(which names go in which file) is made from the sizes alone before any tensor is read, so every
rank of a distributed export knows where the files end and can agree after each one
(`write_shards`'s `agree`): a failure is raised everywhere, and the folder is removed.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import NamedTuple

from torch import Tensor

__all__ = ["DEFAULT_MAX_SHARD_SIZE", "INDEX", "Written", "parse_size", "plan_shards",
           "read_weights", "shard_names", "weight_files", "write_shards"]

#: Hugging Face's default: 5 GB (``save_pretrained(max_shard_size="5GB")``)
DEFAULT_MAX_SHARD_SIZE = 5 * 10**9
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*")


def parse_size(size: str | int) -> int:
    """Bytes from ``"5GB"``, ``"200MB"``, ``"20KB"``, ``"1.5GiB"`` or a number of bytes.

    Units as Hugging Face reads them: KB / MB / GB / TB are powers of 1000, KiB / MiB / GiB /
    TiB powers of 1024; any case. A `ValueError` says what is wrong and what to give.
    """
    if isinstance(size, bool) or not isinstance(size, (int, str)):
        raise ValueError(f"max shard size {size!r} is not a size: give bytes or a string "
                         "such as '5GB'")
    if isinstance(size, int):
        value = size
    else:
        match = _SIZE.fullmatch(size)
        unit = match.group(2).lower() if match else ""
        if match is None or unit not in _UNITS:
            raise ValueError(f"max shard size {size!r} is not a size: give a number of bytes "
                             "(5000000000) or a number and a unit: 5GB, 200MB, 20KB (powers "
                             "of 1000) or 1.5GiB, 512MiB (powers of 1024)")
        value = math.floor(float(match.group(1)) * _UNITS[unit])
    if value <= 0:
        raise ValueError(f"max shard size {size!r} is {value} bytes; give a positive size "
                         "such as 5GB (the default), 200MB or 20KB")
    return value


def plan_shards(sizes: Sequence[tuple[str, int]], max_shard_size: int) -> list[list[str]]:
    """The names of each file: in order, a file is closed when the next tensor would take it
    past `max_shard_size` bytes; a tensor larger than that gets a file of its own.

        sizes 6 4 5 12 3, max 10    ->    [6 4] [5] [12] [3]
    """
    plan: list[list[str]] = []
    current: list[str] = []
    held = 0
    for name, nbytes in sizes:
        if current and held + nbytes > max_shard_size:
            plan.append(current)
            current, held = [], 0
        current.append(name)
        held += nbytes
    if current:
        plan.append(current)
    return plan


def shard_names(count: int) -> list[str]:
    """The file names of `count` shards, as ``save_pretrained`` writes them."""
    if count == 1:
        return [SINGLE]
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


class Written(NamedTuple):
    """What `write_shards` wrote: `files` on every rank, the counts on the writing rank (zeros
    on the ranks that only took part)."""

    files: tuple[str, ...]   #: the weight files, in order (the index and extras not counted)
    tensors: int             #: the tensors written
    values: int              #: their elements (``total_parameters`` in the index)
    total_size: int          #: their bytes (``total_size`` in the index)
    peak_bytes: int          #: the most tensor bytes held at once: the file being filled + one


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


def _temporary(target: Path) -> Path:
    """The hidden name the folder is assembled under, beside `target` (`hybridpar.io.files`)."""
    return target.with_name(f".{target.name}.{os.getpid()}.tmp")


def _raise(error: BaseException | None) -> None:
    if error is not None:
        raise error


def write_shards(target: str | os.PathLike[str] | None, sizes: Sequence[tuple[str, int]],
                 tensors: Iterator[Tensor | None], *, max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
                 extra: Callable[[Path], object] | None = None,
                 agree: Callable[[BaseException | None], None] = _raise) -> Written:
    """Write the tensors `tensors` yields (one per entry of `sizes`, in order) as shards.

    `target`: the folder to create (None on ranks that only take part: their `tensors` yields
    None); it must not exist. `sizes`: ``(name, bytes)`` of every tensor, known before any
    is read (`plan_shards`). `extra(folder)` adds files (``config.json``) before the rename.
    After each file, and after the rename, `agree(error)` runs on every rank with this rank's
    error (None: all went well): it raises on every rank if any rank failed (the default
    raises this rank's own). On a failure the hidden folder is removed; `target` is never
    created. The writing rank holds the file being filled and the tensor being added, no more.
    """
    out = Path(target) if target is not None else None
    plan = plan_shards(sizes, max_shard_size)
    names = shard_names(len(plan))
    expected = dict(sizes)
    tmp = _temporary(out) if out is not None else None
    weight_map: dict[str, str] = {}
    count = values = total = peak = 0
    error: BaseException | None = None
    try:
        if tmp is not None:
            try:
                tmp.mkdir()
            except OSError as e:
                error = e
        agree(error)
        for file, keys in zip(names, plan):
            shard: dict[str, Tensor] = {}
            held = 0
            for name in keys:
                tensor = next(tensors)
                if tmp is None or error is not None or tensor is None:
                    continue   # (a rank that only sends; or the write failed: drained)
                nbytes = _nbytes(tensor)
                if nbytes != expected[name]:
                    error = RuntimeError(f"{name} came as {nbytes} bytes, planned as "
                                         f"{expected[name]}: its dtype or shape changed")
                    continue
                peak = max(peak, held + nbytes)   # the file being filled + this tensor
                shard[name] = tensor.contiguous()
                held += nbytes
                count, values, total = count + 1, values + tensor.numel(), total + nbytes
                weight_map[name] = file
            if tmp is not None and error is None:
                try:
                    _save(shard, tmp / file)
                except Exception as e:   # disk full, a read-only folder, a failed write
                    error = e
            del shard
            tensor = None   # (the file's last tensor: freed with it)
            agree(error)
        if tmp is not None and out is not None and error is None:
            try:
                if len(names) > 1:
                    index = {"metadata": {"total_parameters": values, "total_size": total},
                             "weight_map": weight_map}
                    (tmp / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n",
                                             encoding="utf-8")
                if extra is not None:
                    extra(tmp)
                if out.exists():
                    raise FileExistsError(f"{out} appeared while it was written; nothing "
                                          "was replaced")
                os.rename(tmp, out)
            except Exception as e:
                error = e
        agree(error)
    finally:
        if tmp is not None and tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return Written(tuple(names), count, values, total, peak)


def _save(shard: dict[str, Tensor], path: Path) -> None:
    """``save_file``; a failed write (disk full, a file-size limit) as the `OSError` it was:
    safetensors raises a `SafetensorError` ending in ``(os error N)``, which names no file."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    try:
        save_file(shard, str(path), metadata={"format": "pt"})
    except SafetensorError as e:
        code = re.search(r"\(os error (\d+)\)", str(e))
        if code is None:
            raise
        errno = int(code.group(1))
        raise OSError(errno, os.strerror(errno), str(path)) from None


def weight_files(path: str | os.PathLike[str]) -> list[Path]:
    """The safetensors files of an export: a folder (its index's files, or its
    ``model.safetensors``), an index ``.json`` (the files it lists, beside it), or one file."""
    path = Path(path)
    index = path / INDEX if path.is_dir() else path
    if index.suffix == ".json":
        if not index.is_file():
            raise FileNotFoundError(f"{index} is missing")
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        return [index.parent / name for name in dict.fromkeys(weight_map.values())]
    if path.is_dir():
        single = path / SINGLE
        if not single.is_file():
            raise FileNotFoundError(f"{path} holds neither {INDEX} nor {SINGLE}; give the "
                                    "folder `hybridpar export` wrote")
        return [single]
    return [path]


def read_weights(path: str | os.PathLike[str]) -> dict[str, Tensor]:
    """Every tensor of an export's safetensors files (`weight_files`), on the CPU."""
    from safetensors.torch import load_file

    state: dict[str, Tensor] = {}
    for file in weight_files(path):
        state.update(load_file(str(file), device="cpu"))
    return state
