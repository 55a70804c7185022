"""scripts/gpu_microbatch.py runs end to end on the CPU (a tiny GPT, gloo): it is not broken
without a GPU. Its numbers mean nothing here; every time must be measured and written."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STEPS = ["whole batch", "plain loop", "plain loop fwd", "pipe", "pipe host time",
         "plain loop host time"]


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "scripts/gpu_microbatch.py", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def test_the_tiny_run_times_every_step_and_writes_the_profile(tmp_path):
    done = run("--device", "cpu", "--tiny", "--out", str(tmp_path))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((tmp_path / "gpu_microbatch.json").read_text())
    assert list(result["times_ms"]) == STEPS
    assert all(ms > 0 for ms in result["times_ms"].values())
    assert result["model"]["n_layer"] == 4 and result["chunks"] == 8 and result["backend"] == "gloo"
    for step in STEPS:
        assert f"| {step} " in done.stdout, step
    profile = (tmp_path / "gpu_microbatch_profile.txt").read_text()
    assert "by device time" in profile and "by host time" in profile


def test_a_batch_that_does_not_split_is_refused(tmp_path):
    done = run("--device", "cpu", "--tiny", "--batch", "6", "--chunks", "4",
               "--out", str(tmp_path))
    assert done.returncode == 2
    assert "--batch (6) must be a positive multiple of --chunks (4)" in done.stderr
    assert not (tmp_path / "gpu_microbatch.json").exists()
