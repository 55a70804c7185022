"""tp_plan's TPDense styles (dense_gather / dense_scatter, sync and async ring) match one device.

A plain module sharded by a dense plan gives the plain module's outputs, input and parameter
gradients and dropout masks (float64, tp=2 and 4). Inside `HybridPipe` (pp=2 x tp=2, a stage
boundary inside a dense link) 3 SGD steps give the single-device losses, every parameter of
`consolidated_state_dict` and the outputs (fp32, 1e-5) under gpipe and 1f1b. The TPDense
shards go through `collect_state_dict` / `relocate_state_dict`, and through a DCP checkpoint
saved at tp=2 and loaded at tp=1 (full tensors) and at tp=2 (the same shards).
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hybridpar
from hybridpar.nn import ParallelDropout, ParallelLinear, TPDense
from hybridpar.sharded.attrs import get_parallel_dim
from hybridpar.tensor_parallel.plans.plan import apply_tp_plan, plan_decisions
from hybridpar.tensor_parallel.state import collect_state_dict, gather_full, relocate_state_dict
from hybridpar.train.checkpoints.checkpoint import load_checkpoint, save_checkpoint
from hybridpar.train.checkpoints.shards import ShardChunk, model_entries, optimizer_entries

from pipe_harness import checked_step, data, reference

F64 = torch.float64


def dense_mlp(seed=0, p=0.0):
    """Flat, for balance: gather -> GELU -> Dropout -> scatter, Tanh, gather -> ReLU ->
    scatter, then a last gather whose output is all-gathered (no layer reads its shard)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Dropout(p), nn.Linear(16, 8),
                         nn.Tanh(), nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8),
                         nn.Linear(8, 4))


PLAN = {"0": "dense_gather", "3": "dense_scatter_async", "5": "dense_gather_async",
        "7": "dense_scatter", "8": "dense_gather"}
MIXED = {"0": "column", "3": "dense_scatter", "5": "dense_gather", "7": "row"}  # feeds both ways
ALONE = {"5": "dense_scatter"}             # a full input sliced, its output gathered
NESTED = {"*.fc1": "dense_gather", "*.fc2": "dense_scatter_async"}


def nested(seed=0, p=0.0):
    """Blocks as nested nn.Sequential (fc1, act, drop, fc2) and a LayerNorm between them."""
    torch.manual_seed(seed)
    block = lambda: nn.Sequential(  # noqa: E731
        *[nn.Linear(8, 16), nn.GELU(), nn.Dropout(p), nn.Linear(16, 8)])
    model = nn.Sequential(block(), nn.LayerNorm(8), block())
    for b in (model[0], model[2]):
        for old, new in (("0", "fc1"), ("1", "act"), ("2", "drop"), ("3", "fc2")):
            b.add_module(new, b._modules.pop(old))
    return model


CASES = {
    # name: (builder, plan)
    "every_style": (lambda: dense_mlp(p=0.3), PLAN),
    "mixed_with_column_and_row": (lambda: dense_mlp(p=0.3), MIXED),
    "alone": (lambda: dense_mlp(), ALONE),
    "nested_blocks": (lambda: nested(p=0.3), NESTED),
}


# plain modules ------------------------------------------------------------------------------

def _run_case(name, group):
    build, plan = CASES[name]
    ref = build().to(F64)
    model = apply_tp_plan(copy.deepcopy(ref), plan, group=group)
    assert list(model.state_dict()) == list(ref.state_dict())
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(3), dtype=F64)
    x_ref, x_tp = x.clone().requires_grad_(), x.clone().requires_grad_()
    torch.manual_seed(7)
    out_ref = ref(x_ref)
    torch.manual_seed(7)
    out = model(x_tp)
    w = torch.randn(out_ref.shape, generator=torch.Generator().manual_seed(4), dtype=F64)
    (out_ref * w).sum().backward()
    (out * w).sum().backward()
    errors = {"out": (out - out_ref).abs().max().item(),
              "input grad": (x_tp.grad - x_ref.grad).abs().max().item()}
    params = dict(model.named_parameters())
    for key, p in ref.named_parameters():
        full = gather_full(params[key].grad, params[key], group)
        errors[key] = (full - p.grad).abs().max().item()
    return {"errors": errors, "tagged": get_parallel_dim(out), "decisions": plan_decisions(model),
            "types": {k: type(m).__name__ for k, m in model.named_modules() if k}}


