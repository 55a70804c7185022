"""Hugging Face families in every layout: pipeline stages, tensor-parallel sharding ("auto"
and the model's own plan), 1F1B, GPipe and ZBV train as the single-device HF model does
(float64, 3 AdamW steps, every parameter to 1e-9), with the replica check after every step.
The suite runs both plans at pp 2 x tp 2 (1F1B) and "auto" under ZBV; the campaign adds tp 2
on one stage and the HF plan under ZBV (tests/tiers.py).

    family    what it adds                                   plans
    llama     GQA (4 q / 2 kv heads)                         auto, hf
    mistral   a sliding window (4) shorter than the sequence auto, hf
    qwen2     biases on q, k, v                              auto, hf
    qwen3     q_norm / k_norm over the sharded heads:        auto, hf
              gradients summed over tp (`pipeline.parameters.partial`)
    gpt2      tied embedding / head, Conv1D, fused q|k|v     auto (it has no plan)

The layouts run as cases of one spawn per world size (module fixtures): each new set of
ranks first imports the model families and builds a first model, which costs several times
a case. Each layout keeps its own test, asserting its own case.
"""

import pytest
import torch

pytest.importorskip("transformers", reason="hybridpar.hf needs the optional extra hybridpar[hf]")

from hf_models import tiny
from spawn_cases import selected_ids, spawn_cases
from test_hf_pipe import _assert_same, _reference, _train

import hybridpar
from hybridpar.hf import hf_state_dict, to_sequential
from hybridpar.tensor_parallel.fused import fused_parts
from hybridpar.train.checkpoints.shards import model_entries

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gpt2")
# (pp, tp), balance, schedule: the Sequential's 5 layers are the embedding(s), 2 blocks, the
# final norm and the head; ZBV cuts them in 2 stages per rank (a V: rank 0 holds 0 and 3)
TP_LAYOUTS = [((1, 2), [5], "gpipe"), ((2, 2), [2, 3], "1f1b"), ((2, 2), [2, 1, 1, 1], "zbv")]
PP_LAYOUTS = [("gpt2", (2, 1), [2, 3], "1f1b", None), ("gpt2", (4, 1), [2, 1, 1, 1], "gpipe", None),
              ("gpt2", (4, 1), [2, 1, 1, 1], "1f1b", None)]
# (model, (pp, tp), balance, schedule, plan)
LAYOUTS = PP_LAYOUTS + [(kind, layout, balance, schedule, plan)
                        for kind in FAMILIES for plan in ("auto", "hf")
                        if (kind, plan) != ("gpt2", "hf")
                        for layout, balance, schedule in TP_LAYOUTS]


def _worker(kind, layout, balance, schedule, plan):
    pp, tp = layout
    topo = hybridpar.init(pp=pp, tp=tp, timeout=60)
    return _train(kind, True, topo, balance, {"chunks": 2, "schedule": schedule,
                                              "tp_plan": plan})


IDS = [f"{k}-pp{g[0]}tp{g[1]}-{s}" + (f"-{p}" if p else "") for k, g, _, s, p in LAYOUTS]


def _case(what, *args):
    if what == "fused save":
        return _checkpoint_worker(*args)
    return _worker(*args)


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
    """The results of each layout this session runs by its id (tests/tiers.py holds some for
    the campaign) and the tp=2 save of the fused q|k|v test ("fused save", in the folder
    "fused folder"): one spawn of 2 ranks, one of 4."""
    folder = str(tmp_path_factory.mktemp("fused"))
    wanted = selected_ids(request, "test_hugging_face_models_train_as_on_one_device")
    two = {name: ("layout", *args) for name, args in zip(IDS, LAYOUTS)
           if args[1][0] * args[1][1] == 2 and name in wanted}
    four = {name: ("layout", *args) for name, args in zip(IDS, LAYOUTS)
            if args[1][0] * args[1][1] == 4 and name in wanted}
    two["fused save"] = ("fused save", folder, 2)
    return {**spawn_cases(_case, 2, two, timeout=300),
            **(spawn_cases(_case, 4, four, timeout=400) if four else {}), "fused folder": folder}


@pytest.fixture(scope="module")
def references():
    return {kind: _reference(kind, True) for kind in FAMILIES}


@pytest.mark.parametrize("kind,layout,balance,schedule,plan", LAYOUTS, ids=IDS)
def test_hugging_face_models_train_as_on_one_device(kind, layout, balance, schedule, plan, runs,
                                                    references, request):
    got = runs[request.node.callspec.id]
    ref = references[kind]
    for r in got:
        _assert_same(r, ref)      # every parameter and buffer, under its HF name
        if layout[1] > 1:         # every attention and MLP projection is sharded
            layer = [d.split(" ")[0].rpartition(".")[2] for d in r["decisions"]]
            projections = [d for d, n in zip(r["decisions"], layer)
                           if n.endswith("proj") or n.startswith("c_")]
            assert projections and all(": column" in d or ": row" in d for d in projections), \
                projections
        # Qwen3's q_norm / k_norm (and only they) have their gradients summed over tp
        normed = [n for n in r["partial"] if n.endswith(("q_norm.weight", "k_norm.weight"))]
        assert normed == r["partial"] and bool(normed) == (kind == "qwen3" and layout[1] > 1)
    worst = max(float((got[0]["state"][k] - v).abs().max()) for k, v in ref[1].items())
    print(f"{kind} pp={layout[0]} tp={layout[1]} {schedule} {plan}: max |diff| {worst:.1e}")


def _checkpoint_worker(folder, tp):
    from hybridpar.train.checkpoints.checkpoint import load_checkpoint, save_checkpoint

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


def test_tp_plan_maps_the_hugging_face_plan_to_the_sequential_names():
    from hybridpar.hf import tp_plan

    plan = tp_plan(to_sequential(tiny("llama")))
    assert plan["1.self_attn.q_proj"] == "colwise" and plan["2.mlp.down_proj"] == "rowwise"
    assert plan["4"] == "colwise_gather_output"
    with pytest.raises(ValueError, match="has no tensor-parallel plan"):
        tp_plan(tiny("gpt2"))
