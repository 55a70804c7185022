"""Hugging Face mixtures of experts through `to_sequential` and HybridPipe, against the plain
transformers model (float64, 3 AdamW steps, every parameter to 1e-9), the load-balancing
loss on (``output_router_logits``, ``router_aux_loss_coef`` = 0.1).

The reference is the HF model on one device fed the same micro-batches with their gradients
accumulated: each micro-batch's loss is its mean cross-entropy plus the coefficient times
HF's own ``aux_loss`` (`load_balancing_loss_func` over that forward's router logits), over
the number of micro-batches. Every sparse block runs as hybridpar's view of it
(`hybridpar.moe.hf_blocks`: the block's own router and weights, grouped experts, the routing
sums carried across the stages to the head).
"""

from __future__ import annotations

import contextlib
import importlib

import pytest
import torch
import torch.nn.functional as F
from spawn_cases import selected_ids, spawn_cases

import hybridpar
from hybridpar.models import gpt_loss
from hybridpar.pipeline.schedules import replay as nccl

from pipe_harness import checked_step

transformers = pytest.importorskip("transformers")

STEPS, BATCH, SEQ, V = 3, 4, 8, 64
COMMON = dict(vocab_size=V, hidden_size=16, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, num_experts_per_tok=2, output_router_logits=True,
              router_aux_loss_coef=0.1, max_position_embeddings=64, pad_token_id=0,
              bos_token_id=0, eos_token_id=1)
# family: (config class, its extra keys)
FAMILIES = {
    "mixtral": ("MixtralConfig", dict(intermediate_size=12, num_local_experts=4)),
    "qwen2_moe": ("Qwen2MoeConfig", dict(intermediate_size=24, moe_intermediate_size=12,
                                         num_experts=4, shared_expert_intermediate_size=20,
                                         norm_topk_prob=False)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(intermediate_size=24, moe_intermediate_size=12,
                                         num_experts=4, norm_topk_prob=True, head_dim=8)),
    "olmoe": ("OlmoeConfig", dict(intermediate_size=12, num_experts=4)),
    "granitemoe": ("GraniteMoeConfig", dict(intermediate_size=12, num_local_experts=4)),
    "gpt_oss": ("GptOssConfig", dict(intermediate_size=12, num_local_experts=4, head_dim=8,
                                     sliding_window=4,
                                     layer_types=["sliding_attention", "full_attention"])),
    "cohere2_moe": ("Cohere2MoeConfig", dict(intermediate_size=12, num_experts=4, head_dim=4,
                                             sliding_window=4,
                                             layer_types=["sliding_attention", "full_attention"],
                                             mlp_layer_types=["sparse", "sparse"])),
    "flex_olmo": ("FlexOlmoConfig", dict(intermediate_size=12, num_experts=4)),
    "mellum": ("MellumConfig", dict(intermediate_size=24, moe_intermediate_size=12,
                                    num_local_experts=4, head_dim=4,
                                    layer_types=["full_attention", "full_attention"],
                                    mlp_layer_types=["sparse", "sparse"])),
    "minimax": ("MiniMaxConfig", dict(intermediate_size=12, num_local_experts=4, head_dim=4,
                                      layer_types=["full_attention", "linear_attention"],
                                      block_size=4)),
}


def tiny_moe(family: str) -> torch.nn.Module:
    config_name, extra = FAMILIES[family]
    config = getattr(transformers, config_name)(**COMMON, **extra)
    config._experts_implementation = "eager"
    torch.manual_seed(0)
    module = importlib.import_module(f"transformers.models.{family}")
    cls = next(getattr(module, n) for n in dir(module) if n.endswith("ForCausalLM"))
    model = cls(config).double()
    with torch.no_grad():   # routers and experts away from uniform: choices that matter
        for name, p in model.named_parameters():
            if ".experts." in name or name.endswith(("gate.weight", "router.weight")):
                p.normal_(0, 0.3)
    return model


def _batches():
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(2, V, (BATCH, SEQ), generator=g)
        y = torch.cat([ids[:, 1:], torch.full((BATCH, 1), -100)], dim=1)   # next ids
        out.append((ids, y))
    return out


def _reference(family: str, micro: int):
    model = tiny_moe(family)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    coef = model.config.router_aux_loss_coef
    for ids, y in _batches():
        opt.zero_grad()
        rows = BATCH // micro
        for i in range(micro):
            out = model(ids[i * rows:(i + 1) * rows])
            ce = F.cross_entropy(out.logits.flatten(0, 1), y[i * rows:(i + 1) * rows].flatten(),
                                 ignore_index=-100)
            aux = out.aux_loss if out.aux_loss is not None else 0.0   # (Cohere2-MoE: none)
            ((ce + coef * aux) / micro).backward()
        opt.step()
    return model.state_dict()


