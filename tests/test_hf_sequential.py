"""to_sequential: a Hugging Face causal LM as an nn.Sequential with the model's own numbers."""

import subprocess
import sys

import pytest
import torch
from torch import nn

pytest.importorskip("transformers", reason="hybridpar.hf needs the optional extra hybridpar[hf]")

from hf_models import tiny, token_batches

from hybridpar.hf import DecoderBlock, to_sequential
from hybridpar.nn import CausalLMLoss


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "mistral", "gpt2"])
def test_logits_equal_the_hf_model(kind):
    model = tiny(kind)
    seq = to_sequential(model)
    ids = token_batches(1, 3, 9)[0]                  # mistral's sliding window is 4 < 9
    assert len(seq) == model.config.num_hidden_layers + 3
    for mode in (True, False):                       # train and eval mode (no dropout set)
        model.train(mode)
        seq.train(mode)
        torch.testing.assert_close(seq(ids), model(ids).logits, atol=1e-12, rtol=0)


def test_parameters_are_the_model_own_and_ties_stay():
    llama = tiny("llama")
    seq = to_sequential(llama)
    assert {id(p) for p in seq.parameters()} == {id(p) for p in llama.parameters()}
    gpt2 = tiny("gpt2")
    seq = to_sequential(gpt2)
    assert seq[-1].weight is seq[0].wte.weight is gpt2.transformer.wte.weight
    assert {id(p) for p in seq.parameters()} == {id(p) for p in gpt2.parameters()}


def test_names_are_the_layers_names_under_the_layer_index():
    seq = to_sequential(tiny("llama"))
    names = list(seq.state_dict())
    assert names[0] == "0.weight"
    assert "1.self_attn.q_proj.weight" in names and "2.mlp.down_proj.weight" in names
    assert names[-2:] == ["3.weight", "4.weight"]                # final norm, head
    assert not any("inv_freq" in n for n in names)              # non-persistent buffers
    assert {n for n, _ in seq.named_buffers()} == {
        "1.inv_freq", "1.original_inv_freq", "2.inv_freq", "2.original_inv_freq"}
    gpt2_names = list(to_sequential(tiny("gpt2")).state_dict())
    assert gpt2_names[:3] == ["0.wte.weight", "0.wpe.weight", "1.ln_1.weight"]


def test_a_block_is_a_view_of_the_hf_layer():
    model = tiny("llama")
    seq = to_sequential(model)
    block = seq[1]
    assert isinstance(block, DecoderBlock)
    replacement = nn.Identity()
    block.mlp = replacement                                      # replaced on both
    assert model.model.layers[0].mlp is replacement
    seq.eval()
    assert not model.model.layers[0].training and not block.hf_rotary.training
    seq.to(torch.float32)                                        # one set of tensors
    assert model.model.layers[0].self_attn.q_proj.weight.dtype == torch.float32


def test_the_hf_loss_equals_causal_lm_loss_on_the_sequential():
    model = tiny("qwen2")
    seq = to_sequential(model)
    ids = token_batches(1, 2, 8)[0]
    labels = ids.clone()
    labels[0, 3:5] = -100
    ours = CausalLMLoss()(seq(ids), labels)
    assert ours.dtype == torch.float64
    hf = model(ids, labels=labels).loss                          # HF scores in float32
    torch.testing.assert_close(ours.float(), hf, atol=1e-6, rtol=0)


def test_unsupported_models_are_clear_errors():
    import transformers as tf

    config = tf.DeepseekV3Config(vocab_size=32, hidden_size=16, num_hidden_layers=1,
                                 num_attention_heads=2, intermediate_size=32,
                                 n_routed_experts=4, moe_intermediate_size=8)
    with pytest.raises(ValueError, match=r"DeepseekV3ForCausalLM has multi-head latent"):
        to_sequential(tf.DeepseekV3ForCausalLM(config))
    base = tf.LlamaModel(tiny("llama").config)
    with pytest.raises(ValueError, match="without a causal-LM head"):
        to_sequential(base)
    with pytest.raises(TypeError, match="Hugging Face model"):
        to_sequential(nn.Linear(2, 2))


def test_import_hybridpar_does_not_import_transformers():
    code = ("import sys; sys.modules['transformers'] = None; sys.modules['safetensors'] = None\n"
            "import hybridpar, hybridpar.hf, hybridpar.nn\n"
            "print('imported')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "imported"
