"""Bad input to HybridPipe: a clear error on every rank, never a hang.

Cases that raise before any message or train to the end share a spawn (module fixtures, a
test per case); a pipeline stopped mid-step or a rank made to stall gets a spawn of its own.
"""

import copy
import re
import time

import pytest
import torch
from spawn_cases import spawn_cases
from torch import nn
from torchgpipe.skip import pop, skippable

import hybridpar
from hybridpar.pipeline.schedules.schedule import get_schedule

from pipe_harness import mlp


@skippable(pop=["nowhere"])
class PopsNothing(nn.Module):
    def forward(self, x):
        yield pop("nowhere")
        return x


def _build(case):
    topo = hybridpar.init(pp=2, timeout=30)
    model = mlp()
    ce = nn.functional.cross_entropy
    builders = {
        "not sequential": lambda: hybridpar.HybridPipe(nn.ModuleList(model), [2, 2],
                                                       topology=topo),
        "balance length": lambda: hybridpar.HybridPipe(model, [4], topology=topo),
        "balance sum": lambda: hybridpar.HybridPipe(model, [2, 3], topology=topo),
        "balance zero": lambda: hybridpar.HybridPipe(model, [4, 0], topology=topo),
        "balance type": lambda: hybridpar.HybridPipe(model, [2.0, 2.0], topology=topo),
        "chunks": lambda: hybridpar.HybridPipe(model, [2, 2], chunks=0, topology=topo),
        "checkpoint": lambda: hybridpar.HybridPipe(model, [2, 2], checkpoint="sometimes",
                                                   topology=topo),
        "schedule": lambda: hybridpar.HybridPipe(model, [2, 2], schedule="zb", topology=topo),
        "pop without stash": lambda: hybridpar.HybridPipe(
            nn.Sequential(nn.Linear(2, 2), PopsNothing()), [1, 1], topology=topo),
        "empty model": lambda: hybridpar.HybridPipe(nn.Sequential(), [1, 1], topology=topo),
        "no loss": lambda: hybridpar.HybridPipe(model, [2, 2], topology=topo).train_step(
            torch.randn(4, 8), torch.zeros(4, dtype=torch.long)),
        "rows differ": lambda: hybridpar.HybridPipe(model, [2, 2], topology=topo,
                                                    loss_fn=ce).train_step(
            torch.randn(4, 8), torch.zeros(3, dtype=torch.long)),
        "empty batch": lambda: hybridpar.HybridPipe(model, [2, 2], topology=topo,
                                                    loss_fn=ce).train_step(
            torch.randn(0, 8), torch.zeros(0, dtype=torch.long)),
        "not a tensor": lambda: hybridpar.HybridPipe(model, [2, 2], topology=topo,
                                                     loss_fn=ce).train_step(
            [1.0, 2.0], torch.zeros(2, dtype=torch.long)),
    }
    try:
        builders[case]()
    except Exception as e:
        return [type(e).__name__, str(e)]
    return ["no error", ""]


BAD_INPUTS = [
    ("not sequential", "TypeError", "needs an nn.Sequential, got ModuleList"),
    ("balance length", "ValueError", "balance [4] has 1 stages but the pipeline has pp=2"),
    ("balance sum", "ValueError", "covers 5 layers but the model has 4"),
    ("balance zero", "ValueError", "has a stage with no layer"),
    ("balance type", "TypeError", "balance must hold integers"),
    ("chunks", "ValueError", "chunks must be a positive integer"),
    ("checkpoint", "ValueError", "checkpoint must be one of 'always'"),
    ("schedule", "ValueError", "unknown schedule 'zb'"),
    ("pop without stash", "TypeError", "'nowhere'"),
    ("empty model", "ValueError", "empty nn.Sequential"),
    ("no loss", "ValueError", "train_step needs a loss"),
    ("rows differ", "ValueError", "input has 4 rows but target has 3"),
    ("empty batch", "ValueError", "has no rows"),
    ("not a tensor", "TypeError", "must be a Tensor or a tuple of Tensors, got list"),
]


