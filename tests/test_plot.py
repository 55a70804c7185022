"""`hybridpar plot`: PNGs of a run's metrics against step, several runs overlaid."""

from __future__ import annotations

import json

import pytest

from hybridpar.cli import main
from hybridpar.train.commands.plot import PANELS, plot_runs

pytest.importorskip("matplotlib")


def _run_dir(path, scale):
    path.mkdir(parents=True)
    lines = [{"step": s, "loss": 5.0 / s * scale, "lr": 1e-3 * s, "tokens_per_s": 1000.0 * scale,
              "step_time": 0.1, "mfu": 0.01, "host_peak_mib": [300.0, 310.0 + s],
              **({"eval_loss": 4.0 / s} if s % 2 == 0 else {})} for s in (1, 2, 3, 4)]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    return path


def test_two_runs_are_drawn_into_one_png_per_quantity_and_a_grid(tmp_path):
    a, b = _run_dir(tmp_path / "a", 1.0), _run_dir(tmp_path / "b", 2.0)
    written = plot_runs([a, b], tmp_path / "plots")
    assert [p.name for p in written] == [f"{name}.png" for name in PANELS] + ["story.png"]
    for path in written:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 5000


def test_the_command_writes_into_the_first_runs_plots_folder(tmp_path, capsys):
    a = _run_dir(tmp_path / "a", 1.0)
    assert main(["plot", str(a)]) == 0
    assert (a / "plots" / "story.png").is_file()
    assert "wrote" in capsys.readouterr().out


def test_a_folder_without_metrics_is_a_clear_error(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert main(["plot", str(tmp_path / "empty")]) == 2
    err = capsys.readouterr().err
    assert "has no metrics.jsonl: give run folders that `hybridpar run` trained in" in err
    assert main(["plot", str(tmp_path / "missing")]) == 2
    assert "is not a folder" in capsys.readouterr().err
