"""A user's builder (``model.name = "package.module:function"``) is built on `meta` and drawn
keyed by name, as the zoo is, once a check of its meta build proves the keyed resets set
every tensor as the builder does; otherwise an error names the builder, the tensors, the
reason and both fixes. ``model.init = "full"`` builds the whole model with its own values.

The builders are in tests/user_builders.py (imported by name, as a user's would be).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from user_builders import SelfAttention, stack, tied

import hybridpar
from hybridpar.keyed import KeyedInit, keyed
from hybridpar.models.registry import build
from hybridpar.pipeline.parameters.partition import materialize
from hybridpar.train import ConfigError
from hybridpar.train.configs.builder_check import MetaBuildError, build_checked
from hybridpar.train.configs.config import Config, ModelConfig, ParallelConfig, TrainConfig
from hybridpar.train.configs.model_build import build_model
from hybridpar.train.trainer import build_pipe

SEED = 3
FIXES = ("a reset_parameters() that sets every tensor it owns", 'set model.init = "full"')


def _config(builder: str, *, init: str = "keyed", pp: int = 1, **args) -> Config:
    """A config of `builder`, not checked (a worker's view of a resolved config)."""
    return Config(model=ModelConfig(name=f"user_builders:{builder}", args=args, init=init),
                  parallel=ParallelConfig(pp=pp, dp=1, timeout=60),
                  train=TrainConfig(seed=SEED))


def _keyed_reference(builder) -> dict[str, torch.Tensor]:
    """What every layout starts from: the builder's model, keyed (float64, one device)."""
    torch.manual_seed(SEED)
    return keyed(SEED, builder()[0]).state_dict()


@pytest.fixture
def float64():
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(before)


# model.init ---------------------------------------------------------------------------------

def test_model_init_is_keyed_or_full_and_travels_in_config_json():
    with pytest.raises(ConfigError, match=r"model\.init must be one of 'keyed', 'full', "
                                          r"got 'lazy'"):
        Config.from_dict({"model": {"name": "mlp", "init": "lazy"}})
    config = Config.from_dict({"model": {"name": "mlp", "init": "full"}})
    assert config.model.init == "full" and "init" not in config.model.args
    assert Config.from_dict(config.to_dict()).model.init == "full"
    assert Config.from_dict({"model": {"name": "mlp"}}).model.init == "keyed"


def test_multihead_attention_is_drawn_by_its_own_reset_parameters_on_meta():
    torch.manual_seed(0)
    whole = keyed(SEED, nn.Sequential(SelfAttention(8, 2)))      # MHA: _reset_parameters
    with torch.device("meta"):
        part = nn.Sequential(SelfAttention(8, 2))
    materialize(part, "cpu", init_fn=KeyedInit(SEED))
    for name, value in whole.state_dict().items():
        assert torch.equal(part.state_dict()[name], value), name
    assert not torch.equal(whole[0].attn.in_proj_bias, torch.full((24,), float("nan")))


# keyed: built on meta, checked --------------------------------------------------------------

@pytest.mark.parametrize("builder", [stack, tied])
def test_a_builder_whose_resets_set_everything_builds_on_meta_with_the_keyed_values(builder,
                                                                                  float64):
    model, _, init = build_model(_config(builder.__name__))
    assert isinstance(init, KeyedInit) and all(t.is_meta for t in model.state_dict().values())
    materialize(model, "cpu", init_fn=init)
    reference = _keyed_reference(builder)
    for name, value in model.state_dict().items():
        assert torch.equal(value, reference[name]), name


def test_the_zoos_builders_pass_the_check():
    for name in ("gpt", "mlp", "unet"):
        model, _ = build_checked(name, lambda n=name: build(n))
        assert all(t.is_meta for t in model.state_dict().values())


REFUSED = {   # builder -> what its error names: tensors / modules, the reason
    "reads_a_value": ["RuntimeError: Tensor.item() cannot be called on meta tensors",
                      "must not read tensor values"],
    "no_reset": ["'1' (Scale) owns weight but has no reset_parameters()", "Give Scale"],
    "unreset_buffer": ["'1.index' (Positions) is written by no reset", "Give Positions",
                       "uninitialized memory"],
    "zeroed_bias": ["'3.bias' (Linear) is written by the builder after its reset",
                    "last aten.zero_.default", "ends with aten.uniform_.default",
                    "values would be lost"],
    "custom_init": ["'1.0.weight' (Linear)", "'3.weight' (Linear)", "nn.init.trunc_normal_"],
    "from_data": ["'3.weight' (Linear) is on cpu, not meta"],
}


@pytest.mark.parametrize("builder", list(REFUSED))
def test_a_builder_the_keyed_resets_cannot_reproduce_is_refused_with_both_fixes(builder):
    trunc_normal = torch.nn.init._no_grad_trunc_normal_
    with pytest.raises(MetaBuildError) as info:
        build_model(_config(builder))
    message = str(info.value)
    assert f"model 'user_builders:{builder}'" in message
    for part in REFUSED[builder]:
        assert part in message, (part, message)
    assert 'set model.init = "full"' in message
    if builder != "reads_a_value":
        assert FIXES[0] in message
    assert torch.nn.init._no_grad_trunc_normal_ is trunc_normal   # nn.init given back


def test_the_launcher_refuses_it_before_any_worker_starts():
    with pytest.raises(ConfigError, match=r"model\.init = \"full\"") as info:
        Config.from_dict({"model": {"name": "user_builders:zeroed_bias", "init": "keyed"},
                          "data": {"source": "corpus", "seq_len": 8}})
    assert "'3.bias' (Linear)" in str(info.value)


# full: the builder's own values ------------------------------------------------------------

@pytest.mark.parametrize("builder", ["zeroed_bias", "reads_a_value", "stack"])
def test_full_builds_the_whole_model_with_the_builders_own_values(builder):
    config = Config.from_dict({"model": {"name": f"user_builders:{builder}", "init": "full"},
                               "data": {"source": "corpus", "seq_len": 8},
                               "train": {"seed": SEED}})
    torch.manual_seed(SEED)
    model, _, init = build_model(config)
    torch.manual_seed(SEED)
    reference = build(f"user_builders:{builder}")[0].state_dict()
    assert init is None
    for name, value in model.state_dict().items():
        assert not value.is_meta and torch.equal(value, reference[name]), name


def test_full_builds_a_zoo_model_whole_with_no_initializer():
    config = Config.from_dict({"model": {"name": "mlp", "init": "full"}})
    torch.manual_seed(SEED)
    model, _, init = build_model(config)
    torch.manual_seed(SEED)
    reference = build("mlp")[0].state_dict()
    assert init is None
    for name, value in model.state_dict().items():
        assert torch.equal(value, reference[name]), name


# through build_pipe, at pp2 -----------------------------------------------------------------

def _pp2_worker(builder: str):
    torch.set_default_dtype(torch.float64)
    config = _config(builder, pp=2)
    topo = hybridpar.init(pp=2, tp=1, dp=1, timeout=60)
    try:
        pipe = build_pipe(config, topo)
    except MetaBuildError as e:
        return {"error": str(e)}
    return {"initial": pipe.consolidated_state_dict()}


@pytest.fixture(scope="module")
def pp2():
    from spawn_cases import spawn_cases

    return spawn_cases(_pp2_worker, 2, {b: (b,) for b in ("stack", "no_reset")}, timeout=120)


def test_at_pp2_every_rank_starts_from_the_keyed_values_of_the_one_device_model(pp2, float64):
    reference = _keyed_reference(stack)
    for rank in pp2["stack"]:
        assert list(rank["initial"]) == list(reference)
        for name, value in reference.items():
            assert torch.equal(rank["initial"][name], value), name    # bit for bit


def test_at_pp2_every_rank_refuses_a_builder_it_cannot_reproduce(pp2):
    assert len(pp2["no_reset"]) == 2
    for rank in pp2["no_reset"]:
        assert "'1' (Scale) owns weight but has no reset_parameters()" in rank["error"]
        assert FIXES[0] in rank["error"] and FIXES[1] in rank["error"]
