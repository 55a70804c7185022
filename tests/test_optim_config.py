"""[optim]: the optimizer a run builds (`train.build.build_optimizer`) and the refusals of
`train.configs.optimizer.check_optim`.

SGD with momentum and weight decay (on matrices only) through `build_pipe` and
`build_optimizer` from a config, in float64 at pp2 x dp2 under ZeRO 0, 1 and 2, trains every
parameter as a plain `torch.optim.SGD` loop over the one-device model (the same initial
weights, batches, lr schedule and clipping); a whole `train` run with SGD at bf16 weights and
zero 2 (float32 masters) trains. Bad [optim] values are refused with the key's name.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from config_errors import error_of
from spawn_cases import spawn_cases

from hybridpar.models import build_model
from hybridpar.train import Config, ConfigError
from hybridpar.train.build import build_optimizer, build_pipe, topology_for
from hybridpar.train.lr import lr_at

TIMEOUT = 180
STEPS, BATCH, CLIP, LR = 3, 8, 0.5, 0.05
MODEL = {"name": "gpt", "vocab_size": 64, "block_size": 8, "n_layer": 2, "n_head": 2,
         "n_embd": 16, "dropout": 0.0}
SGD = {"name": "sgd", "momentum": 0.9, "weight_decay": 0.1}
NO_CHECKPOINTS = {"every": 0, "on_signal": False}


def sgd_config(zero: int, **more: dict) -> Config:
    return Config.from_dict({
        "model": MODEL, "data": {"source": "synthetic"},
        "parallel": {"pp": 2, "dp": 2, "zero": zero, "chunks": 2, "timeout": 60.0},
        "train": {"steps": STEPS, "batch_size": BATCH, "lr": LR, "warmup_steps": 1,
                  "min_lr": 0.01, "grad_clip": CLIP, "sample_tokens": 0},
        "optim": SGD, "checkpoint": NO_CHECKPOINTS, **more})


def batches():
    g = torch.Generator().manual_seed(7)
    return [(torch.randint(0, 64, (BATCH, 8), generator=g),
             torch.randint(0, 64, (BATCH, 8), generator=g)) for _ in range(STEPS)]


def _sgd_steps(zero):
    torch.set_default_dtype(torch.float64)   # the model is built in float64
    try:
        return _sgd_steps_float64(zero)
    finally:
        torch.set_default_dtype(torch.float32)


def _sgd_steps_float64(zero):
    cfg = sgd_config(zero)
    topo = topology_for(cfg)
    pipe = build_pipe(cfg, topo)
    start = pipe.consolidated_state_dict()
    optimizer = build_optimizer(pipe, cfg)
    rows = BATCH // topo.dp
    part = slice(topo.dp_rank * rows, (topo.dp_rank + 1) * rows)
    for step, (x, y) in enumerate(batches()):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, lr=LR, steps=STEPS, warmup_steps=1, min_lr=0.01)
        optimizer.zero_grad(set_to_none=True)
        pipe.train_step(x[part], y[part])
        pipe.clip_grad_norm_(CLIP)
        optimizer.step()
    end = pipe.consolidated_state_dict()
    pipe.close()
    return {"start": start, "end": end, "dtype": str(next(pipe.parameters()).dtype),
            "optimizer": type(getattr(optimizer, "optim", optimizer)).__name__}


def _train_bf16(zero, run_dir):
    from hybridpar.train.trainer import train

    cfg = sgd_config(zero, train={"steps": 4, "batch_size": BATCH, "lr": LR, "sample_tokens": 0,
                               "precision": "bf16", "param_dtype": "bf16", "log_every": 1})
    return train(cfg, run_dir, progress=False)["losses"]


def _call(fn, *args):
    return fn(*args)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The float64 steps at zero 0, 1, 2, the bf16 runs at zero 1, 2 and the SGD resumes
    through a checkpoint at zero 0, 1 (`_sgd_resumed`): one spawn of 4 ranks."""
    cases = {**{f"zero {z}": (_sgd_steps, z) for z in (0, 1, 2)},
             **{f"bf16 zero {z}": (_train_bf16, z, str(tmp_path_factory.mktemp("bf16")))
                for z in (1, 2)},
             **{f"resumed zero {z}": (_sgd_resumed, str(tmp_path_factory.mktemp("resumed")), z)
                for z in (0, 1)}}
    out = spawn_cases(_call, 4, cases, timeout=TIMEOUT * 2)
    return out, {k.removeprefix("bf16 "): v for k, v in out.items() if k.startswith("bf16")}


