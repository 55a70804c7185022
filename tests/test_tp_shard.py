"""hybridpar.shard: strategies give the one-device numbers, and every rule that refuses one says so.

One spawned worker per tp size (2, 4) runs every case on plain float64 modules (outputs, input
and parameter gradients, dropout masks) and collects the error messages; a config whose
[parallel.tp_plan] holds strategies is loaded and trained in a HybridPipe (pp=2 x tp=2) against
the plain single-device run.
"""

import copy
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hybridpar
from hybridpar.models import mlp as mlp_model
from hybridpar.nn import ParallelDropout, ParallelEmbedding, ParallelLinear
from hybridpar.sharded.attrs import get_parallel_dim
from hybridpar.tensor_parallel.plans.plan import apply_tp_plan, plan_decisions
from hybridpar.tensor_parallel.state import gather_full
from hybridpar.train import ConfigError, load_config

from pipe_harness import data

F64 = torch.float64
ROOT = Path(__file__).resolve().parents[1]


# models and cases -----------------------------------------------------------------------------

class Block(nn.Module):
    """fc1 -> F.gelu (functional: drops the tag) -> dropout -> fc2, with a residual."""

    def __init__(self, width=8, hidden=16, p=0.25):
        super().__init__()
        self.fc1 = nn.Linear(width, hidden)
        self.drop = nn.Dropout(p)
        self.fc2 = nn.Linear(hidden, width)

    def forward(self, x):
        return x + self.fc2(self.drop(F.gelu(self.fc1(x))))


def _seq(*layers):
    return nn.Sequential(*layers)


def col(layer, tp):
    """A column-parallel layer's strategies: its weight split by output, its bias with it."""
    prefix = f"{layer}." if layer else ""
    return {f"{prefix}weight": (tp, 1), f"{prefix}bias": (tp,)}


# name: tp -> (module built under seed 0, parameter_plan, in_strategy, input shape or "ids")
CASES = {
    "column": lambda tp: (_seq(nn.Linear(8, 16)), col("0", tp), None, (6, 8)),
    "row": lambda tp: (_seq(nn.Linear(16, 8)), {"0.weight": (1, tp)}, None, (6, 16)),
    "column_row_mlp": lambda tp: (
        _seq(nn.Linear(8, 16), nn.GELU(), nn.Dropout(0.25), nn.Linear(16, 8)),
        {**col("0", tp), "3.weight": (1, tp), "3.bias": (1,)}, None, (6, 8)),
    "block_functional_gelu": lambda tp: (
        _seq(Block(), nn.LayerNorm(8), nn.Linear(8, 4)),
        {**col("0.fc1", tp), **col("2", tp), "0.fc2.weight": (1, tp)}, None, (6, 8)),
    "column_layernorm_row": lambda tp: (
        _seq(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 8)),
        {**col("0", tp), "2.weight": (1, tp)}, None, (6, 8)),
    "across_sequentials": lambda tp: (
        _seq(_seq(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 16)), _seq(nn.ReLU(), nn.Linear(16, 8))),
        {**col("0.2", tp), "1.1.weight": (1, tp)}, None, (6, 8)),
    "hybridpar_nn_mlp": lambda tp: (
        mlp_model(in_features=8, hidden=16, out_features=4, n_layer=2, dropout=0.25),
        {**col("0.fc1", tp), **col("1.fc1", tp), **col("2", tp),
         "0.fc2.weight": (1, tp), "1.fc2.weight": (1, tp)}, None, (6, 8)),
    "replicate": lambda tp: (
        _seq(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4)),
        {"0.weight": (1, 1), "0.bias": (1,), "1.weight": (1,), "2.weight": (1, 1)}, None, (6, 8)),
    "embedding_vocab": lambda tp: (
        _seq(nn.Embedding(12, 8, padding_idx=1), nn.Linear(8, 4)),
        {"0.weight": (tp, 1), **col("1", tp)}, None, "ids"),
    "embedding_feature": lambda tp: (
        _seq(nn.Embedding(12, 8), nn.Linear(8, 4)), {"0.weight": (1, tp)}, None, "ids"),
    "input_sharded_into_row": lambda tp: (
        _seq(nn.Linear(16, 8), nn.Tanh()), {"0.weight": (1, tp)}, ((1, tp),), (6, 16)),
    "input_sharded_gathered": lambda tp: (
        _seq(nn.LayerNorm(16), nn.Linear(16, 8)), col("1", tp), ((1, tp),), (6, 16)),
    "input_batch_split_3d": lambda tp: (
        _seq(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8)),
        {**col("0", tp), "2.weight": (1, tp)}, ((tp, 1, 1),), (4, 3, 8)),
    "the_module_is_a_linear": lambda tp: (nn.Linear(8, 16), col("", tp), None, (6, 8)),
}