def _state_dicts(group):
    """collect_state_dict gives the plain module's tensors; relocate_state_dict the shards."""
    ref = dense_mlp()
    model = apply_tp_plan(copy.deepcopy(ref), PLAN, group=group)
    full = collect_state_dict(model, model.state_dict())
    collected = max((full[k] - v).abs().max().item() for k, v in ref.state_dict().items())
    other = apply_tp_plan(dense_mlp(seed=1), PLAN, group=group)
    other.load_state_dict(relocate_state_dict(other, ref.state_dict()))
    mine = model.state_dict()
    relocated = max((v - mine[k]).abs().max().item() for k, v in other.state_dict().items())
    return {"collected": collected, "relocated": relocated}


def _errors(group):
    messages = {}
    tied = nn.Sequential(nn.Embedding(8, 8), nn.Linear(8, 8, bias=False))
    tied[1].weight = tied[0].weight
    cases = {
        "odd_in": (nn.Sequential(nn.Linear(9, 8)), {"0": "dense_gather"}),
        "odd_out": (nn.Sequential(nn.Linear(8, 9)), {"0": "dense_scatter"}),
        "not_linear": (nn.Sequential(nn.Linear(8, 8), nn.ReLU()), {"1": "dense_gather"}),
        "tied": (tied, {"1": "dense_gather"}),
        "strategy_too": (nn.Sequential(nn.Linear(8, 8)),
                         {"0": "dense_gather", "0.weight": (1, 1)}),
    }
    for key, (model, plan) in cases.items():
        try:
            apply_tp_plan(model, plan, group=group)
            messages[key] = "no error"
        except ValueError as e:
            messages[key] = str(e)
    return messages


def _from_module(group):
    with torch.device("meta"):
        meta = nn.Linear(8, 8)
    torch.manual_seed(0)
    plain = nn.Linear(8, 4)
    plain.bias.requires_grad_(False)
    dense = TPDense.from_module(plain.eval(), mode="scatter", group=group)
    weight = gather_full(dense.weight.detach(), dense.weight, group)
    return {"meta": TPDense.from_module(meta, mode="gather", group=group).weight.is_meta,
            "values": (weight - plain.weight).abs().max().item(),
            "frozen_bias": not dense.bias.requires_grad, "eval": not dense.training}


def _direct_worker(tp):
    topo = hybridpar.init(tp=tp, timeout=60)
    results = {name: _run_case(name, topo.tp_group) for name in CASES}
    results["from_module"] = _from_module(topo.tp_group)
    results["state"] = _state_dicts(topo.tp_group)
    results["errors"] = _errors(topo.tp_group)
    return results


@pytest.fixture(scope="module", params=[2, 4])
def direct(request):
    return request.param, hybridpar.spawn(_direct_worker, request.param,
                                          args=(request.param,), timeout=120)


@pytest.mark.parametrize("case", list(CASES))
def test_dense_plans_match_one_device(direct, case):
    tp, results = direct
    for rank, r in enumerate(results):
        assert r[case]["tagged"] is None, "the output must be full (all-gathered)"
        for what, err in r[case]["errors"].items():
            assert err < 1e-12, f"tp={tp} rank {rank} {case}: {what} differs by {err}"


