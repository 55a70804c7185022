"""The benchmark suite runs: each benchmark's smallest configuration, so none can rot.

The numbers of a smoke run mean nothing (tiny models, one repeat); what is checked is that
every benchmark runs end to end against its peer and produces its table and its JSON, and
that the exact counts (communication, activation memory) still meet their formulas.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from hybridpar.pipeline.schedules.schedule import gpipe, live_microbatches, one_f_one_b

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
sys.path.insert(0, str(SCRIPTS))

import bench_all  # noqa: E402


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    assert bench_all.main(["--smoke", "--skip-tpdense", "--out-dir", str(out)]) == 0
    return out, json.loads((out / "bench_all.json").read_text())


def test_every_benchmark_writes_its_table_and_json(smoke):
    out, combined = smoke
    names = [r["name"] for r in combined["results"]]
    assert names == ["schedule", "comm", "memory", "overhead", "tp_mlp", "gpt", "zero_bubble",
                     "virtual"]
    markdown = (out / "bench_all.md").read_text()
    assert markdown.startswith("## Benchmarks") and "--smoke" in markdown
    for result in combined["results"]:
        assert result["rows"], result["name"]
        assert result["title"] in markdown and result["table"] in markdown
        assert json.loads((out / f"{result['name']}.json").read_text())["name"] == result["name"]
    assert combined["machine"]["torch"] and combined["seconds"] > 0


def test_the_peers_ran_and_are_compared(smoke):
    _, combined = smoke
    by_name = {r["name"]: r for r in combined["results"]}
    for row in by_name["schedule"]["rows"]:
        assert row["peer_s"]["median"] > 0 and row["hybridpar_s"]["median"] > 0
        # a sleep never ends early: the one-process run is never faster than the bound
        assert row["one_process_s"] >= row["bound_s"] and 0 < row["one_process_efficiency"] <= 1
    for row in by_name["tp_mlp"]["rows"]:
        assert row["loss_diff"] < 1e-4          # DTensor holds the same weights
    for row in by_name["gpt"]["rows"]:
        assert abs(row["first_loss"] - row["peer_first_loss"]) < 1e-4
    for row in by_name["zero_bubble"]["rows"]:
        assert row["peer_zb_s"]["median"] > 0 and row["hybridpar_zb_s"]["median"] > 0
        assert row["bound_zb_s"] < row["bound_1f1b_s"]       # the simulated W fill
    for row in by_name["virtual"]["rows"]:
        for name in ("interleaved", "zbv"):
            assert row[f"hybridpar_{name}_s"]["median"] > 0 and row[f"peer_{name}_s"]["median"] > 0
            assert row[f"bound_{name}_s"] < row["bound_1f1b_s"]   # fewer bubbles, simulated


def test_exact_counts_meet_their_formulas(smoke):
    _, combined = smoke
    by_name = {r["name"]: r for r in combined["results"]}
    assert all(r["match"] for r in by_name["comm"]["rows"])
    for r in by_name["memory"]["rows"]:
        assert r["measured_bytes"] == pytest.approx(r["expected_bytes"], rel=0.05)
        assert r["left_bytes"] == 0


def test_live_microbatches_with_checkpointing_count_the_recomputation():
    # 1F1B, 2 stages, 4 micro-batches; stage 0 runs F0 F1 B0 F2 B1 F3 B2 B3
    assert live_microbatches(one_f_one_b(2, 4)) == [2, 1]
    assert live_microbatches(one_f_one_b(2, 4), checkpointed=lambda i: i < 3) == [2, 1]
    assert live_microbatches(one_f_one_b(4, 8), checkpointed=lambda i: i < 7) == [2, 2, 2, 1]
    assert live_microbatches(one_f_one_b(4, 8), checkpointed=lambda i: True) == [1] * 4
    assert live_microbatches(gpipe(3, 5), checkpointed=lambda i: i < 4) == [1] * 3
