"""apply_tp_plan: dict and "auto" plans give the one-device numbers, alone and in HybridPipe.

One spawned worker per tp size checks every plan on plain modules (float64, outputs, input
and parameter gradients, dropout masks) and the errors that need a tp group; the HybridPipe
workers train 3 SGD steps with a tp_plan and must match the plain single-device run.
"""

import copy
import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hybridpar
from hybridpar.sharded.attrs import get_parallel_dim
from hybridpar.sharded.mappings import gather_from_group
from hybridpar.tensor_parallel.layers import ParallelEmbedding, ParallelLinear
from hybridpar.tensor_parallel.loss import ParallelCrossEntropyLoss
from hybridpar.tensor_parallel.plans.plan import apply_tp_plan, plan_decisions
from hybridpar.tensor_parallel.random import ParallelDropout
from hybridpar.tensor_parallel.state import gather_full

from pipe_harness import checked_step, data, reference

F64 = torch.float64


# models -------------------------------------------------------------------------------------

class Block(nn.Module):
    """fc1 -> activation -> dropout -> fc2 with a residual; `functional` calls F.gelu."""

    def __init__(self, width=8, hidden=16, p=0.0, functional=False):
        super().__init__()
        self.functional = functional
        self.fc1 = nn.Linear(width, hidden)
        if not functional:
            self.act = nn.GELU()
        self.drop = nn.Dropout(p)
        self.fc2 = nn.Linear(hidden, width)

    def forward(self, x):
        h = self.fc1(x)
        h = F.gelu(h) if self.functional else self.act(h)
        return x + self.fc2(self.drop(h))


def mlp(seed=0, hidden=(16, 16), p=0.25):
    """Blocks Linear -> act -> Linear and a final classifier (4 classes)."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Sequential(nn.Linear(8, hidden[0]), nn.ReLU(), nn.Dropout(p), nn.Linear(hidden[0], 8)),
        nn.Sequential(nn.Linear(8, hidden[1]), nn.Tanh(), nn.Linear(hidden[1], 8)),
        nn.Linear(8, 4),
    )


def emb_model(seed=0):
    """Embedding (10 ids: uneven over 4 ranks), a block with a functional GELU, a classifier."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Embedding(10, 8, padding_idx=1), Block(functional=True),
                         nn.LayerNorm(8), nn.Linear(8, 12))