def plain_sgd(start):
    """The one-device float64 model trained by a plain torch.optim.SGD loop."""
    torch.manual_seed(0)
    model = build_model("gpt", **{k: v for k, v in MODEL.items() if k != "name"})
    model = model.double()
    model.load_state_dict(start)
    params = list(model.parameters())
    optimizer = torch.optim.SGD([{"params": [p for p in params if p.dim() >= 2],
                                  "weight_decay": 0.1},
                                 {"params": [p for p in params if p.dim() < 2],
                                  "weight_decay": 0.0}], lr=LR, momentum=0.9)
    for step, (x, y) in enumerate(batches()):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, lr=LR, steps=STEPS, warmup_steps=1, min_lr=0.01)
        optimizer.zero_grad()
        logits = model(x)
        F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)).backward()
        torch.nn.utils.clip_grad_norm_(params, CLIP)
        optimizer.step()
    return model.state_dict()


@pytest.mark.parametrize("zero", [0, 1, 2])
def test_sgd_with_momentum_trains_as_a_plain_torch_loop_in_float64(runs, zero):
    ranks = runs[0][f"zero {zero}"]
    assert {r["dtype"] for r in ranks} == {"torch.float64"}
    assert {r["optimizer"] for r in ranks} == {"SGD"}
    expected = plain_sgd(ranks[0]["start"])
    moved = 0.0
    for name, value in expected.items():
        got = ranks[0]["end"][name]
        assert torch.allclose(got, value, rtol=1e-10, atol=1e-12), name
        moved = max(moved, float((value - ranks[0]["start"][name]).abs().max()))
        assert all(torch.equal(r["end"][name], got) for r in ranks), name
    assert moved > 1e-3   # the steps changed the weights


def test_sgd_trains_with_bf16_weights_at_zero_1_and_2(runs):
    """`train` with SGD over float32 masters of bf16 weights (`MasterWeights`, sharded)."""
    first = runs[1]["zero 1"][0]
    for zero in (1, 2):
        losses = runs[1][f"zero {zero}"][0]
        assert len(losses) == 4 and all(math.isfinite(x) for x in losses)
        assert all(r == losses for r in runs[1][f"zero {zero}"])
        assert losses == pytest.approx(first, abs=2e-2)   # the same update, summed otherwise


@pytest.mark.parametrize("optim,extra,message", [
    ({"name": "lbfgs"}, {}, "optim.name: unknown optimizer 'lbfgs'; give one of adamw, adam, "
                            "sgd or a class as 'package.module:Class'"),
    ({"name": "nosuch.module:Opt"}, {}, "cannot import optimizer 'nosuch.module:Opt'"),
    ({"name": "torch.nn:Linear"}, {}, "not a torch.optim.Optimizer class"),
    ({"name": "torch.optim:LBFGS"}, NO_CHECKPOINTS, "LBFGS.step needs a closure"),
    ({"name": "test_optim_config:CountingSGD"}, {},
     "CountingSGD keeps state that is not a tensor (calls: int)"),
    ({"momentum": 0.9}, {}, "optim.momentum = 0.9, but AdamW takes no momentum"),
    ({"name": "sgd", "betas": [0.8, 0.9]}, NO_CHECKPOINTS,
     "optim.betas = [0.8, 0.9], but SGD takes no betas"),
    ({"betas": [0.9]}, {}, "optim.betas must be two numbers"),
    ({"betas": [0.9, 1.0]}, {}, "optim.betas must be in [0, 1)"),
    ({"eps": 0.0}, {}, "optim.eps must be positive"),
    ({"momentum": -0.5, "name": "sgd"}, NO_CHECKPOINTS, "optim.momentum must be in [0, 1)"),
    ({"name": "sgd", "nesterov": True}, NO_CHECKPOINTS,
     "SGD refuses these options (momentum=0.0, nesterov=True)"),
    ({"weight_decay": 0.1}, {"train_weight_decay": 0.2},
     "train.weight_decay = 0.2 and optim.weight_decay = 0.1"),
])
def test_bad_optim_values_are_refused_naming_the_key(optim, extra, message):
    train = {"steps": 2}
    if "train_weight_decay" in extra:
        train["weight_decay"] = extra.pop("train_weight_decay")
    raw = {"model": MODEL, "train": train, "optim": optim}
    if extra:
        raw["checkpoint"] = extra
    with pytest.raises(ConfigError) as e:
        Config.from_dict(raw)
    assert message in str(e.value)


