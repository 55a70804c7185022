"""Hugging Face MoE checkpoints as the Hub stores them: experts one by one (Mixtral's
``block_sparse_moe.experts.{e}.w1.weight``, Qwen's ``mlp.experts.{e}.gate_proj.weight``),
renamed fused ones (Granite-MoE's ``input_linear``), the model's own (GPT-OSS): read into
the fused layout whole or each rank its experts alone, written back as ``save_pretrained``
writes them, and a meta build at ep > 1 drawing the one-device experts."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from test_moe_hf import tiny_moe

import hybridpar
from hybridpar.models import gpt_loss

transformers = pytest.importorskip("transformers")

FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "granitemoe", "gpt_oss", "cohere2_moe",
            "flex_olmo", "mellum", "minimax")


def _saved(family, folder):
    """The family's tiny model (float64), saved by ``save_pretrained`` into `folder`."""
    model = tiny_moe(family)
    model.save_pretrained(folder)
    return model


def _files(folder):
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


@pytest.mark.parametrize("family", FAMILIES)
def test_a_hub_checkpoint_reads_into_the_fused_experts_and_writes_back_bit_equal(
        family, tmp_path):
    from hybridpar.hf import (
        load_hf_checkpoint,
        load_hf_shards,
        save_hf_checkpoint,
        to_sequential,
    )

    model = _saved(family, tmp_path / "hub")
    expected = to_sequential(model).state_dict()
    whole = load_hf_checkpoint(tmp_path / "hub")
    assert set(whole) <= set(expected)
    for k, v in whole.items():
        assert torch.equal(v, expected[k]), k
    fresh = to_sequential(tiny_moe(family))
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    load_hf_shards(fresh, tmp_path / "hub")
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, expected[k]), k
    save_hf_checkpoint(expected, model.config, tmp_path / "ours")
    hub, ours = _files(tmp_path / "hub"), _files(tmp_path / "ours")
    assert set(ours) == set(hub)
    assert all(torch.equal(ours[k], hub[k]) for k in hub)
    if family in ("mixtral", "qwen3_moe"):   # the Hub's per-expert names, not the model's
        assert not any(k.endswith("gate_up_proj") for k in hub)


def _cut(folder, drop=None, add=None):
    state = load_file(str(folder / "model.safetensors"))
    if drop is not None:
        del state[drop]
    if add is not None:
        state[add[0]] = state[add[1]].clone()
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})


def test_a_checkpoint_missing_an_expert_or_holding_one_more_is_refused_naming_it(tmp_path):
    from hybridpar.hf import load_hf_checkpoint, load_hf_shards, to_sequential

    _saved("mixtral", tmp_path)
    name = "model.layers.1.block_sparse_moe.experts.3.w3.weight"
    _cut(tmp_path, drop=name)
    with pytest.raises(ValueError, match=r"experts of model\.layers\.1\.mlp\.experts\."
                                         r"gate_up_proj are incomplete: " + name.replace(
                                             ".", r"\.") + r" is missing \(1 of 8"):
        load_hf_checkpoint(tmp_path)
    with pytest.raises(ValueError, match=r"1 tensor\(s\) this rank needs are not in the "
                                         r"checkpoint: " + name.replace(".", r"\.") +
                                         r" \(expert 3 of the model's 2\.mlp\.experts\."
                                         r"gate_up_proj\)"):
        load_hf_shards(to_sequential(tiny_moe("mixtral")), tmp_path)
    _saved("mixtral", tmp_path)
    _cut(tmp_path, add=("model.layers.0.block_sparse_moe.experts.4.w1.weight",
                        "model.layers.0.block_sparse_moe.experts.0.w1.weight"))
    with pytest.raises(ValueError, match=r"holds 1 tensor\(s\) the model built from "
                                         r"config\.json does not have, e\.g\. model\.layers\.0"
                                         r"\.block_sparse_moe\.experts\.4\.w1\.weight: .* "
                                         r"experts\)"):
        load_hf_shards(to_sequential(tiny_moe("mixtral")), tmp_path)


def _meta_pipe(family, topo, init):
    from hybridpar.hf import to_sequential

    config = tiny_moe(family).config
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config).double()
    return model, hybridpar.HybridPipe(to_sequential(model), [2, 3], topology=topo,
                                       loss_fn=gpt_loss, init_fn=init(model))


def _ep_worker(family, folder, out):
    from hybridpar.hf import init_fn, init_for_loading, load_hf_shards
    from hybridpar.keyed import KeyedInit
    from hybridpar.train.export import export_pipe

    topo = hybridpar.init(pp=2, dp=2, ep=2, timeout=60)
    _, drawn = _meta_pipe(family, topo, lambda model: KeyedInit(5, init=init_fn(model)))
    model, loaded = _meta_pipe(family, topo, lambda model: init_for_loading)
    read = load_hf_shards(loaded, folder)
    export_pipe(loaded, out, config=model.config)
    return drawn.consolidated_state_dict(), loaded.consolidated_state_dict(), read.bytes_read


