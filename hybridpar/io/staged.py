"""A folder written whole or not at all: filled as a hidden sibling, renamed into place.

The folder is built as ``.OUT.PID.tmp`` beside OUT, then renamed to OUT in one step; a killed
run leaves only that hidden folder (removed by the next run), never an OUT that looks
complete. Two writers of one OUT: the later one finds OUT there and, unless it replaces it,
gets `FolderAppeared` (rename(2) refuses a non-empty target, so there is no window between a
check and the rename).
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

from hybridpar.io.files import fsync_dir

__all__ = ["FolderAppeared", "staged_folder"]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class FolderAppeared(FileExistsError):
    """The target of `staged_folder` was filled by someone else while this one was staged."""


def _exchange(a: Path, b: Path) -> bool:
    """Swap two folders in one step (Linux renameat2 RENAME_EXCHANGE); False where the system
    or the file system cannot (then nothing moved)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        rename = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, exchange = -100, 2
    if rename(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), exchange) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EXDEV):
        return False
    raise OSError(code, f"cannot swap {a} and {b}: {os.strerror(code)}")


def _swap_in(tmp: Path, out: Path, *, replace: bool) -> bool:
    """Rename `tmp` to `out`; True when a non-empty `out` was replaced (only with `replace`).

    Without `replace`, a non-empty `out` (one that appeared since the caller looked) raises
    `FolderAppeared`: rename(2) refuses to put a folder onto a non-empty one, so there is no
    window between a check and the rename. With it, the two folders are exchanged in one
    step where the system can (a reader sees the old folder or the new, never none), else
    the old is moved aside first; `tmp` then holds the old folder, for the caller to remove.
    """
    try:
        os.replace(tmp, out)               # onto nothing, or an empty folder
        return False
    except OSError as e:
        if e.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
            raise
    if not replace or not out.is_dir():
        raise FolderAppeared(f"{out} appeared while tokenizing (another hybridpar tokenize "
                             "writing the same folder?); not replacing it")
    if not _exchange(tmp, out):
        old = out.with_name(f".{out.name}.{os.getpid()}.old")
        os.replace(out, old)
        os.replace(tmp, out)
        os.replace(old, tmp)
    return True


@contextlib.contextmanager
def staged_folder(out: Path, *, replace: bool = False,
                  replaced: Callable[[], None] | None = None) -> Iterator[Path]:
    """A fresh hidden sibling of `out` to fill; renamed to `out` when the block ends cleanly.

    Removed instead when the block raises. Leftovers of killed runs (``.OUT.PID.tmp`` whose
    process is gone) are removed first. A non-empty `out` at the end (there before, or one
    that appeared meanwhile) is replaced only with `replace` (atomically where the system
    can: `_swap_in`), and `replaced` is called; without it, `FolderAppeared` is raised.
    """
    out.parent.mkdir(parents=True, exist_ok=True)
    for stale in out.parent.glob(f".{out.name}.*.tmp"):
        pid = stale.name[len(out.name) + 2:-len(".tmp")]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(stale, ignore_errors=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        fsync_dir(tmp)
        if _swap_in(tmp, out, replace=replace) and replaced is not None:
            replaced()
        fsync_dir(out.parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)   # what failed, or the folder replaced
