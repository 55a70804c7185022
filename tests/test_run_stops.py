"""How a run stops early: endless skipped steps (`train.max_skipped`), a non-finite first
step (whose cause is not the learning rate), and a signal (`checkpoint.on_signal`: the step in
flight finishes on every rank, a checkpoint is written, a new run resumes from it)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from spawn_cases import spawn_cases
from test_bad_inputs import _config, _poison

import hybridpar
from hybridpar.train.metrics import read_metrics

TIMEOUT = 120
ROOT = Path(__file__).resolve().parents[1]


def _always_nan(state_module):
    """Every batch's inputs NaN: every step's loss is NaN (the weights stay finite)."""
    real = state_module.make_batches

    def make_batches(config, *, split, **kw):
        batches = real(config, split=split, **kw)
        next_batch = batches.next_batch
        batches.next_batch = lambda: (next_batch()[0] * float("nan"), next_batch()[1])
        return batches

    state_module.make_batches = make_batches
    return lambda: setattr(state_module, "make_batches", real)


def _train_failing(run_dir, changes, poison):
    from hybridpar.train import state
    from hybridpar.train.trainer import train

    undo = _always_nan(state) if poison == "always nan" else _poison(*poison)
    try:
        train(_config(**changes), run_dir, progress=False)
    except FloatingPointError as e:
        return str(e)
    finally:
        undo()
    return "no error"


def _checkpoints(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoints").glob("step-*"))


def _signalled(run_dir, changes, rank_step):
    """Train; rank `rank_step[0]` sends itself SIGTERM during step `rank_step[1]` (its peers
    get none): every rank must stop after the same step."""
    from hybridpar.train import state
    from hybridpar.train.trainer import train

    real = state.build_pipe

    def build_pipe(config, topo, **kw):
        pipe = real(config, topo, **kw)
        steps, train_step = [0], pipe.train_step

        def counted(x, y):
            steps[0] += 1
            if (topo.rank, steps[0]) == tuple(rank_step):
                os.kill(os.getpid(), signal.SIGTERM)
            return train_step(x, y)

        pipe.train_step = counted
        return pipe

    state.build_pipe = build_pipe
    try:
        result = train(_config(**changes), run_dir, progress=False)
    finally:
        state.build_pipe = real
    return result["steps"], result["stopped_by"]


SKIPPED = {"train__steps": 8, "train__nonfinite": "skip", "train__max_skipped": 3}
NO_LIMIT = {"train__steps": 4, "train__nonfinite": "skip", "train__max_skipped": 0,
            "checkpoint__every": 0}
SIGNALLED = {"train__steps": 6, "checkpoint__every": 0}


@pytest.fixture(scope="module")
def stops(tmp_path_factory):
    """Every run below that stops cleanly (on every rank, after the same step), in one spawn
    of 2 ranks, each in a run directory of its own: {case: (run dir, [rank 0's, rank 1's])}.
    A signalled run and its resume (a new `train` in the same ranks, no signal) are cases in
    turn."""
    root = tmp_path_factory.mktemp("stops")
    cases = {"skipped": (_train_failing, SKIPPED, "always nan"),
             "no limit": (_train_failing, NO_LIMIT, "always nan"),
             "first nan": (_train_failing, {}, ("nan loss", 1))}
    for rank in (0, 1):
        cases[f"signal {rank}"] = (_signalled_then_look, SIGNALLED, (rank, 3))
        cases[f"resume {rank}"] = (_signalled, SIGNALLED, (rank, 0))     # no signal this time
    # a resume runs in the folder of the run it resumes
    folder = {name: root / name.replace("resume", "signal") for name in cases}
    args = {name: (fn, str(folder[name]), changes, poison)
            for name, (fn, changes, poison) in cases.items()}
    out = spawn_cases(_call, 2, args, timeout=TIMEOUT * 2)
    return {name: (folder[name], out[name]) for name in cases}


def _call(fn, run_dir, changes, poison):
    return fn(run_dir, changes, poison)


def _signalled_then_look(run_dir, changes, rank_step):
    """`_signalled`, then (every rank done: a barrier) what it left in RUN_DIR, before the
    resume case writes there: (steps, stopped_by, checkpoints, the steps in metrics.jsonl)."""
    import torch.distributed as dist

    steps, stopped_by = _signalled(run_dir, changes, rank_step)
    dist.barrier()
    metrics = [r["step"] for r in read_metrics(Path(run_dir) / "metrics.jsonl")]
    return steps, stopped_by, _checkpoints(Path(run_dir)), metrics


def test_steps_skipped_in_a_row_stop_the_run_on_every_rank(stops):
    run_dir, out = stops["skipped"]
    for message in out:
        assert message.startswith("3 steps in a row were skipped (train.nonfinite = 'skip', "
                                  "steps 1-3; train.max_skipped = 3)"), message
        assert "raise train.max_skipped (0: no limit)" in message
    assert _checkpoints(run_dir) == ["step-1", "step-2"]   # step 3 stopped before its save


def test_max_skipped_0_lets_a_run_skip_every_step(stops):
    run_dir, out = stops["no limit"]
    assert out == ["no error", "no error"]
    assert [r.get("skipped") for r in read_metrics(run_dir / "metrics.jsonl")] == [True] * 4


def test_a_non_finite_first_step_does_not_blame_the_learning_rate(stops):
    _, out = stops["first nan"]
    for message in out:
        assert message.startswith("the loss is nan at step 1, the first step of this run, "
                                  "before any update: the learning rate is not the cause"), message
        assert "lower train.lr" not in message


# checkpoint.on_signal ----------------------------------------------------------------------

@pytest.mark.parametrize("rank", [0, 1])
def test_a_signal_on_one_rank_stops_every_rank_after_the_same_step_with_a_checkpoint(
        stops, rank):
    run_dir, out = stops[f"signal {rank}"]
    assert [(steps, by) for steps, by, _, _ in out] == [(3, "SIGTERM"), (3, "SIGTERM")]
    for _, _, checkpoints, metrics in out:          # as the signalled run left its folder
        assert checkpoints == ["step-3"]             # checkpoint.every = 0: the signal's
        assert metrics[-1] == 3
    _, resumed = stops[f"resume {rank}"]             # a new run in that folder: no signal
    assert resumed == [(6, None), (6, None)]
    assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")] == [1, 2, 3, 4, 5, 6]


def test_on_signal_false_leaves_the_signal_its_default(tmp_path):
    changes = {"train__steps": 6, "checkpoint__every": 0, "checkpoint__on_signal": False}
    with pytest.raises(hybridpar.SpawnError, match=r"exited with code -15|lost stage 1 \(rank 1\)"):
        hybridpar.spawn(_signalled, 2, args=(str(tmp_path), changes, (1, 2)), timeout=TIMEOUT)
    assert not (tmp_path / "checkpoints").exists() or _checkpoints(tmp_path) == []


def test_sigterm_to_hybridpar_run_saves_a_checkpoint(tmp_path):
    """The real launcher: SIGTERM to the agent reaches every worker, which finish their step,
    save a complete checkpoint, and exit (the resume from it: the test above)."""
    config = tmp_path / "mlp.toml"
    config.write_text(
        '[model]\nname = "mlp"\nin_features = 8\nhidden = 8\nout_features = 4\nn_layer = 2\n'
        '[parallel]\npp = 2\nchunks = 2\ntimeout = 60.0\n'
        '[train]\nsteps = 100000\nbatch_size = 4\nlog_every = 1\nsample_tokens = 0\n'
        '[checkpoint]\nevery = 0\n')
    run_dir = tmp_path / "run"
    command = [sys.executable, "-m", "hybridpar.cli", "run", str(config),
               "--run-dir", str(run_dir)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    agent = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 180   # 70 s to its third step seen on a loaded machine
    while time.monotonic() < deadline and not (metrics.exists() and
                                                 len(metrics.read_text().splitlines()) >= 3):
        time.sleep(0.2)
    agent.send_signal(signal.SIGTERM)
    sent = time.monotonic()
    output, _ = agent.communicate(timeout=180)
    # stopped, not finished: the shell's status for SIGTERM, one line, no traceback; and at
    # once (the workers exit with it: a worker that returned waited 30 s for torch's agent)
    assert agent.returncode == 128 + signal.SIGTERM, output
    assert "hybridpar run: stopped by SIGTERM" in output and "Traceback" not in output, output
    assert time.monotonic() - sent < 25, output
    last = json.loads(metrics.read_text().splitlines()[-1])["step"]
    assert _checkpoints(run_dir) == [f"step-{last}"], output
    assert f"SIGTERM: stopped after step {last} with a checkpoint" in output, output
    assert (run_dir / "checkpoints" / f"step-{last}" / ".metadata").exists()   # complete
