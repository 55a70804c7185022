"""Sequential <-> Hugging Face names, and Hugging Face checkpoint directories."""

import pytest
import torch

pytest.importorskip("transformers", reason="hybridpar.hf needs the optional extra hybridpar[hf]")
pytest.importorskip("safetensors", reason="hybridpar.hf needs the optional extra hybridpar[hf]")

from hf_models import tiny, token_batches

from hybridpar.hf import (
    hf_state_dict,
    key_map,
    load_hf_checkpoint,
    save_hf_checkpoint,
    sequential_state_dict,
    to_sequential,
)


def test_key_map_literal_names():
    llama = key_map(tiny("llama").config)                       # 2 blocks: norm 3, head 4
    assert llama.to_hf("0.weight") == "model.embed_tokens.weight"
    assert llama.to_hf("1.self_attn.q_proj.weight") == "model.layers.0.self_attn.q_proj.weight"
    assert llama.to_hf("2.mlp.up_proj.weight") == "model.layers.1.mlp.up_proj.weight"
    assert llama.to_hf("3.weight") == "model.norm.weight"
    assert llama.to_hf("4.weight") == "lm_head.weight"
    assert llama.from_hf("model.layers.1.self_attn.o_proj.weight") == "2.self_attn.o_proj.weight"
    assert llama.from_hf("layers.0.mlp.up_proj.weight") == "1.mlp.up_proj.weight"   # bare decoder
    gpt2 = key_map({"model_type": "gpt2", "n_layer": 2})           # a config.json dict
    assert gpt2.to_hf("0.wte.weight") == "transformer.wte.weight"
    assert gpt2.to_hf("0.wpe.weight") == "transformer.wpe.weight"
    assert gpt2.to_hf("2.attn.c_attn.bias") == "transformer.h.1.attn.c_attn.bias"
    assert gpt2.from_hf("transformer.ln_f.bias") == "3.bias"
    assert gpt2.tied == ("lm_head.weight", "transformer.wte.weight")
    with pytest.raises(KeyError, match="not a Sequential name"):
        llama.to_hf("7.weight")
    with pytest.raises(ValueError, match="model_type 'bert'"):
        key_map({"model_type": "bert", "num_hidden_layers": 2})


@pytest.mark.parametrize("kind", ["llama", "qwen3", "gpt2"])
def test_round_trip_loads_strictly_into_a_fresh_hf_model(kind):
    model = tiny(kind, seed=0)
    fresh = tiny(kind, seed=1)
    fresh.load_state_dict(hf_state_dict(to_sequential(model).state_dict(), model.config),
                          strict=True)
    ids = token_batches(1, 2, 6)[0]
    assert torch.equal(fresh(ids).logits, model(ids).logits)
    seq = to_sequential(tiny(kind, seed=2))
    seq.load_state_dict(sequential_state_dict(model.state_dict(), model.config), strict=True)
    assert torch.equal(seq(ids), model(ids).logits)


@pytest.mark.parametrize("kind,shard", [("llama", None), ("llama", "20KB"), ("gpt2", "30KB")])
def test_save_pretrained_directory_loads_into_the_sequential(tmp_path, kind, shard):
    model = tiny(kind, dtype=torch.float32)
    model.save_pretrained(tmp_path, **({"max_shard_size": shard} if shard else {}))
    files = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert (len(files) > 1) == (shard is not None)
    state = load_hf_checkpoint(tmp_path)
    expected = to_sequential(model).state_dict()
    assert list(state) == list(expected) or set(state) == set(expected)
    for k, v in expected.items():
        assert torch.equal(state[k], v), k
    if kind == "gpt2":                                     # the tied head is not in the files
        assert state["4.weight"] is state["0.wte.weight"]


def test_checkpoint_keys_without_weights_are_dropped():
    model = tiny("gpt2")
    hf = dict(model.state_dict())
    hf["transformer.h.0.attn.bias"] = torch.ones(1, 1, 4, 4)       # old GPT-2 mask buffers
    hf["transformer.h.0.attn.masked_bias"] = torch.tensor(-1e4)
    del hf["lm_head.weight"]
    seq = to_sequential(tiny("gpt2", seed=3))
    seq.load_state_dict(sequential_state_dict(hf, model.config), strict=True)
    assert torch.equal(seq[-1].weight, model.lm_head.weight)


def test_save_hf_checkpoint_is_read_by_from_pretrained(tmp_path):
    from transformers import AutoModelForCausalLM

    for kind in ("llama", "gpt2"):
        model = tiny(kind, dtype=torch.float32).eval()
        save_hf_checkpoint(to_sequential(model).state_dict(), model.config, tmp_path / kind)
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path / kind).eval()
        ids = token_batches(1, 2, 6)[0]
        assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_a_directory_without_safetensors_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a directory"):
        load_hf_checkpoint(tmp_path / "missing")
    (tmp_path / "config.json").write_text('{"model_type": "llama", "num_hidden_layers": 1}')
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors.*pytorch_model\.bin"):
        load_hf_checkpoint(tmp_path)
