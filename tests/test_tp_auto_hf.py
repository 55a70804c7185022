"""tp_plan on Hugging Face models: "auto" by data flow, HF's own plans, Conv1D and fused q|k|v.

Each worker builds the tiny model under the same seed on every rank, shards a copy with
apply_tp_plan, and trains it 3 SGD steps in float64 next to the plain model: logits, the
loss (ParallelCrossEntropyLoss on the class-sharded logits) and every gradient must match.

The tp=2 runs are cases of one spawn of 2 ranks, the tp=4 refusals cases of one spawn of 4
(module fixtures): a new set of ranks first imports the model families, which costs more
than a case. Each test asserts on its own cases.
"""

import copy

import pytest
import torch
from spawn_cases import spawn_cases

import hybridpar
from hybridpar.sharded.attrs import get_parallel_dim, register_parallel_dim
from hybridpar.sharded.mappings import gather_from_group
from hybridpar.tensor_parallel.fused import fused_gather_full, fused_parts
from hybridpar.tensor_parallel.loss import ParallelCrossEntropyLoss
from hybridpar.tensor_parallel.plans.plan import apply_tp_plan, plan_decisions
from hybridpar.tensor_parallel.state import gather_full

transformers = pytest.importorskip("transformers", reason="the Hugging Face tests need "
                                                          "transformers (pip install .[hf])")

F64 = torch.float64
VOCAB = 64


def llama(kv_heads=2):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=kv_heads)
    return transformers.LlamaForCausalLM(config).to(F64)


def gpt2():
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4,
                                     n_positions=16, resid_pdrop=0.0, embd_pdrop=0.0,
                                     attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(config).to(F64)


BUILD = {"llama": llama, "gpt2": gpt2}


def _full_grad(p, group):
    if p.grad is None:
        return None
    if fused_parts(p) > 1:
        return fused_gather_full(p.grad, p, group)
    return gather_full(p.grad, p, group)


def _logits(out, group):
    logits = out.logits
    return gather_from_group(logits, group, dim=-1) if get_parallel_dim(logits) == -1 else logits


