"""scripts/bench_zero.py runs end to end on a tiny GPT (its times mean nothing): every (dp, zero)
row's bytes per parameter are the exact counts of the formulas (params 4, gradients 4 in the
buckets at dp > 1, AdamW's moments 8 or, at zero = 1, 8 in all over the dp ranks, plus one
4-byte `step` per tensor a rank owns), and both step times are measured."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_zero_benchmark_counts_the_formulas_exactly_and_times_both(tmp_path):
    out = tmp_path / "bench_zero.json"
    done = subprocess.run([sys.executable, "scripts/bench_zero.py", "--smoke", "--out",
                           str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "| dp | zero | params | grads | buckets | optimizer |" in done.stdout
    assert "zero 1 / zero 0" in done.stdout
    result = json.loads(out.read_text())
    rows = result["memory"]
    assert [(r["dp"], r["zero"]) for r in rows] == [(1, 0), (1, 1), (2, 0), (2, 1), (4, 0),
                                                     (4, 1)]
    for r in rows:
        dp, zero, n, ranks = r["dp"], r["zero"], r["n_params"], r["ranks"]
        assert len(ranks) == dp and n > 0
        for k in ranks:
            assert k["n_params"] == n and k["params"] == 4 * n
            assert (k["grads"], k["buckets"]) == ((4 * n, 0) if dp == 1 else (0, 4 * n))
            assert k["optimizer"] == k["moments"] + k["step_counts"]
            assert k["moments"] == 8 * k["owned_params"]
            assert k["step_counts"] == 4 * k["owned_tensors"]
            assert k["total"] == k["params"] + k["grads"] + k["buckets"] + k["optimizer"]
        if zero == 0 or dp == 1:   # every rank: 4 + 4 + 8 = 16, plus its step counts
            assert r["formula"] == 16
            for k in ranks:
                assert k["owned_params"] == n and k["total"] - k["step_counts"] == 16 * n
        else:                      # 4 + 4 + 8/dp: the moments dealt over the ranks
            assert r["formula"] == 4 + 4 + 8 / dp
            assert sum(k["moments"] for k in ranks) == 8 * n
            assert all(0 < k["moments"] < 8 * n for k in ranks)
            assert sum(k["owned_tensors"] for k in ranks) == r["n_tensors"]
            assert sum(k["total"] - k["step_counts"] for k in ranks) == (8 * dp + 8) * n
        worst = max(k["total"] for k in ranks)
        assert ranks[r["worst_rank"]]["total"] == worst
        assert r["per_param"]["total"] == worst / n
    timing = result["step_time"]
    assert timing["dp"] == 2 and timing["repeats"] == 1
    assert timing["zero0_s"]["median"] > 0 and timing["zero1_s"]["median"] > 0
    assert timing["ratio"]["median"] > 0
    assert result["machine"]["cpus"] >= 1 and result["smoke"] is True
