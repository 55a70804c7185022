"""scripts/wakeup_latency.py runs end to end (a few rounds, a 1 ms sleep) and refuses bad
arguments; its numbers mean nothing here."""

import json

import pytest
import torch


def test_a_short_run_measures_every_sleep_and_the_hop(tmp_path, capsys):
    # in this process: the hop is timed in ranks that hybridpar.spawn starts (timeout 300 s;
    # the suite's pytest-timeout bounds the test); main's torch.set_num_threads(1) is undone
    import wakeup_latency

    threads = torch.get_num_threads()
    try:
        code = wakeup_latency.main(["--sleep-ms", "1", "--rounds", "3", "--out", str(tmp_path)])
    finally:
        torch.set_num_threads(threads)
    printed = capsys.readouterr()
    assert code == 0, printed.out[-3000:] + printed.err[-3000:]
    result = json.loads((tmp_path / "wakeup_latency.json").read_text())
    assert set(result["op_after_sleep_us"]) == {"0.0", "1.0", "5.0"}
    assert all(us > 0 for us in result["op_after_sleep_us"].values()) and result["hop_us"] > 0
    assert "gloo hop after a 1 ms sleep" in printed.out


def test_a_sleep_of_zero_is_refused(tmp_path, capsys):
    # in this process: the script's main refuses before it measures or starts a rank
    import wakeup_latency

    with pytest.raises(SystemExit) as exit_:
        wakeup_latency.main(["--sleep-ms", "0", "--out", str(tmp_path)])
    assert exit_.value.code == 2 and "--sleep-ms must be > 0" in capsys.readouterr().err
    assert not (tmp_path / "wakeup_latency.json").exists()
