"""scripts/bench_build_memory.py runs end to end on small models: every rank's peak and shard
are measured, for every row asked (here the two that write checkpoints of their own: a plain
export read by --init-from, and a tied GPT-2's save_pretrained, with its generated config);
its numbers mean little at this size. tests/test_memory_bound.py runs the rows' code at a
size that means something."""

import json


def test_a_small_run_measures_every_rank_of_every_row(tmp_path, capsys):
    # in this process: every measure is a rank's own (hybridpar.spawn, timeout 600 s; the
    # suite's pytest-timeout bounds the test), so the script needs no interpreter of its own
    import bench_build_memory

    out = tmp_path / "build_memory.json"
    rows = ["gpt-pp2tp2-init-from", "gpt2-pp2tp2-pretrained"]
    bench_build_memory.main(["--small", "--repeats", "1", "--rows", *rows, "--out", str(out)])
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())
    assert [r["row"] for r in result["rows"]] == rows
    for r in result["rows"]:
        assert len(r["ranks"]) == 4 and all(k["shard"] > 0 and k["peak"] > 0 for k in r["ranks"])
    assert "peak / shard" in printed and result["machine"]["processor"]