@pytest.mark.parametrize("family", ["mixtral", "granitemoe", "gpt_oss"])
def test_at_pp2_dp2_ep2_a_meta_build_draws_and_loads_each_ranks_experts_alone(
        family, tmp_path):
    """Built on meta at pp 2 x dp 2 x ep 2: drawn keyed (each layer's experts whole, each
    rank keeping its slice) it equals the one-device keyed draw; loaded from the Hub layout
    each rank reads its stage's tensors and its E / ep experts, no more (bytes counted);
    exported it is ``save_pretrained``'s folder bit for bit."""
    from hybridpar.hf import init_fn, to_sequential
    from hybridpar.keyed import keyed_reset_

    model = _saved(family, tmp_path / "hub")
    expected = to_sequential(model).state_dict()
    results = hybridpar.spawn(_ep_worker, 4, args=(family, str(tmp_path / "hub"),
                                                   str(tmp_path / "export")), timeout=240)
    plain = tiny_moe(family)
    reference = to_sequential(plain)
    keyed_reset_(reference, 5, init=init_fn(plain))
    for drawn, loaded, _ in results:
        for k, v in reference.state_dict().items():
            assert torch.equal(drawn[k], v), k
            assert torch.equal(loaded[k], expected[k]), k
    experts = sum(v.numel() for k, v in expected.items() if ".experts." in k) * 8
    rest = sum(v.numel() for k, v in model.state_dict().items()
               if ".experts." not in k) * 8
    # every rank reads its stage's tensors; the 2 ranks of a stage's ep group split its experts
    assert sum(read for *_, read in results) == 2 * rest + experts
    hub, ours = _files(tmp_path / "hub"), _files(tmp_path / "export")
    assert set(ours) == set(hub) and all(torch.equal(ours[k], hub[k]) for k in hub)


def test_the_dry_run_of_a_meta_built_mixtral_at_ep2_holds_half_its_experts_per_fake_gpu():
    """`hybridpar check` of configs/mixtral_tiny.toml at dp 2 x ep 2, built on meta (fake GPUs):
    each layer's experts drawn whole and sliced without reading a value on the host, and
    each rank holding its dense bytes and half of the expert bytes."""
    from pathlib import Path

    from hybridpar.train.check.run import dry_run

    config = Path(__file__).resolve().parents[1] / "configs" / "mixtral_tiny.toml"
    report = dry_run(config, overrides=[
        "model.hidden_size=16", "model.intermediate_size=12", "model.num_hidden_layers=2",
        "model.verify=false", "data.seq_len=8", "parallel.tp=1", "parallel.pp=1",
        "parallel.balance=[5]", "parallel.dp=2", "parallel.ep=2", "parallel.checkpoint=never",
        "train.batch_size=4"])
    model = transformers.MixtralForCausalLM(transformers.MixtralConfig(
        vocab_size=256, hidden_size=16, intermediate_size=12, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4))
    experts = sum(p.numel() * 4 for n, p in model.named_parameters() if ".experts." in n)
    dense = sum(p.numel() * 4 for n, p in model.named_parameters() if ".experts." not in n)
    assert experts == 2 * 4 * (2 * 12 * 16 + 16 * 12) * 4   # 2 layers of 4 experts, float32
    for rank in report.ranks:
        assert rank.buckets == dense + experts // 2   # (params: + the rotary buffers)
        assert "all_to_all" in rank.comm


def test_the_config_counts_a_pretrained_folders_experts(tmp_path):
    """ep is checked against the experts of model.pretrained's config.json (4 here), not the
    family's default (Mixtral's 8), and a folder of another family is named."""
    from pathlib import Path

    from config_errors import error_of

    _saved("mixtral", tmp_path / "hub")
    config = Path(__file__).resolve().parents[1] / "configs" / "mixtral_tiny.toml"
    base = ["parallel.tp=1", "parallel.pp=1", "parallel.balance=[5]", "parallel.dp=8",
            f"model.pretrained={tmp_path / 'hub'}"]
    assert "parallel.ep=8 does not divide the pretrained config.json's experts=4: each ep " \
           "rank holds E / ep of the experts" in error_of(config, *base, "parallel.ep=8")
    assert "holds a 'mixtral' model, not 'qwen3_moe': use model.name = 'hf:mixtral'" in \
        error_of(config, *base, "parallel.ep=2", "model.name=hf:qwen3_moe")
