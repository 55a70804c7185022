"""The MoE GPT through HybridPipe against its one-device self, float64, 3 AdamW steps.

The load-balancing loss is per micro-batch over every MoE layer of it, wherever the layers
sit (the routing sums travel with the micro-batch): every schedule and layout must equal one
device trained with gradient accumulation over the same micro-batches (replica r's rows,
split into `chunks`), each micro-batch's loss weighted by its share. Every parameter to
1e-9, every P2P group replayed under NCCL's rules (the runs are order-only: all tags 0).
"""

from __future__ import annotations

import pytest
import torch
from spawn_cases import layout_id, selected_ids, spawn_by_world

import hybridpar
from hybridpar.models import example_batch, gpt, gpt_loss
from hybridpar.models.packing import pack_documents
from hybridpar.moe import split_aux
from hybridpar.pipeline.schedules import replay as nccl

from pipe_harness import checked_step

MOE = {"vocab_size": 32, "block_size": 8, "n_layer": 4, "n_head": 2, "n_embd": 16,
       "n_experts": 4, "top_k": 2, "expert_hidden": 8, "balance_coef": 0.1}
STEPS, BATCH = 3, 8


def _positions(rows: int, step: int) -> torch.Tensor:
    """Packed documents: each row's positions restart once, at a row- and step-given place."""
    out = torch.zeros(rows, MOE["block_size"], dtype=torch.int64)
    for r in range(rows):
        cut = 2 + (r + step) % 5
        out[r, :cut] = torch.arange(cut)
        out[r, cut:] = torch.arange(MOE["block_size"] - cut)
    return out


def _batches(packed: bool):
    out = []
    for step in range(STEPS):
        x, y = example_batch("gpt", BATCH, seed=step, **{k: MOE[k] for k in (
            "vocab_size", "block_size", "n_layer", "n_head", "n_embd")})
        out.append(((x, _positions(BATCH, step)) if packed else x, y))
    return out


def _rows(x, lo: int, hi: int):
    return tuple(t[lo:hi] for t in x) if isinstance(x, tuple) else x[lo:hi]


def _model(packed: bool, **kwargs) -> torch.nn.Sequential:
    torch.manual_seed(0)
    model = gpt(**MOE, **kwargs).double()
    return pack_documents(model) if packed else model


def _reference(micro: int, packed: bool, clip: float | None = None):
    """One device, gradient accumulation over `micro` micro-batches of the global batch
    (clipped to `clip`): the state, each micro-batch's aux loss, each step's norm."""
    model = _model(packed)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    auxes, norms = [], []
    for x, y in _batches(packed):
        opt.zero_grad()
        rows = BATCH // micro
        for i in range(micro):
            out = model(_rows(x, i * rows, (i + 1) * rows))
            auxes.append(float(split_aux(out)[1].detach()))
            (gpt_loss(out, y[i * rows:(i + 1) * rows]) / micro).backward()
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
    return model.state_dict(), auxes, norms


def _worker(layout, balance, options, packed):
    pp, tp, dp = layout
    topo = hybridpar.init(pp=pp, tp=tp, dp=dp, timeout=60)
    model = _model(packed, **({"tp": tp} if tp > 1 else {}))
    pipe = hybridpar.HybridPipe(model, balance, topology=topo, loss_fn=gpt_loss, **options)
    pipe.p2p_log = []
    opt = torch.optim.AdamW(pipe.parameters(), lr=0.01)
    rows = BATCH // dp
    for x, y in _batches(packed):
        opt.zero_grad()
        checked_step(pipe, _rows(x, topo.dp_rank * rows, (topo.dp_rank + 1) * rows),
                     y[topo.dp_rank * rows:(topo.dp_rank + 1) * rows])
        opt.step()
    log = [[[op.kind, op.peer, op.numel, op.dtype, op.label] for op in group]
           for group in pipe.p2p_log]
    return {"state": pipe.consolidated_state_dict(), "log": log}


# (pp, tp, dp), balance over the 7 layers (embeddings, 4 blocks, norm, head), options
LAYOUTS = [
    ((2, 1, 1), [3, 4], {"chunks": 2, "schedule": "gpipe", "checkpoint": "never"}),
    ((2, 1, 1), [4, 3], {"chunks": 4, "schedule": "1f1b", "checkpoint": "always"}),
    ((2, 1, 1), [2, 2, 2, 1], {"chunks": 4, "schedule": "zbv", "checkpoint": "except_last"}),
    ((2, 1, 1), [2, 2, 2, 1], {"chunks": 4, "schedule": "interleaved", "checkpoint": "never"}),
    ((2, 1, 1), [3, 4], {"chunks": 4, "schedule": "zb-h1", "checkpoint": "never"}),
    ((2, 2, 1), [3, 4], {"chunks": 2, "schedule": "1f1b", "checkpoint": "except_last"}),
    ((2, 1, 2), [4, 3], {"chunks": 2, "schedule": "gpipe", "checkpoint": "never"}),
]
IDS = [layout_id(layout, options) for layout, _, options in LAYOUTS]
PACKED = ((2, 1, 1), [3, 4], {"chunks": 2, "schedule": "1f1b", "checkpoint": "never"})


