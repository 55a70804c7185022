"""`hybridpar run` builds on `meta` and draws only each rank's shard, keyed by name: the
quick-start GPT and a Hugging Face Llama start from the one-device weights in every layout
(bit for bit) and train 3 steps as the 1 x 1 run does.

Every run goes through `train.trainer.build_pipe` (what `hybridpar run` calls), in float64
(the default dtype of the ranks), one spawn per world size.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from spawn_cases import spawn_by_world

import hybridpar
from hybridpar.models.registry import build
from hybridpar.train import load_config
from hybridpar.train.trainer import build_pipe

pytest.importorskip("transformers", reason="the Llama runs need hybridpar[hf]")

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
MODELS = {   # config file, its overrides (small), the model's arguments for the reference
    "gpt": ("quickstart.toml", ["model.n_embd=32", "model.n_layer=2", "model.n_head=4",
                                "model.block_size=16", "model.dropout=0.0"]),
    "llama": ("llama_tiny.toml", ["model.hidden_size=32", "model.intermediate_size=64",
                                  "model.num_hidden_layers=2"]),
}
LAYOUTS = {   # name -> (pp, tp, balance, schedule, virtual stages)
    "1x1": (1, 1, "params", "1f1b", None),
    "pp2": (2, 1, "params", "1f1b", None),
    "tp2": (1, 2, "params", "gpipe", None),
    "pp2 x tp2": (2, 2, "params", "1f1b", None),
    "interleaved": (2, 1, "uniform", "interleaved", 2),
}
STEPS, BATCH, SEQ = 3, 4, 8


def _config(model: str, layout: str):
    file, overrides = MODELS[model]
    pp, tp, balance, schedule, virtual = LAYOUTS[layout]
    extra = [f"parallel.pp={pp}", f"parallel.tp={tp}", "parallel.dp=1", "parallel.chunks=2",
             f"parallel.balance={balance}", f"parallel.schedule={schedule}",
             "parallel.timeout=60", "train.seed=3"]
    # the Llama is sharded by "auto"; the GPT by its own tp layers (model.tp, no plan)
    extra.append("parallel.tp_plan=auto" if model == "llama" else "parallel.tp_plan=none")
    if virtual:
        extra.append(f"parallel.virtual_stages={virtual}")
    return load_config(CONFIGS / file, [*overrides, *extra])


def _worker(model: str, layout: str):
    torch.set_default_dtype(torch.float64)
    config = _config(model, layout)
    par = config.parallel
    topo = hybridpar.init(pp=par.pp, tp=par.tp, dp=1, timeout=par.timeout)
    pipe = build_pipe(config, topo)
    initial = pipe.consolidated_state_dict()
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(7)
    losses = []
    for _ in range(STEPS):
        ids = torch.randint(0, 256, (BATCH, SEQ + 1), generator=g)
        opt.zero_grad()
        losses.append(pipe.train_step(ids[:, :-1], ids[:, 1:]).item())
        pipe.check_replicas()
        opt.step()
    return {"initial": initial, "state": pipe.consolidated_state_dict(), "losses": losses}


@pytest.fixture(scope="module")
def runs():
    cases = {f"{m} {name}": (pp * tp, (m, name))
             for m in MODELS for name, (pp, tp, *_) in LAYOUTS.items()}
    return spawn_by_world(_worker, cases, timeout=300)


def _one_device(model: str):
    """The model built whole on one device from the run's seed (float64)."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        config = _config(model, "1x1")
        torch.manual_seed(config.train.seed)
        return build(config.model.name, **config.model.args)[0].state_dict()
    finally:
        torch.set_default_dtype(before)


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_layout_starts_from_the_one_device_weights_and_trains_as_1x1(model, layout, runs):
    whole = _one_device(model)
    (ref,) = runs[f"{model} 1x1"]
    for r in runs[f"{model} {layout}"]:
        assert list(r["initial"]) == list(whole)
        for k, v in whole.items():
            assert torch.equal(r["initial"][k], v), k                 # bit for bit
        assert r["losses"] == pytest.approx(ref["losses"], rel=1e-7)  # float32 reported
        for k, v in ref["state"].items():
            torch.testing.assert_close(r["state"][k], v, atol=1e-9, rtol=0, msg=k)
