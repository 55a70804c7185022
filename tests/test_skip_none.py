"""None and conditional skips across stages (torchgpipe allows None in place of a skip).

The runs that train to the end are cases of one spawn per world size (the `runs` module
fixture); the one that fails mid-step keeps a spawn of its own."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from spawn_cases import spawn_cases
from torch import nn
from torchgpipe.skip import pop, skippable, stash

import hybridpar
from hybridpar.pipeline.schedules.replay import P2POp, replay

WIDTH = 6


@skippable(stash=["maybe", "always"])
class MaybeStash(nn.Module):
    """torchgpipe's user-guide conditional skip: the input when `test(input)`, else None."""

    def __init__(self, rule: str) -> None:
        super().__init__()
        self.rule = rule
        self.fc = nn.Linear(WIDTH, WIDTH)

    def test(self, x):
        if self.rule == "never":
            return False
        if self.rule == "even rows":          # known from the shapes: agreed with them
            return x.shape[0] % 2 == 0
        return bool(x.sum() > 0)              # "values": changes with the data

    def forward(self, x):
        yield stash("maybe", x if self.test(x) else None)
        yield stash("always", x * 2)          # a second skip in the same message
        return torch.tanh(self.fc(x))


@skippable(pop=["maybe", "always"])
class MaybePop(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        out = self.fc(x)
        maybe = yield pop("maybe")
        always = yield pop("always")
        if maybe is not None:
            out = out + maybe
        return out + always


def model(rule: str) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(MaybeStash(rule), nn.Linear(WIDTH, WIDTH), nn.Tanh(), MaybePop(),
                         nn.Linear(WIDTH, 3)).double()


def batches(rows: list[int], sign: list[float]):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(n, WIDTH, generator=g, dtype=torch.float64).abs() * s,
             torch.randint(0, 3, (n,), generator=g)) for n, s in zip(rows, sign)]


def one_device(rule, data, chunks):
    net = model(rule)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    losses = []
    for x, y in data:   # as the pipe: micro-batch losses weighted by their rows
        opt.zero_grad()
        parts = list(zip(x.chunk(chunks), y.chunk(chunks)))
        loss = sum(F.cross_entropy(net(a), b) * len(a) / len(x) for a, b in parts)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, net.state_dict()


def worker(rule, balance, schedule, checkpoint, data, chunks):
    topo = hybridpar.init(pp=len(balance), timeout=30)
    pipe = hybridpar.HybridPipe(model(rule), balance, chunks=chunks, topology=topo,
                                schedule=schedule, checkpoint=checkpoint, loss_fn=F.cross_entropy)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    pipe.p2p_log = []          # the P2P groups, replayed under NCCL's rules by the test
    losses = []
    try:
        for x, y in data:
            opt.zero_grad()
            losses.append(pipe.train_step(x, y).item())
            opt.step()
    except Exception as e:
        return {"error": "\n".join([f"{type(e).__name__}: {e}", *getattr(e, "__notes__", [])])}
    out = pipe(data[0][0])
    log = [[[op.kind, op.peer, op.numel, op.dtype, op.label] for op in group]
           for group in pipe.p2p_log]
    return {"losses": losses, "state": pipe.consolidated_state_dict(), "out": out, "log": log}


RULES = [("never", [8, 8, 8]), ("even rows", [8, 6, 8])]
STAGES = [
    ([1, 4], "gpipe", "always"),
    ([2, 2, 1], "1f1b", "except_last"),
    ([1, 3, 1], "1f1b", "never"),
]


@pytest.fixture(scope="module")
def runs():
    """Every (rule, rows) x (balance, schedule, checkpoint) run, by name, as cases of one
    spawn per world size (2 and 3 ranks): none stops mid-step."""
    cases = {f"{rule} {rows} {balance} {schedule} {checkpoint}": (
        len(balance), (rule, balance, schedule, checkpoint, batches(rows, [1.0] * len(rows)), 2))
        for rule, rows in RULES for balance, schedule, checkpoint in STAGES}
    out = {}
    for world in (2, 3):
        out.update(spawn_cases(worker, world, {
            name: args for name, (w, args) in cases.items() if w == world}, timeout=240))
    return out


@pytest.mark.parametrize("rule,rows", RULES)
@pytest.mark.parametrize("balance,schedule,checkpoint", STAGES)
def test_none_and_conditional_skips_cross_stages_as_on_one_device(rule, rows, balance, schedule,
                                                                  checkpoint, runs):
    chunks = 2
    # "even rows": 8 rows give micro-batches of 4 (skip present), 6 give 3 (None)
    data = batches(rows, [1.0] * len(rows))
    ref_losses, ref_state = one_device(rule, data, chunks)
    ref_out = model(rule)
    ref_out.load_state_dict(ref_state)
    results = runs[f"{rule} {rows} {balance} {schedule} {checkpoint}"]
    logs = {rank: [[P2POp(*op) for op in group] for group in r["log"]]
            for rank, r in enumerate(results)}
    assert replay(logs, check_labels=True).pairs > 0   # an order NCCL can progress
    for r in results:
        assert "error" not in r, r.get("error")
        assert r["losses"] == pytest.approx(ref_losses, rel=1e-6)
        for k, v in ref_state.items():
            torch.testing.assert_close(r["state"][k], v, atol=1e-12, rtol=0)
        torch.testing.assert_close(r["out"], ref_out(data[0][0]), atol=1e-12, rtol=0)


def test_a_skip_whose_presence_changes_with_values_is_a_clear_error_on_every_rank():
    data = batches([4, 4], [1.0, -1.0])    # the same shapes: present, then None
    results = hybridpar.spawn(worker, 2, args=("values", [1, 4], "gpipe", "never", data, 2),
                              timeout=120)
    stash_rank, pop_rank = (r["error"] for r in results)
    assert "ValueError: the skips of micro-batch 0 is (2, 6) torch.float64, None but in the " \
        "first step of these input shapes it was (2, 6) torch.float64, (2, 6) " in stash_rank
    assert "a skip stashed as None must be None" in stash_rank and "not on values" in stash_rank
    assert "PipelineError" in pop_rank and "a peer failed first" in pop_rank, pop_rank