def _float64_rms_norm(self, hidden):
    variance = hidden.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden * torch.rsqrt(variance + self.variance_epsilon))


@contextlib.contextmanager
def float64_norms(family, tp):
    """OLMoE's (and FlexOlmo's) RMSNorm computing in float64 under tp, in this process
    (restored after).

    Its q / k norms span the whole projection: under tp the mean of squares is each rank's
    float32 sum, added (HF's float32, as OLMo 2's: test_hf_families.py), ~1e-8 off, and a
    routing choice near a tie may flip on it. Computed in float64, in the reference and the
    ranks alike, every parameter agrees to 1e-9."""
    norms = {"olmoe": "OlmoeRMSNorm", "flex_olmo": "FlexOlmoRMSNorm"}
    if family not in norms or tp == 1:
        yield
        return
    cls = getattr(importlib.import_module(f"transformers.models.{family}.modeling_{family}"),
                  norms[family])
    old, cls.forward = cls.forward, _float64_rms_norm
    try:
        yield
    finally:
        cls.forward = old


def _worker(family, layout, balance, options):
    with float64_norms(family, layout[1]):
        return _train(family, layout, balance, options)


def _train(family, layout, balance, options):
    from hybridpar.hf import hf_state_dict, to_sequential

    pp, tp, dp, ep = layout
    topo = hybridpar.init(pp=pp, tp=tp, dp=dp, ep=ep, timeout=60)
    model = tiny_moe(family)
    pipe = hybridpar.HybridPipe(to_sequential(model), balance, topology=topo,
                                loss_fn=gpt_loss, **options)
    pipe.p2p_log = []
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    rows = BATCH // dp
    for ids, y in _batches():
        opt.zero_grad()
        part = slice(topo.dp_rank * rows, (topo.dp_rank + 1) * rows)
        checked_step(pipe, ids[part], y[part])
        opt.step()
    if tp > 1 and family != "gpt_oss" and (family != "minimax" or topo.pp_rank == 0):
        # "auto" followed the MoE: attention is sharded (GPT-OSS's attention sinks keep its
        # attention whole under "auto", and so does MiniMax's linear attention, its block 2)
        from hybridpar.sharded.attrs import get_parallel_dim

        assert any(get_parallel_dim(p) is not None for p in pipe.parameters()), family
    log = [[[op.kind, op.peer, op.numel, op.dtype, op.label] for op in group]
           for group in pipe.p2p_log]
    return {"state": hf_state_dict(pipe.consolidated_state_dict(), model.config), "log": log}


# (pp, tp, dp, ep), balance over embedding, 2 blocks, norm, head, options
LAYOUTS = {
    "pp2-1f1b": ((2, 1, 1, 1), [2, 3], {"chunks": 2, "schedule": "1f1b"}),
    "pp2-zbv": ((2, 1, 1, 1), [2, 1, 1, 1], {"chunks": 2, "schedule": "zbv"}),
    "pp2dp2-gpipe": ((2, 1, 2, 1), [3, 2], {"chunks": 2, "schedule": "gpipe",
                                            "checkpoint": "always"}),
    # "auto": attention and the dense MLPs sharded, each MoE replicated over tp
    "pp2tp2-1f1b-auto": ((2, 2, 1, 1), [2, 3], {"chunks": 2, "schedule": "1f1b",
                                                "tp_plan": "auto"}),
    # expert parallelism: half the experts on each rank of an ep group
    "dp2ep2-gpipe": ((1, 1, 2, 2), [5], {"chunks": 2, "schedule": "gpipe"}),
    "pp2dp2ep2-1f1b": ((2, 1, 2, 2), [2, 3], {"chunks": 2, "schedule": "1f1b"}),
    "tp2dp2ep2-auto": ((1, 2, 2, 2), [5], {"chunks": 2, "schedule": "gpipe",
                                           "tp_plan": "auto"}),
    "pp2dp2ep2-zbv": ((2, 1, 2, 2), [2, 1, 1, 1], {"chunks": 2, "schedule": "zbv"}),
    # 8 ranks: kept few (two families)
    "pp2tp2dp2ep2-1f1b-auto": ((2, 2, 2, 2), [2, 3], {"chunks": 2, "schedule": "1f1b",
                                                      "tp_plan": "auto"}),
}
EIGHT_RANKS = ("mixtral", "qwen2_moe")
CASES = {f"{family}-{name}": (family, *layout) for family in FAMILIES
         for name, layout in LAYOUTS.items()
         if not name.startswith("pp2tp2dp2") or family in EIGHT_RANKS}


