"""scripts/bench_zero.py runs end to end on a tiny GPT (its times mean nothing): every
(param dtype, dp, zero) row's bytes per parameter are the exact counts of the formulas (fp32:
params 4, gradients 4 in the buckets at dp > 1, AdamW's moments 8; bf16 weights: params 2,
float32 gradients 4 in the buckets at every dp, masters and moments 12; at zero = 1 the
optimizer's part dealt over the dp ranks, at zero = 2 the gradients too (each rank's buckets
hold its own parameters' only); plus one 4-byte `step` per tensor a rank owns), and every
step time is measured, and each zero level's peak resident set above the baseline too."""

from __future__ import annotations

import json


def test_the_zero_benchmark_counts_the_formulas_exactly_and_times_both(tmp_path, capsys):
    # in this process: every count, time and peak is a spawned rank's own (hybridpar.spawn,
    # timeout 600 s; the suite's pytest-timeout bounds the test), so no interpreter of its own
    import bench_zero

    out = tmp_path / "bench_zero.json"
    # dp 1 and 2 (dp 4's rows are the benchmark's, docs/benchmarks.md §13: 4 ranks a row)
    bench_zero.main(["--smoke", "--dp", "1", "2", "--time-param-dtype", "fp32", "--peak-dp", "2",
                     "--out", str(out)])
    printed = capsys.readouterr().out
    assert "| weights | dp | zero | params | grads | buckets | optimizer |" in printed
    assert "zero 1 / zero 0" in printed and "zero 2 / zero 0" in printed
    result = json.loads(out.read_text())
    rows = result["memory"]
    assert [(r["param_dtype"], r["dp"], r["zero"]) for r in rows] == [
        (dtype, dp, zero) for dtype in ("fp32", "bf16") for dp in (1, 2) for zero in (0, 1, 2)]
    for r in rows:
        dp, zero, n, ranks = r["dp"], r["zero"], r["n_params"], r["ranks"]
        weights, state = (4, 8) if r["param_dtype"] == "fp32" else (2, 12)
        buckets = dp > 1 or r["param_dtype"] == "bf16"    # float32 gradients live in them
        assert len(ranks) == dp and n > 0
        sharded_grads = zero == 2 and dp > 1
        for k in ranks:
            assert k["n_params"] == n and k["params"] == weights * n
            if sharded_grads:    # float32 gradients of the parameters it owns only
                assert (k["grads"], k["buckets"]) == (0, 4 * k["owned_params"])
            else:
                assert (k["grads"], k["buckets"]) == ((0, 4 * n) if buckets else (4 * n, 0))
            assert k["optimizer"] == k["moments"] + k["masters"] + k["step_counts"]
            assert k["moments"] + k["masters"] == state * k["owned_params"]
            assert k["step_counts"] == 4 * k["owned_tensors"]
            assert k["total"] == k["params"] + k["grads"] + k["buckets"] + k["optimizer"]
        if zero == 0 or dp == 1:   # every rank: weights + 4 + state, plus its step counts
            assert r["formula"] == weights + 4 + state
            for k in ranks:
                assert k["owned_params"] == n
                assert k["total"] - k["step_counts"] == (weights + 4 + state) * n
        elif sharded_grads:        # weights + (4 + state) / dp: state and gradients dealt
            assert r["formula"] == weights + (4 + state) / dp
            assert sum(k["moments"] + k["masters"] for k in ranks) == state * n
            assert sum(k["buckets"] for k in ranks) == 4 * n
            assert sum(k["total"] - k["step_counts"] for k in ranks) == \
                (weights * dp + 4 + state) * n
        else:                      # weights + 4 + state / dp: the state dealt over the ranks
            assert r["formula"] == weights + 4 + state / dp
            assert sum(k["moments"] + k["masters"] for k in ranks) == state * n
            assert all(0 < k["moments"] < 8 * n for k in ranks)
            assert sum(k["owned_tensors"] for k in ranks) == r["n_tensors"]
            assert sum(k["total"] - k["step_counts"] for k in ranks) == \
                ((weights + 4) * dp + state) * n
        worst = max(k["total"] for k in ranks)
        assert ranks[r["worst_rank"]]["total"] == worst
        assert r["per_param"]["total"] == worst / n
    times = result["step_time"]
    assert [(t["param_dtype"], t["dp"], t["repeats"]) for t in times] == [("fp32", 2, 1)]
    for t in times:
        assert min(t[f"zero{z}_s"]["median"] for z in (0, 1, 2)) > 0
        assert t["ratio"]["median"] > 0 and t["ratio2"]["median"] > 0
    # the peak rows: each zero level's worst rank above its baseline, and the ratio to zero 0
    assert "peak above baseline (MiB, worst rank)" in printed
    peaks = result["peak"]
    assert [(r["dp"], r["zero"], r["param_dtype"]) for r in peaks] == [
        (2, z, "fp32") for z in (0, 1, 2)]
    for r in peaks:
        assert len(r["samples_mib"]) == 1 and r["peak_mib"]["median"] > 0
        assert r["ratio"] == r["peak_mib"]["median"] / peaks[0]["peak_mib"]["median"]
    assert result["machine"]["cpus"] >= 1 and result["smoke"] is True
