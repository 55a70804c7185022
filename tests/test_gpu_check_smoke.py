"""scripts/gpu_check.py runs end to end on the CPU: the proof it is not broken without a GPU.

The smoke run (`--device cpu --quick`, gloo, one thread a rank) takes about 45 s on 2
cores, on the quick-start GPT at 32 tokens a sequence (tests/data/gpu_check_smoke.toml) and a
batch of 4 (one row a micro-batch): half the time of the quick run's own sizes. `--ranks 2`
adds the layout sweep (pp x tp = 1 x 2 and 2 x 1 on two gloo ranks), so the multi-device code
path runs too. Its numbers mean nothing; every check must PASS and every table must be printed.
The script's `main` runs in the test's process (what `python scripts/gpu_check.py` runs: every
check's work is in ranks that `hybridpar.spawn` starts, so the process boundary is not what
is tested; this saves an interpreter's imports and a fork server's start).
"""

import contextlib
import io
import json
import subprocess
from pathlib import Path

import pytest

CONFIG = Path(__file__).resolve().parent / "data" / "gpu_check_smoke.toml"

SCHEDULE_CHECKS = ["schedule_gpipe", "schedule_1f1b", "schedule_interleaved", "schedule_zb-h1",
                   "schedule_zbv"]
CHECKS = ["loss_falls", "grads_finite", "checkpoint_modes_agree", "balance_by_time",
          "trace_vs_clock", "stage_mfu", "layout_pp1_tp2", "layout_pp2_tp1", *SCHEDULE_CHECKS]
TABLE_HEADERS = ["| step ", "| dropout | checkpoint ", "| layer | kind ", "| stage | layers ",
                 "| span ", "| part ", "| checkpoint  | blocks ", "| pp × tp ",
                 "| schedule    | ranks | stages ", "| check "]


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """The script's `main` in this process (its ranks are `hybridpar.spawn`'s, each with the
    script's timeout; the suite's pytest-timeout bounds the whole): what it prints, and its
    output folder."""
    import gpu_check

    out = tmp_path_factory.mktemp("gpu_check")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = gpu_check.main(["--device", "cpu", "--quick", "--ranks", "2", "--out", str(out),
                               "--config", str(CONFIG), "--batch", "4"])
    return subprocess.CompletedProcess("gpu_check.main", code, printed.getvalue(), ""), out


def test_every_check_passes_and_is_in_the_json(smoke):
    run, out = smoke
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    result = json.loads((out / "gpu_check.json").read_text())
    assert [c["name"] for c in result["checks"]] == CHECKS
    failed = [c for c in result["checks"] if c["status"] != "PASS"]
    assert not failed, failed
    assert result["passed"] and result["device"] == "cpu" and result["mode"] == "quick"
    assert f"torch {result['environment']['torch']}" in result["checks"][0]["environment"]
    assert set(result["tolerances"]) >= {"bf16_grad_rel", "fp32_grad_rel", "trace_ratio"}


def test_the_tables_and_verdicts_are_printed_and_written(smoke):
    run, out = smoke
    for header in TABLE_HEADERS:
        assert header in run.stdout, header
    for name in CHECKS:
        assert f"**PASS** `{name}`" in run.stdout, name
    assert "**13 of 13 checks pass**" in run.stdout
    report = (out / "gpu_check.md").read_text()
    assert report.startswith("## GPU check") and "--quick" in report
    assert "6 N + 12 L h s" in report                  # the MFU formula is stated
    # check 6's compiled row: the blocks compiled (aot_eager under --quick), host time kept
    assert "| never       | aot_eager |" in run.stdout and "host ms / micro-batch" in run.stdout
    mfu = next(c for c in json.loads((out / "gpu_check.json").read_text())["checks"]
               if c["name"] == "stage_mfu")
    assert mfu["numbers"]["compiled_speedup"] > 0
    assert (out / "trace" / "trace.json").exists() and (out / "trace" / "table.txt").exists()


def test_the_numbers_behind_the_verdicts(smoke):
    _, out = smoke
    result = json.loads((out / "gpu_check.json").read_text())
    numbers = {c["name"]: c["numbers"] for c in result["checks"]}
    assert numbers["loss_falls"]["ratio"] < 0.8
    assert numbers["checkpoint_modes_agree"]["grad_rel"] <= 2e-2
    assert sum(numbers["balance_by_time"]["balance"]) == 7        # 4 blocks: 7 layers
    assert all(0.9 <= r <= 1.1 for r in numbers["trace_vs_clock"]["ratios"].values())
    assert numbers["stage_mfu"]["tokens_per_s"] > 0
    assert numbers["stage_mfu"]["peak_flops"] is None               # no peak for a CPU
    for layout in ("layout_pp1_tp2", "layout_pp2_tp1"):
        assert numbers[layout]["grad_rel"] <= 1e-4
    for name in SCHEDULE_CHECKS:   # float64: only the summation order differs
        assert numbers[name]["loss_rel"] <= 1e-6 and numbers[name]["grad_rel"] <= 1e-12
    rows = {r["schedule"]: r for s in result["sections"] if s["title"].startswith("8.")
            for r in s["data"]["rows"]}
    assert {name: rows[name]["stages"] for name in rows} == {
        "gpipe": 2, "1f1b": 2, "interleaved": 4, "zb-h1": 2, "zbv": 4}
    assert all(len(r["losses"]) == 3 for r in rows.values())


def test_a_schedule_that_fails_or_drifts_is_a_fail_with_its_reason():
    import gpu_check

    assert [gpu_check.schedule_pp(n) for n in (1, 2, 3, 4, 8)] == [0, 2, 2, 4, 4]
    from bench.gpu_schedules import schedule_balance
    assert [schedule_balance(n) for n in (2, 4, 8)] == [[5, 4], [3, 2, 2, 2], [2] + [1] * 7]
    good = {"schedule": "1f1b", "pp": 4, "stages": 4, "loss_rel": 1e-7, "grad_rel": 2e-15,
            "worst_param": "0.conv.0.weight", "losses": [1.0], "seconds": 3.0}
    drift = {**good, "schedule": "zbv", "stages": 8, "grad_rel": 3e-9}
    hung = {"schedule": "gpipe", "pp": 4,
            "error": "SpawnTimeout: ranks [0, 1, 2, 3] of 4 did not finish within 900 s"}
    section = gpu_check.schedules_section([good, drift, hung], "nccl")
    verdicts = {c.name: c for c in section.checks}
    assert verdicts["schedule_1f1b"].passed
    assert not verdicts["schedule_zbv"].passed and "gradient 3.0e-09" in \
        verdicts["schedule_zbv"].summary
    assert not verdicts["schedule_gpipe"].passed and "did not finish within 900 s" in \
        verdicts["schedule_gpipe"].summary
    assert "| gpipe    | 4     | error" in section.tables[0]
