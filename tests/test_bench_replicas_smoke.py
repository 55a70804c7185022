"""scripts/bench_replicas.py runs end to end on a tiny GPT and its byte counts meet the formula
(per group, 2 x (parameters + gradients) of the replicated copies in float32); its times mean
nothing here."""

import json

TINY = ["--n-layer", "1", "--n-embd", "16", "--n-head", "2", "--batch", "4", "--seq", "8",
        "--chunks", "2", "--warmup", "0", "--iters", "1"]


def test_a_tiny_run_times_the_check_and_counts_its_bytes_by_the_formula(tmp_path, capsys):
    # in this process: every time and byte count is a spawned rank's (hybridpar.spawn, timeout
    # 600 s; the suite's pytest-timeout bounds the test), so no interpreter of its own
    import bench_replicas

    out = tmp_path / "replicas.json"
    code = bench_replicas.main([*TINY, "--repeats", "3", "--layouts", "1x2x2", "2x2x1",
                                "--out", str(out)])
    printed = capsys.readouterr()
    assert code == 0, printed.out[-3000:] + printed.err[-3000:]
    result = json.loads(out.read_text())
    assert [(r["pp"], r["tp"], r["dp"]) for r in result["rows"]] == [(1, 2, 2), (2, 2, 1)]
    for r in result["rows"]:
        assert r["match"] and r["largest_difference"] == 0.0
        assert r["step_s"]["median"] > 0 and r["check_s"]["median"] > 0
        assert len(r["step_s"]["samples"]) == 3
    dp_row = result["rows"][0]        # dp=2: every parameter of the rank, 16 bytes each, + tp's
    assert all(b >= 16 * n for b, n in zip(dp_row["bytes_per_rank"], dp_row["params_per_rank"]))
    assert "check / step" in printed.out and result["machine"]["processor"]