def test_dense_styles_build_tpdense_layers_linked_through_elementwise_modules(direct):
    _, results = direct
    r = results[0]["every_style"]
    types = r["types"]
    assert all(types[k] == "TPDense" for k in PLAN)
    assert types["2"] == ParallelDropout.__name__ and types["1"] == "GELU"
    assert r["decisions"][:2] == [
        "0 (Linear 8->16): dense_gather - keeps this rank's slice of a full input; its shard "
        "flows into 3 through 1, 2",
        "3 (Linear 16->8): dense_scatter_async - reads the shard of 0; its shard flows into 5 "
        "through 4"]
    assert r["decisions"][4] == ("8 (Linear 8->4): dense_gather - reads the shard of 7; output "
                                 "all-gathered (no TPDense or row layer reads its shard)")
    mixed = results[0]["mixed_with_column_and_row"]
    assert mixed["types"]["0"] == mixed["types"]["7"] == ParallelLinear.__name__
    assert "3 (Linear 16->8): dense_scatter - reads the shard of 0; its shard flows into 5 " \
           "through 4" in mixed["decisions"]
    assert "5 (Linear 8->16): dense_gather - reads the shard of 3; its shard flows into 7 " \
           "through 6" in mixed["decisions"]
    alone = results[0]["alone"]["decisions"]
    assert "5 (Linear 8->16): dense_scatter - keeps this rank's slice of a full input; output " \
           "all-gathered (no TPDense or row layer reads its shard)" in alone
    blocks = results[0]["nested_blocks"]["decisions"]
    assert "0.fc2 (Linear 16->8): dense_scatter_async - reads the shard of 0.fc1; output " \
           "all-gathered (no TPDense or row layer reads its shard)" in blocks


def test_dense_shards_collect_and_relocate_as_the_plain_state_dict(direct):
    _, results = direct
    for r in results:
        assert r["state"] == {"collected": 0.0, "relocated": 0.0}


def test_dense_style_errors_name_the_layer(direct):
    tp, results = direct
    m = results[0]["errors"]
    assert m["odd_in"].startswith(f"layer '0': in_features 9 is not divisible by tp={tp}")
    assert m["odd_out"].startswith(f"layer '0': out_features 9 is not divisible by tp={tp}")
    assert "'dense_gather' applies to nn.Linear only, but '1' matched '1' (ReLU)" in \
        m["not_linear"]
    assert m["tied"].startswith("tp_plan: layer '1' cannot be made 'dense_gather': its weight "
                                "is tied")
    assert "has the style 'dense_gather' and the strategies" in m["strategy_too"]


def test_tpdense_from_module_keeps_meta_requires_grad_and_mode(direct):
    _, results = direct
    assert all(r["from_module"] == {"meta": True, "values": 0.0, "frozen_bias": True,
                                    "eval": True} for r in results)


# HybridPipe ---------------------------------------------------------------------------------

def _pipe_worker(schedule, chunks, p, balance, plan, steps, batch):
    topo = hybridpar.init(pp=2, tp=2, timeout=60)
    pipe = hybridpar.HybridPipe(dense_mlp(p=p), balance, topology=topo, chunks=chunks,
                                schedule=schedule, loss_fn=F.cross_entropy, tp_plan=plan)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    xs, ys = data(steps, batch, classes=4)
    losses = []
    for x, y in zip(xs, ys):
        opt.zero_grad()
        losses.append(checked_step(pipe, x, y))
        opt.step()
    pipe.eval()
    return {"losses": losses, "state": pipe.consolidated_state_dict(),
            "out": pipe(xs[0]).detach(), "decisions": pipe.tp_plan_decisions,
            "types": sorted({type(m).__name__ for m in pipe.modules()})}


