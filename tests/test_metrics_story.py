"""The run's story in metrics.jsonl: throughput, MFU, every rank's peak memory and the
learning rate in every record; TensorBoard and W&B copies under [logging]."""

from __future__ import annotations

import collections
import importlib.util
import sys
import types

import pytest
from host_reads import watching_reads
from test_train_run import config

import hybridpar
from hybridpar.flops import flops_per_token, matmul_params, peak_bf16
from hybridpar.models import gpt
from hybridpar.train import Config, ConfigError
from hybridpar.train.metrics import ScalarSinks, model_flops, read_metrics, scalars
from hybridpar.train.trainer import train

HAS_TENSORBOARD = importlib.util.find_spec("tensorboard") is not None


def _run(run_dir: str, tensorboard: bool):
    cfg = config("train.steps=6", "train.log_every=3", "checkpoint.every=0",
                 f"logging.tensorboard={str(tensorboard).lower()}")
    reads: collections.Counter = collections.Counter()

    def count(name, caller):
        if caller.co_filename.endswith("train/metrics.py"):
            reads[f"{caller.co_name}:{name}"] += 1

    with watching_reads(count):
        train(cfg, run_dir, progress=False)
    return dict(reads)


def test_every_record_has_throughput_mfu_peak_memory_and_lr(tmp_path):
    run_dir = tmp_path / "run"
    reads = hybridpar.spawn(_run, 4, args=(str(run_dir), HAS_TENSORBOARD), timeout=120)
    records = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == [3, 6]
    for r in records:
        assert r["tokens_per_s"] > 0 and r["lr"] > 0
        assert 0 < r["mfu"] < 1
        assert len(r["host_peak_mib"]) == 4 and all(m > 10 for m in r["host_peak_mib"])
        assert "device_peak_mib" not in r   # CPU ranks
    # memory is read on the host at the two log steps only, by the reporting rank (2)
    assert [r.get("gather_peak_memory:tolist", 0) for r in reads] == [0, 0, 2, 0]
    if not HAS_TENSORBOARD:
        pytest.skip("tensorboard is not installed: its event files are not read back")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    tags = events.Tags()["scalars"]
    assert {"loss", "lr", "tokens_per_s", "mfu", "host_peak_mib"} <= set(tags)
    loss = events.Scalars("loss")
    assert [e.step for e in loss] == [3, 6]
    assert [e.value for e in loss] == pytest.approx([r["loss"] for r in records], rel=1e-6)


def test_model_flops_of_the_gpt_config_are_6n_plus_12lhs():
    cfg = config()   # gpt: 4 blocks, n_embd 32, seq_len = block_size 16
    flops, how = model_flops(cfg)
    model = gpt(**cfg.model.args)
    n = matmul_params([model])
    embeddings = sum(p.numel() for p in model[0].parameters())
    assert n == sum(p.numel() for p in model.parameters()) - embeddings
    assert how == "6N+12Lhs"
    assert flops == flops_per_token(n, 4, 32, 16) == 6 * n + 12 * 4 * 32 * 16


def test_unet_has_no_model_flops_and_mlp_counts_6n_per_sample():
    def of(name):
        return Config.from_dict({"model": {"name": name}, "data": {"source": "synthetic"}})

    assert model_flops(of("unet"))[0] is None
    flops, how = model_flops(of("mlp"))
    assert how == "6N per sample" and flops > 0


def test_the_peak_table_names_the_gpu():
    assert peak_bf16("NVIDIA H100 80GB HBM3") == (989e12, "H100 SXM")
    assert peak_bf16("NVIDIA GeForce RTX 3090")[0] is None


def test_scalars_take_the_largest_rank_and_leave_out_the_step_and_comm():
    record = {"step": 4, "loss": 2.0, "skipped": True, "comm": {"p2p_send": {"bytes": 1}},
              "host_peak_mib": [300.0, 420.5], "mfu": None}
    assert scalars(record) == {"loss": 2.0, "host_peak_mib": 420.5}


@pytest.mark.skipif(importlib.util.find_spec("wandb") is not None, reason="wandb is installed")
def test_wandb_without_the_package_is_a_config_error_that_names_the_fix():
    with pytest.raises(ConfigError, match=r"logging.wandb = true but the wandb package is not "
                       r"installed: pip install wandb.*--set logging.wandb=true"):
        config("logging.wandb=true")


def test_wandb_logs_offline_by_default(tmp_path, monkeypatch):
    calls = []
    fake = types.ModuleType("wandb")

    class FakeRun:
        def log(self, values, step):
            calls.append(("log", values, step))

        def finish(self):
            calls.append(("finish",))

    def init(**kwargs):
        calls.append(("init", kwargs))
        return FakeRun()

    fake.init = init
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())
    cfg = config("logging.wandb=true")
    sinks = ScalarSinks(cfg, tmp_path)
    sinks.write({"step": 2, "loss": 3.5, "lr": 1e-3, "host_peak_mib": [1.0, 2.0]})
    sinks.close()
    (_, kwargs), log, finish = calls
    assert kwargs["mode"] == "offline" and kwargs["project"] == "hybridpar"
    assert kwargs["dir"] == str(tmp_path) and kwargs["config"]["logging"]["wandb"] is True
    assert log == ("log", {"loss": 3.5, "lr": 1e-3, "host_peak_mib": 2.0}, 2)
    assert finish == ("finish",)