@pytest.fixture(scope="module")
def runs(request):
    wanted = selected_ids(request, "test_a_hugging_face_moe_trains_as_the_plain_model")
    cases = {name: args for name, args in CASES.items() if name in wanted}
    by_world: dict[int, dict] = {}
    for name, (family, layout, balance, options) in cases.items():
        by_world.setdefault(layout[0] * layout[1] * layout[2], {})[name] = (
            family, layout, balance, options)
    out = {}
    for world, group in sorted(by_world.items()):
        out.update(spawn_cases(_worker, world, group, timeout=300))
    return out


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_hugging_face_moe_trains_as_the_plain_model(case, runs):
    family, layout, _, options = CASES[case]
    with float64_norms(family, layout[1]):
        reference = _reference(family, options["chunks"] * layout[2])
    tol = 1e-9
    for result in runs[case]:
        state = result["state"]
        assert set(state) == set(reference)
        for k, v in reference.items():
            torch.testing.assert_close(state[k], v, atol=tol, rtol=0,
                                       msg=lambda m, k=k: f"{case} {k}: {m}")
    if layout[0] > 1:   # the stages' P2P (the routing sums ride along) under NCCL's rules
        logs = {rank: [[nccl.P2POp(*op) for op in group] for group in r["log"]]
                for rank, r in enumerate(runs[case])}
        assert nccl.replay(logs, check_labels=True).pairs > 0


def test_a_sparse_block_with_a_part_the_view_does_not_run_is_refused_naming_it():
    """Cohere2-MoE with shared experts: its block holds `shared_experts`, which the view
    would skip (a silently different model), so the conversion refuses it by name."""
    from hybridpar.hf import to_sequential

    config_name, extra = FAMILIES["cohere2_moe"]
    config = getattr(transformers, config_name)(**COMMON, **extra, num_shared_experts=1)
    with pytest.raises(ValueError, match=r"Cohere2MoeSparseMoeBlock has parts the MoE view "
                                         r"does not run \(shared_experts: "):
        to_sequential(transformers.Cohere2MoeForCausalLM(config))


def test_the_hugging_face_plan_of_a_model_with_experts_is_refused_naming_auto():
    from hybridpar.hf import to_sequential, tp_plan

    with pytest.raises(ValueError, match=r"MixtralConfig's own tensor-parallel plan shards "
                                         r"experts .* use tp_plan='auto'"):
        tp_plan(to_sequential(tiny_moe("mixtral")))


def _run_config(run_dir, *overrides):
    from pathlib import Path

    from hybridpar.train.configs.config import load_config
    from hybridpar.train.trainer import train

    config = load_config(Path(__file__).resolve().parents[1] / "configs" / "mixtral_tiny.toml", [
        "model.hidden_size=16", "model.intermediate_size=12", "model.num_hidden_layers=2",
        "data.seq_len=8", "parallel.tp=1", "parallel.timeout=60", "train.steps=2",
        "train.batch_size=4", "train.warmup_steps=1", "train.log_every=1",
        "train.eval_every=0", "train.sample_tokens=0", "checkpoint.every=0", *overrides])
    return train(config, run_dir, progress=False)["losses"]


def test_a_mixtral_config_at_ep2_built_on_meta_trains_as_at_ep1(tmp_path):
    """dp 2 x ep 2 from a meta build (each rank drawing its experts as slices of the whole
    layer) against dp 2: the same losses (float32; expert gradients summed in another order)."""
    runs = [hybridpar.spawn(_run_config, 2, args=(str(tmp_path / f"ep{ep}"), "parallel.pp=1",
                                                  "parallel.balance=[5]", "parallel.dp=2",
                                                  f"parallel.ep={ep}"), timeout=240)[0]
            for ep in (1, 2)]
    assert len(runs[0]) == 2
    torch.testing.assert_close(runs[1], runs[0], rtol=1e-5, atol=0)


def test_a_mixtral_config_trains_meta_built_and_logs_its_routing(tmp_path):
    """configs/mixtral_tiny.toml, shrunk, through the trainer at pp 2: built on meta and
    initialized by Hugging Face's own `_init_weights` (the norm and head views' tensors
    included), and each step's aux loss and expert load in metrics.jsonl."""
    import json

    losses = hybridpar.spawn(_run_config, 2, args=(str(tmp_path),), timeout=240)[0]
    assert len(losses) == 2 and all(loss == loss for loss in losses)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text()
               .splitlines() if '"loss"' in line]
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert r["aux_loss"] > 0 and sorted(r["expert_load"]) == ["1", "2"]