@pytest.fixture(scope="module")
def bad_inputs():
    """Every bad input, one after another on the same 2 ranks (none sends a message)."""
    return spawn_cases(_build, 2, {case: (case,) for case, _, _ in BAD_INPUTS}, timeout=120)


@pytest.mark.parametrize("case,error,phrase", BAD_INPUTS)
def test_bad_input_is_a_clear_error_on_every_rank(case, error, phrase, bad_inputs):
    for kind, message in bad_inputs[case]:
        assert kind == error, message
        assert phrase in message


def _no_init():
    try:
        hybridpar.HybridPipe(mlp(), [4])
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_a_pipe_before_init_says_to_call_init():
    (message,) = hybridpar.spawn(_no_init, 1, timeout=60)
    assert "call hybridpar.init" in message


class ReturnsADict(nn.Module):
    def forward(self, x):
        return {"x": x}


def _bad_stage_output():
    topo = hybridpar.init(pp=2, timeout=300)
    pipe = hybridpar.HybridPipe(nn.Sequential(ReturnsADict(), nn.Identity()), [1, 1],
                                topology=topo, loss_fn=lambda out, y: out.sum())
    pipe.train_step(torch.randn(4, 2), torch.zeros(4))


def test_a_stage_that_fails_brings_the_job_down_promptly_with_its_error():
    start = time.monotonic()
    with pytest.raises(hybridpar.SpawnError) as info:
        hybridpar.spawn(_bad_stage_output, 2, timeout=120)
    assert info.value.rank == 0  # the original error, not the peer's wait
    assert "stage 0" in info.value.trace and "F(0)" in info.value.trace
    assert "returned dict; a stage must return a Tensor or a tuple of Tensors" in info.value.trace
    assert time.monotonic() - start < 30  # far below the 300 s wait timeout


def _stage_zero_stalls():
    topo = hybridpar.init(pp=2, timeout=2)
    pipe = hybridpar.HybridPipe(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), [1, 1],
                                topology=topo, loss_fn=lambda out, y: out.sum())
    if topo.pp_rank == 0:
        time.sleep(3.5)  # never sends within its peer's 2 s timeout (and spawn keeps
        return "stalled"  # this rank's process up until the peer has reported)
    start = time.monotonic()
    try:
        pipe.train_step(torch.randn(2, 2), torch.zeros(2))
    except hybridpar.PipelineError as e:
        return [time.monotonic() - start, str(e)]
    return "no error"


def test_a_wait_past_the_topology_timeout_names_the_stage_microbatch_and_peer():
    _, (waited, message) = hybridpar.spawn(_stage_zero_stalls, 2, timeout=60)
    assert waited < 5
    assert message.startswith(
        "stage 1 (rank 1) gave up at F(0) of train_step after 0:00:02 waiting to receive the "
        "activation of micro-batch 0 from stage 0 (rank 0)"), message
    assert "  last completed: RECV_F(0)" in message
    assert "parallel.timeout" in message            # how to fix it, if the peer is only slow


# timeouts and failures on 4 stages: every other rank reports one block -------------------

TIMEOUT = 2


def _four_stages(mode, schedule):
    """pp=4, 2 micro-batches; `mode` breaks stage 1: it sleeps (stuck but alive), skips its
    SEND_F(1) in the second step, or raises in F(0). Each rank returns (seconds until it
    stopped, message)."""
    topo = hybridpar.init(pp=4, timeout=TIMEOUT)
    torch.manual_seed(0)
    pipe = hybridpar.HybridPipe(nn.Sequential(*[nn.Linear(4, 4) for _ in range(4)]),
                                [1, 1, 1, 1], chunks=2, topology=topo, schedule=schedule,
                                loss_fn=lambda out, y: out.pow(2).mean())
    x, y = torch.randn(4, 4), torch.zeros(4)
    if mode == "skip send" and topo.pp_rank != 1:
        pipe.train_step(x, y)
    if topo.pp_rank == 1:
        if mode == "sleep":
            time.sleep(TIMEOUT + 1.5)
            return [0.0, "slept"]
        if mode == "skip send":   # after a first step has agreed the message shapes
            pipe.train_step(x, y)
            real = pipe._executor._communicate
            pipe._executor._communicate = \
                lambda a: None if str(a) == "SEND_F1" else real(a)
        if mode == "raise":
            pipe.partition[0].register_forward_hook(lambda *_: {"not": "a tensor"})
    start = time.monotonic()
    try:
        pipe.train_step(x, y)
    except Exception as e:   # peers: PipelineError; the failing rank: its own error + the block
        return [time.monotonic() - start, _block_of(e), type(e).__name__]
    return [time.monotonic() - start, "no error", ""]