def _mixed_plan(tp):
    """A tp_plan dict with styles for layer names and strategies for parameter names."""
    return (_seq(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8), nn.Linear(8, 4)),
            {"0": "column", "2": "row", "3.weight": (tp, 1), "3.bias": (tp,)}, None, (6, 8))


def _run_case(name, tp, group):
    build, via_plan = (_mixed_plan, True) if name == "tp_plan_styles_and_strategies" else \
        (CASES[name], False)
    torch.manual_seed(0)
    ref, plan, ins, shape = build(tp)
    ref = ref.to(F64)
    if via_plan:
        model = apply_tp_plan(copy.deepcopy(ref), plan, group=group)
    else:
        model = hybridpar.shard(copy.deepcopy(ref), parameter_plan=plan, in_strategy=ins,
                                group=group)
    g = torch.Generator().manual_seed(3)
    split = next((d for d, s in enumerate(ins[0]) if s > 1), None) if ins else None
    if shape == "ids":
        x_ref = x_tp = torch.randint(0, 12, (3, 5), generator=g)
    else:
        x = torch.randn(shape, generator=g, dtype=F64)
        x_ref = x.clone().requires_grad_()
        local = x if split is None else x.tensor_split(tp, dim=split)[group.rank()]
        x_tp = local.clone().requires_grad_()
    torch.manual_seed(7)
    out_ref = ref(x_ref)
    torch.manual_seed(7)
    out = model(x_tp)
    w = torch.randn(out_ref.shape, generator=g, dtype=F64)
    (out_ref * w).sum().backward()
    (out * w).sum().backward()
    errors = {"out": (out - out_ref).abs().max().item()}
    if shape != "ids":
        want = x_ref.grad if split is None else \
            x_ref.grad.tensor_split(tp, dim=split)[group.rank()]
        errors["input grad"] = (x_tp.grad - want).abs().max().item()
    params = dict(model.named_parameters())
    for key, p in ref.named_parameters():
        full = gather_full(params[key].grad, params[key], group)
        errors[key] = (full - p.grad).abs().max().item()
    return {"errors": errors, "tagged": get_parallel_dim(out),
            "decisions": plan_decisions(model), "same_keys": list(model.state_dict()) ==
            list(ref.state_dict()),
            "types": {k: type(m).__name__ for k, m in model.named_modules()}}


# the error rules ------------------------------------------------------------------------------

def _tied():
    model = _seq(nn.Embedding(8, 8), nn.Linear(8, 8, bias=False))
    model[1].weight = model[0].weight
    return model


# name: tp -> (module, parameter_plan, in_strategy); `ERRORS` holds what the message must say
ERROR_CASES = {
    "slices_not_1_or_tp": lambda tp: (_seq(nn.Linear(8, 12)), {"0.weight": (3, 1)}, None),
    "two_dimensions_split": lambda tp: (_seq(nn.Linear(8, 16)), {"0.weight": (tp, tp)}, None),
    "not_divisible": lambda tp: (_seq(nn.Linear(8, 9)), {"0.weight": (tp, 1)}, None),
    "unknown_parameter": lambda tp: (_seq(nn.Linear(8, 16)), {"0.wieght": (tp, 1)}, None),
    "entries_per_dimension": lambda tp: (_seq(nn.Linear(8, 16)), {"0.weight": (tp,)}, None),
    "not_a_strategy": lambda tp: (_seq(nn.Linear(8, 16)), {"0.weight": "column"}, None),
    "not_a_linear_or_embedding": lambda tp: (_seq(nn.LayerNorm(8)), {"0.weight": (tp,)}, None),
    "bias_follows_column_weight": lambda tp: (
        _seq(nn.Linear(8, 16)), {"0.weight": (tp, 1), "0.bias": (1,)}, None),
    "bias_without_its_weight": lambda tp: (_seq(nn.Linear(8, 16)), {"0.bias": (tp,)}, None),
    "tied_weight": lambda tp: (_tied(), {"1.weight": (tp, 1)}, None),
    "feature_split_with_max_norm": lambda tp: (
        _seq(nn.Embedding(8, 8, max_norm=1.0)), {"0.weight": (1, tp)}, None),
    "bad_in_strategy": lambda tp: (_seq(nn.Linear(8, 16)), {}, ((1, 3),)),
    "in_strategy_not_wrapped": lambda tp: (_seq(nn.Linear(8, 16)), {}, (1, tp)),
}

