"""The router z-loss (ST-MoE), DeepSeek-V3's aux-loss-free bias update and a capacity factor
with its drop policies, against independent computations and, through the pipeline and
expert parallelism, against one device (float64)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from spawn_cases import spawn_by_world

import hybridpar
from hybridpar.models import example_batch, gpt, gpt_loss
from hybridpar.moe import ExpertBiasUpdate, Experts, MoE, Router, split_aux
from hybridpar.pipeline.schedules import replay as nccl

from pipe_harness import checked_step

MOE = {"vocab_size": 32, "block_size": 8, "n_layer": 4, "n_head": 2, "n_embd": 16,
       "n_experts": 4, "top_k": 2, "expert_hidden": 8, "balance_coef": 0.1,
       "router": "sigmoid", "z_loss_coef": 0.05, "bias_update_rate": 0.02}
STEPS, BATCH = 3, 8


def _model(**kwargs) -> torch.nn.Sequential:
    torch.manual_seed(0)
    return gpt(**{**MOE, **kwargs}).double()


def _batches():
    return [example_batch("gpt", BATCH, seed=step, **{k: MOE[k] for k in (
        "vocab_size", "block_size", "n_layer", "n_head", "n_embd")}) for step in range(STEPS)]


def test_the_z_loss_is_the_mean_squared_logsumexp_of_every_layers_router_logits():
    """aux = balance_coef · balance + z_coef · Σ_layers mean(logsumexp(logits)²), value and
    every gradient, against the same model without the z term plus the z term computed from
    its routers' logits (taken by hooks), for the softmax and the sigmoid router."""
    for router in ("softmax", "sigmoid"):
        model = _model(router=router, bias_update_rate=0.0)
        plain = _model(router=router, bias_update_rate=0.0, z_loss_coef=0.0)   # same weights
        x, y = _batches()[0]
        logits: list[torch.Tensor] = []
        for m in plain.modules():
            if isinstance(m, Router):
                m.register_forward_hook(lambda m, args, out: logits.append(out.logits))
        plain_out, out = plain(x), model(x)
        z = sum(torch.logsumexp(t.float(), dim=-1).square().mean() for t in logits)
        assert len(logits) == MOE["n_layer"] and float(z.detach()) > 1
        torch.testing.assert_close(split_aux(out)[1],
                                   split_aux(plain_out)[1] + MOE["z_loss_coef"] * z,
                                   atol=1e-6, rtol=0)   # (the sums are float32)
        gpt_loss(out, y).backward()
        (gpt_loss(plain_out, y) + MOE["z_loss_coef"] * z).backward()
        for (name, p), q in zip(model.named_parameters(), plain.parameters()):
            torch.testing.assert_close(p.grad, q.grad, atol=1e-10, rtol=0,
                                       msg=lambda m, name=name: f"{router} {name}: {m}")


def test_the_bias_update_moves_each_expert_by_the_sign_of_its_load_below_the_mean():
    torch.manual_seed(0)
    router = Router(6, 4, 2, scoring="sigmoid", bias_rate=0.25).double()
    update = ExpertBiasUpdate(router)
    x = torch.randn(10, 6, dtype=torch.float64)
    chosen = torch.cat([router(x).experts.reshape(-1), router(x[:3]).experts.reshape(-1)])
    load = torch.bincount(chosen, minlength=4).double()
    with torch.no_grad():
        router.eval()(x)                       # an evaluation forward counts nothing
    router.train()
    update.step()
    torch.testing.assert_close(router.correction_bias,
                               0.25 * torch.sign(load.mean() - load), atol=0, rtol=0)
    before = router.correction_bias.clone()
    router(x)
    update.step(apply=False)                   # a skipped step's loads are dropped
    update.step()                              # nothing routed since: zero loads, no move
    assert torch.equal(router.correction_bias, before)


@pytest.mark.parametrize("kwargs, message", [
    ({"router": "top1"}, "router='top1' is not one of softmax, sigmoid"),
    ({"router": "softmax"}, "bias_update_rate=0.02 moves the correction bias of the sigmoid "
                            "router"),
    ({"z_loss_coef": -1.0}, "z_loss_coef=-1.0 and bias_update_rate=0.02 must be >= 0"),
])
def test_bad_balancing_options_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        gpt(**{**MOE, **kwargs})


def _kept_by_hand(routing, N, k, E, capacity, policy):
    """{expert: [(slot, token)] it keeps}: its copies slot by slot, tokens in order (or by
    weight, largest first), the first `capacity` of them."""
    kept = {}
    for e in range(E):
        copies = [(j, i) for j in range(k) for i in range(N) if routing.experts[i, j] == e]
        if policy == "probs":
            copies.sort(key=lambda c: -float(routing.weights[c[1], c[0]].detach()))
        kept[e] = copies[:capacity]
    return kept


