"""scripts/bench_moe.py runs end to end on a tiny MoE GPT (its times mean nothing): a row per
ep, each rank holding exactly experts / ep of every block's expert bytes, the all-to-alls
timed at ep > 1 only, and the ratio to ep 1 in the same run."""

from __future__ import annotations

import json


def test_the_moe_benchmark_holds_e_over_ep_experts_per_rank(tmp_path, capsys):
    import bench_moe

    out = tmp_path / "bench_moe.json"
    bench_moe.main(["--smoke", "--ep", "1", "2", "--dp", "2", "--experts", "4",
                    "--out", str(out)])
    printed = capsys.readouterr().out
    assert "| ep | tokens/s | vs ep 1 |" in printed.replace("  ", " ").replace("  ", " ")
    rows = json.loads(out.read_text())["rows"]
    assert [r["ep"] for r in rows] == [1, 2]
    one, two = rows
    assert two["expert_mib"] * 2 == one["expert_mib"] > 0
    assert one["a2a_ms"]["median"] == 0 < two["a2a_ms"]["median"]
    assert one["vs_ep1"] == 1.0 and two["vs_ep1"] > 0