ERRORS = {  # the parameter (or input) named, and the rule
    "slices_not_1_or_tp": ("parameter '0.weight' strategy (3, 1)", "must be 1 (whole) or the tp "
                           "size {tp}"),
    "two_dimensions_split": ("parameter '0.weight' strategy ({tp}, {tp})",
                             "splits dimensions 0 and 1, but at most one dimension"),
    "not_divisible": ("parameter '0.weight' strategy ({tp}, 1)",
                      "dimension 0 of size 9 is not divisible into {tp} slices"),
    "unknown_parameter": ("parameter '0.wieght'", "names no parameter of the module; did you "
                          "mean ['0.weight'"),
    "entries_per_dimension": ("parameter '0.weight' strategy ({tp},)",
                              "has 1 entry but the parameter has 2 dimensions"),
    "not_a_strategy": ("parameter '0.weight'", "a strategy is a non-empty tuple of integers"),
    "not_a_linear_or_embedding": ("parameter '0.weight' strategy ({tp},)",
                                  "only the weight and bias of nn.Linear and the weight of "
                                  "nn.Embedding can be split, and it belongs to LayerNorm"),
    "bias_follows_column_weight": ("parameter '0.bias' strategy (1,)",
                                   "a bias follows its weight, and '0.weight' ({tp}, 1) is "
                                   "column-parallel"),
    "bias_without_its_weight": ("parameter '0.bias' strategy ({tp},)",
                                "a bias follows its weight, and '0.weight' (1, 1) is "
                                "replicated; give (1,)"),
    "tied_weight": ("parameter '1.weight'", "its layer cannot be split: its weight is tied"),
    "feature_split_with_max_norm": ("parameter '0.weight' strategy (1, {tp})", "max_norm"),
    "bad_in_strategy": ("in_strategy[0] (1, 3)", "must be 1 (whole) or the tp size {tp}"),
    "in_strategy_not_wrapped": ("in_strategy holds one strategy per input, got (1, {tp})",
                                "for a single input write ((1, {tp}),)"),
    "nested_shard": ("parameters ['1.0.weight'", "nested shard is not supported"),
    "already_parallel_layer": ("parameter '0.weight'", "its layer is already split over tp"),
    "style_and_strategy": ("layer '0'", "has the style 'column' and the strategies "
                           "0.weight ({tp}, 1); give one or the other"),
    "inputs_at_call": ("in_strategy has 2 entries", "called with 1 positional input;"),
}


def _message(fn):
    try:
        fn()
    except ValueError as e:
        return str(e)
    return "no error"


def _errors(tp, group):
    out = {}
    for key, build in ERROR_CASES.items():
        module, plan, ins = build(tp)
        out[key] = _message(lambda m=module, p=plan, i=ins: hybridpar.shard(
            m, parameter_plan=p, in_strategy=i, group=group))
    inner = _seq(nn.Linear(8, 8))
    hybridpar.shard(inner, parameter_plan={"0.weight": (1, tp)}, group=group)
    out["nested_shard"] = _message(lambda: hybridpar.shard(
        _seq(nn.Linear(8, 8), inner), parameter_plan={"1.0.weight": (1, 1)}, group=group))
    out["already_parallel_layer"] = _message(lambda: hybridpar.shard(
        _seq(ParallelLinear(8, 16, dim=-1, group=group)), parameter_plan={"0.weight": (1, 1)},
        group=group))
    out["style_and_strategy"] = _message(lambda: apply_tp_plan(
        _seq(nn.Linear(8, 16)), {"0": "column", "0.weight": (tp, 1)}, group=group))
    two = hybridpar.shard(_seq(nn.Linear(8, 16)), in_strategy=((1, tp), None), group=group)
    out["inputs_at_call"] = _message(lambda: two(torch.randn(2, 8)))
    return out