@pytest.mark.parametrize("schedule,chunks,p,balance,plan", [
    ("gpipe", 2, 0.0, [2, 7], PLAN),    # the boundary carries 0's shard (after GELU)
    ("1f1b", 2, 0.0, [2, 7], PLAN),
    ("1f1b", 1, 0.25, [4, 5], PLAN),    # one micro-batch: the one-device dropout masks
    ("gpipe", 2, 0.0, [5, 4], MIXED),   # column -> TPDense -> TPDense -> row
])
def test_pipe_with_dense_styles_matches_one_device(schedule, chunks, p, balance, plan):
    steps, batch = 3, 8
    xs, ys = data(steps, batch, classes=4)
    ref_losses, ref_state = reference(dense_mlp(p=p), xs, ys)
    with torch.no_grad():
        model = dense_mlp(p=p)
        model.load_state_dict(ref_state)
        ref_out = model.eval()(xs[0])
    results = hybridpar.spawn(_pipe_worker, 4, args=(schedule, chunks, p, balance, plan, steps,
                                                     batch), timeout=120)
    for r in results:
        assert "TPDense" in r["types"]
        assert r["losses"] == pytest.approx(ref_losses, abs=1e-5)
        assert list(r["state"]) == list(ref_state)
        for k, v in ref_state.items():
            torch.testing.assert_close(r["state"][k], v, atol=1e-5, rtol=0)
        torch.testing.assert_close(r["out"], ref_out, atol=1e-5, rtol=0)


# DCP checkpoints ----------------------------------------------------------------------------

def _checkpoint_worker(root):
    topo = hybridpar.init(pp=2, tp=2, timeout=60)
    pipe = hybridpar.HybridPipe(dense_mlp(), [4, 5], topology=topo, loss_fn=F.cross_entropy,
                                tp_plan=PLAN)
    opt = torch.optim.AdamW(pipe.parameters(), lr=0.01)
    xs, ys = data(1, 8, classes=4)
    pipe.train_step(xs[0], ys[0])
    opt.step()
    state = {**model_entries(pipe, topo.tp_group), **optimizer_entries(pipe, opt, topo.tp_group)}
    chunks = sorted(k for k, v in state.items() if isinstance(v, ShardChunk))
    save_checkpoint(root, 1, state, keep=1)
    saved = pipe.consolidated_state_dict()
    out = {"chunks": chunks}
    # the same layout, another seed: every local shard and optimizer state comes back
    again = hybridpar.HybridPipe(dense_mlp(seed=5), [4, 5], topology=topo,
                                 loss_fn=F.cross_entropy, tp_plan=PLAN)
    opt2 = torch.optim.AdamW(again.parameters(), lr=0.01)
    state2 = {**model_entries(again, topo.tp_group),
              **optimizer_entries(again, opt2, topo.tp_group)}
    load_checkpoint(f"{root}/step-1", state2)
    mine = dict(pipe.named_parameters())
    out["same_layout"] = max((p - mine[k]).abs().max().item()
                             for k, p in again.named_parameters())
    moments = [(opt.state[mine[k]]["exp_avg"], opt2.state[p]["exp_avg"])
               for k, p in again.named_parameters()]
    out["same_layout_exp_avg"] = max((a - b).abs().max().item() for a, b in moments)
    # tp=1 (dp=2), no plan: the full tensors
    one = hybridpar.init(pp=2, tp=1, dp=2, timeout=60)
    plain = hybridpar.HybridPipe(dense_mlp(seed=6), [4, 5], topology=one,
                                 loss_fn=F.cross_entropy)
    load_checkpoint(f"{root}/step-1", model_entries(plain, None))
    full = plain.consolidated_state_dict()
    out["tp1"] = max((full[k] - v).abs().max().item() for k, v in saved.items())
    return out


def test_dense_shards_in_a_checkpoint_load_under_another_tp(tmp_path):
    results = hybridpar.spawn(_checkpoint_worker, 4, args=(str(tmp_path / "ckpt"),),
                              timeout=120)
    stage0 = ["model/0.bias", "model/0.weight", "model/3.bias", "model/3.weight"]
    assert [k for k in results[0]["chunks"] if k.startswith("model/")] == stage0
    assert any(k.startswith("optim/0.weight/") for k in results[0]["chunks"])
    for r in results:
        assert r["same_layout"] == 0.0 and r["same_layout_exp_avg"] == 0.0
        assert r["tp1"] == 0.0