def _train_worker(kind, plan, steps=3):
    topo = hybridpar.init(tp=2, timeout=60)
    group = topo.tp_group
    torch.set_num_threads(1)
    ref = BUILD[kind]()
    model = apply_tp_plan(copy.deepcopy(ref), plan, group=group)
    tie = getattr(model, "lm_head").weight is model.get_input_embeddings().weight
    sharded_loss = get_parallel_dim(model(torch.zeros(1, 2, dtype=torch.long)).logits) == -1
    loss_tp = ParallelCrossEntropyLoss() if sharded_loss else torch.nn.CrossEntropyLoss()
    loss_ref = torch.nn.CrossEntropyLoss()
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (ref, model)]
    g = torch.Generator().manual_seed(1)
    errors = {"logits": 0.0, "loss": 0.0, "grad": 0.0}
    params = dict(model.named_parameters())
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (2, 6), generator=g)
        for opt in opts:
            opt.zero_grad()
        out_ref, out = ref(ids), model(ids)
        # next-token loss, shifted as HF does (ParallelCrossEntropyLoss on the shard)
        lr = loss_ref(out_ref.logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
        shifted = out.logits[:, :-1].flatten(0, 1)  # still this rank's classes: re-tag
        register_parallel_dim(shifted, get_parallel_dim(out.logits))
        lt = loss_tp(shifted, ids[:, 1:].flatten())
        lr.backward()
        lt.backward()
        errors["logits"] = max(errors["logits"],
                               (_logits(out, group) - out_ref.logits).abs().max().item())
        errors["loss"] = max(errors["loss"], abs(lt.item() - lr.item()))
        for key, p in ref.named_parameters():
            full = _full_grad(params[key], group)
            errors["grad"] = max(errors["grad"], (full - p.grad).abs().max().item())
        for opt in opts:
            opt.step()
    return {"errors": errors, "decisions": plan_decisions(model), "tie": tie,
            "sharded_params": sum(p.numel() for p in model.parameters()),
            "full_params": sum(p.numel() for p in ref.parameters())}


def _tp2_case(what, *args):
    return _share_worker() if what == "share" else _train_worker(*args)


@pytest.fixture(scope="module")
def tp2():
    """Every tp=2 run by name, each rank's result."""
    gpt2_tied_plan = {"transformer.wte": "embedding_rowwise", "lm_head": "column",
                      "transformer.h.*.attn.c_attn": "colwise",
                      "transformer.h.*.attn.c_proj": "rowwise"}
    return spawn_cases(_tp2_case, 2, {
        "llama auto": ("train", "llama", "auto"),
        "gpt2 auto": ("train", "gpt2", "auto"),
        "llama base_model_tp_plan": ("train", "llama",
                                     dict(transformers.LlamaConfig.base_model_tp_plan)),
        "llama _tp_plan": ("train", "llama", llama()._tp_plan),
        "gpt2 tied plan": ("train", "gpt2", gpt2_tied_plan),
        "share": ("share",),
    }, timeout=240)


def _assert_matches(results):
    for rank, r in enumerate(results):
        for what, err in r["errors"].items():
            assert err < 1e-10, f"rank {rank}: {what} differs by {err}"
    assert results[0]["decisions"] == results[1]["decisions"]


def _decision(decisions, name):
    (line,) = [d for d in decisions if d.startswith(f"{name} (")]
    return line


def test_auto_shards_every_llama_attention_and_mlp_linear_and_matches_one_device(tp2):
    results = tp2["llama auto"]
    _assert_matches(results)
    d = results[0]["decisions"]
    for layer in range(2):
        at = f"model.layers.{layer}"
        for proj in ("q_proj", "k_proj", "v_proj"):
            assert f"column - feeds {at}.self_attn.o_proj" in _decision(d, f"{at}.self_attn.{proj}")
        assert "1 of 2 heads" in _decision(d, f"{at}.self_attn.k_proj")
        assert "2 of 4 heads" in _decision(d, f"{at}.self_attn.q_proj")
        assert _decision(d, f"{at}.self_attn.o_proj").endswith(
            f"row - reads the shards of {at}.self_attn.q_proj, {at}.self_attn.k_proj, "
            f"{at}.self_attn.v_proj")
        for proj in ("gate_proj", "up_proj"):
            assert f"column - feeds {at}.mlp.down_proj" in _decision(d, f"{at}.mlp.{proj}")
        assert ": row - reads the shards of" in _decision(d, f"{at}.mlp.down_proj")
    assert "column - class-sharded logits" in _decision(d, "lm_head")
    assert ": vocab" in _decision(d, "model.embed_tokens")


def test_auto_shards_gpt2_conv1d_and_the_fused_qkv_by_heads_and_matches_one_device(tp2):
    results = tp2["gpt2 auto"]
    _assert_matches(results)
    d = results[0]["decisions"]
    for layer in range(2):
        at = f"transformer.h.{layer}"
        c_attn = _decision(d, f"{at}.attn.c_attn")
        assert c_attn.startswith(f"{at}.attn.c_attn (Conv1D 32->96): column - feeds "
                                 f"{at}.attn.c_proj; 2 of 4 heads (head_dim 8) per rank; "
                                 f"fused in 3 parts")
        assert ": row" in _decision(d, f"{at}.attn.c_proj")
        assert ": column - feeds" in _decision(d, f"{at}.mlp.c_fc")
        assert ": row" in _decision(d, f"{at}.mlp.c_proj")
        # its config's head counts too, in a view of its own (`flow.LocalConfig`)
        assert any(line.startswith(f"{at}.attn: num_heads 4 -> 2, split_size 32 -> 16, "
                                   f"embed_dim 32 -> 16, config.") and
                   line.endswith("(this rank's heads)") for line in d), d
    # the tied embedding and head stay replicated, one Parameter, and say why
    assert results[0]["tie"]
    assert "replicate - replicated (its weight is tied to ['lm_head.weight'])" in \
        _decision(d, "transformer.wte")
    assert "final classifier replicated" in _decision(d, "lm_head")
    # the position table is indexed by arange, not by the input ids: replicated
    assert "replicated: a position table" in _decision(d, "transformer.wpe")


def test_hf_base_model_tp_plan_and_a_tied_vocab_plan_are_accepted(tp2):
    results = tp2["llama base_model_tp_plan"]            # relative to model.model
    _assert_matches(results)
    d = results[0]["decisions"]
    assert ": column" in _decision(d, "model.layers.1.self_attn.k_proj")
    assert ": row" in _decision(d, "model.layers.1.mlp.down_proj")
    assert "replicate - not in the plan" in _decision(d, "lm_head")
    # HF's full plan: lm_head colwise_gather_output gives full logits (HF's own loss works)
    results = tp2["llama _tp_plan"]
    _assert_matches(results)
    assert "column - output all-gathered" in _decision(results[0]["decisions"], "lm_head")
    # GPT-2 with its tie sharded on both ends: one Parameter, the vocab rows of each rank
    results = tp2["gpt2 tied plan"]
    _assert_matches(results)
    assert all(r["tie"] for r in results)
    d = results[0]["decisions"]
    assert "fused in 3 parts" in _decision(d, "transformer.h.0.attn.c_attn")
    assert "one Parameter with 'lm_head.weight'" in _decision(d, "transformer.wte")


def _heads_worker(plan):
    topo = hybridpar.init(tp=4, timeout=60)
    try:
        apply_tp_plan(llama(kv_heads=2), plan, group=topo.tp_group)
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.fixture(scope="module")
def tp4_refusals():
    return spawn_cases(_heads_worker, 4, {
        "auto": ("auto",),
        "base_model_tp_plan": (dict(transformers.LlamaConfig.base_model_tp_plan),)},
        timeout=120)


@pytest.mark.parametrize("plan", ["auto", "base_model_tp_plan"])
def test_tp_that_does_not_divide_the_kv_heads_is_refused_on_every_rank(plan, tp4_refusals):
    messages = tp4_refusals[plan]
    for m in messages:
        assert m.startswith("tp=4 does not divide the heads of 'model.layers.0.self_attn': "
                            "heads per projection q_proj 4, k_proj 2, v_proj 2 (head_dim 8); "
                            "'model.layers.0.self_attn.k_proj' has 2."), m
        assert "use a tp that divides 2 and 4" in m


def _share_worker():
    topo = hybridpar.init(tp=2, timeout=60)
    out = {}
    for kind in ("llama", "gpt2"):
        model = apply_tp_plan(BUILD[kind](), "auto", group=topo.tp_group)
        local = sum(p.numel() for p in model.parameters())
        full = sum(p.numel() for p in BUILD[kind]().parameters())
        # a sharded parameter holds 1/2 of its full tensor at tp=2: share = 2 * (full - local)
        out[kind] = (2 * (full - local) / full, plan_decisions(model))
    return out


def test_every_linear_has_a_reason_and_the_sharded_share(tp2):
    (r, _) = tp2["share"]
    for kind, (share, decisions) in r.items():
        print(f"{kind}: 'auto' shards {share:.1%} of the parameters at tp=2")
        for line in decisions:
            if "(Linear" in line or "(Conv1D" in line:
                assert " - " in line, f"no reason: {line}"
        assert share > 0.5 if kind == "llama" else share > 0.3