def _block_of(error):
    """The step's block: a PipelineError's message, or the note on the failing rank's error."""
    if isinstance(error, hybridpar.PipelineError):
        return str(error)
    return "\n".join(getattr(error, "__notes__", [])) or f"no block on {error!r}"


def _block(message):
    """The message's headline and its `key: value` lines."""
    head, *rest = message.splitlines()
    pairs = (line.split(":", 1) for line in rest if ":" in line)
    fields = {key.strip(): value.strip() for key, value in pairs}
    return head, fields


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_stuck_stage_makes_every_other_rank_report_where_it_waits(schedule):
    start = time.monotonic()
    results = hybridpar.spawn(_four_stages, 4, args=("sleep", schedule), timeout=60)
    # Nobody waited out a hang: the spawn returned far inside its own 60 s limit (each rank's
    # own time to give up is bounded below; start-up on a loaded 2-core machine took 8-10 s)
    assert time.monotonic() - start < 30
    for rank in (0, 2, 3):
        waited, message, _ = results[rank]
        _, fields = _block(message)
        assert waited < TIMEOUT + 3, (rank, waited)
        assert fields["stage"] == f"{rank} of 4 (rank {rank})", message
        assert re.fullmatch(r"[A-Z_]+\(\d\), micro-batch \d \(action \d+ of \d+ of this "
                            r"train_step\)", fields["action"]), message
        assert "last completed" in fields, message
    # the neighbours of the stuck stage time out on it
    head0, f0 = _block(results[0][1])
    assert head0.startswith("stage 0 (rank 0) gave up at B(")
    assert f0["waiting for"].startswith("receive the gradient of micro-batch ")
    assert f0["waiting for"].endswith("from stage 1 (rank 1)")
    head2, f2 = _block(results[2][1])
    assert head2.startswith("stage 2 (rank 2) gave up at F(0) of train_step after 0:00:02")
    assert f2["waiting for"] == "receive the activation of micro-batch 0 from stage 1 (rank 1)"
    assert f2["last completed"] == previous(schedule, 2, "F0")
    assert "Timed out" in f2["cause"]
    # stage 3 waits on stage 2: its own timeout or stage 2's abort, whichever comes first
    head3, f3 = _block(results[3][1])
    assert head3.startswith(("stage 3 (rank 3) gave up at F(0)", "stage 3 (rank 3) stopped at "
                             "F(0) of train_step; a peer failed first: stage 2 (rank 2) gave up "
                             "at F(0)")), head3
    assert f3["waiting for"].startswith("receive the activation of micro-batch 0 from stage 2")


def previous(schedule, stage, action):
    """The action before `action` in `stage`'s list (its last completed one when it waits)."""
    actions = [str(a) for a in get_schedule(schedule)(4, 2)[stage]]
    before = actions[actions.index(action) - 1]
    return re.sub(r"(\D+)(\d+)", r"\1(\2)", before)


