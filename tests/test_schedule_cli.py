"""`hybridpar schedule`: a schedule's timeline, makespan, bubble and live memory, printed."""

import pytest

from hybridpar.cli import main


def test_schedule_prints_the_timeline_bubble_and_peak_memory(capsys):
    assert main(["schedule", "--pp", "4", "--chunks", "8", "--schedule", "zb-h1"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "zb-h1: pp 4, 8 micro-batches, 1 virtual stage per rank; per stage F 1, B 1, W 1; "
        "latency 0",
        "rank 0 | F0 F1 F2 F3 .  .  .  I0 W0 F4 I1 W1 F5 I2 W2 F6 I3 W3 F7 I4 W4 I5 W5 I6 W6 I7 W7",
        "rank 1 | .  F0 F1 F2 .  .  I0 F3 I1 W0 F4 I2 W1 F5 I3 W2 F6 I4 W3 F7 I5 W4 I6 W5 I7 W6 W7",
        "rank 2 | .  .  F0 F1 .  I0 F2 I1 F3 I2 W0 F4 I3 W1 F5 I4 W2 F6 I5 W3 F7 I6 W4 I7 W5 W6 W7",
        "rank 3 | .  .  .  F0 I0 F1 I1 F2 I2 F3 I3 W0 F4 I4 W1 F5 I5 W2 F6 I6 W3 F7 I7 W4 W5 W6 W7",
        "makespan 27: 24 of work per rank + 3 of bubble (11.1%)",
        "1f1b with the same times: makespan 33",
        "rank  busy  idle  bubble  peak live micro-batches",
        "   0    24     3   11.1%  4",
        "   1    24     3   11.1%  4",
        "   2    24     3   11.1%  4",
        "   3    24     3   11.1%  4",
    ]


def test_schedule_with_virtual_stages_times_and_latency(capsys):
    assert main(["schedule", "--pp", "2", "--chunks", "4", "--schedule", "interleaved",
                 "--virtual", "2", "--times", "1,1,0", "--latency", "0"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1:3] == [
        "rank 0 | 0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 .   2B2 .   2B3 0B2 0B3",
        "rank 1 | .   1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3 .",
    ]
    assert out[3:5] == ["makespan 18: 16 of work per rank + 2 of bubble (11.1%)",
                        "1f1b with a rank's 2 virtual stages as one stage: makespan 20"]
    assert main(["schedule", "--pp", "2", "--chunks", "1", "--schedule", "zbv",
                 "--latency", "0.5"]) == 0
    assert "makespan 12: 6 of work per rank + 6 of bubble (50.0%)" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["--schedule", "interleaved", "--virtual", "1"], "virtual >= 2"),
    (["--schedule", "zbv", "--virtual", "3"], "'zbv' has 2 virtual stages per rank"),
    (["--times", "1,x"], "--times '1,x' must be three numbers F,B,W"),
    (["--latency", "-1"], "latency must be >= 0"),
])
def test_schedule_errors_are_one_line_with_exit_code_two(argv, message, capsys):
    assert main(["schedule", "--pp", "4", "--chunks", "8", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hybridpar schedule: error: ") and message in err
    assert len(err.splitlines()) == 1
