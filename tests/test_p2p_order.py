"""P2P matched by order alone, shapes agreed once per step signature (`hybridpar.comm.p2p`).

When the shapes crossing a stage boundary change between steps (uneven micro-batches, train /
eval / forward interleaved, tp scatter-gather, skip connections), every step still equals the
plain model; a step whose signature was seen before sends no header at all; every rank's P2P
operations, recorded during the real gloo steps, replay under NCCL's rules; and shapes that
disagree between ranks or depend on values are clear errors on every rank.
"""

from functools import cache

import pytest
import torch
from spawn_cases import selected_ids, spawn_by_world, spawn_cases
from torch import nn

import hybridpar
from hybridpar.models import example_batch, gpt, gpt_loss
from hybridpar.pipeline.schedules import replay as nccl
from hybridpar.pipeline.schedules.lowering import lower, lower_stage

from pipe_harness import skipnet

SMALL = {"vocab_size": 32, "block_size": 8, "n_layer": 2, "n_head": 2, "n_embd": 16}
# (kind, rows) per step, chunks = 4: rows 8, 7, 6, 5, 3 make micro-batches of 2+2+2+2,
# 2+2+2+1, 2+2+2, 2+2+1, 1+1+1 rows. A signature is (train or not, micro-batch shapes): eval
# and forward share theirs. Steps 1, 5, 6, 8, 10 repeat a signature seen before.
PLAN = [("train", 8), ("train", 8), ("train", 7), ("eval", 8), ("train", 5), ("forward", 8),
        ("train", 8), ("train", 6), ("eval", 8), ("eval", 3), ("forward", 8)]
REPEATS = {1, 5, 6, 8, 10}
NEW = {0, 2, 3, 4, 7, 9}


def _model(name, tp):
    torch.manual_seed(0)
    if name == "gpt":
        return gpt(**SMALL, tp=tp), gpt_loss
    return skipnet(), nn.functional.cross_entropy


def _batch(name, rows, step):
    if name == "gpt":
        return example_batch("gpt", rows, seed=step, **SMALL)
    g = torch.Generator().manual_seed(step)
    return torch.randn(rows, 8, generator=g), torch.randint(0, 3, (rows,), generator=g)


def _run(name, step_fn):
    """Run PLAN through `step_fn(kind, x, y)`; returns the value of every step."""
    return [step_fn(kind, *_batch(name, rows, step)) for step, (kind, rows) in enumerate(PLAN)]


@cache
def _reference(name):
    """One device's values of the PLAN's steps and its final state (computed once a model)."""
    model, loss_fn = _model(name, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.3)

    def step(kind, x, y):
        if kind == "train":
            opt.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()
            opt.step()
            return loss.item()
        with torch.no_grad():
            return loss_fn(model(x), y).item() if kind == "eval" else model(x)

    return _run(name, step), model.state_dict()


def _worker(name, layout, balance, schedule):
    pp, tp = layout
    topo = hybridpar.init(pp=pp, tp=tp, timeout=60)
    model, loss_fn = _model(name, tp)
    pipe = hybridpar.HybridPipe(model, balance, chunks=4, topology=topo, schedule=schedule,
                                loss_fn=loss_fn)
    opt = torch.optim.SGD(list(pipe.parameters()) or [nn.Parameter(torch.zeros(1))], lr=0.3)
    headers = []
    pipe.p2p_log = []       # every group of P2P operations, as issued, for the NCCL replay

    def step(kind, x, y):
        hybridpar.reset_comm_stats()
        if kind == "train":
            opt.zero_grad()
            value = pipe.train_step(x, y).item()
            opt.step()
        elif kind == "eval":
            value = pipe.eval_step(x, y).item()
        else:
            value = pipe(x)
        headers.append(hybridpar.comm_stats().get("p2p_header", {}).get("calls", 0))
        return value

    values = _run(name, step)
    log = [[[op.kind, op.peer, op.numel, op.dtype, op.label] for op in group]
           for group in pipe.p2p_log]                              # plain lists travel back
    return {"values": values, "headers": headers, "log": log,
            "state": pipe.consolidated_state_dict()}


def assert_plan_matches(results, ref_values, ref_state) -> None:
    """Every rank's values of the PLAN's steps and final state equal one device's."""
    for r in results:
        for (kind, _), got, want in zip(PLAN, r["values"], ref_values):
            if kind == "forward":
                torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
            else:
                assert got == pytest.approx(want, abs=1e-5), kind
        for k, v in ref_state.items():
            torch.testing.assert_close(r["state"][k], v, atol=1e-5, rtol=0)


