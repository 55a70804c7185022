"""A model built on `meta` is initialized completely, or the pipe says what is missing."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import hybridpar
from hybridpar.pipeline.parameters.partition import materialize

WIDTH = 6


class Scale(nn.Module):
    """A learned per-feature scale with no reset_parameters (as HF's LlamaRMSNorm)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(WIDTH))

    def forward(self, x):
        return x * self.weight


class Rotary(nn.Module):
    """A buffer computed in __init__ (as a rotary embedding's inv_freq)."""

    def __init__(self, *, recompute: bool) -> None:
        super().__init__()
        self.recompute = recompute
        self.register_buffer("inv_freq", self._inv_freq(), persistent=False)

    @staticmethod
    def _inv_freq(device=None):
        return 1.0 / (10000 ** (torch.arange(0, WIDTH, 2, device=device).float() / WIDTH))

    def reset_parameters(self) -> None:
        if self.recompute:
            self.inv_freq.copy_(self._inv_freq(self.inv_freq.device))

    def forward(self, x):
        return x * self.inv_freq.repeat(2)


def init_scales(module: nn.Module) -> None:
    """An init_fn: what the plain constructors do (HF's _init_weights plays this part)."""
    if isinstance(module, Scale):
        nn.init.ones_(module.weight)
    elif isinstance(module, nn.Linear):
        module.reset_parameters()


def model(*, rotary: bool | None = None) -> nn.Sequential:
    torch.manual_seed(0)
    layers = [nn.Linear(WIDTH, WIDTH), Scale(), nn.Linear(WIDTH, WIDTH)]
    if rotary is not None:
        layers = [nn.Linear(WIDTH, WIDTH), Rotary(recompute=rotary), nn.Linear(WIDTH, WIDTH)]
    return nn.Sequential(*layers)


def build_worker(kind: str):
    topo = hybridpar.init(pp=3, timeout=60)
    with torch.device("meta"):
        net = model(rotary={"scale": None, "init_fn": None, "stale": False,
                            "recomputed": True}[kind])
    init_fn = init_scales if kind == "init_fn" else None
    try:
        pipe = hybridpar.HybridPipe(net, [1, 1, 1], topology=topo, init_fn=init_fn)
    except ValueError as e:
        return {"error": str(e)}
    return {"state": {k: v.clone() for k, v in pipe.state_dict().items()},
            "buffers": {k: v.clone() for k, v in pipe.named_buffers()}}


def test_a_module_without_reset_parameters_is_refused_on_every_rank():
    for r in hybridpar.spawn(build_worker, 3, args=("scale",), timeout=120):
        assert "module '1' (Scale) holds parameters or buffers but has no reset_parameters()" \
            in r["error"]
        assert "init_fn=" in r["error"] and "build the model on a real device" in r["error"]


def test_init_fn_initializes_what_reset_parameters_cannot():
    ranks = hybridpar.spawn(build_worker, 3, args=("init_fn",), timeout=120)
    assert torch.equal(ranks[1]["state"]["1.weight"], torch.ones(WIDTH))
    for r in ranks:
        assert all(not torch.isnan(v).any() for v in r["state"].values())


def test_a_buffer_computed_in_init_and_not_recomputed_is_named():
    for r in hybridpar.spawn(build_worker, 3, args=("stale",), timeout=120):
        assert "'1.inv_freq' is not initialized" in r["error"]


def test_a_recomputed_buffer_equals_the_cpu_build():
    ranks = hybridpar.spawn(build_worker, 3, args=("recomputed",), timeout=120)
    expected = model(rotary=True)[1].inv_freq
    assert torch.equal(ranks[1]["buffers"]["1.inv_freq"], expected)


def test_init_fn_is_applied_children_first_as_model_apply():
    seen: list[str] = []
    with torch.device("meta"):
        net = nn.Sequential(nn.Sequential(nn.Linear(2, 2)))
    materialize(net, "cpu", init_fn=lambda m: (seen.append(type(m).__name__),
                                               init_scales(m)))
    assert seen == ["Linear", "Sequential", "Sequential"]


def test_hugging_face_norms_and_rotary_buffers_initialize_with_its_init_weights():
    transformers = pytest.importorskip("transformers", reason="pip install 'hybridpar[hf]'")
    config = transformers.LlamaConfig(vocab_size=32, hidden_size=8, intermediate_size=16,
                                      num_hidden_layers=1, num_attention_heads=2,
                                      num_key_value_heads=1)
    cpu = transformers.LlamaForCausalLM(config).model
    with torch.device("meta"):
        hf = transformers.LlamaForCausalLM(config)
    stage = nn.Sequential(hf.model.norm, hf.model.rotary_emb)
    with pytest.raises(ValueError, match=r"module '0' \(LlamaRMSNorm\)"):
        materialize(stage, "cpu")
    materialize(stage, "cpu", init_fn=hf._init_weights)
    assert torch.equal(stage[0].weight, cpu.norm.weight)
    assert torch.equal(stage[1].inv_freq, cpu.rotary_emb.inv_freq)


def test_a_tie_within_a_stage_survives_materialization():
    with torch.device("meta"):
        net = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10, bias=False))
    net[1].weight = net[0].weight
    materialize(net, "cpu")
    assert net[1].weight is net[0].weight and not torch.isnan(net[0].weight).any()


def gpt2_meta_worker(pp, state):
    import sys

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    from hf_models import tiny

    from hybridpar.hf import init_fn, to_sequential

    topo = hybridpar.init(pp=pp, timeout=60)
    with torch.device("meta"):
        model = tiny("gpt2")
    pipe = hybridpar.HybridPipe(to_sequential(model), [5] if pp == 1 else [2, 3],
                                topology=topo, init_fn=init_fn(model))
    fresh = pipe.consolidated_state_dict()
    layers = dict(pipe.named_children())
    tied = pp == 2 or layers["4"].weight is layers["0"].wte.weight   # one Parameter in a stage
    pipe.load_consolidated_state_dict(state)
    ids = torch.arange(16).view(2, 8) % 64
    return {"fresh": fresh, "logits": pipe(ids), "tied": tied}


@pytest.mark.parametrize("pp", [1, 2])
def test_a_meta_built_hugging_face_gpt2_keeps_its_tie_and_equals_the_cpu_build(pp):
    pytest.importorskip("transformers", reason="pip install 'hybridpar[hf]'")
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from hf_models import tiny

    from hybridpar.hf import sequential_state_dict

    cpu = tiny("gpt2")
    state = sequential_state_dict(cpu.state_dict(), cpu.config)
    ids = torch.arange(16).view(2, 8) % 64
    for r in hybridpar.spawn(gpt2_meta_worker, pp, args=(pp, state), timeout=120):
        assert r["tied"]
        assert all(not torch.isnan(v).any() for v in r["fresh"].values())
        torch.testing.assert_close(r["logits"], cpu(ids).logits, atol=1e-12, rtol=0)