@pytest.mark.parametrize("policy", ["position", "probs"])
def test_a_capacity_keeps_each_experts_first_copies_and_drops_the_rest(policy):
    """The block with capacity_factor 0.5 against a loop over experts that keeps each one's
    first ceil(0.5 · N · k / E) copies by the policy: output and every gradient."""
    torch.manual_seed(0)
    N, H, E, k, inner = 12, 6, 4, 2, 5
    moe = MoE(Router(H, E, k, scoring="softmax"), Experts(E, H, inner), capacity_factor=0.5,
              drop_policy=policy).double()
    with torch.no_grad():
        moe.router.weight.normal_(0, 1.0)          # uneven loads: something is dropped
    x = torch.randn(N, H, dtype=torch.float64, requires_grad=True)
    out = moe(x)
    routing = moe.router(x)
    capacity = math.ceil(0.5 * N * k / E)
    kept = _kept_by_hand(routing, N, k, E, capacity, policy)
    assert sum(map(len, kept.values())) < N * k                   # copies were dropped
    expected = torch.zeros(N, H, dtype=torch.float64)
    gate_up, down = moe.experts.gate_up_proj, moe.experts.down_proj
    for e, copies in kept.items():
        for j, i in copies:
            gate, up = F.linear(x[i], gate_up[e]).chunk(2)
            expected = expected.index_add(0, torch.tensor([i]), (
                routing.weights[i, j] * F.linear(F.silu(gate) * up, down[e])).unsqueeze(0))
    torch.testing.assert_close(out, expected, atol=1e-12, rtol=0)
    grads = torch.autograd.grad(out.square().sum(), [x, *moe.parameters()])
    by_hand = torch.autograd.grad(expected.square().sum(), [x, *moe.parameters()])
    for a, b in zip(grads, by_hand):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)
    # a capacity of every copy drops nothing: the dropless block (to rounding: each expert's
    # rows padded to the capacity, in another matrix shape)
    moe.capacity_factor = E / k
    dropless = MoE(moe.router, moe.experts)
    torch.testing.assert_close(moe(x), dropless(x), atol=1e-15, rtol=0)


def test_a_capacity_that_drops_every_token_is_refused():
    with pytest.raises(ValueError, match=r"capacity_factor=0\.0 drops every token .* give a "
                                         r"factor > 0"):
        MoE(Router(4, 4, 2), Experts(4, 4, 4), capacity_factor=0.0)
    with pytest.raises(ValueError, match="gpt: drop_policy 'random' is not one of position, "
                                         "probs"):
        gpt(**{**MOE, "capacity_factor": 1.0, "drop_policy": "random"})


# through the pipeline ---------------------------------------------------------------------
def _reference(micro: int, **kwargs):
    """One device, gradient accumulation over `micro` micro-batches, the bias updated after
    each step from all of them: the state (the correction biases included)."""
    model = _model(**kwargs)
    update = ExpertBiasUpdate(model)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    rows = BATCH // micro
    for x, y in _batches():
        opt.zero_grad()
        for i in range(micro):
            (gpt_loss(model(x[i * rows:(i + 1) * rows]), y[i * rows:(i + 1) * rows])
             / micro).backward()
        opt.step()
        update.step()
    return model.state_dict()


def _worker(layout, balance, options, kwargs):
    pp, dp, ep = layout
    topo = hybridpar.init(pp=pp, dp=dp, ep=ep, timeout=60)
    pipe = hybridpar.HybridPipe(_model(**kwargs, **({"ep": ep} if ep > 1 else {})), balance,
                                topology=topo, loss_fn=gpt_loss, **options)
    update = ExpertBiasUpdate(pipe, group=topo.dp_group)
    pipe.p2p_log = []
    opt = torch.optim.AdamW(pipe.parameters(), lr=0.01)
    rows, counted = BATCH // dp, []
    for x, y in _batches():
        opt.zero_grad()
        part = slice(topo.dp_rank * rows, (topo.dp_rank + 1) * rows)
        checked_step(pipe, x[part], y[part])
        counted.append(sorted(float(v.sum()) for v in update.loads.values()))
        opt.step()
        update.step()
    log = [[[op.kind, op.peer, op.numel, op.dtype, op.label] for op in group]
           for group in pipe.p2p_log]
    return {"state": pipe.consolidated_state_dict(), "counted": counted, "log": log}


# name: ((pp, dp, ep), balance, pipe options, model options beyond MOE)
CAPACITY = {"capacity_factor": 0.75}
LAYOUTS = {
    "pp2-1f1b-always": ((2, 1, 1), [3, 4], {"chunks": 2, "schedule": "1f1b",
                                            "checkpoint": "always"}, {}),
    "pp2dp2-zbv": ((2, 2, 1), [2, 2, 2, 1], {"chunks": 2, "schedule": "zbv",
                                             "checkpoint": "never"}, {}),
    "capacity-pp2-1f1b": ((2, 1, 1), [3, 4], {"chunks": 2, "schedule": "1f1b",
                                              "checkpoint": "never"}, CAPACITY),
    "capacity-probs-dp2ep2": ((1, 2, 2), [7], {"chunks": 2, "schedule": "gpipe",
                                               "checkpoint": "never"},
                              {**CAPACITY, "drop_policy": "probs"}),
}


