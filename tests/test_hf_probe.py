"""The parity probe (`hybridpar.hf.probe`) and the generic structure: a family is exact or
refused, never silently different, and what no adapter takes is refused by name."""

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="hybridpar.hf needs the optional extra hybridpar[hf]")

import transformers as tf

from hybridpar.hf import GLUE, hf_state_dict, to_sequential
from hybridpar.hf.probe import ProbeError, probe, shrunk_config
from hybridpar.hf.structure import structure_of
from hybridpar.models.registry import build

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("config,attribute,layer", [
    (tf.CohereConfig(logit_scale=0.5), "logit_scale", "layer 4 (the head (logits))"),
    (tf.GraniteConfig(embedding_multiplier=3.0), "embedding_multiplier",
     "layer 0 (the input layer)"),
    (tf.Gemma2Config(), "final_logit_softcapping", "layer 4 (the head (logits))"),
])
def test_a_family_whose_glue_is_unregistered_is_refused_naming_the_layer(config, attribute,
                                                                          layer):
    glue = [g for g in GLUE if g.attribute != attribute]
    with pytest.raises(ProbeError) as e:
        probe(config, glue=glue)
    assert f"converted is not its own forward: {layer} differs by" in str(e.value)
    assert "model.verify = false" in str(e.value)
    assert probe(config).max_difference <= 1e-10       # registered: exact


def test_the_probe_keeps_each_per_layer_pattern_at_a_tiny_size():
    config = tf.Gemma3TextConfig(num_hidden_layers=12, sliding_window=512)
    small = shrunk_config(config)
    assert small.num_hidden_layers == 2 and small.layer_types == ["sliding_attention",
                                                                  "full_attention"]
    assert (small.hidden_size, small.vocab_size, small.sliding_window) == (64, 128, 4)
    smol = shrunk_config(tf.SmolLM3Config(num_hidden_layers=8))   # no_rope_layers: 1,1,1,0
    assert smol.no_rope_layers == [1, 0] and smol.num_hidden_layers == 2
    assert config.num_hidden_layers == 12                           # the original untouched


@pytest.mark.parametrize("model_type,message", [
    ("deepseek_v3", "multi-head latent attention"),
    ("gemma3n_text", "per-layer inputs"),
    ("qwen3_next", "linear-attention layers"),
    ("gemma3", "a multi-modal model"),
    ("bert", "BertLMHeadModel (model_type 'bert', no base_model_pp_plan) has no 'bert' trunk"),
    ("opt", "is not embedding -> blocks -> one norm (its trunk holds ['decoder'])"),
])
def test_what_no_adapter_takes_is_refused_by_name(model_type, message):
    with pytest.raises(ValueError, match=None) as e:
        structure_of({"model_type": model_type})
    assert message in str(e.value)


def test_a_block_that_needs_inputs_the_sequential_does_not_make_is_refused():
    with pytest.raises(ProbeError, match=r"MptForCausalLM converted does not run as its own "
                                         r"forward does .*position_bias"):
        probe(tf.MptConfig())


def test_structure_comes_from_the_classes_plans():
    neox = structure_of({"model_type": "gpt_neox"})
    assert (neox.base, neox.inputs, neox.layers, neox.norm, neox.head) == (
        "gpt_neox", ("embed_in", "emb_dropout"), "layers", "final_layer_norm", "lm_head")
    assert ("^embed_out\\.", "lm_head.") in neox.renames          # transformers' own rename
    gpt2 = structure_of({"model_type": "gpt2"})                     # no pp plan: inspected
    assert gpt2.learned_positions and gpt2.inputs == ("wte", "wpe", "drop")


def test_an_old_checkpoint_name_loads_under_transformers_rename():
    from hybridpar.hf import key_map

    names = key_map({"model_type": "gpt_neox", "num_hidden_layers": 2,
                     "tie_word_embeddings": False})
    assert names.from_hf("embed_out.weight") == "4.weight"
    assert names.from_hf("gpt_neox.embed_in.weight") == "0.embed_in.weight"
    assert names.to_hf("0.embed_in.weight") == "gpt_neox.embed_in.weight"


def test_any_model_type_builds_from_its_config_fields_and_is_probed(caplog):
    caplog.set_level("INFO", logger="hybridpar.models.hf")
    sequential, _ = build("hf:phi3", vocab_size=64, hidden_size=32, intermediate_size=48,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          pad_token_id=0, bos_token_id=0, eos_token_id=1)
    assert len(sequential) == 5
    assert "model.verify: Phi3ForCausalLM converts exactly" in caplog.text
    with pytest.raises(ValueError, match="pad_token_id, for one, must be < vocab_size"):
        build("hf:phi3", vocab_size=64, hidden_size=32, num_hidden_layers=1, verify=False)
    with pytest.raises(ValueError, match="unknown Hugging Face model type 'nope'"):
        build("hf:nope")


def test_the_coverage_script_reports_exact_and_refused_types(tmp_path):
    out = subprocess.run([sys.executable, "scripts/hf_coverage.py", "--types", "llama",
                          "cohere", "mixtral", "deepseek_v3", "--no-tp", "--out",
                          str(tmp_path / "c.json")],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "3 of 4 causal-LM model types convert exactly" in out.stdout
    assert "| `mixtral` | exact |" in out.stdout
    assert "| `deepseek_v3` | refused: ValueError: DeepseekV3ForCausalLM has multi-head " \
           "latent attention" in out.stdout


def test_to_sequential_keeps_the_glue_in_small_layers():
    torch = pytest.importorskip("torch")
    config = tf.GraniteConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
                              num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                              embedding_multiplier=2.0, logits_scaling=4.0)
    model = tf.GraniteForCausalLM(config).double()
    sequential = to_sequential(model)
    assert type(sequential[0]).__name__ == "InputLayer"
    assert type(sequential[-1]).__name__ == "LogitsLayer"
    names = set(hf_state_dict(sequential.state_dict(), config))   # Hugging Face's names
    assert {"model.embed_tokens.weight", "lm_head.weight"} <= names
    ids = torch.randint(0, 32, (2, 5))
    torch.testing.assert_close(sequential(ids), model(ids).logits, atol=0, rtol=0)


def test_an_any_family_config_round_trips_through_the_run_dirs_config_json(tmp_path):
    """configs/gemma2_tiny.toml: options left at the class's defaults stay the class's (its
    layer_types follow num_hidden_layers), and RUN_DIR/config.json reads back the same
    (a table default, rope_parameters, is a table again)."""
    from hybridpar.models.hf import hf_config
    from hybridpar.train.configs.config import load_config, load_resolved, write_resolved

    config = load_config(ROOT / "configs" / "gemma2_tiny.toml")
    assert isinstance(config.model.args["rope_parameters"], dict)
    again = load_resolved(write_resolved(config, tmp_path))
    assert again.model.args == config.model.args
    hf = hf_config("gemma2", again.model.args)
    assert hf.num_hidden_layers == 4 and len(hf.layer_types) == 4 and hf.sliding_window == 32
    with pytest.raises(Exception, match="refuses the \\[model\\] options of 'hf:gemma2'"):
        hf_config("gemma2", {**again.model.args, "layer_types": ["full_attention"]})

