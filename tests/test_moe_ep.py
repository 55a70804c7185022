"""Expert parallelism: the MoE GPT with its experts split over ep ranks, against one device.

ep is carved out of dp: an ep group of P dp replicas holds every expert once (E / P each) and
sends each token's copies to the rank of its expert and back by all-to-all. Every layout
must train as one device with gradient accumulation over the same micro-batches (every
parameter to 1e-9 in float64 after 3 AdamW steps, the clipped norm too), the replica check
must pass (dense parameters equal over dp, each expert equal over the dp ranks holding it),
and each rank must hold exactly E / ep experts of every MoE layer.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch
from spawn_cases import selected_ids, spawn_by_world
from test_moe_gpt import BATCH, MOE, _batches, _rows
from test_moe_gpt import _reference as _moe_gpt_reference

import hybridpar
from hybridpar.models import gpt, gpt_loss
from hybridpar.moe import Experts
from hybridpar.pipeline.schedules import replay as nccl

from pipe_harness import checked_step

CLIP = 0.5
QUICKSTART = Path(__file__).resolve().parents[1] / "configs" / "quickstart.toml"


def _reference(micro: int):
    state, _, norms = _moe_gpt_reference(micro, False, clip=CLIP)
    return state, norms


@contextlib.contextmanager
def _recording_all_to_alls():
    """Every `all_to_all_single` of this process inside, as (group ranks, input splits,
    output splits), the real call made after: an instrument, not a stand-in."""
    import torch.distributed as dist

    log: list[tuple[list[int], list[int], list[int]]] = []
    real = dist.all_to_all_single

    def recorded(output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                 async_op=False):
        ranks = dist.get_process_group_ranks(group)
        even = [input.shape[0] // len(ranks)] * len(ranks)
        log.append((ranks, list(input_split_sizes or even), list(output_split_sizes or even)))
        return real(output, input, output_split_sizes, input_split_sizes, group=group,
                    async_op=async_op)

    dist.all_to_all_single = recorded
    try:
        yield log
    finally:
        dist.all_to_all_single = real


def _worker(layout, ep, balance, options):
    with _recording_all_to_alls() as all_to_alls:
        return {**_train(layout, ep, balance, options), "all_to_alls": all_to_alls}


def _train(layout, ep, balance, options):
    from hybridpar.optim import optimizer_state_tensors, pipe_optimizer

    pp, tp, dp = layout
    topo = hybridpar.init(pp=pp, tp=tp, dp=dp, ep=ep, timeout=60)
    torch.manual_seed(0)
    model = gpt(**MOE, ep=ep, **({"tp": tp} if tp > 1 else {})).double()
    held = [(m.first, m.local) for m in model.modules() if isinstance(m, Experts)]
    options = dict(options)
    zero = options.pop("zero", 0)
    pipe = hybridpar.HybridPipe(model, balance, topology=topo, loss_fn=gpt_loss, **options)
    pipe.p2p_log = []
    opt = pipe_optimizer(pipe, torch.optim.AdamW, zero=zero, lr=0.01)
    rows, norms = BATCH // dp, []
    for x, y in _batches(False):
        opt.zero_grad()
        checked_step(pipe, _rows(x, topo.dp_rank * rows, (topo.dp_rank + 1) * rows),
                     y[topo.dp_rank * rows:(topo.dp_rank + 1) * rows])
        pipe.check_replicas()   # dense over dp, experts over expert dp (their grads unsharded)
        norms.append(float(pipe.clip_grad_norm_(CLIP)))
        opt.step()
    log = [[[op.kind, op.peer, op.numel, op.dtype, op.label] for op in group]
           for group in pipe.p2p_log]
    state_bytes = sum(t.numel() * t.element_size() for t in optimizer_state_tensors(opt))
    return {"state": pipe.consolidated_state_dict(), "norms": norms, "held": held,
            "ep_rank": topo.ep_rank, "log": log, "state_bytes": state_bytes}


# (pp, tp, dp), ep, balance over the 7 layers, options
LAYOUTS = [
    ((1, 1, 2), 2, [7], {"chunks": 2, "schedule": "gpipe", "checkpoint": "never"}),
    ((1, 1, 4), 2, [7], {"chunks": 1, "schedule": "gpipe", "checkpoint": "never"}),
    ((1, 1, 4), 4, [7], {"chunks": 2, "schedule": "gpipe", "checkpoint": "always"}),
    ((2, 1, 2), 2, [3, 4], {"chunks": 2, "schedule": "1f1b", "checkpoint": "except_last"}),
    ((2, 1, 2), 2, [2, 2, 2, 1], {"chunks": 4, "schedule": "zbv", "checkpoint": "never"}),
    ((1, 2, 2), 2, [7], {"chunks": 2, "schedule": "gpipe", "checkpoint": "never"}),
    ((2, 2, 2), 2, [3, 4], {"chunks": 2, "schedule": "1f1b", "checkpoint": "except_last"}),
    # ZeRO-1: the dense state dealt over dp, the experts' over expert-dp (2 ranks; then 1)
    ((1, 1, 4), 2, [7], {"chunks": 1, "schedule": "gpipe", "checkpoint": "never", "zero": 1}),
    ((2, 1, 2), 2, [3, 4], {"chunks": 2, "schedule": "1f1b", "checkpoint": "never",
                            "zero": 1}),
    # ZeRO-2: and each gradient on its owner only (the clipped norm over both groups)
    ((1, 1, 4), 2, [7], {"chunks": 2, "schedule": "gpipe", "checkpoint": "never", "zero": 2}),
    ((2, 1, 2), 2, [3, 4], {"chunks": 2, "schedule": "1f1b", "checkpoint": "always",
                            "zero": 2}),
]
IDS = [f"pp{pp}tp{tp}dp{dp}ep{ep}-{o['schedule']}-{o['checkpoint']}"
       + (f"-zero{o['zero']}" if "zero" in o else "") for (pp, tp, dp), ep, _, o in LAYOUTS]


@pytest.fixture(scope="module")
def runs(request):
    wanted = selected_ids(request, "test_expert_parallel_moe_gpt_equals_one_device")
    cases = {name: (layout[0] * layout[1] * layout[2], (layout, ep, balance, options))
             for (layout, ep, balance, options), name in zip(LAYOUTS, IDS) if name in wanted}
    return spawn_by_world(_worker, cases, timeout=240)


@pytest.mark.parametrize("layout,ep,balance,options", LAYOUTS, ids=IDS)
def test_expert_parallel_moe_gpt_equals_one_device(layout, ep, balance, options, runs, request):
    results = runs[request.node.callspec.id]
    reference, norms = _reference(options["chunks"] * layout[2])
    local = MOE["n_experts"] // ep
    for r in results:
        assert r["held"] == [(r["ep_rank"] * local, local)] * MOE["n_layer"]
        assert r["norms"] == pytest.approx(norms, rel=1e-6)    # returned in float32
        assert list(r["state"]) == list(reference)
        for k, v in reference.items():
            torch.testing.assert_close(r["state"][k], v, atol=1e-9, rtol=0,
                                       msg=lambda m, k=k: f"{k}: {m}")
    if options.get("zero"):   # each parameter's AdamW state on one rank of its group
        # (exp_avg, exp_avg_sq: float64; step: a float32 scalar, one per expert slice)
        params = dict(gpt(**MOE).named_parameters())
        one_device = sum(2 * p.numel() * 8 + 4 for p in params.values())
        slices = sum(".experts." in name for name in params) * (ep - 1)
        assert sum(r["state_bytes"] for r in results) == one_device + 4 * slices
        assert max(r["state_bytes"] for r in results) < one_device // 2
    assert_nccl_order(results)
    if layout[0] > 1:   # the stages' P2P (the routing sums ride along) under NCCL's rules
        logs = {rank: [[nccl.P2POp(*op) for op in group] for group in r["log"]]
                for rank, r in enumerate(results)}
        assert nccl.replay(logs, check_labels=True).pairs > 0


def assert_nccl_order(results) -> None:
    """NCCL's rule for a collective, checked on the record: every rank of an ep group issues
    the same number of all-to-alls on it, and the k-th of rank a sends to rank b exactly the
    rows the k-th of b expects from a."""
    for rank, r in enumerate(results):
        assert r["all_to_alls"], rank
        for k, (ranks, sent, _) in enumerate(r["all_to_alls"]):
            me = ranks.index(rank)
            for peer, other in enumerate(ranks):
                theirs = results[other]["all_to_alls"]
                assert len(theirs) == len(r["all_to_alls"]), (rank, other)
                assert theirs[k][0] == ranks and theirs[k][2][me] == sent[peer], (rank, k)


# the trainer: a meta-built run at ep 2, resumed at ep 1 ------------------------------------
def _config(ep: int, steps: int, zero: int = 0, *extra: str):
    from hybridpar.train.configs.config import load_config

    return load_config(QUICKSTART, [
        "model.block_size=8", "model.n_embd=16", "model.n_layer=2", "model.n_head=2",
        "model.n_experts=4", "model.top_k=2", "data.source=synthetic", "parallel.pp=1",
        "parallel.tp=1", "parallel.dp=2", f"parallel.ep={ep}", "parallel.chunks=2",
        "parallel.timeout=60", f"train.steps={steps}", "train.batch_size=8",
        "train.warmup_steps=1", "train.log_every=1", "train.eval_every=0",
        "train.sample_tokens=0", "checkpoint.every=2", f"parallel.zero={zero}", *extra])


def _runs(root):
    import shutil

    import torch.distributed as dist

    from hybridpar.train.trainer import train

    def resumed(run: str, zero: int) -> tuple[list[float], list[float]]:
        """(a run at ep 2, then back to step 4 at ep 1; the replicas compared every step)"""
        first = train(_config(2, 6, zero, "parallel.check_replicas=1"), f"{root}/{run}",
                      progress=False)["losses"]
        dist.barrier()
        if dist.get_rank() == 0:   # back to step 4 (the learning rate follows train.steps = 6)
            shutil.rmtree(f"{root}/{run}/checkpoints/step-6")
        dist.barrier()
        then = train(_config(1, 6, zero), f"{root}/{run}", progress=False)["losses"]
        return first, [*first[:4], *then]

    first, then = resumed("a", 0)
    _, zero_then = resumed("c", 1)   # ZeRO-1: the experts' state dealt over expert-dp
    _, zero2_then = resumed("d", 2)  # ZeRO-2: and the gradients
    return {"ep2 then ep1": then, "ep2": first, "zero1 ep2 then ep1": zero_then,
            "zero2 ep2 then ep1": zero2_then,
            "ep1": train(_config(1, 6), f"{root}/b", progress=False)["losses"]}


def test_a_run_at_ep2_resumed_at_ep1_trains_as_a_run_at_ep1(tmp_path):
    """The trainer builds on meta and materializes the stage (the experts keep their shard
    tag), and checkpoints store experts at their global index: a run at ep 2 equals one at
    ep 1 step for step, before and after it resumes at ep 1; with ZeRO-1 and ZeRO-2 too (the
    dense state dealt over dp, the experts' kept by their ranks, each saved once), the
    replicas compared every step."""
    for rank in hybridpar.spawn(_runs, 2, args=(str(tmp_path),), timeout=240):
        assert len(rank["ep2 then ep1"]) == 6
        assert rank["ep2"] == pytest.approx(rank["ep1"], rel=1e-6)
        assert rank["ep2 then ep1"] == pytest.approx(rank["ep1"], rel=1e-6)
        assert rank["zero1 ep2 then ep1"] == pytest.approx(rank["ep1"], rel=1e-6)
        assert rank["zero2 ep2 then ep1"] == pytest.approx(rank["ep1"], rel=1e-6)
    # the metrics: each step's aux loss and each MoE layer's [fewest, most] copies an expert got
    import json

    records = [json.loads(line) for line in (tmp_path / "b" / "metrics.jsonl").read_text()
               .splitlines() if '"loss"' in line]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    copies = 8 * 8 * 2                        # batch rows x tokens x top-k, over both replicas
    for r in records:
        assert r["aux_loss"] > 0
        assert sorted(r["expert_load"]) == ["1", "2"]
        assert all(0 <= low <= copies / 4 <= high <= copies
                   for low, high in r["expert_load"].values())


# the config's checks ---------------------------------------------------------------------
@pytest.mark.parametrize("overrides, message", [
    (["parallel.ep=2"], "parallel.ep=2 shards experts: the built-in gpt with model.n_experts "
                        "> 0, or a Hugging Face MoE family (Mixtral, Qwen2/3-MoE, OLMoE, "
                        "GraniteMoE, GPT-OSS); got model 'gpt' without experts"),
    (["model.n_experts=6", "parallel.ep=4", "parallel.dp=4"],
     "parallel.ep=4 does not divide model.n_experts=6"),
    (["model.n_experts=4", "parallel.ep=4", "parallel.dp=2"],
     "parallel.ep=4 does not divide parallel.dp=2: ep is carved out of the dp replicas"),
    (["model.n_experts=4", "model.top_k=5"], "top_k=5 must be between 1 and n_experts=4"),
    (["model.n_experts=4", "parallel.sequence_parallel=true", "parallel.tp=2"],
     "parallel.sequence_parallel does not take experts yet"),
    (["model.n_experts=4", "model.router=top1"], "router='top1' is not one of softmax, sigmoid"),
    (["model.n_experts=4", "model.bias_update_rate=0.01"],
     "bias_update_rate=0.01 moves the correction bias of the sigmoid router"),
    (["model.n_experts=4", "model.capacity_factor=0"], "capacity_factor=0.0 drops every token"),
])
def test_the_config_refuses_bad_expert_layouts_naming_the_keys(overrides, message):
    from config_errors import error_of

    got = error_of(QUICKSTART, "parallel.tp=1", "parallel.pp=1", "parallel.dp=1", *overrides)
    assert message in got


# the dispatch alone: exact bytes, a rank whose experts get nothing ---------------------------
def _dispatch_worker(chosen):
    """A float64 MoE block at ep 2 whose router sends every token to the experts `chosen`
    (a huge router bias): its output and gradients, and the all-to-alls of one forward and
    backward."""
    from hybridpar import trace
    from hybridpar.moe import MoE, Router

    topo = hybridpar.init(dp=2, ep=2, timeout=60)
    torch.manual_seed(0)
    router = Router(8, 4, 2, scoring="topk_softmax", bias=True).double()
    with torch.no_grad():
        router.bias.copy_(torch.tensor([100.0 if e in chosen else 0.0 for e in range(4)]))
    experts = Experts(4, 8, 6, first=2 * topo.ep_rank, local=2).double()
    moe = MoE(router, experts, group=topo.ep_group)
    x = torch.randn(2, 5, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(
        topo.rank)).requires_grad_()
    trace.reset_comm_stats()
    moe(x).square().sum().backward()
    return {"x": x.detach(), "grad": x.grad, "comm": trace.comm_stats()["all_to_all"],
            "experts": {n: p.grad for n, p in experts.named_parameters()},
            "router": router.weight.grad}


@pytest.mark.parametrize("chosen", [(0, 3), (0, 1)], ids=["one-each", "all-to-rank-0"])
def test_the_dispatch_sends_exactly_the_routed_rows_and_equals_one_block(chosen):
    """10 tokens per rank, k = 2, E = 4 over 2 ranks, 8 float64 features (64 bytes a row).
    What leaves each rank: 2 of its 4 int64 counts (16 bytes), then in the four all-to-alls
    of rows (dispatch, combine, their backwards) the copies bound for the other rank:

        routed to     rank 0 sends (rows)          rank 1 sends (rows)
        experts 0, 3  10, 10, 10, 10               10, 10, 10, 10
        experts 0, 1  0, 20 (home), 0, 20          20, 0, 20, 0

    2576 bytes either way. With every token on rank 0's experts, rank 1's get no rows and it
    still runs the backward's all-to-alls (or rank 0 would wait)."""
    from hybridpar.moe import MoE, Router

    results = hybridpar.spawn(_dispatch_worker, 2, args=(chosen,), timeout=90)
    torch.manual_seed(0)
    router = Router(8, 4, 2, scoring="topk_softmax", bias=True).double()
    with torch.no_grad():
        router.bias.copy_(torch.tensor([100.0 if e in chosen else 0.0 for e in range(4)]))
    whole = MoE(router, Experts(4, 8, 6).double())
    xs = [r["x"].clone().requires_grad_() for r in results]
    sum(whole(x).square().sum() for x in xs).backward()
    for rank, r in enumerate(results):
        assert r["comm"] == {"bytes": 16 + 40 * 64, "calls": 5}
        torch.testing.assert_close(r["grad"], xs[rank].grad, atol=1e-13, rtol=0)
        for name, grad in r["experts"].items():
            full = getattr(whole.experts, name).grad[2 * rank:2 * rank + 2]
            torch.testing.assert_close(grad, full, atol=1e-12, rtol=0)
    # the router is replicated: each rank's gradient is its own tokens', summed over ranks
    torch.testing.assert_close(sum(r["router"] for r in results), whole.router.weight.grad,
                               atol=1e-12, rtol=0)


# the dry run -------------------------------------------------------------------------------
@pytest.mark.parametrize("capacity", [[], ["model.capacity_factor=1.0"]],
                         ids=["dropless", "capacity"])
def test_the_dry_run_holds_e_over_ep_experts_per_rank_and_counts_the_all_to_alls(capacity):
    """`hybridpar check` at ep 2 (fake ranks, no values: the routing taken as balanced): each
    rank holds its stage's dense bytes and half of its expert bytes, every gradient lives in
    a bucket (the experts' own included), and the step's collectives include the
    all-to-alls; with a capacity factor too (its static shapes: no value read to shape the
    work)."""
    from hybridpar.train.check.run import dry_run

    common = ["model.block_size=8", "model.n_embd=16", "model.n_layer=2", "model.n_head=2",
              "model.n_experts=4", "parallel.tp=1", "parallel.pp=2", "parallel.dp=2",
              "parallel.ep=2", "data.source=synthetic", "train.batch_size=8",
              "parallel.chunks=2", *capacity]
    # fake CPU ranks in this process (fake GPUs need a process whose autograd engine has not
    # started yet: `dry_run`'s isolate; the CLI's default): the same bytes
    report = dry_run(QUICKSTART, overrides=common, device="cpu", isolate=False)
    torch.manual_seed(0)
    model = gpt(vocab_size=256, block_size=8, n_embd=16, n_layer=2, n_head=2, n_experts=4)
    for rank in report.ranks:
        held = [(n, p) for i in rank.layers for n, p in model[i].named_parameters()]
        experts = sum(p.numel() * 4 for n, p in held if ".experts." in f".{n}")
        dense = sum(p.numel() * 4 for n, p in held if ".experts." not in f".{n}")
        assert experts and rank.params == dense + experts // 2
        assert rank.buckets == rank.params and rank.grads == 0   # every gradient in a bucket
        assert "all_to_all" in rank.comm


def _zero_worker():
    from hybridpar.optim import MasterWeights
    from hybridpar.optim.zero import zero_optimizer

    topo = hybridpar.init(dp=4, ep=2, timeout=60)
    torch.manual_seed(0)
    pipe = hybridpar.HybridPipe(gpt(**MOE, ep=2), [7], topology=topo, loss_fn=gpt_loss)
    errors = []
    for make in (lambda: zero_optimizer(pipe.parameters(), torch.optim.AdamW,
                                        group=topo.dp_group),
                 lambda: MasterWeights(pipe.parameters(), torch.optim.AdamW,
                                       group=topo.dp_group, shard=True),
                 lambda: pipe.shard_gradients({})):
        try:
            make()
            errors.append(None)
        except ValueError as e:
            errors.append(str(e))
    return errors


def test_zero_over_the_whole_dp_group_of_a_models_experts_is_refused():
    """ZeRO with ep deals the experts' state (and at zero 2 their gradients) over the
    expert-dp group (`pipe_optimizer`); an optimizer sharding experts over the whole dp
    group is refused (torch's ZeroRedundancyOptimizer, sharded master weights), and so are
    sharded gradients without the experts' owners."""
    for errors in hybridpar.spawn(_zero_worker, 4, timeout=120):
        assert all(e is not None for e in errors), errors
        assert "a slice of the experts in an optimizer sharded over the dp group" in \
               errors[0] and errors[0] == errors[1]
        assert "ZeRO-2 with expert parallelism needs expert_owners" in errors[2]


def _bf16_worker():
    """dp 4 x ep 2, bf16 weights: 3 steps with zero 0 (whole masters on every rank) and
    with zero 1 (the dense masters dealt over dp 4, the experts' over expert-dp 2)."""
    from hybridpar.optim import pipe_optimizer

    topo = hybridpar.init(dp=4, ep=2, timeout=60)
    out = {}
    for zero in (0, 1):
        torch.manual_seed(0)
        pipe = hybridpar.HybridPipe(gpt(**MOE, ep=2), [7], topology=topo, loss_fn=gpt_loss,
                                    param_dtype=torch.bfloat16)
        opt = pipe_optimizer(pipe, torch.optim.AdamW, zero=zero, lr=0.01)
        rows = BATCH // 4
        for x, y in _batches(False):
            opt.zero_grad()
            part = slice(topo.dp_rank * rows, (topo.dp_rank + 1) * rows)
            pipe.train_step(x[part], y[part])
            opt.step()
        out[zero] = (pipe.consolidated_state_dict(), len(opt.masters))
    return out


def test_bf16_weights_with_zero_1_and_ep_deal_each_parts_masters_and_train_as_zero_0():
    """Each parameter's float32 master is stepped on one rank of the ranks holding it, so the
    bf16 weights after 3 steps equal zero 0's bit for bit, with fewer masters a rank."""
    for rank in hybridpar.spawn(_bf16_worker, 4, timeout=240):
        (whole, all_masters), (dealt, some_masters) = rank[0], rank[1]
        assert some_masters < all_masters
        for k, v in whole.items():
            assert v.dtype == torch.bfloat16 and torch.equal(dealt[k], v), k


def _bf16_runs(root):
    import dataclasses
    import shutil

    import torch.distributed as dist

    from hybridpar.train.trainer import train

    def bf16(zero):
        config = _config(2, 6, zero)
        return dataclasses.replace(config, train=dataclasses.replace(
            config.train, param_dtype="bf16", precision="bf16"))

    first = train(bf16(1), f"{root}/a", progress=False)["losses"]
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(f"{root}/a/checkpoints/step-6")
    dist.barrier()
    return {"zero1": first, "zero1 resumed": train(bf16(1), f"{root}/a", progress=False)["losses"],
            "zero0": train(bf16(0), f"{root}/b", progress=False)["losses"]}


def test_a_bf16_zero1_run_at_ep2_resumes_from_its_checkpoint_exactly(tmp_path):
    """bf16 weights, zero 1, dp 2 x ep 2 through the trainer: the split masters (dense over
    dp, experts on their ranks) saved and read back: steps 5 and 6 again, to the bit, and
    the run equals zero 0's."""
    for rank in hybridpar.spawn(_bf16_runs, 2, args=(str(tmp_path),), timeout=240):
        assert rank["zero1 resumed"] == rank["zero1"][4:]
        assert rank["zero1"] == rank["zero0"]