def _meta(tp, group):
    """Built on meta, sharded, materialized under the seed: the plain module's values."""
    def build():
        return _seq(nn.Embedding(12, 8), nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))

    with torch.device("meta"):
        model = hybridpar.shard(build(), parameter_plan={
            "0.weight": (tp, 1), **col("1", tp), "3.weight": (1, tp)}, group=group)
    still_meta = all(p.is_meta for p in model.parameters())
    torch.manual_seed(0)
    model.to_empty(device="cpu")
    for m in model.modules():
        if hasattr(m, "reset_parameters"):
            m.reset_parameters()
    torch.manual_seed(0)
    plain = build()
    params = dict(model.named_parameters())
    error = max((gather_full(params[k].detach(), params[k], group) - v).abs().max().item()
                for k, v in plain.named_parameters())
    return {"still_meta": still_meta, "error": error}


def _direct_worker(tp):
    topo = hybridpar.init(tp=tp, timeout=60)
    names = [*CASES, "tp_plan_styles_and_strategies"]
    return {"cases": {n: _run_case(n, tp, topo.tp_group) for n in names},
            "errors": _errors(tp, topo.tp_group), "meta": _meta(tp, topo.tp_group)}


@pytest.fixture(scope="module", params=[2, 4])
def direct(request):
    return request.param, hybridpar.spawn(_direct_worker, request.param,
                                          args=(request.param,), timeout=120)


@pytest.mark.parametrize("case", [*CASES, "tp_plan_styles_and_strategies"])
def test_strategies_match_the_unsharded_module(direct, case):
    tp, results = direct
    for rank, r in enumerate(results):
        c = r["cases"][case]
        assert c["same_keys"] and c["tagged"] is None   # full, untagged outputs
        for what, err in c["errors"].items():
            assert err < 1e-10, f"tp={tp} rank {rank} {case}: {what} differs by {err}"


def test_layers_become_hybridpar_nn_layers_and_shards_flow_between_them(direct):
    tp, results = direct
    cases = results[0]["cases"]
    mlp = cases["column_row_mlp"]
    assert [mlp["types"][k] for k in "0123"] == [ParallelLinear.__name__, "GELU",
                                                 ParallelDropout.__name__, ParallelLinear.__name__]
    assert mlp["decisions"] == [
        f"0 (Linear 8->16): column <- 0.weight ({tp}, 1), 0.bias ({tp},)",
        f"3 (Linear 16->8): row <- 3.weight (1, {tp}), 3.bias (1,)",
        "0 -> 3: the shard flows on, re-tagged by 1, 2"]
    assert "0 -> 3" not in " ".join(cases["column_layernorm_row"]["decisions"])
    assert "0: output all-gathered (no row layer follows)" in \
        cases["column_layernorm_row"]["decisions"]
    assert "0.2 -> 1.1: the shard flows on, re-tagged by 1.0" in \
        cases["across_sequentials"]["decisions"]
    assert "0.fc1 -> 0.fc2: the shard flows on, re-tagged by 0.tag, 0.drop" in \
        cases["hybridpar_nn_mlp"]["decisions"]
    assert cases["block_functional_gelu"]["types"]["0.drop"] == ParallelDropout.__name__
    assert [cases["replicate"]["types"][k] for k in "012"] == ["Linear", "LayerNorm", "Linear"]
    assert cases["embedding_vocab"]["types"]["0"] == ParallelEmbedding.__name__
    assert f"0 (Embedding 12x8): vocab <- 0.weight ({tp}, 1)" in \
        cases["embedding_vocab"]["decisions"]
    assert f"0 (Embedding 12x8): feature <- 0.weight (1, {tp})" in \
        cases["embedding_feature"]["decisions"]
    assert cases["the_module_is_a_linear"]["types"][""] == ParallelLinear.__name__


def test_a_module_built_on_meta_is_sharded_without_values_and_initialized_as_the_plain_one(
        direct):
    _, results = direct
    for r in results:
        assert r["meta"]["still_meta"] and r["meta"]["error"] == 0


def test_in_strategy_keeps_a_shard_for_a_row_layer_and_gathers_otherwise(direct):
    tp, results = direct
    cases = results[0]["cases"]
    assert f"input 0 (1, {tp}): kept as a shard for the row layer it starts with" in \
        cases["input_sharded_into_row"]["decisions"]
    assert f"input 0 (1, {tp}): all-gathered along dim 1" in \
        cases["input_sharded_gathered"]["decisions"]
    assert f"input 0 ({tp}, 1, 1): all-gathered along dim 0" in \
        cases["input_batch_split_3d"]["decisions"]


