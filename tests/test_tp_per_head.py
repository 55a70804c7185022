"""Per-head parameters under a tp plan (`tensor_parallel.plans.flow_heads`): cut by head with
the column whose heads they meet, or the column kept replicated when they are also used whole;
one viewed with dims of size 1 around its heads (attention sinks) too.

Decisions only, on one process over torch's fake process group of 2 ranks (nothing is
communicated: the plan is read from the forward on `meta`). The training arithmetic of such a
cut (Cohere's q / k norms, GraniteSWA's sinks) is checked against the plain Hugging Face model in
tests/test_hf_families.py, at tp 2 and pp 2 x tp 2 under both plans.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.testing._internal.distributed.fake_pg import FakeStore

from hybridpar.tensor_parallel.plans.plan import apply_tp_plan, plan_decisions
from hybridpar.tensor_parallel.state import full_shape, shard_ranges

HEADS, HEAD_DIM, WIDTH = 4, 8, 32


class HeadScaled(nn.Module):
    """q -> (B, T, H, D) * scale (H, D) -> o; with `whole`, scale also meets the input."""

    def __init__(self, *, whole: bool = False) -> None:
        super().__init__()
        self.q = nn.Linear(WIDTH, HEADS * HEAD_DIM)
        self.o = nn.Linear(HEADS * HEAD_DIM, WIDTH)
        self.scale = nn.Parameter(torch.ones(HEADS, HEAD_DIM))
        self.whole = whole

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.q(x).view(*x.shape[:-1], -1, HEAD_DIM) * self.scale
        if self.whole:
            x = x * self.scale.flatten()
        return x + self.o(torch.relu(h.flatten(-2)))


@pytest.fixture
def fake_tp2():
    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=2)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_a_per_head_parameter_is_cut_by_head_with_its_column(fake_tp2):
    model = apply_tp_plan(HeadScaled(), "auto", group=fake_tp2)
    decisions = plan_decisions(model)
    assert any(d.startswith("q (Linear 32->32): column") for d in decisions), decisions
    assert any(d.startswith("o (Linear 32->32): row") for d in decisions), decisions
    assert "scale: sharded by head (dim 0: 2 of 4 per rank), as the column whose heads it " \
           "meets" in decisions
    scale = model.scale
    assert tuple(scale.shape) == (2, HEAD_DIM) and full_shape(scale) == (HEADS, HEAD_DIM)
    assert shard_ranges(scale, fake_tp2) == (0, [(2, 4)])      # rank 1 holds heads 2 and 3
    assert not getattr(scale, "tp_partial_grad", False)       # its gradient is whole


def test_a_dict_plan_cuts_it_too(fake_tp2):
    model = apply_tp_plan(HeadScaled(), {"q": "column", "o": "row"}, group=fake_tp2)
    assert tuple(model.scale.shape) == (2, HEAD_DIM)
    assert any(d.startswith("scale: sharded by head") for d in plan_decisions(model))


def test_one_also_used_whole_keeps_auto_replicated_and_fails_a_dict_plan(fake_tp2):
    model = apply_tp_plan(HeadScaled(whole=True), "auto", group=fake_tp2)
    decisions = plan_decisions(model)
    assert any(d.startswith("q (Linear 32->32): replicate - its shard meets 'scale' split by "
                            "head, which is also used whole on full activations")
               for d in decisions), decisions
    assert tuple(model.scale.shape) == (HEADS, HEAD_DIM)
    with pytest.raises(ValueError, match="the parameter 'scale' is used on the shards of "
                                         r"\['q'\] and on full activations"):
        apply_tp_plan(HeadScaled(whole=True), {"q": "column", "o": "row"}, group=fake_tp2)


class Sinks(nn.Module):
    """An attention's sinks: (B, H, T) per-head log-sum-exps minus sinks (H,) viewed
    (1, H, 1), as GraniteSWA's attention does."""

    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(WIDTH, HEADS * HEAD_DIM)
        self.o = nn.Linear(HEADS * HEAD_DIM, WIDTH)
        self.sinks = nn.Parameter(torch.linspace(-1.0, 1.0, HEADS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.q(x).view(*x.shape[:-1], -1, HEAD_DIM).transpose(1, 2)    # (B, H, T, D)
        scale = (h.logsumexp(-1) - self.sinks.view(1, -1, 1)).sigmoid()    # (B, H, T)
        return x + self.o((h * scale.unsqueeze(-1)).transpose(1, 2).flatten(-2))


class Attention(nn.Module):
    """`Sinks` as a submodule: a Hugging Face plan names its parameter `attn.sinks`."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = Sinks()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attn(x)


def test_sinks_viewed_around_their_heads_are_cut_by_head(fake_tp2):
    model = apply_tp_plan(Sinks(), "auto", group=fake_tp2)
    assert "sinks: sharded by head (dim 0: 2 of 4 per rank), as the column whose heads it " \
           "meets" in plan_decisions(model)
    assert model.sinks.tolist() == pytest.approx([1 / 3, 1.0])     # rank 1: heads 2 and 3
    assert full_shape(model.sinks) == (HEADS,)


HF_PLAN = {"attn.q": "colwise", "attn.o": "rowwise", "attn.sinks": "colwise",
           "attn": "local_params"}


def test_a_hugging_face_plan_may_name_the_sinks_colwise_and_its_module_local_params(fake_tp2):
    model = apply_tp_plan(Attention(), HF_PLAN, group=fake_tp2)
    assert tuple(model.attn.sinks.shape) == (2,)
    assert any(d.startswith("attn.sinks: sharded by head") for d in plan_decisions(model))


@pytest.mark.parametrize("key,style,message", [
    ("attn.sinks", "rowwise", r"tp_plan\['attn.sinks'\] = 'rowwise' names a parameter; "
                              r"hybridpar takes 'colwise' there"),
    ("attn.sink", "colwise", r"tp_plan key 'attn.sink' \('colwise'.*matches no module"),
])
def test_a_parameter_key_of_another_style_or_no_parameter_is_refused(fake_tp2, key, style,
                                                                      message):
    plan = {k: v for k, v in HF_PLAN.items() if k != "attn.sinks"} | {key: style}
    with pytest.raises(ValueError, match=message):
        apply_tp_plan(Attention(), plan, group=fake_tp2)
