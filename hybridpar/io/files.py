"""Files written whole or not at all: a temporary name beside the target, then `os.replace`.

A reader (or a crash) never sees half a file: until the rename the target is the old file,
or absent. The temporary name is hidden (``.name.PID.tmp``) and removed if the write fails.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

__all__ = ["atomic_write", "atomic_write_text", "fsync_dir"]


def atomic_write(target: str | os.PathLike[str], write: Callable[[Path], object], *,
                 suffix: str = "") -> Path:
    """Call ``write(tmp)`` (a file or a directory), then move it to `target` in one step.

    `suffix` ends the temporary name (``".png"``: writers that pick a format from it).
    """
    path = Path(target)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp{suffix}")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)
    return path


def atomic_write_text(target: str | os.PathLike[str], text: str, *, fsync: bool = False
                      ) -> Path:
    """Write `text` (UTF-8) to `target` whole or not at all; `fsync`: on disk before the rename."""
    def write(tmp: Path) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            if fsync:
                f.flush()
                os.fsync(f.fileno())

    return atomic_write(target, write)


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Flush a directory's entries (a rename or a new file in it) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