class CountingSGD(torch.optim.SGD):
    """SGD that also counts its steps in a Python int: state a checkpoint cannot hold."""

    def step(self, closure=None):
        out = super().step(closure)
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p]["calls"] = self.state[p].get("calls", 0) + 1
        return out


def _sgd_resumed(run_dir, zero):
    """SGD with momentum: 4 steps at once, then 2 + 2 through a checkpoint; both losses."""
    from hybridpar.train.trainer import train

    cfg = sgd_config(zero, checkpoint={"every": 2})
    whole = train(cfg, f"{run_dir}/whole", progress=False)["losses"]
    train(cfg, f"{run_dir}/halves", progress=False, stop_at=2)
    resumed = train(cfg, f"{run_dir}/halves", progress=False)
    return whole, resumed["start"], resumed["losses"]


@pytest.mark.parametrize("zero", [0, 1])
def test_sgd_with_momentum_resumes_exactly_from_a_checkpoint(runs, zero):
    for whole, start, resumed in runs[0][f"resumed zero {zero}"]:
        assert start == 2 and resumed == whole[2:], (whole, resumed)   # the momentum came back


def test_train_weight_decay_is_the_older_name_of_optim_weight_decay(tmp_path):
    cfg = Config.from_dict({"model": MODEL, "train": {"weight_decay": 0.2}})
    assert cfg.optim.weight_decay == 0.2 and "weight_decay" not in cfg.to_dict()["train"]
    assert Config.from_dict(cfg.to_dict()) == cfg
    path = tmp_path / "c.toml"
    path.write_text('[model]\nname = "gpt"\n')
    message = error_of(path, "train.weight_decay=0.1", "optim.weight_decay=0.3")
    assert "(from --set train.weight_decay=0.1)" in message


def test_a_users_optimizer_class_by_path_is_built_with_the_options_it_takes():
    cfg = Config.from_dict({"model": MODEL, "optim": {"name": "torch.optim:RMSprop",
                                                      "momentum": 0.5, "eps": 1e-6},
                            "checkpoint": NO_CHECKPOINTS})
    from hybridpar.train.configs.optimizer import optimizer_class, optimizer_options

    cls = optimizer_class(cfg.optim.name)
    assert cls is torch.optim.RMSprop
    assert optimizer_options(cfg.optim, cls) == {"eps": 1e-6, "momentum": 0.5}


def test_the_sgd_example_of_docs_training_md_loads(tmp_path):
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "training.md").read_text()
    example = text.split("**The optimizer and the learning rate.**", 1)[1]
    example = example.split("```toml\n", 1)[1].split("```", 1)[0]
    path = tmp_path / "sgd.toml"
    path.write_text('[model]\nname = "gpt"\n' + example)
    from hybridpar.train import load_config

    cfg = load_config(path)
    assert (cfg.optim.name, cfg.optim.momentum, cfg.optim.weight_decay) == ("sgd", 0.9, 0.1)
