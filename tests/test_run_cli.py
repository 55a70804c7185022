"""`hybridpar run` / `export` through the real console script, launcher and elastic agent."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from cli_in_process import hybridpar

from hybridpar.cli import main
from hybridpar.launch import free_port
from hybridpar.models import build_model
from hybridpar.train import load_config
from hybridpar.train.launcher import worker_pids

TINY = Path(__file__).parent / "data" / "tiny_gpt.toml"   # 2 workers, 8 steps

HYBRIDPAR = [sys.executable, "-m", "hybridpar.cli"]


@pytest.fixture
def tiny(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.toml"
    path.write_text(TINY.read_text())
    return path


def _run(*args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*HYBRIDPAR, *args], capture_output=True, text=True, cwd=cwd,
                          timeout=timeout)


def _losses(run_dir: Path) -> dict[int, float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    steps = [r["step"] for r in records]
    assert len(steps) == len(set(steps)), f"duplicate steps in metrics.jsonl: {steps}"
    return {r["step"]: r["loss"] for r in records}


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path,
                                                                subprocess.CompletedProcess[str]]:
    """`hybridpar run tiny.toml` in a folder of its own, as it comes (runs/tiny): the first run
    of the next test, and the one node the two-node run must train like."""
    folder = tmp_path_factory.mktemp("tiny_run")
    tiny = folder / "tiny.toml"
    tiny.write_text(TINY.read_text())
    return folder, tiny, _run("run", str(tiny), cwd=folder)


def test_run_trains_resumes_and_exports(tiny_run: tuple[Path, Path,
                                                        subprocess.CompletedProcess[str]]) -> None:
    tmp_path, tiny, done = tiny_run
    assert done.returncode == 0, done.stderr
    run_dir = tmp_path / "runs" / "tiny"            # the default: runs/<config name>
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-6", "step-8"]
    losses = _losses(run_dir)
    assert sorted(losses) == list(range(1, 9))
    assert json.loads((run_dir / "config.json").read_text())["parallel"]["pp"] == 2
    assert (run_dir / "sample.txt").read_text()
    assert "quickstart" not in done.stderr and "tiny" in done.stderr   # the progress bar

    again = _run("run", str(tiny), cwd=tmp_path)    # everything done: resumes at the end
    assert again.returncode == 0, again.stderr
    assert "resumed from" in again.stderr and _losses(run_dir) == losses

    out = tmp_path / "plain.pt"     # in this process: the console script is the same `main`
    assert main(["export", str(run_dir / "checkpoints" / "step-8"), str(out)]) == 0
    state = torch.load(out, weights_only=True)
    model = build_model("gpt", **load_config(tiny).model.args)
    model.load_state_dict(state, strict=True)


def test_a_bad_config_fails_in_one_line_before_any_worker(tiny: Path, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty").mkdir()
    cases = {
        ("--set", "parallel.tp=3"): "parallel.tp=3 does not fit model 'gpt'",
        ("--set", "train.stepz=3"): "did you mean train.steps?",
        ("--nnodes", "3"): "--nnodes 3 does not divide the 2 workers",
        ("--nnodes", "2"): "--nnodes > 1 needs --rdzv-endpoint",
        ("--rdzv-endpoint", "localhost"): "--rdzv-endpoint 'localhost' is not HOST:PORT",
        ("--node-rank", "1"): "--node-rank 1 is not in 0..0",
        ("--max-restarts", "-1"): "--max-restarts must be >= 0",
        ("--init-from", "missing.pt"): "--init-from missing.pt: no such file",
        ("--init-from", "empty"): "--init-from empty: the folder holds neither "
                                  "model.safetensors.index.json nor model.safetensors",
    }
    for extra, message in cases.items():
        assert main(["run", str(tiny), *extra]) == 2, extra
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and message in lines[0], (extra, lines)
    assert main(["run", "configs/nope.toml"]) == 2
    assert "no such config file" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()          # nothing started, nothing written
    assert main(["export", "nope", "x.pt"]) == 2
    assert "no such checkpoint folder" in capsys.readouterr().err
    assert not (tmp_path / "x.pt").exists()


def test_a_failing_worker_ends_the_run_with_its_error_first(tiny: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"not a checkpoint")
    # in this process: the line checked is the agent's own (the workers' go elsewhere);
    # test_bad_inputs.py's run with failing workers checks the exit status 1 of a real process
    done = hybridpar("run", tiny, "--init-from", bad, cwd=tmp_path, timeout=300)
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("hybridpar run: worker rank ") and "CheckpointError" in last
    assert "give a .pt file written by `hybridpar export`" in last


def test_two_nodes_on_localhost_train_like_one(
        tiny: Path, tmp_path: Path,
        tiny_run: tuple[Path, Path, subprocess.CompletedProcess[str]]) -> None:
    endpoint = f"127.0.0.1:{free_port()}"
    nodes = [subprocess.Popen(
        [*HYBRIDPAR, "run", str(tiny), "--run-dir", "two", "--nnodes", "2", "--node-rank",
         str(rank), "--rdzv-endpoint", endpoint],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for rank in (0, 1)]
    outputs = [node.communicate(timeout=300)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs
    one_folder, _, one = tiny_run     # the same config on one node (the module's first run)
    assert one.returncode == 0, one.stderr
    assert _losses(tmp_path / "two") == _losses(one_folder / "runs" / "tiny")


# 30 steps: a kill at the step-3 checkpoint comes 27 steps (seconds) before the end
KILLED = ["--set", "train.steps=30", "--set", "model.dropout=0.1",
          "--set", "train.sample_tokens=0", "--set", "checkpoint.every=3"]


Done = tuple[Path, subprocess.CompletedProcess[str]]   # (its run directory, the process)


@pytest.fixture(scope="module")
def torchrun_run(tmp_path_factory: pytest.TempPathFactory) -> Done:
    """The worker module under torchrun (no `hybridpar run`), with the settings of the killed
    run below: the whole run, never interrupted, that the killed one must train exactly like.
    (Its workers take 1 thread each, as `hybridpar run`'s do.)"""
    folder = tmp_path_factory.mktemp("torchrun")
    tiny = folder / "tiny.toml"
    tiny.write_text(TINY.read_text())
    torchrun = Path(sys.executable).with_name("torchrun")
    done = subprocess.run(
        [str(torchrun), "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
         "--master-port", str(free_port()), "-m", "hybridpar.train", str(tiny),
         "--run-dir", "tr", *KILLED],
        cwd=folder, capture_output=True, text=True, timeout=300)
    return folder / "tr", done


def test_torchrun_runs_the_worker_module(torchrun_run: Done) -> None:
    run_dir, done = torchrun_run
    assert done.returncode == 0, done.stderr
    assert sorted(_losses(run_dir)) == list(range(1, 31))


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds the workers through /proc")
def test_a_killed_worker_is_restarted_and_nothing_is_lost(tiny: Path, tmp_path: Path,
                                                          torchrun_run: Done) -> None:
    run_dir = str(tmp_path / "killed")
    log = tmp_path / "agent.log"  # a file, not a pipe: nobody reads a pipe while it runs
    with log.open("w") as sink:
        agent = subprocess.Popen([*HYBRIDPAR, "run", str(tiny), "--run-dir", run_dir,
                                  "--max-restarts", "1", *KILLED], cwd=tmp_path,
                                 stdout=sink, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 180
    while not (Path(run_dir) / "checkpoints" / "step-3").is_dir():
        assert agent.poll() is None and time.monotonic() < deadline, "no checkpoint came"
        time.sleep(0.05)
    workers = worker_pids(run_dir)
    assert len(workers) == 2
    os.kill(workers[-1], signal.SIGKILL)
    agent.wait(timeout=300)
    output = log.read_text()
    assert agent.returncode == 0, output
    # The agent logs the first failure it sees (the killed worker, SIGKILL, or its peer's
    # error on losing it: torch's "failed (exitcode: N)" line or the traceback of the process
    # that "terminated with" it), then restarts both from the last checkpoint
    assert "resumed from" in output, output[-3000:]
    assert re.search(r"exitcode: -?\d+|terminated with", output), output[-3000:]

    whole, done = torchrun_run            # the same settings, never interrupted
    assert done.returncode == 0, done.stderr
    assert _losses(Path(run_dir)) == _losses(whole)   # exactly: RNG restored
