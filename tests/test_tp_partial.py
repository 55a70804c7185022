"""Replicated parameters used on a tp shard: found by the data flow, summed over tp, checked.

A per-head scale between a column and its row layer is Qwen3's q_norm in miniature: on a tp
rank it multiplies that rank's heads only, so its gradient there is a part. The flow finds it
("auto" and dict plans), a plan style or `register_partial_grad` asks for it, HybridPipe sums
it over tp once per step, and `check_replicas` turns a missing sum into an error on every
rank. The exact collective count: Qwen3 costs one all-reduce more than Llama per step.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hybridpar
from hybridpar.nn import ParallelLinear, register_partial_grad
from hybridpar.pipeline.parameters.replicas import ReplicaMismatchError
from hybridpar.tensor_parallel.plans.layer_graph import Layers
from hybridpar.tensor_parallel.plans.plan_flow import resolve_auto

from pipe_harness import attempt, checked_step

F64 = torch.float64
WIDTH, HIDDEN, HEAD = 8, 16, 4
SAMPLE = ((torch.zeros(2, 3, WIDTH, dtype=F64, device="meta"),), {})


class HeadScale(nn.Module):
    """fc1 -> (heads of 4) x scale -> GELU -> fc2; `also_on_input`: the scale also multiplies
    the (full) input, whose gradient is then part shard, part whole."""

    def __init__(self, also_on_input: bool = False) -> None:
        super().__init__()
        self.also_on_input = also_on_input
        self.fc1 = nn.Linear(WIDTH, HIDDEN, dtype=F64)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, HEAD, dtype=F64))
        self.fc2 = nn.Linear(HIDDEN, WIDTH, dtype=F64)

    def forward(self, x):
        h = self.fc1(x)                                     # (B, T, H)
        h = h.view(*h.shape[:-1], -1, HEAD) * self.scale    # (B, T, H / 4, 4)
        out = self.fc2(F.gelu(h.flatten(-2)))               # (B, T, W)
        if self.also_on_input:
            out = out + (x.view(*x.shape[:-1], -1, HEAD) * self.scale).flatten(-2)
        return out


def _model(seed: int = 0, also_on_input: bool = False) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(HeadScale(also_on_input), nn.Linear(WIDTH, 3, dtype=F64))


# the data flow (no process group: the plan's analysis alone) ----------------------------------

def test_auto_finds_a_replicated_parameter_used_on_a_shard():
    model = _model()
    styles, _, _, _, partial, _, _ = resolve_auto(model, Layers(model), 2, SAMPLE)
    assert styles["0.fc1"] == "column" and styles["0.fc2"] == "row"
    assert partial == {"0.scale": {"0.fc1"}}


def test_auto_replicates_columns_whose_shard_meets_a_parameter_also_used_on_full_tensors():
    model = _model(also_on_input=True)
    styles, notes, _, _, partial, _, _ = resolve_auto(model, Layers(model), 2, SAMPLE)
    assert styles.get("0.fc1") is None and styles.get("0.fc2") is None and partial == {}
    assert "'0.scale', which is also used on full activations" in notes["0.fc1"]


def test_parameters_used_on_full_activations_only_are_not_partial():
    model = nn.Sequential(nn.Linear(WIDTH, HIDDEN, dtype=F64), nn.GELU(),
                          nn.Linear(HIDDEN, WIDTH, dtype=F64), nn.LayerNorm(WIDTH, dtype=F64))
    styles, _, _, _, partial, _, _ = resolve_auto(model, Layers(model), 2, SAMPLE)
    assert styles["0"] == "column" and styles["2"] == "row" and partial == {}


# trained: the sum over tp, and the replica check ----------------------------------------------

def _batches():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 5, WIDTH, generator=g, dtype=F64),
             torch.randint(0, 3, (4, 5), generator=g)) for _ in range(3)]


def _loss(out, y):
    return F.cross_entropy(out.flatten(0, 1), y.flatten())


def _reference():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for x, y in _batches():
        opt.zero_grad()
        loss = _loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, model.state_dict()


def _by_hand(mark: bool) -> nn.Sequential:
    """The model with ParallelLinear layers and no plan: the scale tagged by hand, or not."""
    model = _model()
    block = model[0]
    block.fc1 = ParallelLinear.from_module(block.fc1, -1)
    block.fc2 = ParallelLinear.from_module(block.fc2, 0)
    # GELU drops the shard's tag (as torchshard's users, re-tag it): fc2 reads its shard
    block.fc2.register_forward_pre_hook(lambda _, args: hybridpar.register_parallel_dim(
        args[0], -1))
    if mark:
        register_partial_grad(block.scale)
    return model


def _train(how: str, pp: int = 1):
    topo = hybridpar.init(pp=pp, tp=2, timeout=60)
    plans = {"auto": "auto", "style": {"0.fc1": "column", "0.fc2": "row",
                                       "0": "replicate_sum_grad"}}
    model = _by_hand(how == "by hand") if how in ("by hand", "unmarked") else _model()
    pipe = hybridpar.HybridPipe(model, [1] * pp if pp > 1 else [2], topology=topo, chunks=2,
                                loss_fn=_loss, tp_plan=plans.get(how))
    opt = torch.optim.SGD(pipe.parameters(), lr=0.5)
    losses = []
    for x, y in _batches():
        opt.zero_grad()
        losses.append(checked_step(pipe, x, y))
        opt.step()
    return {"losses": losses, "state": pipe.consolidated_state_dict(),
            "partial": pipe.partial_grads}


@pytest.fixture(scope="module")
def trained():
    from spawn_cases import spawn_cases

    return spawn_cases(_train, 2, {how: (how,) for how in ("auto", "style", "by hand")},
                       timeout=120)


@pytest.mark.parametrize("how", ["auto", "style", "by hand"])
def test_a_partial_gradient_summed_over_tp_trains_as_on_one_device(how, trained):
    ref_losses, ref_state = _reference()
    for r in trained[how]:
        assert r["partial"] == ["0.scale"]
        assert r["losses"] == pytest.approx(ref_losses, rel=1e-7)   # reported in float32
        for k, v in ref_state.items():
            torch.testing.assert_close(r["state"][k], v, atol=1e-12, rtol=0, msg=k)


def _unmarked():
    return attempt(lambda: _train("unmarked", pp=2))


def test_a_missing_sum_is_a_replica_mismatch_on_every_rank():
    # pp = 2 x tp = 2: the scale lives on stage 0 (ranks 0, 1); the stage-1 ranks raise too
    errors = hybridpar.spawn(_unmarked, 4, timeout=120)
    for rank, error in enumerate(errors):
        assert error[0] == ReplicaMismatchError.__name__, (rank, error)
    assert "'0.scale' differs in gradients" in errors[0][1] and "tp replicas (ranks [0, 1])" \
        in errors[0][1] and "register_partial_grad" in errors[0][1]
    assert "differ on ranks [0, 1]" in errors[2][1] and "differ on ranks [0, 1]" in errors[3][1]


def test_register_partial_grad_refuses_a_sharded_parameter():
    weight = nn.Parameter(torch.ones(4, 4))
    hybridpar.register_parallel_attribute(weight, -1, 0)    # a column layer's weight
    with pytest.raises(ValueError, match="is for replicated parameters"):
        register_partial_grad(weight)


# the exact count: one all-reduce per step, only where a parameter needs it ---------------------

def _count(kind: str):
    from hf_models import tiny
    from test_hf_pipe import _batches as hf_batches

    from hybridpar.hf import to_sequential
    from hybridpar.nn import CausalLMLoss

    topo = hybridpar.init(tp=2, timeout=60)
    model = tiny(kind)
    loss_fn = CausalLMLoss()
    pipe = hybridpar.HybridPipe(to_sequential(model), [5], topology=topo, chunks=2,
                                loss_fn=loss_fn, tp_plan="auto")
    ids, y = hf_batches(True)[0]
    pipe.train_step(ids, y)                     # shapes agreed; then count one step
    hybridpar.reset_comm_stats()
    with loss_fn.token_mean_over(y):
        pipe.train_step(ids, y)
    stats = hybridpar.comm_stats()["all_reduce"]
    partial = dict(pipe.named_parameters())
    return stats, sum(partial[n].numel() for n in pipe.partial_grads)


def _counts():
    return {kind: _count(kind) for kind in ("llama", "qwen3")}


def test_qwen3_costs_exactly_one_all_reduce_more_than_llama_per_step():
    pytest.importorskip("transformers")
    for r in hybridpar.spawn(_counts, 2, timeout=120):
        (llama, llama_numel), (qwen3, qwen3_numel) = r["llama"], r["qwen3"]
        assert llama_numel == 0 and qwen3_numel == 2 * 2 * 8     # q, k norms of 2 blocks
        assert qwen3["calls"] == llama["calls"] + 1
        assert qwen3["bytes"] == llama["bytes"] + qwen3_numel * 8   # float64
