"""checkpoint = "layers" / "layers:K": each (every K-th) layer recomputed on its own, and
"selective": the attention core only.

The tensor-parallel GPT of test_pipe_tp trains as on one device with these modes, over
schedules (GPipe, 1F1B, ZB-H1's split backward, ZBV) and layouts; with dropout, the masks of
the one-device run (one micro-batch) and, over several micro-batches, exactly those of the
same run without checkpointing (the recomputation replays each layer's RNG state). Each
checkpointed layer runs once more in backward, with `is_recomputing()` true, and keeps only
its input for backward.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from spawn_cases import layout_id, selected_ids, spawn_by_world, spawn_cases
from test_pipe_tp import _gpt_worker, assert_like_one_device
from torch import nn
from torchgpipe.checkpoint import is_recomputing

import hybridpar

LAYOUTS = [   # (pp, tp, dp), balance, options
    ((1, 2, 1), [5], {"chunks": 2, "schedule": "gpipe", "checkpoint": "layers"}),
    ((2, 2, 1), [3, 2], {"chunks": 4, "schedule": "1f1b", "checkpoint": "layers:2"}),
    ((2, 2, 1), [2, 3], {"chunks": 2, "schedule": "zb-h1", "checkpoint": "layers"}),
    ((2, 1, 1), [1, 2, 1, 1], {"chunks": 4, "schedule": "zbv", "checkpoint": "layers"}),
    ((2, 2, 1), [3, 2], {"chunks": 4, "schedule": "zb-h1", "checkpoint": "selective"}),
    ((1, 2, 2), [5], {"chunks": 2, "schedule": "1f1b", "checkpoint": "selective"}),
]
DROPOUT = [   # one stage, one micro-batch: the one-device masks
    {"chunks": 1, "checkpoint": "layers"},
    {"chunks": 1, "schedule": "zb-h1", "checkpoint": "layers:2"},
    {"chunks": 1, "checkpoint": "selective"},
]
IDS = [layout_id(layout, options) for layout, _, options in LAYOUTS]
MODES = ["never", "layers", "selective"]   # dropout, 4 micro-batches, tp2


def _case(*args):
    return _gpt_worker(*args)


@pytest.fixture(scope="module")
def runs(request):
    cases = {}
    wanted = selected_ids(request, "test_layer_checkpointing_trains_as_one_device")
    for (layout, balance, options), name in zip(LAYOUTS, IDS):
        if name not in wanted:   # the campaign's (tests/tiers.py)
            continue
        cases[f"train {layout} {options}"] = (layout[0] * layout[1] * layout[2],
                                              (layout, balance, options, 0.0))
    for options in DROPOUT:
        cases[f"dropout {options}"] = (2, ((1, 2, 1), [5], options, 0.2))
    for mode in MODES:
        cases[f"mode {mode}"] = (2, ((1, 2, 1), [5], {"chunks": 4, "schedule": "1f1b",
                                                      "checkpoint": mode}, 0.2))
    return spawn_by_world(_case, cases, timeout=240)


@pytest.mark.parametrize("layout,balance,options", LAYOUTS, ids=IDS)
def test_layer_checkpointing_trains_as_one_device(layout, balance, options, runs):
    assert_like_one_device(runs[f"train {layout} {options}"])


@pytest.mark.parametrize("options", DROPOUT)
def test_layer_checkpointing_keeps_the_one_device_dropout_masks(options, runs):
    assert_like_one_device(runs[f"dropout {options}"], 0.2)


@pytest.mark.parametrize("mode", MODES[1:])
def test_every_mode_replays_the_masks_of_the_run_without_checkpointing(mode, runs):
    for plain, checkpointed in zip(runs["mode never"], runs[f"mode {mode}"], strict=True):
        assert checkpointed["losses"] == plain["losses"]
        for k, v in plain["state"].items():
            torch.testing.assert_close(checkpointed["state"][k], v, atol=1e-12, rtol=0)


class Counted(nn.Module):
    """A Linear that counts its forwards, and those under recomputation."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.calls = {False: 0, True: 0}

    def forward(self, x):
        self.calls[is_recomputing()] += 1
        return torch.tanh(self.fc(x))


def _counting(mode):
    topo = hybridpar.init(timeout=60)
    torch.manual_seed(0)
    layers = [Counted() for _ in range(4)]
    pipe = hybridpar.HybridPipe(nn.Sequential(*layers), [4], chunks=2, topology=topo,
                                loss_fn=F.mse_loss, checkpoint=mode)
    pipe.train_step(torch.randn(4, 4), torch.randn(4, 4))
    return [dict(layer.calls) for layer in layers]


def _call(fn, *args):
    return fn(*args)


@pytest.fixture(scope="module")
def one_rank():
    """The one-rank steps of the tests below (`_counting` per mode, `_selective` per mode and
    dropout), in turn on the same rank (each builds its own model and pipe)."""
    cases = {f"counting {mode}": (_counting, mode) for mode in ("layers", "layers:2", "never")}
    cases.update({f"selective {mode} {dropout}": (_selective, mode, dropout)
                  for mode, dropout in (("never", 0.1), ("selective", 0.1), ("selective", 0.0))})
    return spawn_cases(_call, 1, cases, timeout=120)


@pytest.mark.parametrize("mode,recomputed", [("layers", [2, 2, 2, 2]),
                                             ("layers:2", [2, 0, 2, 0]),
                                             ("never", [0, 0, 0, 0])])