def pipe_model(seed=0):
    """Flat, for balance: column/ReLU/Dropout/row at the top level, a block, a classifier."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.0), nn.Linear(16, 8),
                         Block(), nn.Tanh(), nn.Linear(8, 3 + 1))


CASES = {
    # name: (builder, plan, input kind)
    "dict_globs": (lambda: mlp(), {"*.0": "column", "0.3": "row", "1.2": "row",
                                   "2": "column", "?.1": "replicate"}, "x"),
    "dict_full_width_rows": (lambda: mlp(), {"0.*": "replicate", "1.*": "row"}, "x"),
    "auto_mlp": (lambda: mlp(), "auto", "x"),
    "auto_mlp_uneven_hidden": (lambda: mlp(hidden=(16, 6)), "auto", "x"),
    "auto_embedding": (lambda: emb_model(), "auto", "ids"),
}


# the plain-module worker --------------------------------------------------------------------

def _full(t, group):
    return gather_from_group(t, group, dim=-1) if get_parallel_dim(t) in (-1, 1) else t


def _run_case(name, group):
    build, plan, kind = CASES[name]
    ref = build().to(F64)
    model = apply_tp_plan(copy.deepcopy(ref), plan, group=group)
    assert list(model.state_dict()) == list(ref.state_dict())
    g = torch.Generator().manual_seed(3)
    if kind == "x":
        x = torch.randn(6, 8, generator=g, dtype=F64)
        x_ref, x_tp = x.clone().requires_grad_(), x.clone().requires_grad_()
    else:
        x_ref = x_tp = torch.randint(0, 10, (3, 5), generator=g)
    torch.manual_seed(7)
    out_ref = ref(x_ref)
    torch.manual_seed(7)
    out = model(x_tp)
    tagged = get_parallel_dim(out)
    out = _full(out, group)
    w = torch.randn(out_ref.shape, generator=g, dtype=F64)
    (out_ref * w).sum().backward()
    (out * w).sum().backward()
    errors = {"out": (out - out_ref).abs().max().item()}
    if kind == "x":
        errors["input grad"] = (x_tp.grad - x_ref.grad).abs().max().item()
    params = dict(model.named_parameters())
    for key, p in ref.named_parameters():
        full = gather_full(params[key].grad, params[key], group)
        errors[key] = (full - p.grad).abs().max().item()
    return {"errors": errors, "decisions": plan_decisions(model), "tagged": tagged,
            "types": {k: type(m).__name__ for k, m in model.named_modules() if k}}


def _errors_at_tp(group):
    """The messages of the errors that need a tp group (sizes tp does not divide, etc.)."""
    messages = {}
    cases = {
        "column": (nn.Sequential(nn.Linear(8, 10), nn.ReLU()), {"0": "column"}),
        "row": (nn.Sequential(nn.Linear(9, 8)), {"0": "row"}),
        "nested": (nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), Block(hidden=10)),
                   {"2.fc1": "column"}),
        "mha": (nn.Sequential(nn.MultiheadAttention(8, 2)), {"0.out_proj": "column"}),
    }
    tied = nn.Sequential(nn.Embedding(8, 8), nn.Linear(8, 8, bias=False))
    tied[1].weight = tied[0].weight
    cases["tied"] = (tied, {"1": "column"})
    for key, (model, plan) in cases.items():
        try:
            apply_tp_plan(model, plan, group=group)
            messages[key] = "no error"
        except ValueError as e:
            messages[key] = str(e)
    # auto keeps what it cannot shard replicated (tied weights, indivisible), and says so
    tied = nn.Sequential(nn.Embedding(8, 8), nn.Linear(8, 8, bias=False))
    tied[1].weight = tied[0].weight
    apply_tp_plan(tied, "auto", group=group)
    messages["auto_tied"] = plan_decisions(tied)
    messages["auto_tied_types"] = [type(m).__name__ for m in tied]
    # a dict plan shards both ends of the tie: one Parameter, the vocab rows of this rank
    tied = nn.Sequential(nn.Embedding(8, 8), nn.Linear(8, 8, bias=False))
    tied[1].weight = tied[0].weight
    full = tied[0].weight.detach().clone()
    apply_tp_plan(tied, {"0": "vocab", "1": "column"}, group=group)
    messages["dict_tied_shared"] = tied[1].weight is tied[0].weight and \
        torch.equal(gather_full(tied[0].weight, tied[0].weight, group), full)
    messages["dict_tied"] = plan_decisions(tied)
    return messages


class Attention(nn.Module):
    """Adjacent q, k, v Linears that run side by side: "auto" must not pair them."""

    def __init__(self, d=8):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x):
        att = (self.q(x) @ self.k(x).transpose(-1, -2)).softmax(-1)
        return x + att @ self.v(x)


class LogSoftmaxHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 4)

    def forward(self, x):
        return self.proj(x).log_softmax(-1)


def _more_auto(group):
    """q / k / v are not paired; an op after the class-sharded logits is caught; meta works."""
    out = {}
    torch.manual_seed(0)
    attn = nn.Sequential(Attention(), nn.Linear(8, 4))
    ref = copy.deepcopy(attn)
    apply_tp_plan(attn, "auto", group=group)
    out["attention_decisions"] = plan_decisions(attn)
    x = torch.randn(2, 3, 8)
    out["attention_error"] = (_full(attn(x), group) - ref(x)).abs().max().item()
    head = nn.Sequential(nn.LayerNorm(8), LogSoftmaxHead())
    apply_tp_plan(head, "auto", group=group)
    try:
        head(x)
        out["guard"] = "no error"
    except RuntimeError as e:
        out["guard"] = str(e)
    # built on meta, sharded, then materialized under the seed: the plain model's values
    with torch.device("meta"):
        meta = mlp()
    apply_tp_plan(meta, "auto", group=group)
    out["meta_is_meta"] = all(p.is_meta for p in meta.parameters())
    torch.manual_seed(0)
    meta.to_empty(device="cpu")
    for m in meta.modules():
        if hasattr(m, "reset_parameters"):
            m.reset_parameters()
    plain = mlp()
    params = dict(meta.named_parameters())
    out["meta_error"] = max((gather_full(params[k].detach(), params[k], group) - v).abs().max()
                            .item() for k, v in plain.named_parameters())
    return out


def _direct_worker(tp):
    topo = hybridpar.init(tp=tp, timeout=60)
    group = topo.tp_group
    records = []
    logger = logging.getLogger("hybridpar.test_tp_plan")
    logger.setLevel(logging.INFO)
    logger.addHandler(type("H", (logging.Handler,), {"emit": lambda s, r: records.append(
        r.getMessage())})())
    results = {name: _run_case(name, group) for name in CASES}
    apply_tp_plan(mlp(), "auto", group=group, log=logger)
    results["log"] = records
    results["errors"] = _errors_at_tp(group)
    results["more"] = _more_auto(group)
    # tp=1 changes nothing
    one = hybridpar.init(tp=1, dp=tp, timeout=60)
    model = mlp()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    same = apply_tp_plan(model, "auto", group=one.tp_group)
    results["tp1_unchanged"] = same is model and all(
        type(m) in (nn.Linear, nn.ReLU, nn.Dropout, nn.Tanh, nn.Sequential)
        for m in model.modules()) and all(torch.equal(before[k], v)
                                          for k, v in model.state_dict().items())
    return results


@pytest.fixture(scope="module", params=[2, 4])
def direct(request):
    return request.param, hybridpar.spawn(_direct_worker, request.param,
                                          args=(request.param,), timeout=120)


@pytest.mark.parametrize("case", list(CASES))
def test_plans_match_one_device(direct, case):
    tp, results = direct
    for rank, r in enumerate(results):
        for what, err in r[case]["errors"].items():
            assert err < 1e-10, f"tp={tp} rank {rank} {case}: {what} differs by {err}"


def test_auto_mlp_decisions(direct):
    tp, results = direct
    r = results[0]["auto_mlp"]
    assert r["decisions"][:5] == [
        "0.0 (Linear 8->16): column - feeds 0.3", "0.3 (Linear 16->8): row - reads the "
        "shards of 0.0", "1.0 (Linear 8->16): column - feeds 1.2",
        "1.2 (Linear 16->8): row - reads the shards of 1.0",
        "2 (Linear 8->4): column - class-sharded logits (tagged -1): train with "
        "ParallelCrossEntropyLoss"]
    assert "0.1, 0.2, 1.1" in r["decisions"][5]
    assert r["tagged"] == -1
    types = r["types"]
    assert types["0.0"] == types["0.3"] == types["2"] == ParallelLinear.__name__
    assert types["0.2"] == ParallelDropout.__name__ and types["0.1"] == "ReLU"
    uneven = results[0]["auto_mlp_uneven_hidden"]["decisions"]
    if tp == 4:  # the data flow pairs the next Linear with the classifier instead
        assert uneven[2:5] == [
            "1.0 (Linear 8->6): replicate - out_features 6 is not divisible by tp=4",
            "1.2 (Linear 6->8): column - feeds 2", "2 (Linear 8->4): row - reads the shards "
            "of 1.2"]
    else:
        assert "1.0 (Linear 8->6): column - feeds 1.2" in uneven
    log = results[0]["log"]
    assert len(log) == 1 and f"tp_plan 'auto' (tp={tp})" in log[0]
    assert "ParallelCrossEntropyLoss" in log[0]
    assert all(not r["log"] for r in results[1:])  # logged once, by global rank 0


def test_auto_embedding_and_functional_activation(direct):
    _, results = direct
    r = results[0]["auto_embedding"]
    assert r["decisions"][:4] == [
        "0 (Embedding 10x8): vocab", "1.fc1 (Linear 8->16): column - feeds 1.fc2",
        "1.fc2 (Linear 16->8): row - reads the shards of 1.fc1",
        "3 (Linear 8->12): column - class-sharded logits (tagged -1): train with "
        "ParallelCrossEntropyLoss"]
    assert r["types"]["0"] == ParallelEmbedding.__name__


def test_dict_plans(direct):
    _, results = direct
    r = results[0]["dict_globs"]
    assert "0.0 (Linear 8->16): column" in r["decisions"]
    assert "1.1 (Tanh): replicate" in r["decisions"]
    assert r["tagged"] == -1
    rows = results[0]["dict_full_width_rows"]
    assert "1.0 (Linear 8->16): row" in rows["decisions"]
    assert "2 (Linear 8->4): replicate - not in the plan" in rows["decisions"]
    assert rows["tagged"] is None


def test_errors_that_need_tp(direct):
    tp, results = direct
    m = results[0]["errors"]
    if tp == 4:
        assert m["column"].startswith("layer '0': out_features 10 is not divisible by tp=4;")
        assert "replicate" in m["column"]
        assert m["nested"].startswith("layer '2.fc1': out_features 10 is not divisible by tp=4")
    else:
        assert m["column"] == "no error" and m["nested"] == "no error"
    assert m["row"].startswith(f"layer '0': in_features 9 is not divisible by tp={tp}")
    assert "MultiheadAttention" in m["mha"]
    assert "tied" in m["tied"] and "'1'" in m["tied"]
    assert m["auto_tied_types"] == ["Embedding", "Linear"]
    assert any("tied" in d for d in m["auto_tied"])
    assert m["dict_tied_shared"]
    assert m["dict_tied"][0].startswith("0 (Embedding 8x8): vocab - its weight is one "
                                        "Parameter with '1.weight'")


def test_auto_leaves_side_by_side_linears_and_guards_the_logits(direct):
    _, results = direct
    m = results[0]["more"]
    # q @ k^T contracts the features: a shard of q or k gives partial scores
    assert m["attention_decisions"][:2] == [
        f"0.{n} (Linear 8->8): replicate - matmul reduces over the sharded features (each "
        f"rank would hold a partial result)" for n in "qk"]
    assert m["attention_decisions"][2].startswith("0.v (Linear 8->8): replicate - add fails "
                                                  "on the shard")
    assert m["attention_error"] < 1e-6
    assert "column - class-sharded" in m["attention_decisions"][3]
    assert m["guard"].startswith("tp_plan 'auto' made the final Linear '1.proj' column-parallel")
    assert m["meta_is_meta"] and m["meta_error"] == 0


def test_tp1_changes_nothing(direct):
    _, results = direct
    assert all(r["tp1_unchanged"] for r in results)


# errors found before any group is needed ----------------------------------------------------

@pytest.mark.parametrize("plan,match", [
    ({"0.0": "col"}, r"tp_plan\['0.0'\] = 'col' is not a style; valid styles"),
    ({"0.0": "packed_rowwise"}, r"'packed_rowwise' is a Hugging Face style hybridpar "
                                r"does not support; supported: colwise"),
    ({"0.*.x": "colwise"}, r"key '0.\*.x' \('colwise', a Hugging Face style: '\*' is one "
                           r"layer index\) matches no module"),
    ({"*.1": "colwise"}, r"'colwise' does not apply to '0.1' \(ReLU\)"),
    ({"9.fc": "column"}, r"pattern '9.fc' matches no module.*valid styles"),
    ({"0.1": "column"}, r"'column' applies to nn.Linear only, but '0.1' matched '0.1' \(ReLU\)"),
    ({"0.0": "vocab"}, r"'vocab' applies to nn.Embedding only.*'0.0' \(Linear 8->16\)"),
    ({"*.1": "row"}, r"'row' applies to nn.Linear only, but '\*.1' matched '0.1' \(ReLU\)"),
    ({"0": "column"}, r"'0' \(Sequential\)"),
    ({"*.0": "column", "0.*": "row"}, r"layer '0.0' is matched by '\*.0' \('column'\) and "
                                      r"'0.\*' \('row'\)"),
    ("everything", r"tp_plan must be None, 'auto' or a dict"),
    ({0: "column"}, r"must be 'name pattern': 'style' strings"),
])
def test_plan_errors(plan, match):
    with pytest.raises(ValueError, match=match):
        apply_tp_plan(mlp(), plan)


def test_none_plan_returns_the_module():
    model = mlp()
    assert apply_tp_plan(model, None) is model
    assert plan_decisions(model) == []


# HybridPipe with a tp_plan against the plain single-device run -------------------------------

def _pipe_worker(layout, balance, plan, steps, batch, chunks):
    pp, tp, dp = layout
    topo = hybridpar.init(pp=pp, tp=tp, dp=dp, timeout=60)
    pipe = hybridpar.HybridPipe(pipe_model(), balance, topology=topo, chunks=chunks,
                                loss_fn=ParallelCrossEntropyLoss(), tp_plan=plan)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    xs, ys = data(steps, batch, classes=4)
    losses = []
    for x, y in zip(xs, ys):
        opt.zero_grad()
        losses.append(checked_step(pipe, x, y))
        opt.step()
    return {"losses": losses, "state": pipe.consolidated_state_dict(),
            "out": pipe(xs[0]).detach()}


@pytest.mark.parametrize("layout,balance,plan", [
    ((1, 2, 1), [7], "auto"),
    # the boundary carries the column shard (after ReLU); its gradient must go back as a shard
    ((2, 2, 1), [2, 5], "auto"),  # the boundary carries a column shard: see test_bugs
    ((2, 2, 1), [4, 3], {"0": "column", "3": "row", "4.fc*": "row", "6": "column"}),
])
def test_pipe_with_tp_plan_matches_one_device(layout, balance, plan):
    steps, batch = 3, 8
    xs, ys = data(steps, batch, classes=4)
    ref_losses, ref_state = reference(pipe_model(), xs, ys)
    with torch.no_grad():
        model = pipe_model()
        model.load_state_dict(ref_state)
        ref_out = model(xs[0])
    results = hybridpar.spawn(_pipe_worker, layout[0] * layout[1] * layout[2],
                              args=(layout, balance, plan, steps, batch, 2), timeout=120)
    for r in results:
        assert r["losses"] == pytest.approx(ref_losses, abs=1e-5)
        assert list(r["state"]) == list(ref_state)
        for k, v in ref_state.items():
            torch.testing.assert_close(r["state"][k], v, atol=1e-5, rtol=0)
        torch.testing.assert_close(r["out"], ref_out, atol=1e-5, rtol=0)