@pytest.fixture(scope="module")
def runs(request):
    cases = {}
    wanted = selected_ids(request, "test_the_moe_gpt_pipeline_equals_one_device")
    for (layout, balance, options), name in zip(LAYOUTS, IDS):
        if name in wanted:
            cases[name] = (layout[0] * layout[1] * layout[2], (layout, balance, options, False))
    if selected_ids(request, "test_packed_documents_carry_positions_and_routing_sums"):
        layout, balance, options = PACKED
        cases["packed"] = (2, (layout, balance, options, True))
    return spawn_by_world(_worker, cases, timeout=240)


def _assert_like(results, micro: int, packed: bool = False) -> None:
    reference, auxes, _ = _reference(micro, packed)
    assert min(auxes) > 0.1      # the aux loss (coef 0.1, E · Σ f·P >= 1) moves the weights
    for r in results:
        assert list(r["state"]) == list(reference)
        for k, v in reference.items():
            torch.testing.assert_close(r["state"][k], v, atol=1e-9, rtol=0,
                                       msg=lambda m, k=k: f"{k}: {m}")
    logs = {rank: [[nccl.P2POp(*op) for op in group] for group in r["log"]]
            for rank, r in enumerate(results)}
    assert nccl.replay(logs, check_labels=True).pairs > 0


@pytest.mark.parametrize("layout,balance,options", LAYOUTS, ids=IDS)
def test_the_moe_gpt_pipeline_equals_one_device(layout, balance, options, runs):
    _assert_like(runs[layout_id(layout, options)], options["chunks"] * layout[2])


def test_packed_documents_carry_positions_and_routing_sums(runs):
    _assert_like(runs["packed"], PACKED[2]["chunks"], packed=True)


def test_the_moe_gpt_returns_logits_in_eval_and_the_aux_in_training():
    model = _model(False)
    x, y = _batches(False)[0]
    logits, aux = model(x)
    assert logits.shape == (BATCH, MOE["block_size"], MOE["vocab_size"]) and aux.shape == (1,)
    assert gpt_loss((logits, aux), y) == gpt_loss(logits, y) + aux
    model.eval()
    assert torch.equal(model(x), logits)


@pytest.mark.parametrize("kwargs, message", [
    ({"n_experts": 4, "top_k": 5}, "top_k=5 must be between 1 and n_experts=4"),
    ({"n_experts": -1}, "n_experts must be 0 (a dense MLP) or a positive integer, got -1"),
])
def test_bad_expert_numbers_are_refused(kwargs, message):
    with pytest.raises(ValueError) as err:
        gpt(**{**MOE, **kwargs})
    assert message in str(err.value)


def test_sequence_parallel_with_experts_is_refused():
    with pytest.raises(ValueError, match="does not take experts yet"):
        gpt(**MOE, tp=2, sequence_parallel=True)


def _routing_worker(checkpoint):
    from hybridpar.moe.observe import RoutingLog

    topo = hybridpar.init(pp=2, timeout=60)
    pipe = hybridpar.HybridPipe(_model(False), [3, 4], topology=topo, loss_fn=gpt_loss,
                                chunks=2, schedule="1f1b", checkpoint=checkpoint)
    log = RoutingLog(pipe, layers=7, n_experts=MOE["n_experts"])
    x, y = _batches(False)[0]
    log.reset()
    pipe.train_step(x, y)
    counts = {layer: float(c.sum()) for layer, c in log.counts.items()}
    aux = len(log.aux)
    taken = log.take(topo)
    pipe.eval()
    pipe.eval_step(x, y)                       # evaluation: not recorded
    return {"counts": counts, "aux": aux, "taken": taken, "after_eval": dict(log.counts)}


@pytest.mark.parametrize("checkpoint", ["always", "never"])
def test_the_routing_log_counts_each_forward_once_and_every_layer(checkpoint):
    """Each MoE layer's copies per expert over a step: B · T · k copies, once per
    micro-batch even when checkpointing runs its forward again in the backward; the aux loss
    of each micro-batch on the last stage; every layer's [fewest, most] on every rank."""
    stage0, stage1 = hybridpar.spawn(_routing_worker, 2, args=(checkpoint,), timeout=120)
    copies = BATCH * MOE["block_size"] * MOE["top_k"]
    assert stage0["counts"] == {1: copies, 2: copies}
    assert stage1["counts"] == {3: copies, 4: copies}
    assert (stage0["aux"], stage1["aux"]) == (0, 2)             # chunks = 2, on the head's rank
    for r in (stage0, stage1):
        assert sorted(r["taken"]["expert_load"]) == ["1", "2", "3", "4"]
        for low, high in r["taken"]["expert_load"].values():
            assert 0 <= low <= copies / MOE["n_experts"] <= high <= copies
        assert r["after_eval"] == {}
    assert "aux_loss" in stage1["taken"] and "aux_loss" not in stage0["taken"]


def test_model_flops_count_the_experts_a_token_routes_through():
    """6 N counts the active parameters: of each block's E experts, top_k."""
    from hybridpar.flops import matmul_params

    model = _model(False)
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    rest = matmul_params([model]) - experts * MOE["top_k"] // MOE["n_experts"]
    lookups = sum(p.numel() for n, p in model.named_parameters() if n.startswith("0."))
    assert rest == sum(p.numel() for p in model.parameters()) - experts - lookups
