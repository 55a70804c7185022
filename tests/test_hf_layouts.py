"""Hugging Face GPT-2 (tied embedding / head, Conv1D, fused q|k|v) and Llama (GQA) in every
layout: pipeline stages, tensor-parallel "auto" sharding and both schedules train as the
single-device HF model does (float64, 3 AdamW steps, parameters to 1e-9).

The layouts run as cases of one spawn per world size (module fixtures): each new set of
ranks first imports the model families and builds a first model, which costs several times
a case. Each layout keeps its own test, asserting its own case.
"""

import pytest
import torch

pytest.importorskip("transformers", reason="hybridpar.hf needs the optional extra hybridpar[hf]")

from hf_models import tiny
from spawn_cases import spawn_cases
from test_hf_pipe import _assert_same, _reference, _train

import hybridpar
from hybridpar.hf import hf_state_dict, to_sequential
from hybridpar.tensor_parallel.fused import fused_parts
from hybridpar.train.shards import model_entries

# (model, (pp, tp), balance, schedule): GPT-2's 5 layers are wte+wpe, 2 blocks, ln_f, head
LAYOUTS = [
    ("gpt2", (2, 1), [2, 3], "1f1b"),
    ("gpt2", (4, 1), [2, 1, 1, 1], "gpipe"),
    ("gpt2", (4, 1), [2, 1, 1, 1], "1f1b"),
    ("gpt2", (2, 2), [2, 3], "gpipe"),
    ("gpt2", (2, 2), [2, 3], "1f1b"),
    ("llama", (1, 2), [5], "gpipe"),
    ("llama", (2, 2), [2, 3], "1f1b"),
]


def _worker(kind, layout, balance, schedule):
    pp, tp = layout
    topo = hybridpar.init(pp=pp, tp=tp, timeout=60)
    result = _train(kind, True, topo, balance, {"chunks": 2, "schedule": schedule,
                                                "tp_plan": "auto" if tp > 1 else None})
    return result


IDS = [f"{k}-pp{g[0]}tp{g[1]}-{s}" for k, g, _, s in LAYOUTS]


def _case(what, *args):
    if what == "own plan":
        return _hf_plan_worker()
    if what == "fused save":
        return _checkpoint_worker(*args)
    return _worker(*args)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Each layout's results by its id, the own-plan run ("own plan") and the tp=2 save of
    the fused q|k|v test ("fused save", in the folder "fused folder"): one spawn of 2 ranks,
    one of 4."""
    folder = str(tmp_path_factory.mktemp("fused"))
    two = {name: ("layout", *args) for name, args in zip(IDS, LAYOUTS)
           if args[1][0] * args[1][1] == 2}
    four = {name: ("layout", *args) for name, args in zip(IDS, LAYOUTS)
            if args[1][0] * args[1][1] == 4}
    two["fused save"] = ("fused save", folder, 2)
    four["own plan"] = ("own plan",)
    return {**spawn_cases(_case, 2, two, timeout=240), **spawn_cases(_case, 4, four, timeout=240),
            "fused folder": folder}


@pytest.fixture(scope="module")
def references():
    return {kind: _reference(kind, True) for kind in ("gpt2", "llama")}


@pytest.mark.parametrize("kind,layout,balance,schedule", LAYOUTS, ids=IDS)
def test_hugging_face_models_train_as_on_one_device(kind, layout, balance, schedule, runs,
                                                    references, request):
    got = runs[request.node.callspec.id]
    ref = references[kind]
    for r in got:
        _assert_same(r, ref)
        if layout[1] > 1:   # "auto" shards every attention and MLP projection
            projections = [d for d in r["decisions"] if "attn." in d or "mlp." in d]
            assert projections and all(": column" in d or ": row" in d for d in projections), \
                projections
        worst = max(float((r["state"][k] - v).abs().max()) for k, v in ref[1].items())
        print(f"{kind} pp={layout[0]} tp={layout[1]} {schedule}: max |diff| {worst:.1e}")


def _checkpoint_worker(folder, tp):
    from hybridpar.train.checkpoint import load_checkpoint, save_checkpoint

    topo = hybridpar.init(tp=tp, timeout=60)
    model = tiny("gpt2", seed=0 if tp == 2 else 9)
    pipe = hybridpar.HybridPipe(to_sequential(model), [5], topology=topo, tp_plan="auto")
    group = topo.tp_group if tp > 1 else None
    c_attn = dict(pipe.named_parameters())["1.attn.c_attn.weight"]
    assert fused_parts(c_attn) == (3 if tp == 2 else 1)
    entries = model_entries(pipe, group, aliases=pipe.tied_aliases)
    if tp == 2:
        save_checkpoint(folder, 1, entries, keep=1)
    else:
        load_checkpoint(f"{folder}/step-1", entries)
    return hf_state_dict(pipe.consolidated_state_dict(), model.config)


def test_a_fused_qkv_shard_saves_and_gathers_part_by_part(runs):
    """GPT-2's c_attn at tp=2 holds [q_r | k_r | v_r]: consolidated and checkpointed, it is
    the one-device [q | k | v], and it loads into tp=1."""
    expected = tiny("gpt2", seed=0).state_dict()
    saved = runs["fused save"]        # the tp=2 ranks' save, a case of the 2-rank spawn
    (loaded,) = hybridpar.spawn(_checkpoint_worker, 1, args=(runs["fused folder"], 1),
                                timeout=120)
    for state in (*saved, loaded):
        for key in ("transformer.h.0.attn.c_attn.weight", "transformer.h.0.attn.c_attn.bias"):
            torch.testing.assert_close(state[key], expected[key], atol=0, rtol=0, msg=key)


def _hf_plan_worker():
    from test_hf_pipe import _batches

    from hybridpar.hf import tp_plan
    from hybridpar.nn import CausalLMLoss

    topo = hybridpar.init(pp=2, tp=2, timeout=60)
    model = tiny("llama")
    sequential = to_sequential(model)
    loss_fn = CausalLMLoss()
    pipe = hybridpar.HybridPipe(sequential, [2, 3], topology=topo, chunks=2, loss_fn=loss_fn,
                                schedule="1f1b", tp_plan=tp_plan(sequential))
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    losses = []
    for ids, y in _batches(True):
        opt.zero_grad()
        with loss_fn.token_mean_over(y):
            losses.append(pipe.train_step(ids, y).item())
        opt.step()
    return {"losses": losses, "decisions": pipe.tp_plan_decisions,
            "state": hf_state_dict(pipe.consolidated_state_dict(), model.config)}


def test_the_models_own_hugging_face_plan_trains_as_on_one_device(runs, references):
    ref = references["llama"]
    for r in runs["own plan"]:
        _assert_same(r, ref)
        sharded = [d for d in r["decisions"] if "proj" in d]
        assert len(sharded) == 14 and all(": column" in d or ": row" in d for d in sharded), \
            sharded


def test_tp_plan_maps_the_hugging_face_plan_to_the_sequential_names():
    from hybridpar.hf import tp_plan

    plan = tp_plan(to_sequential(tiny("llama")))
    assert plan["1.self_attn.q_proj"] == "colwise" and plan["2.mlp.down_proj"] == "rowwise"
    assert plan["4"] == "colwise_gather_output"
    with pytest.raises(ValueError, match="has no tensor-parallel plan"):
        tp_plan(tiny("gpt2"))
