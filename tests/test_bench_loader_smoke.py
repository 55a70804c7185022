"""scripts/bench_loader.py runs end to end (its smallest run: the numbers mean nothing): every
(size, dp, rank) row is timed for the loader and its memmap floor (the smoke run skips the
quick-start training step, a `hybridpar run` that the run tests cover)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_loader_benchmark_times_every_row_against_its_floor_and_a_step(tmp_path):
    out = tmp_path / "bench_loader.json"
    done = subprocess.run([sys.executable, "scripts/bench_loader.py", "--smoke", "--out",
                           str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "| batch x seq_len | dp | rank reads " in done.stdout
    result = json.loads(out.read_text())
    rows = [(r["batch"], r["seq_len"], r["dp"], r["role"]) for r in result["rows"]]
    assert rows == [(4, 16, 1, "first"), (4, 16, 1, "last"), (4, 16, 2, "first"),
                    (4, 16, 2, "last")]
    for r in result["rows"]:
        assert r["loader_s"]["median"] > 0 and r["floor_s"]["median"] > 0
        assert r["loader_over_floor"] > 0 and r["ns_per_token"] > 0
        assert r["share_of_step"] is None
        assert r["tokens"] == 4 // r["dp"] * 16
    assert result["train_step_s"] is None
    assert result["corpus"]["train_shards"] > 1 and result["machine"]["cpus"] >= 1