CHANGING = [
    ("gpt", (2, 1), [2, 3], "1f1b"),
    ("gpt", (2, 2), [2, 3], "gpipe"),     # scatter-gather: each tp rank sends 1/2
    ("gpt", (2, 2), [3, 2], "1f1b"),
    ("skipnet", (3, 1), [2, 2, 3], "1f1b"),  # skip channels between non-adjacent stages
    ("gpt", (2, 2), [3, 2], "zb-h1"),
    ("skipnet", (3, 1), [2, 2, 3], "zb-h1"),
    ("gpt", (2, 2), [1, 1, 2, 1], "zbv"),          # virtual stages: a slot's headers, then
    ("skipnet", (2, 1), [2, 2, 2, 1], "interleaved"),   # its activations (both ends)
]
CHANGING_IDS = [f"{name}-pp{pp}tp{tp}-{schedule}" for name, (pp, tp), _, schedule in CHANGING]


@pytest.fixture(scope="module")
def changing(request):
    """Each selected case of CHANGING (tests/tiers.py holds some for the campaign) run through
    the PLAN: one spawn per world size (2, 3, 4 ranks), a fresh pipe (its own book of agreed
    shapes) per case. repr(case) -> each rank's result."""
    wanted = selected_ids(request, "test_changing_shapes_equal_one_device_and_known_shapes_"
                                   "send_no_header")
    return spawn_by_world(_worker, {repr(case): (case[1][0] * case[1][1], case)
                                    for case, name in zip(CHANGING, CHANGING_IDS)
                                    if name in wanted}, timeout=360)


@pytest.mark.parametrize("name,layout,balance,schedule", CHANGING, ids=CHANGING_IDS)
def test_changing_shapes_equal_one_device_and_known_shapes_send_no_header(name, layout, balance,
                                                                          schedule, changing):
    ref_values, ref_state = _reference(name)
    results = changing[repr((name, layout, balance, schedule))]
    assert_plan_matches(results, ref_values, ref_state)
    per_step = [sum(r["headers"][i] for r in results) for i in range(len(PLAN))]
    assert [per_step[i] for i in sorted(REPEATS)] == [0] * len(REPEATS), per_step
    assert all(per_step[i] > 0 for i in NEW), per_step
    logs = {rank: [[nccl.P2POp(*op) for op in group] for group in r["log"]]
            for rank, r in enumerate(results)}
    result = nccl.replay(logs, check_labels=True)
    assert result.pairs > 0 and all(n > 0 for n in result.groups.values())


def _shapes_worker(mode):
    topo = hybridpar.init(pp=2, timeout=20)
    torch.manual_seed(0)
    layers = [_ValueShaped(), nn.Linear(4, 4), nn.Linear(4, 4)]
    pipe = hybridpar.HybridPipe(nn.Sequential(*layers), [2, 1], chunks=2, topology=topo,
                                loss_fn=lambda out, y: out.pow(2).mean())
    x = torch.ones(4, 4)
    try:
        if mode == "ranks disagree":   # stage 1 is given a batch of other shapes
            rows = 4 if topo.pp_rank == 0 else 6
            pipe.train_step(torch.ones(rows, 4), torch.zeros(rows))
        else:                          # the same input shape, but values change the output
            pipe.train_step(x, torch.zeros(4))
            pipe.train_step(-x, torch.zeros(4))
    except hybridpar.PipelineError as e:
        return str(e)
    except ValueError as e:   # the failing stage: its own error, the step's block as a note
        return "\n".join(getattr(e, "__notes__", [])) + "\n" + str(e)
    return "no error"


