"""The MoE layer against transformers' own blocks, float64: outputs and every gradient.

Each HF family's sparse block (eager experts: transformers' reference loop) is built from a
tiny config, its weights copied into a `hybridpar.moe.MoE` of the family's recipe, and both
run on the same tokens; then the load-balancing loss over several layers against
`load_balancing_loss_func`, and the errors a bad router or expert set raises.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from hybridpar.moe import (
    Experts,
    MoE,
    Router,
    SharedExpert,
    balance_loss,
    empty_stats,
    expert_load,
    group_by_expert,
    grouped_linear,
    routing_stats,
)

transformers = pytest.importorskip("transformers")

H, FFN, E, K = 16, 12, 8, 2       # hidden, expert intermediate, experts, top-k

# family: (module, config class, block class, config extras, our recipe)
FAMILIES = {
    "mixtral": ("mixtral", "MixtralConfig", "MixtralSparseMoeBlock",
                {"num_local_experts": E}, {"scoring": "softmax", "normalize": True}),
    "qwen2_moe": ("qwen2_moe", "Qwen2MoeConfig", "Qwen2MoeSparseMoeBlock",
                  {"num_experts": E, "moe_intermediate_size": FFN, "norm_topk_prob": False,
                   "shared_expert_intermediate_size": 20},
                  {"scoring": "softmax", "normalize": False}),
    "qwen3_moe": ("qwen3_moe", "Qwen3MoeConfig", "Qwen3MoeSparseMoeBlock",
                  {"num_experts": E, "moe_intermediate_size": FFN, "norm_topk_prob": True},
                  {"scoring": "softmax", "normalize": True}),
    "olmoe": ("olmoe", "OlmoeConfig", "OlmoeSparseMoeBlock",
              {"num_experts": E, "norm_topk_prob": False},
              {"scoring": "softmax", "normalize": False}),
    "granitemoe": ("granitemoe", "GraniteMoeConfig", "GraniteMoeMoE",
                   {"num_local_experts": E}, {"scoring": "topk_softmax"}),
    "gpt_oss": ("gpt_oss", "GptOssConfig", "GptOssMLP", {"num_local_experts": E},
                {"scoring": "topk_softmax", "bias": True, "score_dtype": None}),
    "deepseek_v3": ("deepseek_v3", "DeepseekV3Config", "DeepseekV3MoE",
                    {"n_routed_experts": E, "moe_intermediate_size": FFN, "n_group": 4,
                     "topk_group": 2, "n_shared_experts": 1, "routed_scaling_factor": 2.5,
                     "norm_topk_prob": True},
                    {"scoring": "sigmoid", "normalize": True, "groups": 4, "top_groups": 2,
                     "scale": 2.5}),
}


def _hf_block(family: str) -> tuple[torch.nn.Module, object]:
    module, config_name, block_name, extras, _ = FAMILIES[family]
    hf = importlib.import_module(f"transformers.models.{module}.modeling_{module}")
    config_cls = getattr(importlib.import_module(f"transformers.models.{module}"), config_name)
    config = config_cls(hidden_size=H, intermediate_size=FFN, num_experts_per_tok=K,
                        hidden_act="silu", **extras)
    config._experts_implementation = "eager"
    torch.manual_seed(0)
    block = getattr(hf, block_name)(config).double()
    with torch.no_grad():       # HF leaves its 3-D experts and routers uninitialized
        for p in block.parameters():
            p.normal_(0, 0.3)
        for b in block.buffers():
            b.normal_(0, 0.1)   # DeepSeek's correction bias: choices it must steer
    return block, config


def _ours(family: str, block: torch.nn.Module) -> MoE:
    recipe = FAMILIES[family][4]
    hf_router = getattr(block, "gate", None) or block.router
    router = Router(H, E, K, **recipe)
    gpt_oss = family == "gpt_oss"
    experts = Experts(E, H, FFN, layout="gpt_oss" if gpt_oss else "fused")
    hf_shared = getattr(block, "shared_expert", None) or getattr(block, "shared_experts", None)
    shared = None
    if hf_shared is not None:
        shared = SharedExpert(H, hf_shared.down_proj.in_features,
                              gated=hasattr(block, "shared_expert_gate"))
    moe = MoE(router, experts, shared).double()
    with torch.no_grad():
        router.weight.copy_(hf_router.weight)
        if router.bias is not None:
            router.bias.copy_(hf_router.bias)
        if family == "deepseek_v3":
            router.correction_bias.copy_(hf_router.e_score_correction_bias)
        for name, p in experts.named_parameters():
            p.copy_(getattr(block.experts, name))
        if shared is not None:
            for name in ("gate_proj", "up_proj", "down_proj"):
                getattr(shared, name).weight.copy_(getattr(hf_shared, name).weight)
            if shared.gate is not None:
                shared.gate.weight.copy_(block.shared_expert_gate.weight)
    return moe


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_block_equals_transformers_bit_for_bit_in_float64(family):
    block, _ = _hf_block(family)
    moe = _ours(family, block)
    x = torch.randn(3, 10, H, dtype=torch.float64)
    x_hf, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()
    hf_out = block(x_hf)
    hf_out = hf_out[0] if isinstance(hf_out, tuple) else hf_out      # GPT-OSS: (out, scores)
    out = moe(x_ours)
    assert out.shape == x.shape
    assert torch.equal(out, hf_out), (out - hf_out).abs().max()
    g = torch.randn_like(out)
    hf_out.backward(g)
    out.backward(g)
    # the backward sums a token's copies in another order: the last bits may differ
    assert (x_ours.grad - x_hf.grad).abs().max() <= 1e-14
    theirs = dict(block.named_parameters())
    ours = {n: p for n, p in moe.named_parameters()}
    assert len(ours) == len(theirs)
    hf_router = "gate" if "gate.weight" in theirs else "router"
    pairs = {"router.weight": f"{hf_router}.weight", "router.bias": f"{hf_router}.bias",
             "shared.gate.weight": "shared_expert_gate.weight"}
    hf_shared = "shared_expert" if family == "qwen2_moe" else "shared_experts"
    for name, p in ours.items():
        hf_name = pairs.get(name, name.replace("shared.", f"{hf_shared}."))
        assert (p.grad - theirs[hf_name].grad).abs().max() <= 1e-14, name


def test_every_token_reaches_its_k_experts_dropless():
    torch.manual_seed(1)
    x = torch.randn(40, 4, dtype=torch.float64)
    experts = torch.zeros(40, 2, dtype=torch.int64)        # all tokens to experts 0 and 3
    experts[:, 1] = 3
    copies, counts, order = group_by_expert(x, experts, 4)
    assert counts.tolist() == [40, 0, 0, 40]                  # no capacity: nothing dropped
    assert torch.equal(copies[:40], x) and torch.equal(copies[40:], x)
    assert order.tolist() == list(range(80))                  # slot by slot, tokens in order


def test_the_loop_is_each_experts_own_matrix_on_its_rows():
    torch.manual_seed(2)
    x, w = torch.randn(9, 4, dtype=torch.float64), torch.randn(4, 5, 4, dtype=torch.float64)
    counts = torch.tensor([3, 4, 0, 2])
    out = grouped_linear(x, w, counts)
    expected = torch.cat([x[:3] @ w[0].T, x[3:7] @ w[1].T, x[7:] @ w[3].T])
    assert torch.equal(out, expected)
    assert torch.equal(grouped_linear(x, w.transpose(1, 2), counts, transposed=True), expected)
    assert grouped_linear(x[:0], w, torch.zeros(4, dtype=torch.int64)).shape == (0, 5)


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "olmoe"])
def test_the_balance_loss_of_summed_stats_equals_load_balancing_loss_func(family):
    """Three layers' sums carried in one vector give HF's loss, and its gradient."""
    module = FAMILIES[family][0]
    hf = importlib.import_module(f"transformers.models.{module}.modeling_{module}")
    torch.manual_seed(3)
    logits = [torch.randn(30, E, dtype=torch.float64, requires_grad=True) for _ in range(3)]
    expected = hf.load_balancing_loss_func(tuple(logits), E, K)
    stats = empty_stats(E)
    for layer in logits:
        stats = stats + routing_stats(layer, K)
    loss = balance_loss(stats)
    assert loss.dtype == expected.dtype == torch.float32
    assert torch.equal(loss, expected)
    ours = torch.autograd.grad(loss, logits)
    theirs = torch.autograd.grad(expected, logits)
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b)


def test_the_block_adds_its_routing_sums_and_the_load_is_logged():
    torch.manual_seed(4)
    moe = MoE(Router(H, E, K), Experts(E, H, FFN)).double()
    x = torch.randn(2, 5, H, dtype=torch.float64)
    out, stats = moe(x, empty_stats(E))
    assert torch.equal(out, moe(x))
    assert stats.shape == (2 * E + 2,) and stats[2 * E] == 10 and stats[:E].sum() == 10 * K
    low, high = expert_load(stats)
    assert 0 <= low <= 1 <= high <= E


@pytest.mark.parametrize("kwargs, message", [
    ({"top_k": 9}, "top_k=9 must be between 1 and the number of experts (8)"),
    ({"top_k": 0}, "top_k=0 must be between 1"),
    ({"scoring": "max"}, "router scoring 'max' is not one of softmax, topk_softmax, sigmoid"),
    ({"groups": 3, "scoring": "sigmoid"}, "groups=3 must divide the 8 experts"),
    ({"groups": 2}, "group-limited top-k (groups > 1) is a recipe of the sigmoid router"),
    ({"groups": 2, "top_groups": 3, "scoring": "sigmoid"}, "top_groups=3 must be between 1"),
    ({"groups": 4, "top_groups": 1, "top_k": 3, "scoring": "sigmoid"},
     "top_k=3 <= top_groups × experts per group (1 × 2)"),
])
def test_a_bad_router_is_refused_naming_the_numbers(kwargs, message):
    args = {"top_k": K, **kwargs}
    with pytest.raises(ValueError) as err:
        Router(H, E, args.pop("top_k"), **args)
    assert message in str(err.value)


def test_bad_experts_are_refused():
    with pytest.raises(ValueError, match="layout 'x' is not one of fused, gpt_oss"):
        Experts(E, H, FFN, layout="x")
    with pytest.raises(ValueError, match="activation 'tanh' is not one of"):
        Experts(E, H, FFN, activation="tanh")
    with pytest.raises(ValueError, match=r"experts 6\.\.9 are not among the 8 experts"):
        Experts(E, H, FFN, first=6, local=4)
    with pytest.raises(ValueError, match=r"experts 2\.\.5 are not one of equal slices of the 8"):
        Experts(E, H, FFN, first=2, local=4)
    with pytest.raises(ValueError, match=r"experts 0\.\.2 are not one of equal slices of the 8"):
        Experts(E, H, FFN, first=0, local=3)
    with pytest.raises(ValueError, match=r"rank 0 must hold experts 0\.\.7 .* but the block "
                                         r"holds 0\.\.3 of 8"):
        MoE(Router(H, E, K), Experts(E, H, FFN, local=4))