def test_tp_plan_dispatches_strategies_to_shard(direct):
    tp, results = direct
    decisions = results[0]["cases"]["tp_plan_styles_and_strategies"]["decisions"]
    assert decisions[:3] == ["0 (Linear 8->16): column", "2 (Linear 16->8): row",
                             f"3 (Linear 8->4): column <- 3.weight ({tp}, 1), 3.bias ({tp},)"]
    assert "3: output all-gathered (no row layer follows)" in decisions


@pytest.mark.parametrize("key", list(ERRORS))
def test_every_rule_names_the_parameter_and_the_rule(direct, key):
    tp, results = direct
    message = results[0]["errors"][key]
    where, rule = (s.format(tp=tp) for s in ERRORS[key])
    assert where in message and rule in message, message


# the config's tp_plan and HybridPipe ----------------------------------------------------------

CONFIG = """\
[model]
name = "mlp"
in_features = 8
hidden = 16
out_features = 4
n_layer = 2

[parallel]
pp = 2
tp = 2
chunks = 2

[parallel.tp_plan]
"0.fc1.weight" = [2, 1]     # column: output features split
"0.fc1.bias" = [2]
"0.fc2.weight" = [1, 2]     # row: input features split
"1.fc1.weight" = [2, 1]
"1.fc1.bias" = [2]
"1.fc2.weight" = [1, 2]
"2.weight" = [1, 1]         # the classifier stays whole
"""
STEPS, BATCH = 3, 8


@pytest.fixture
def config_path(tmp_path):
    path = tmp_path / "shard.toml"
    path.write_text(CONFIG)
    return path


def test_config_tp_plan_holds_strategies_and_styles(config_path):
    plan = load_config(config_path).parallel.tp_plan
    assert plan["0.fc1.weight"] == [2, 1] and plan["0.fc1.bias"] == [2]
    mixed = load_config(config_path, ['parallel.tp_plan={"*.fc" = "column", "2.weight" = [2, 1]}'])
    assert mixed.parallel.tp_plan == {"*.fc": "column", "2.weight": [2, 1]}


@pytest.mark.parametrize("override, expected", [
    ('parallel.tp_plan={"0.fc1.weight" = [4, 1]}',
     "parallel.tp_plan['0.fc1.weight'] = [4, 1]: slices must be 1 (whole) or the tp size 2"),
    ('parallel.tp_plan={"0.fc1.weight" = [2, 2]}', "at most one dimension of a tensor"),
    ('parallel.tp_plan={"0.fc1.weight" = []}', "a strategy is a non-empty tuple of integers"),
    ('parallel.tp_plan={"0.fc1.weight" = [true, 1]}', "parallel.tp_plan must be a table of"),
])
def test_config_strategies_are_checked_before_launch(config_path, override, expected):
    with pytest.raises(ConfigError) as e:
        load_config(config_path, [override])
    assert expected in str(e.value)


def _config_pipe_worker(path):
    from hybridpar.train.trainer import build_pipe

    config = load_config(path)
    par = config.parallel
    topo = hybridpar.init(pp=par.pp, tp=par.tp, timeout=60)
    pipe = build_pipe(config, topo)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    losses = []
    for x, y in zip(*data(STEPS, BATCH, classes=4)):
        opt.zero_grad()
        losses.append(pipe.train_step(x, y).item())
        opt.step()
    return {"losses": losses, "state": pipe.consolidated_state_dict(),
            "decisions": pipe.tp_plan_decisions}


def test_hybridpipe_built_from_the_config_matches_one_device(config_path):
    config = load_config(config_path)
    torch.manual_seed(config.train.seed)
    model = mlp_model(**config.model.args)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_losses = []
    for x, y in zip(*data(STEPS, BATCH, classes=4)):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        ref_losses.append(loss.item())
    results = hybridpar.spawn(_config_pipe_worker, 4, args=(str(config_path),), timeout=120)
    for r in results:
        assert r["losses"] == pytest.approx(ref_losses, abs=1e-5)
        assert list(r["state"]) == list(model.state_dict())
        for k, v in model.state_dict().items():
            torch.testing.assert_close(r["state"][k], v, atol=1e-5, rtol=0)
    assert "0.fc1 (Linear 8->16): column <- 0.fc1.weight (2, 1), 0.fc1.bias (2,)" in \
        results[0]["decisions"]


def test_example_runs_on_two_ranks_and_matches_the_plain_module():
    out = subprocess.run([sys.executable, "examples/shard_strategy.py"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120, check=True).stdout
    assert "outputs and gradients equal the plain module's: True" in out, out
