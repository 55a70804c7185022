"""scripts/bench_tokenize.py runs end to end (its smallest run: the numbers mean nothing)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_tokenize_benchmark_times_hybridpar_and_its_peers_on_the_same_tokens(tmp_path):
    out = tmp_path / "bench_tokenize.json"
    done = subprocess.run([sys.executable, "scripts/bench_tokenize.py", "--smoke", "--workers",
                           "1", "--out", str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "| workers | tokens " in done.stdout and "M tokens per CPU s" in done.stdout
    result = json.loads(out.read_text())
    (row,) = result["rows"]
    assert row["workers"] == 1 and row["tokens"] > row["documents"] > 10
    for side in ("hybridpar", "encode_batch", "encode_batch_fast"):
        assert row[f"{side}_tokens_per_s"]["median"] > 0
    assert row["ratio_encode_batch"] > 0 and result["machine"]["cpus"] >= 1