def test_each_checkpointed_layer_runs_again_recomputing(mode, recomputed, one_rank):
    calls = one_rank[f"counting {mode}"][0]
    assert [c[True] for c in calls] == recomputed          # once per micro-batch (2)
    assert [c[False] for c in calls] == [2, 2, 2, 2]


def _selective(mode, dropout=0.1):
    """A one-rank gpt step under `mode`: the attention core's calls (recomputing or not)
    and the bytes autograd saved outside checkpointed regions."""
    from hybridpar.models import example_batch, gpt, gpt_loss
    from hybridpar.models.gpt_layers import CausalSelfAttention

    topo = hybridpar.init(timeout=60)
    torch.manual_seed(0)
    model = gpt(vocab_size=32, block_size=8, n_layer=2, n_head=4, n_embd=16, dropout=dropout)
    calls = {False: 0, True: 0}
    for attn in (m for m in model.modules() if isinstance(m, CausalSelfAttention)):
        core = attn._core

        def counted(*args, core=core):
            calls[is_recomputing()] += 1
            return core(*args)

        attn._core = counted
    pipe = hybridpar.HybridPipe(model, [5], chunks=2, topology=topo, loss_fn=gpt_loss,
                                checkpoint=mode)
    saved = [0]

    def pack(t):
        saved[0] += t.numel() * t.element_size()
        return t

    x, y = example_batch("gpt", 4, seed=0, vocab_size=32, block_size=8)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = pipe.train_step(x, y).item()
    return calls, saved[0], loss


def test_selective_recomputes_only_the_attention_core(one_rank):
    out = {mode: one_rank[f"selective {mode} 0.1"][0] for mode in ("never", "selective")}
    (plain_calls, plain_saved, plain_loss), (calls, saved, loss) = out["never"], out["selective"]
    assert plain_calls == {False: 4, True: 0}          # 2 layers x 2 micro-batches
    assert calls == {False: 4, True: 4}                # each core once more, recomputing
    assert loss == plain_loss
    # not kept: per core the (2, 4, 8, 8) float32 probabilities, their dropout mask and
    # the dropped-out ones (at least 3 x 2 KiB)
    assert plain_saved - saved >= 4 * 3 * 2 * 4 * 8 * 8 * 4 * 0.9
    # without attention dropout the core is fused sdpa, which keeps no probabilities:
    # nothing to gain, so it is not recomputed
    calls, _, _ = one_rank["selective selective 0.0"][0]
    assert calls == {False: 4, True: 0}


def _eager_tiny(*args, **kwargs):
    """hf_models.tiny with eager attention (it keeps (B, h, T, T): selective recomputes it)."""
    from hf_models import tiny

    model = tiny(*args, **kwargs)
    model.config._attn_implementation = "eager"
    return model


def _hf_worker(kind, layout, balance, schedule):
    """A Hugging Face model with eager attention trained under checkpoint = "selective"
    (test_hf_pipe's `_train`), and how its attention calls ran (recomputing or not)."""
    import importlib

    import test_hf_pipe
    from test_hf_pipe import _train

    test_hf_pipe.tiny = _eager_tiny                    # in this rank's process only
    module = importlib.import_module(f"transformers.models.{kind}.modeling_{kind}")
    attention = module.eager_attention_forward
    calls = {False: 0, True: 0}

    def counted(*args, **kwargs):
        calls[is_recomputing()] += 1
        return attention(*args, **kwargs)

    module.eager_attention_forward = counted
    pp, tp = layout
    topo = hybridpar.init(pp=pp, tp=tp, timeout=60)
    out = _train(kind, True, topo, balance, {"chunks": 2, "schedule": schedule,
                                             "tp_plan": "auto" if tp > 1 else None,
                                             "checkpoint": "selective"})
    return {**out, "calls": calls}


@pytest.mark.parametrize("kind,layout,balance,schedule", [
    ("llama", (2, 2), [2, 3], "1f1b"), ("gpt2", (2, 1), [2, 1, 1, 1], "zbv")])
def test_hugging_face_attention_is_recomputed_selectively(kind, layout, balance, schedule,
                                                         monkeypatch):
    pytest.importorskip("transformers")
    import test_hf_pipe
    from test_hf_pipe import _assert_same, _reference

    got = hybridpar.spawn(_hf_worker, layout[0] * layout[1],
                          args=(kind, layout, balance, schedule), timeout=120)
    monkeypatch.setattr(test_hf_pipe, "tiny", _eager_tiny)
    ref = _reference(kind, True)                       # the eager model on one device
    for r in got:
        _assert_same(r, ref)                           # float64, every parameter to 1e-9
        # each rank holds one decoder layer: 3 steps x 2 micro-batches, once more each,
        # recomputing (the forwards also count the tp plan's look at the model)
        assert r["calls"][True] == 6 and r["calls"][False] >= 6


def test_bad_layer_modes_are_refused():
    from hybridpar.pipeline.activations.checkpoint import check_checkpoint

    for bad in ("layers:0", "layers:x", "layer", "layers:-1"):
        with pytest.raises(ValueError, match=r"or 'layers:K' \(every K-th layer, K >= 1\)"):
            check_checkpoint(bad)
    assert check_checkpoint("layers:3") == "layers:3"
