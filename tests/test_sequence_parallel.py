"""Sequence parallelism (gpt(sequence_parallel=True), parallel.sequence_parallel): exact.

The tensor-parallel GPT of test_pipe_tp with its LayerNorms, dropouts and residuals on 1 / tp
of the tokens trains as the one-device model (SGD, float64 to 1e-9) over layouts, schedules
and checkpoint modes; with dropout, the one-device masks (one micro-batch) and, over several,
exactly the masks of the same layout without sequence parallelism. Stage boundaries carry
each rank's (B, T / tp, C) shard; one block moves the bytes of the all-reduces it replaces
(an all-gather and a reduce-scatter of the same tensor each) and keeps 1 / tp of the
LayerNorm and dropout activations.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from spawn_cases import layout_id, selected_ids, spawn_by_world
from test_pipe_tp import BATCH, SMALL, _batches, assert_like_one_device

import hybridpar
from hybridpar.models import gpt, gpt_loss
from hybridpar.models.gpt_layers import Block
from hybridpar.sharded.attrs import SEQUENCE, get_parallel_dim

ROOT = Path(__file__).resolve().parents[1]


def _worker(layout, balance, options, dropout, sequence_parallel=True):
    pp, tp, dp = layout
    topo = hybridpar.init(pp=pp, tp=tp, dp=dp, timeout=60)
    torch.manual_seed(0)
    model = gpt(**SMALL, dropout=dropout, tp=tp, sequence_parallel=sequence_parallel).double()
    pipe = hybridpar.HybridPipe(model, balance, topology=topo, loss_fn=gpt_loss, **options)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.5)
    losses, norms = [], []
    rows = BATCH // dp
    for x, y in _batches(BATCH):
        part = slice(topo.dp_rank * rows, (topo.dp_rank + 1) * rows)
        opt.zero_grad()
        losses.append(pipe.train_step(x[part], y[part]).item())
        pipe.check_replicas()
        norms.append(pipe.clip_grad_norm_(0.5).item())
        opt.step()
    return {"losses": losses, "norms": norms, "state": pipe.consolidated_state_dict(),
            "partial": pipe.partial_grads}


LAYOUTS = [   # (pp, tp, dp), balance, options
    ((1, 2, 1), [5], {"chunks": 2, "schedule": "gpipe", "checkpoint": "except_last"}),
    ((2, 2, 1), [2, 3], {"chunks": 4, "schedule": "1f1b", "checkpoint": "always"}),
    ((2, 2, 1), [2, 3], {"chunks": 2, "schedule": "zb-h1", "checkpoint": "never"}),
    ((2, 2, 1), [1, 2, 1, 1], {"chunks": 4, "schedule": "zbv", "checkpoint": "layers"}),
    ((2, 2, 1), [2, 1, 1, 1], {"chunks": 4, "schedule": "interleaved",
                               "checkpoint": "layers:2"}),
    ((2, 2, 2), [3, 2], {"chunks": 2, "schedule": "1f1b", "checkpoint": "selective"}),
]
IDS = [layout_id(layout, options) for layout, _, options in LAYOUTS]
DROPOUT = [{"chunks": 1}, {"chunks": 1, "schedule": "zb-h1", "checkpoint": "always"}]


@pytest.fixture(scope="module")
def runs(request):
    cases = {}
    wanted = selected_ids(request, "test_sequence_parallel_gpt_trains_as_one_device")
    for (layout, balance, options), name in zip(LAYOUTS, IDS):
        if name not in wanted:   # the campaign's (tests/tiers.py)
            continue
        cases[f"train {layout} {options}"] = (layout[0] * layout[1] * layout[2],
                                              (layout, balance, options, 0.0))
    for options in DROPOUT:
        cases[f"dropout {options}"] = (2, ((1, 2, 1), [5], options, 0.2))
    for sp in (False, True):   # dropout over 4 micro-batches: sp against tp alone
        cases[f"masks {sp}"] = (2, ((1, 2, 1), [5], {"chunks": 4, "schedule": "1f1b",
                                                     "checkpoint": "except_last"}, 0.2, sp))
    return spawn_by_world(_worker, cases, timeout=240)


@pytest.mark.parametrize("layout,balance,options", LAYOUTS, ids=IDS)
def test_sequence_parallel_gpt_trains_as_one_device(layout, balance, options, runs):
    assert_like_one_device(runs[f"train {layout} {options}"], dtype=torch.float64)
    for r in runs[f"train {layout} {options}"]:
        # the norms, row-parallel biases, position table: their gradients summed over tp
        assert r["partial"] and all(n.endswith(("ln1.weight", "ln1.bias", "ln2.weight",
                                                "ln2.bias", "proj.bias", "pos.weight")) or
                                    n.split(".")[0] == str(SMALL["n_layer"] + 1)
                                    for n in r["partial"])


@pytest.mark.parametrize("options", DROPOUT)
def test_sequence_parallel_dropout_masks_are_the_one_device_ones(options, runs):
    assert_like_one_device(runs[f"dropout {options}"], 0.2, torch.float64)


def test_sequence_parallel_draws_the_masks_of_tensor_parallelism_alone(runs):
    for plain, sharded in zip(runs["masks False"], runs["masks True"], strict=True):
        assert sharded["losses"] == pytest.approx(plain["losses"], abs=1e-6)
        for k, v in plain["state"].items():
            torch.testing.assert_close(sharded["state"][k], v, atol=1e-6, rtol=0)


def _one_block(sequence_parallel):
    """Forward and backward of one Block at tp=2 on this rank's input: the collectives'
    bytes, the bytes autograd saved, the output's shape and tag."""
    topo = hybridpar.init(tp=2, timeout=60)
    torch.manual_seed(0)
    block = Block(32, 4, dropout=0.1, tp=2, sequence_parallel=sequence_parallel)
    B, T, C = 2, 16, 32
    x = torch.randn(B, T, C)
    if sequence_parallel:
        x = x.narrow(1, topo.tp_rank * T // 2, T // 2).clone()
        from hybridpar.sharded.attrs import register_parallel_dim
        register_parallel_dim(x, SEQUENCE)
    x.requires_grad_()
    saved = [0]

    def pack(t):
        saved[0] += t.numel() * t.element_size()
        return t

    hybridpar.reset_comm_stats()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = block(x)
    out.sum().backward()
    return {"comm": hybridpar.comm_stats(), "saved": saved[0], "shape": tuple(out.shape),
            "tag": get_parallel_dim(out)}


def test_a_block_moves_the_all_reduces_bytes_and_keeps_less():
    plain = hybridpar.spawn(_one_block, 2, args=(False,), timeout=60)[0]
    sharded = hybridpar.spawn(_one_block, 2, args=(True,), timeout=60)[0]
    assert plain["shape"] == (2, 16, 32) and plain["tag"] is None
    assert sharded["shape"] == (2, 8, 32) and sharded["tag"] == SEQUENCE
    # 4 all-reduces of (2, 16, 32) float32 (forward: attention and MLP outputs; backward:
    # their inputs' gradients), each replaced by one all-gather and one reduce-scatter of the
    # same tensor: the same bytes on the wire
    full = 2 * 16 * 32 * 4
    assert plain["comm"]["all_reduce"] == {"bytes": 4 * full, "calls": 4}
    assert "all_reduce" not in sharded["comm"]
    for kind in ("all_gather", "reduce_scatter"):
        assert sharded["comm"][kind] == {"bytes": 4 * full, "calls": 4}
    # the LayerNorms' inputs and the residual dropouts' masks: (2, 8, 32) instead of
    # (2, 16, 32) on each rank (2 norms + 2 masks: 4 x half a full tensor, at least)
    assert plain["saved"] - sharded["saved"] >= 4 * full // 2


def test_what_sequence_parallelism_cannot_take_is_refused():
    from config_errors import error_of

    quick = ROOT / "configs" / "quickstart.toml"
    sp = "parallel.sequence_parallel=true"
    assert "needs parallel.tp > 1" in error_of(quick, sp, "parallel.tp=1")
    assert ("the Hugging Face models ('hf:...') under a tp plan; not yet for model 'gpt' "
            "with parallel.tp_plan = 'auto'") in error_of(
        quick, sp, "parallel.tp_plan=auto")
    assert "use a data.seq_len divisible by 2" in error_of(quick, sp, "data.seq_len=15")
    assert "does not take packed documents yet" in error_of(quick, sp, "data.pack=documents",
                                                            "data.source=corpus")
    with pytest.raises(ValueError, match=r"sequence_parallel=True\) shards the sequence over "
                                         r"the tp group: it needs tp > 1"):
        gpt(**SMALL, sequence_parallel=True)
    from hybridpar.hf.sequence import sequence_parallel

    with pytest.raises(ValueError, match="takes a Hugging Face decoder as to_sequential"):
        sequence_parallel(torch.nn.Sequential(torch.nn.Linear(2, 2)), None)


# Hugging Face decoders ----------------------------------------------------------------------

def _hf_worker(kind, layout, balance, schedule, plan, dropout=0.0):
    """test_hf_pipe's `_train` of `kind` with sequence parallelism (with dropout: one
    micro-batch, whose masks are the one-device ones); how the hidden states crossed the blocks
    (their tags)."""
    from test_hf_pipe import _train

    from hybridpar.hf.blocks import DecoderBlock

    pp, tp = layout
    topo = hybridpar.init(pp=pp, tp=tp, timeout=60)
    tags: set = set()
    real = DecoderBlock.forward

    def forward(self, hidden):
        out = real(self, hidden)
        if torch.is_grad_enabled():                     # training, not the tp plan's probe
            tags.add((get_parallel_dim(hidden), get_parallel_dim(out), tuple(out.shape)))
        return out

    DecoderBlock.forward = forward                      # this rank's process only
    out = _train(kind, True, topo, balance, {"chunks": 1 if dropout else 2, "schedule": schedule,
                                             "tp_plan": plan, "sequence_parallel": True},
                 dropout)
    return {**out, "tags": sorted(tags, key=str)}


HF_LAYOUTS = [("qwen3", (1, 2), [5], "gpipe", "hf"), ("mistral", (2, 2), [2, 3], "1f1b", "auto"),
              ("llama", (2, 2), [2, 1, 1, 1], "zbv", "hf"),
              ("gpt2", (2, 2), [2, 3], "1f1b", "auto"),
              # any decoder: glue around the embedding and the tied, vocab-sharded head
              # (`hf.glue`: an InputLayer, a LogitsLayer), a dropout module before the blocks
              ("granite", (2, 2), [2, 3], "1f1b", "hf"), ("phi", (1, 2), [5], "gpipe", "auto")]


HF_IDS = [f"{kind}-pp{layout[0]}tp{layout[1]}-{schedule}-{plan}"
          for kind, layout, _, schedule, plan in HF_LAYOUTS]
GPT2_DROPOUT = 0.1   # GPT-2's embedding and residual dropouts (its attention's stays 0)


@pytest.fixture(scope="module")
def hf_runs(request):
    pytest.importorskip("transformers", reason="hybridpar.hf needs hybridpar[hf]")
    wanted = selected_ids(request, "test_hugging_face_decoders_train_sequence_parallel_as_"
                                   "one_device")
    cases = {f"{kind} {layout} {schedule} {plan}": (layout[0] * layout[1],
                                                    (kind, layout, balance, schedule, plan))
             for (kind, layout, balance, schedule, plan), name in zip(HF_LAYOUTS, HF_IDS)
             if name in wanted}
    cases["gpt2 dropout"] = (2, ("gpt2", (1, 2), [5], "gpipe", "auto", GPT2_DROPOUT))
    return spawn_by_world(_hf_worker, cases, timeout=300)


@pytest.mark.parametrize("kind,layout,balance,schedule,plan", HF_LAYOUTS, ids=HF_IDS)
def test_hugging_face_decoders_train_sequence_parallel_as_one_device(
        kind, layout, balance, schedule, plan, hf_runs):
    from test_hf_pipe import _assert_same, _reference

    ref = _reference(kind, True)
    for r in hf_runs[f"{kind} {layout} {schedule} {plan}"]:
        _assert_same(r, ref)                           # float64, every parameter to 1e-9
        # each block took and gave this rank's (B, T / 2, D) tokens (the first block of a
        # stage took them from the embedding or over the boundary, tagged alike)
        assert r["tags"] and all(t_in == t_out == SEQUENCE and shape[1] == 8 // 2
                                 for t_in, t_out, shape in r["tags"])
        assert any(n.endswith(("input_layernorm.weight", "ln_1.weight")) for n in r["partial"])


def test_gpt2_sequence_parallel_draws_the_one_device_dropout_masks(hf_runs):
    from test_hf_pipe import _assert_same, _reference

    ref = _reference("gpt2", True, GPT2_DROPOUT)
    for r in hf_runs["gpt2 dropout"]:
        _assert_same(r, ref)                # the masks of the embedding and of each branch
        assert r["tags"] and all(t_in == t_out == SEQUENCE for t_in, t_out, _ in r["tags"])
        # the norms, the row layers' biases (c_proj), the position table (replicated: its
        # split's backward gathers the gradient, so whole on every rank) as the plan left them
        assert any(n.endswith("attn.c_proj.bias") for n in r["partial"])
        assert any(n.endswith("ln_1.weight") for n in r["partial"])


def _refusal_worker():
    """The error of a tp region that keeps a replicated projection (GPT-2's Conv1D, Llama's
    Linear) beside its sharded ones, on each rank."""
    from hf_models import tiny

    from hybridpar.hf import to_sequential

    topo = hybridpar.init(tp=2, timeout=60)
    plans = {"gpt2": {"1.attn.c_proj": "rowwise"},                 # c_attn left replicated
             "llama": {"1.self_attn.o_proj": "rowwise"}}           # q / k / v left replicated
    errors = {}
    for kind, plan in plans.items():
        try:
            hybridpar.HybridPipe(to_sequential(tiny(kind)), [5], topology=topo,
                                 tp_plan=plan, sequence_parallel=True)
        except ValueError as e:
            errors[kind] = str(e)
    return errors


def test_a_region_with_a_replicated_projection_is_refused():
    pytest.importorskip("transformers", reason="hybridpar.hf needs hybridpar[hf]")
    for errors in hybridpar.spawn(_refusal_worker, 2, timeout=120):
        assert "'attn' of a decoder block holds a replicated Conv1D" in errors["gpt2"]
        assert "'self_attn' of a decoder block holds a replicated Linear" in errors["llama"]
