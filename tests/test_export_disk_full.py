"""`hybridpar export` onto a full file system (issue 40, point 9): one line, ``cannot write
OUT: ...``, exit 2, and nothing left behind (no OUT, no hidden temporary folder or file).

Before, the user got a traceback ending in ``SafetensorError: ... No space left on device``
(a folder export) or ``RuntimeError: [enforce fail at inline_container.cc:672]`` (a .pt
export), exit 1: neither is an `OSError`, which is what the command turned into its one line.

The file systems are real: a file-size limit (``RLIMIT_FSIZE`` in the child, ``SIGXFSZ``
ignored so that ``write`` fails with EFBIG instead of killing it), and, where this process
may mount one (root), a 40 KB tmpfs (ENOSPC) filled mid-way through a sharded export.
"""

from __future__ import annotations

import resource
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

pytest.importorskip("safetensors", reason="folder exports write safetensors files")

LIMIT = 20_000   # bytes a file may have under the file-size limit; the model is 64 KB


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint folder as the trainer writes it (DCP, ``model/`` keys): 4 x 16 KB."""
    import torch.distributed.checkpoint as dcp

    folder = tmp_path_factory.mktemp("run") / "step-1"
    torch.manual_seed(0)
    state = {f"model/{i}.weight": torch.randn(64, 64) for i in range(4)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # "assuming the intent is to save in a single process"
        dcp.save(state, checkpoint_id=str(folder), no_dist=True)
    return folder


def _file_size_limit() -> None:   # in the child, before exec
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (LIMIT, LIMIT))


def _export(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """`hybridpar export` in a child under the file-size limit."""
    return subprocess.run([sys.executable, "-m", "hybridpar.cli", "export", *args],
                          capture_output=True, text=True, cwd=cwd, timeout=120,
                          preexec_fn=_file_size_limit)


def _assert_one_line(done: subprocess.CompletedProcess[str], out: Path, reason: str) -> None:
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert lines == [f"hybridpar export: error: cannot write {out}: {reason}"], done.stderr
    assert list(out.parent.iterdir()) == [], "OUT or a hidden temporary was left behind"


@pytest.mark.parametrize("out_name", ["model", "model.pt"])
def test_a_file_size_limit_is_cannot_write_out_and_exit_2(checkpoint, tmp_path, out_name):
    out = tmp_path / "out" / out_name
    out.parent.mkdir()
    done = _export(str(checkpoint), str(out), cwd=tmp_path)
    _assert_one_line(done, out, "File too large")


@pytest.fixture
def full_disk(tmp_path: Path):
    """A 40 KB tmpfs (skipped where this process may not mount one)."""
    mount = tmp_path / "tmpfs"
    mount.mkdir()
    try:
        made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=40k", "tmpfs", str(mount)],
                              capture_output=True, text=True, timeout=30)
    except OSError:
        pytest.skip("no mount command")
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {made.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], capture_output=True, timeout=30)


@pytest.mark.parametrize("out_name, extra", [("model", ["--max-shard-size", "20KB"]),
                                             ("model.pt", [])])
def test_a_full_disk_is_cannot_write_out_and_exit_2(checkpoint, full_disk, out_name, extra,
                                                    capsys):
    # the sharded export fills the disk at its third 16 KB file: two are written by then
    # (the command in this process: the full disk is real, no limit needs a child)
    from hybridpar.cli import main

    out = full_disk / out_name
    code = main(["export", str(checkpoint), str(out), *extra])
    done = subprocess.CompletedProcess([], code, "", capsys.readouterr().err)
    _assert_one_line(done, out, "No space left on device")