def test_a_skipped_send_is_reported_by_both_ends_with_the_last_completed_action():
    results = hybridpar.spawn(_four_stages, 4, args=("skip send", "gpipe"), timeout=60)
    head2, f2 = _block(results[2][1])
    # stage 1 waits first, so its timeout can end its process while stage 2 still waits on
    # it (seen under load): then stage 2 reports the loss of stage 1, at the same action
    if head2.startswith("stage 2 (rank 2) lost stage 1 (rank 1) at F(1) of train_step"):
        assert head2.endswith("waited to receive the activation of micro-batch 1 from it"), head2
    else:
        assert head2.startswith("stage 2 (rank 2) gave up at F(1) of train_step"), head2
        assert f2["waiting for"] == ("receive the activation of micro-batch 1 from stage 1 "
                                     "(rank 1)")
        assert f2["last completed"] == previous("gpipe", 2, "F1")
    head1, f1 = _block(results[1][1])          # stage 1 itself waits for a gradient
    assert head1.startswith("stage 1 (rank 1) gave up at B(1)"), head1
    assert f1["waiting for"].endswith("from stage 2 (rank 2)")
    assert all(waited < TIMEOUT + 4 for waited, _, _ in results), results


def test_an_exception_on_one_stage_stops_every_stage_promptly_with_that_error():
    results = hybridpar.spawn(_four_stages, 4, args=("raise", "1f1b"), timeout=60)
    original = "stage 1 (rank 1) failed at F(0) of train_step: TypeError: stage 1 returned dict"
    assert results[1][1].startswith(original), results[1][1]
    assert results[1][2] == "TypeError"      # the failing rank raises its own exception
    for rank in (0, 2, 3):
        waited, message, kind = results[rank]
        assert kind == "PipelineError"
        assert waited < TIMEOUT, (rank, waited)          # an abort, not the timeout
        head, fields = _block(message)
        assert head.startswith(f"stage {rank} (rank {rank}) stopped at "), head
        assert f"; a peer failed first: {original}" in head, head
        assert "which sent an abort instead" in fields["waiting for"]


class Fails(nn.Module):
    def forward(self, x):
        raise KeyError("boom")


def _forward_only_failure(step, failing):
    """pp=3, stage `failing` raises in `pipe(x)` or `eval_step` and stays alive past the
    timeout; each rank returns (seconds until it stopped, error type, message)."""
    topo = hybridpar.init(pp=3, timeout=TIMEOUT)
    layers = [nn.Linear(4, 4) for _ in range(3)]
    layers[failing] = Fails()
    pipe = hybridpar.HybridPipe(nn.Sequential(*layers), [1, 1, 1], chunks=3, topology=topo,
                                loss_fn=lambda out, y: out.pow(2).mean())
    x = torch.randn(6, 4)
    start = time.monotonic()
    try:
        pipe(x) if step == "forward" else pipe.eval_step(x, x)
        kind, message = "", "no error"
    except Exception as e:
        kind, message = type(e).__name__, str(e)
    seconds = time.monotonic() - start
    if topo.pp_rank == failing:
        time.sleep(TIMEOUT + 0.5)   # its peers must not need its process to end
    return [seconds, kind, message]


@pytest.mark.parametrize("step,failing", [("forward", 1), ("eval_step", 2)])
def test_a_failure_in_a_forward_only_step_stops_the_stages_it_owes_nothing(step, failing):
    # the stages before the failed one wait on sends to it, in the output broadcast or in the
    # loss: their listeners read its failure in the store and break those waits
    results = hybridpar.spawn(_forward_only_failure, 3, args=(step, failing), timeout=60)
    assert results[failing][1] == "KeyError"
    for rank, (seconds, kind, message) in enumerate(results):
        if rank == failing:
            continue
        assert kind == "PipelineError" and seconds < TIMEOUT, (rank, seconds, message)
        head, _ = _block(message)
        assert f"a peer failed first: stage {failing} (rank {failing}) failed at F(0) of " \
            f"{step}: KeyError: 'boom'" in head, head


def _dp_replica_stalls():
    topo = hybridpar.init(dp=2, timeout=TIMEOUT)
    pipe = hybridpar.HybridPipe(nn.Sequential(nn.Linear(2, 2)), [1], topology=topo,
                                loss_fn=lambda out, y: out.sum())
    if topo.dp_rank == 1:
        time.sleep(TIMEOUT + 1.5)
        return "slept"
    try:
        pipe.train_step(torch.randn(2, 2), torch.zeros(2))
    except hybridpar.PipelineError as e:
        return str(e)
    return "no error"


