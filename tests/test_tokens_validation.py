"""No validation data (issue 40, point 7): evaluation asked of an empty split is a config error.

The story: `hybridpar tokenize --val-fraction 0` then `hybridpar run` trained and saved, then
exited 1 in the end-of-run sample ("val split ... has no window"); any train.eval_every failed
mid-run the same way. Now a run that evaluates (train.eval_every > 0, within train.steps) on
data without a validation window is refused before any worker starts, naming the fix, and
`validation_problem` tells the trainer to skip the end-of-run sample.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_tokenize import write_jsonl

from hybridpar.data import tokenize_corpus
from hybridpar.train import load_config
from hybridpar.train.configs.config import ConfigError
from hybridpar.train.data import validation_problem

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "configs" / "quickstart.toml"


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("validation")
    write_jsonl(root / "a.jsonl", [f"document {i} " * 8 for i in range(40)])
    for name, fraction in (("none", 0.0), ("some", 0.25)):
        tokenize_corpus([root / "a.jsonl"], root / name, val_fraction=fraction)
    return root


def config(*overrides: str):
    return load_config(QUICKSTART, ["model.block_size=16", "model.n_embd=32", "model.n_layer=2",
                                    "model.n_head=4", "train.steps=4", *overrides])


def test_evaluating_a_folder_without_a_validation_split_is_a_config_error(folders):
    with pytest.raises(ConfigError, match=r"train\.eval_every = 2 evaluates on the validation "
                       r"split, but the token folder '.*none' has no validation window of "
                       r"data\.seq_len \+ 1 = 17 tokens \(it was tokenized with --val-fraction "
                       r"0\.0\); tokenize it again with --val-fraction > 0 \(e\.g\. 0\.05\); or "
                       r"set train\.eval_every = 0 .*\(from --set train\.eval_every=2\)"):
        config("data.source=tokens", f"data.path={folders / 'none'}", "train.eval_every=2")


def test_no_evaluation_or_one_past_the_last_step_trains_without_validation(folders):
    for every in ("0", "5"):                                  # 5 > train.steps = 4: never
        cfg = config("data.source=tokens", f"data.path={folders / 'none'}",
                     f"train.eval_every={every}")
        assert "--val-fraction 0.0" in str(validation_problem(cfg))   # the sample: skipped
    cfg = config("data.source=tokens", f"data.path={folders / 'some'}", "train.eval_every=2")
    assert validation_problem(cfg) is None


def test_bytes_with_no_validation_fraction_are_a_config_error(tmp_path):
    text = tmp_path / "a.txt"
    text.write_text("some text " * 100)                      # 1000 bytes
    with pytest.raises(ConfigError, match=r"data\.val_fraction = 0\.01 holds out 10 bytes of "
                       r"data\.path, fewer than data\.seq_len \+ 1 = 17: set a larger "
                       r"data\.val_fraction; or set train\.eval_every = 0"):
        config("data.source=text", f"data.path={text}", "data.val_fraction=0.01",
               "train.eval_every=2")
    with pytest.raises(ConfigError, match=r"data\.val_fraction = 0 holds out nothing"):
        config("data.source=corpus", "data.val_fraction=0", "train.eval_every=2")
    ok = config("data.source=text", f"data.path={text}", "data.val_fraction=0.05",
                "train.eval_every=2")
    assert validation_problem(ok) is None
    none = config("data.source=text", f"data.path={text}", "data.val_fraction=0")
    assert "holds out 0 bytes of data.path 'a.txt'".replace("'a.txt'", repr(str(text))) \
        in str(validation_problem(none))
    assert validation_problem(config("data.source=synthetic", "train.eval_every=2")) is None


def _train(cfg, run_dir):
    import logging

    from hybridpar.train.trainer import train

    warnings: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            warnings.append(record.getMessage())

    logging.getLogger("hybridpar.train").addHandler(Keep())
    result = train(cfg, run_dir, progress=False)
    return result["steps"], result["sample"], warnings


def test_a_run_on_a_folder_without_validation_trains_saves_and_skips_the_sample(folders,
                                                                                  tmp_path):
    import hybridpar

    cfg = config("data.source=tokens", f"data.path={folders / 'none'}", "model.vocab_size=320",
                 "parallel.pp=2", "parallel.tp=1", "train.sample_tokens=8", "checkpoint.every=4")
    out = hybridpar.spawn(_train, 2, args=(cfg, str(tmp_path)), timeout=120)
    assert [(steps, sample) for steps, sample, _ in out] == [(4, None), (4, None)]
    reporter = out[1][2]                                     # the last stage reports
    assert any(w.startswith("no sample at the end of the run: the token folder") and
               "--val-fraction 0.0" in w for w in reporter), reporter
    assert (tmp_path / "checkpoints" / "step-4" / ".metadata").exists()
    assert not (tmp_path / "sample.txt").exists()