class _ValueShaped(nn.Module):
    """Keeps all rows when their mean is positive, else half of them: a value-dependent shape."""

    def forward(self, x):
        return x if bool(x.mean() > 0) else x[: len(x) // 2]


def test_ranks_given_batches_of_different_shapes_fail_with_a_clear_error():
    stage0, stage1 = hybridpar.spawn(_shapes_worker, 2, args=("ranks disagree",), timeout=60)
    assert "for a step of different shapes than this rank's" in stage1, stage1
    assert "input and target of the same shapes" in stage1
    assert "a peer failed first" in stage0 and "different shapes" in stage0, stage0


def test_an_output_shape_that_depends_on_values_fails_with_a_clear_error_on_every_rank():
    stage0, stage1 = hybridpar.spawn(_shapes_worker, 2, args=("values",), timeout=60)
    assert "stage 0 (rank 0) failed at SEND_F(0) of train_step: ValueError: the activation of " \
        "micro-batch 0 is (1, 4) torch.float32 but in the first step of these input shapes it " \
        "was (2, 4) torch.float32" in stage0, stage0
    assert "not on values" in stage0
    assert "a peer failed first: stage 0 (rank 0) failed at SEND_F(0)" in stage1, stage1


def _tagged_worker(env_value):
    import os
    os.environ["HYBRIDPAR_P2P_TAGS"] = env_value
    try:
        topo = hybridpar.init(pp=3, timeout=60)
    except ValueError as e:
        return str(e)
    model, loss_fn = _model("skipnet", 1)
    pipe = hybridpar.HybridPipe(model, [2, 2, 3], chunks=4, topology=topo, schedule="1f1b",
                                loss_fn=loss_fn)
    x, y = _batch("skipnet", 8, 0)
    return [topo.p2p_tags, pipe.train_step(x, y).item(), pipe.eval_step(x, y).item()]


def test_tags_per_channel_are_an_opt_in_that_trains_the_same():
    model, loss_fn = _model("skipnet", 1)
    x, y = _batch("skipnet", 8, 0)
    want = loss_fn(model(x), y).item()
    for tags, loss, evaluated in hybridpar.spawn(_tagged_worker, 3, args=("1",), timeout=60):
        assert tags is True
        assert loss == pytest.approx(want, abs=1e-6) and evaluated == pytest.approx(want, abs=1e-6)
    errors = hybridpar.spawn(_tagged_worker, 3, args=("maybe",), timeout=60)
    assert all("HYBRIDPAR_P2P_TAGS must be 0 or 1, got 'maybe'" in e for e in errors)


def _steady_log_worker(schedules):
    topo = hybridpar.init(pp=3, timeout=60)
    x, y = _batch("skipnet", 8, 0)
    out = {}
    for schedule in schedules:
        pipe = hybridpar.HybridPipe(skipnet(), [2, 2, 3], chunks=4, topology=topo,
                                    schedule=schedule, loss_fn=nn.functional.cross_entropy)
        pipe.train_step(x, y)   # learns the shapes
        pipe.p2p_log = []       # a steady step: gloo posts receives computes ahead
        pipe.train_step(x, y)
        skip_in, skip_out = pipe.skip_routes
        routes = [(src, topo.pp_rank) for src, rs in skip_in.items() for _ in rs] + \
                 [(topo.pp_rank, dst) for dst, rs in skip_out.items() for _ in rs]
        actions = lower(pipe.layout.schedule_of(4), routes=routes)[topo.pp_rank]
        want = lower_stage(actions, topo.pp_rank, routes=routes, rank_of=lambda s: s)
        out[schedule] = (_per_queue(pipe.p2p_log), _per_queue(want))
    return out


def _per_queue(groups):
    """Each group's ops in the order NCCL matches them: per (send or receive, peer), in turn
    (how sends and receives interleave inside one group does not matter to it)."""
    return [sorted([(op.kind, op.peer, op.label) for op in group], key=lambda o: o[:2])
            for group in groups]


def test_the_log_of_a_steady_step_has_each_early_receive_in_the_group_of_its_slot():
    """On gloo the receives of the next two computes are posted ahead of their slots; the log
    the NCCL replay reads still has each one in its own slot's group, as NCCL would issue it:
    exactly the lowering's groups (skips between stages 0 and 2; GPipe has slots with no
    compute between them)."""
    for rank, result in enumerate(hybridpar.spawn(_steady_log_worker, 3,
                                                  args=(["1f1b", "gpipe"],), timeout=120)):
        for schedule, (logged, lowered) in result.items():
            assert logged == lowered, (rank, schedule)
            assert any(kind == "recv" for group in logged for kind, _, _ in group)


def _first_compute_worker(schedule):
    topo = hybridpar.init(pp=2, timeout=60)
    x, y = _batch("skipnet", 8, 0)
    pipe = hybridpar.HybridPipe(skipnet(), [3, 4], chunks=4, topology=topo, schedule=schedule,
                                loss_fn=nn.functional.cross_entropy)
    events = []
    first = pipe.partition_of(pipe.stages[0])[0]
    first.register_forward_pre_hook(lambda *_: events.append("forward"))
    irecv, wait = torch.distributed.irecv, hybridpar.comm.p2p.wait

    def counted_irecv(tensor, src=None, group=None, tag=0, **kw):
        events.append("loss receive" if tag else "receive")
        return irecv(tensor, src, group, tag, **kw)

    def counted_wait(work, timeout):
        events.append("wait")
        return wait(work, timeout)

    pipe.train_step(x, y)          # learns the shapes
    events.clear()
    torch.distributed.irecv, hybridpar.comm.p2p.wait = counted_irecv, counted_wait
    try:
        loss = pipe.train_step(x, y).item()
    finally:
        torch.distributed.irecv, hybridpar.comm.p2p.wait = irecv, wait
    return events, loss


@pytest.fixture(scope="module")
def first_computes():
    """`_first_compute_worker` under 1F1B, then GPipe, on the same 2 ranks."""
    return spawn_cases(_first_compute_worker, 2, {s: (s,) for s in ("1f1b", "gpipe")},
                       timeout=120)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_the_first_stage_starts_computing_at_once_and_posts_the_loss_receive_when_it_waits(
        schedule, first_computes):
    """The whole pipeline waits for the first stage's first forward: in a steady step nothing
    is posted before it (gloo prefetch starts at the next compute); the loss's receive is
    posted just before the first wait for a peer (`LossShare`), and the loss is right."""
    (events, loss), (_, last_loss) = first_computes[schedule]
    assert events[0] == "forward", events[:4]
    assert events.count("loss receive") == 1
    assert events[events.index("loss receive") + 1] == "wait", events
    assert events.index("loss receive") < events.index("wait")
    assert loss == pytest.approx(last_loss, abs=0)