def test_a_collective_after_the_schedule_reports_its_group_on_timeout():
    message, _ = hybridpar.spawn(_dp_replica_stalls, 2, timeout=60)
    head, fields = _block(message)
    assert head.startswith("stage 0 (rank 0) gave up in the all-reduce of the gradients over dp "
                           "(ranks [0, 1]) after its schedule of train_step ran"), message
    assert fields["last completed"] == "B(0)"
    assert "stuck, died, or failed first" in fields["hint"]


# few rows: fewer micro-batches than stages, a batch smaller than chunks -------------------

def _small_batches(rows, chunks, schedule):
    topo = hybridpar.init(pp=4, timeout=30)
    model = mlp()
    plain = copy.deepcopy(model)
    pipe = hybridpar.HybridPipe(model, [1, 1, 1, 1], chunks=chunks, topology=topo,
                                schedule=schedule, loss_fn=nn.functional.cross_entropy)
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(rows, 8, generator=g), torch.randint(0, 3, (rows,), generator=g)
    loss = pipe.train_step(x, y)
    expected = nn.functional.cross_entropy(plain(x), y)
    expected.backward()
    grads = {n: p.grad for n, p in pipe.named_parameters()}
    plain_grads = dict(plain.named_parameters())
    worst = max((grads[n] - plain_grads[n].grad).abs().max().item() for n in grads)
    with torch.no_grad():
        out_err = (pipe(x) - plain(x)).abs().max().item()
    return {"loss": (loss - expected).abs().item(), "grad": worst, "out": out_err}


SMALL_BATCHES = [
    (1, 4, "gpipe"),      # one micro-batch on four stages
    (1, 4, "1f1b"),
    (3, 4, "1f1b"),       # fewer rows than chunks: three micro-batches of one row
    (5, 4, "gpipe"),      # torch.chunk: 2 + 2 + 1 rows
]


@pytest.fixture(scope="module")
def small_batches():
    """Every (rows, chunks, schedule) of SMALL_BATCHES, in turn on the same 4 ranks."""
    return spawn_cases(_small_batches, 4, {case: case for case in SMALL_BATCHES}, timeout=120)


@pytest.mark.parametrize("rows,chunks,schedule", SMALL_BATCHES)
def test_fewer_rows_than_chunks_or_stages_train_like_one_device(rows, chunks, schedule,
                                                                small_batches):
    for result in small_batches[rows, chunks, schedule]:
        assert max(result.values()) < 1e-6, result


def _named_balance(name, with_sample):
    topo = hybridpar.init(pp=2, timeout=60)
    sample = torch.randn(4, 8) if with_sample else None
    try:
        pipe = hybridpar.HybridPipe(mlp(), name, topology=topo, balance_sample=sample,
                                    loss_fn=nn.functional.cross_entropy)
    except ValueError as e:
        return str(e)
    loss = pipe.train_step(torch.randn(4, 8), torch.zeros(4, dtype=torch.long))
    return {"balance": pipe.balance, "loss": loss.item()}


@pytest.fixture(scope="module")
def named_balances():
    """Each balance name with a sample, then 'time' without one and an unknown name, in
    turn on the same 2 ranks (the refusals come before any message)."""
    cases = {name: (name, True) for name in ("params", "uniform", "time", "size")}
    cases["time without a sample"] = ("time", False)
    cases["fastest"] = ("fastest", True)
    return spawn_cases(_named_balance, 2, cases, timeout=120)


@pytest.mark.parametrize("name", ["params", "uniform", "time", "size"])
def test_named_balances_give_every_rank_the_same_split(name, named_balances):
    r0, r1 = named_balances[name]
    assert r0["balance"] == r1["balance"] and sum(r0["balance"]) == 4
    assert min(r0["balance"]) >= 1 and r0["loss"] == r1["loss"]


def test_profiling_balances_need_a_sample_and_unknown_names_are_rejected(named_balances):
    for message in named_balances["time without a sample"]:
        assert "balance='time' profiles the model on a sample: pass balance_sample=" in message
    for message in named_balances["fastest"]:
        assert "unknown balance 'fastest'" in message
