"""scripts/gpu_microbatch.py runs end to end on the CPU (a tiny GPT, gloo): it is not broken
without a GPU. Its numbers mean nothing here; every time must be measured and written."""

import json

import pytest


def test_the_tiny_run_times_every_count_and_writes_the_profile(tmp_path, capsys):
    # in this process: the script's main times in a rank that hybridpar.spawn starts (timeout
    # 600 s; the suite's pytest-timeout bounds the test), so no interpreter of its own is needed
    import gpu_microbatch

    code = gpu_microbatch.main(["--device", "cpu", "--tiny", "--chunks", "1,4",
                                "--out", str(tmp_path)])
    printed = capsys.readouterr()
    assert code == 0, printed.out[-3000:] + printed.err[-3000:]
    result = json.loads((tmp_path / "gpu_microbatch.json").read_text())
    assert [r["chunks"] for r in result["rows"]] == [1, 4] and result["whole_batch_ms"] > 0
    for row in result["rows"]:
        assert all(row[k] > 0 for k in ("plain_loop_ms", "plain_loop_fwd_ms", "pipe_ms",
                                        "pipe_host_ms", "plain_loop_host_ms")), row
    assert result["model"]["n_layer"] == 4 and result["backend"] == "gloo"
    assert "| micro-batches | sequences each | plain loop ms" in printed.out
    profile = (tmp_path / "gpu_microbatch_profile.txt").read_text()
    assert "of 4 micro-batches" in profile and "by host time" in profile


def test_a_batch_that_does_not_split_is_refused(tmp_path, capsys):
    # in this process: the script's main refuses before it starts a rank
    import gpu_microbatch

    for argv, message in (
            (["--batch", "6", "--chunks", "4"], "--batch (6) must be a positive multiple of "
                                                "--chunks (4)"),
            (["--chunks", "2,x"], "--chunks must be integers")):
        with pytest.raises(SystemExit) as exit_:
            gpu_microbatch.main(["--device", "cpu", "--tiny", *argv, "--out", str(tmp_path)])
        assert exit_.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "gpu_microbatch.json").exists()
