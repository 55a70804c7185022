"""scripts/wakeup_latency.py runs end to end (a few rounds, a 1 ms sleep) and refuses bad
arguments; its numbers mean nothing here."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "scripts/wakeup_latency.py", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def test_a_short_run_measures_every_sleep_and_the_hop(tmp_path):
    done = run("--sleep-ms", "1", "--rounds", "3", "--out", str(tmp_path))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((tmp_path / "wakeup_latency.json").read_text())
    assert set(result["op_after_sleep_us"]) == {"0.0", "1.0", "5.0"}
    assert all(us > 0 for us in result["op_after_sleep_us"].values()) and result["hop_us"] > 0
    assert "gloo hop after a 1 ms sleep" in done.stdout


def test_a_sleep_of_zero_is_refused(tmp_path, capsys):
    # in this process: the script's main refuses before it measures or starts a rank
    sys.path.insert(0, str(ROOT / "scripts"))
    import wakeup_latency

    with pytest.raises(SystemExit) as exit_:
        wakeup_latency.main(["--sleep-ms", "0", "--out", str(tmp_path)])
    assert exit_.value.code == 2 and "--sleep-ms must be > 0" in capsys.readouterr().err
    assert not (tmp_path / "wakeup_latency.json").exists()