@pytest.fixture(scope="module")
def runs():
    cases = {name: (layout[0] * layout[1], case) for name, case in LAYOUTS.items()
             for layout in [case[0]]}
    return spawn_by_world(_worker, cases, timeout=240)


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_z_loss_and_bias_update_through_the_pipeline_equal_one_device(name, runs):
    """Every parameter and correction bias after 3 steps (sigmoid routers, the z-loss and
    the balance loss on, biases moved each step from the loads summed over dp; with a
    capacity, each rank's micro-batches dropping copies as one device's do, under ep too)
    equals one device's; each rank counted each router's copies once (recomputed forwards
    not)."""
    (_, dp, _), _, options, kwargs = LAYOUTS[name]
    reference = _reference(options["chunks"] * dp, **kwargs)
    if "capacity_factor" in kwargs:   # the capacity dropped copies: not the dropless run
        dropless = _reference(options["chunks"] * dp)
        assert max(float((v - dropless[k]).abs().max()) for k, v in reference.items()) > 1e-4
    assert any(float(v.abs().sum()) > 0 for k, v in reference.items()
               if k.endswith("correction_bias"))
    for r in runs[name]:
        for k, v in reference.items():
            torch.testing.assert_close(r["state"][k], v.to(r["state"][k].dtype), atol=1e-9,
                                       rtol=0, msg=lambda m, k=k: f"{name} {k}: {m}")
        copies = BATCH // dp * MOE["block_size"] * MOE["top_k"]   # this rank's rows' copies
        assert all(set(step) == {copies} for step in r["counted"])
    if LAYOUTS[name][0][0] > 1:   # the stages' P2P (the sums, z-loss's too, ride along)
        logs = {rank: [[nccl.P2POp(*op) for op in group] for group in r["log"]]
                for rank, r in enumerate(runs[name])}
        assert nccl.replay(logs, check_labels=True).pairs > 0


# through the trainer -----------------------------------------------------------------------
def _run(run_dir):
    from pathlib import Path

    from hybridpar.train.configs.config import load_config
    from hybridpar.train.trainer import train

    config = load_config(Path(__file__).resolve().parents[1] / "configs" / "quickstart.toml", [
        "model.block_size=8", "model.n_embd=16", "model.n_layer=2", "model.n_head=2",
        "model.n_experts=4", "model.router=sigmoid", "model.bias_update_rate=0.01",
        "model.z_loss_coef=0.001", "data.source=synthetic", "parallel.pp=1", "parallel.tp=1",
        "parallel.dp=2", "parallel.ep=2", "parallel.chunks=2", "parallel.timeout=60",
        "train.steps=3", "train.batch_size=8",
        "train.warmup_steps=1", "train.log_every=1", "train.eval_every=0",
        "train.sample_tokens=0", "checkpoint.every=3"])
    return train(config, run_dir, progress=False)["losses"]


def test_a_config_trains_with_sigmoid_routers_moving_their_biases_on_every_replica(tmp_path):
    """`model.router = "sigmoid"`, `bias_update_rate`, `z_loss_coef` at dp 2 x ep 2 through
    the trainer: each step moves every layer's correction bias by ±rate per expert, and the
    checkpoint holds the moved biases (that the dp replicas move theirs alike, and as one
    device does, is the pipeline test's above)."""
    from hybridpar.train.export import read_state

    losses = hybridpar.spawn(_run, 2, args=(str(tmp_path),), timeout=240)[0]
    assert len(losses) == 3
    state = read_state(tmp_path / "checkpoints" / "step-3")
    biases = [v for k, v in state.items() if k.endswith("router.correction_bias")]
    assert len(biases) == 2
    for b in biases:   # 3 steps of ±0.01 (or 0 where a load was exactly the mean)
        assert float(b.abs().max()) > 0
        assert torch.all((b / 0.01).round().abs() <= 3)


def test_the_dry_run_takes_the_bias_update_after_the_optimizer_step():
    """`hybridpar check` runs the step as the trainer does, the routers' bias update (its dp
    all-reduce) included, on fake ranks: it goes through, and each rank's experts held."""
    from pathlib import Path

    from hybridpar.train.check.run import dry_run

    report = dry_run(Path(__file__).resolve().parents[1] / "configs" / "quickstart.toml",
                     overrides=["model.block_size=8", "model.n_embd=16", "model.n_layer=2",
                                "model.n_head=2", "model.n_experts=4", "model.router=sigmoid",
                                "model.bias_update_rate=0.01", "model.z_loss_coef=0.001",
                                "data.source=synthetic", "parallel.tp=1", "parallel.pp=1",
                                "parallel.balance=[5]", "parallel.dp=2", "parallel.ep=2",
                                "train.batch_size=8", "parallel.chunks=2"],
                     device="cpu", isolate=False)
    assert len(report.ranks) == 2 and all("all_to_all" in r.comm for r in report.ranks)
