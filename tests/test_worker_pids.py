"""`hybridpar run`'s workers: their pid files (`worker_pids`) and what their fork server imports.

The pid file holds the pid and the process's start time (/proc/PID/stat), so a file left by a
killed worker never names another process that took its pid later.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hybridpar.launch import preloaded
from hybridpar.train import load_config
from hybridpar.train.launcher import _preload, registered_worker, worker_pids

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")


def test_a_worker_is_listed_while_it_runs_and_its_file_goes_with_it(tmp_path):
    assert worker_pids(tmp_path) == []                       # no workers/ folder yet
    with registered_worker(tmp_path, 3):
        assert (tmp_path / "workers" / "3.pid").is_file()
        assert worker_pids(tmp_path) == [os.getpid()]
    assert not (tmp_path / "workers" / "3.pid").exists()
    assert worker_pids(tmp_path) == []


def test_files_of_ended_or_other_processes_are_not_workers(tmp_path):
    folder = tmp_path / "workers"
    folder.mkdir()
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                           capture_output=True, text=True, check=True)
    (folder / "0.pid").write_text(f"{ended.stdout.strip()} 12345\n")   # killed, never removed
    (folder / "1.pid").write_text(f"{os.getpid()} 1\n")   # this pid, another start time
    (folder / "2.pid").write_text("half-written")
    assert worker_pids(tmp_path) == []


def test_the_fork_server_imports_the_models_transformers_family():
    gpt = _preload(load_config(ROOT / "configs" / "quickstart.toml"))
    assert gpt == preloaded() and "hybridpar.train.trainer" in gpt   # `spawn`'s list
    pytest.importorskip("transformers", reason="pip install 'hybridpar[hf]'")
    llama = _preload(load_config(ROOT / "configs" / "llama_tiny.toml"))
    assert "transformers.models.llama.modeling_llama" in llama and "hybridpar.hf" in llama
