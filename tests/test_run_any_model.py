"""`hybridpar run` for any model: Hugging Face families (`hf:llama`) and a user's builder.

Every command runs in this process, which has imported torch and transformers already: `hybridpar
run` through tests/cli_in_process.py (`_cli`: the console entry, its agent's signal handlers
and environment put back; its workers come from the fork server), `export` and `balance` by
`hybridpar.cli.main`.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from cli_in_process import CliResult, hybridpar
from spawn_cases import spawn_cases

from hybridpar.cli import main
from hybridpar.models.registry import build
from hybridpar.train import ConfigError, load_config
from hybridpar.train.metrics import read_metrics
from hybridpar.train.trainer import train

ROOT = Path(__file__).resolve().parent.parent
LLAMA = ROOT / "configs" / "llama_tiny.toml"
SHORT = ["train.eval_every=0", "train.sample_tokens=0", "train.log_every=1",
         "train.warmup_steps=1", "parallel.timeout=60", "checkpoint.every=4"]


def _user_config(folder: Path, name: str, *options: str) -> Path:
    """llama_tiny.toml with its [model] table replaced by `name` and `options` (TOML lines)."""
    text = LLAMA.read_text()
    head, rest = text.split("[model]\n", 1)
    rest = rest[rest.index("[data]"):]
    file = folder / "user.toml"
    file.write_text(head + "[model]\n" + f"name = {name!r}\n" + "".join(
        f"{o}\n" for o in options) + "\n" + rest)
    return file


def _cli(*args: str, cwd: Path = ROOT) -> CliResult:
    return hybridpar(*args, cwd=cwd, timeout=240)


def test_llama_tiny_trains_end_to_end_and_exports_a_checkpoint_from_pretrained_loads(tmp_path,
                                                                                     capsys):
    transformers = pytest.importorskip("transformers", reason="pip install 'hybridpar[hf]'")
    run_dir = tmp_path / "run"
    sets = [f"--set={s}" for s in ("train.steps=4", *SHORT)]
    done = _cli("run", str(LLAMA), "--run-dir", str(run_dir), *sets)
    assert done.returncode == 0, done.stderr[-2000:]
    losses = [r["loss"] for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r]
    assert len(losses) == 4 and all(v == v for v in losses) and losses[-1] < losses[0]
    out = tmp_path / "hf"
    status = main(["export", str(run_dir / "checkpoints" / "step-4"), str(out), "--format", "hf"])
    assert status == 0, capsys.readouterr().err[-2000:]
    model, info = transformers.AutoModelForCausalLM.from_pretrained(out,
                                                                    output_loading_info=True)
    assert not any(info.values()), info                 # nothing missing or unexpected
    # the exported weights are the run's: the same logits as the plain Sequential holding them
    from hybridpar.train.export import read_state

    sequential, _ = build("hf:llama", **load_config(LLAMA).model.args)
    sequential.load_state_dict(read_state(run_dir / "checkpoints" / "step-4"), strict=True)
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, sequential(ids), atol=1e-5, rtol=1e-5)


def _train_worker(cfg, run_dir):
    return train(cfg, run_dir, progress=False)


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    """The runs from a config on 4 in-process ranks, in one spawn: a user's builder (pp2 x dp2:
    it has no tensor-parallel plan) and, where transformers is installed, Llama at pp2 x tp2 by
    its own plan (tp_plan = 'hf'). {case: its run directory}."""
    root = tmp_path_factory.mktemp("four_ranks")
    file = _user_config(root, "user_builders:tiny_lm", "width = 16")
    user = load_config(file, ["parallel.tp=1", "parallel.dp=2", "train.steps=3", *SHORT])
    assert user.model.args == {"vocab_size": 256, "width": 16, "blocks": 2}
    cases = {"user": (user, root / "user")}
    if importlib.util.find_spec("transformers") is not None:
        hf_plan = load_config(LLAMA, ["parallel.tp_plan=hf", "train.steps=2", *SHORT])
        cases["hf plan"] = (hf_plan, root / "hf_plan")
    spawn_cases(_train_worker, 4, cases, timeout=240)
    return {name: run_dir for name, (_, run_dir) in cases.items()}


def test_a_users_builder_trains_from_a_config(four_ranks):
    losses = [r["loss"] for r in read_metrics(four_ranks["user"] / "metrics.jsonl")
              if "loss" in r]
    assert len(losses) == 3 and losses[-1] < losses[0]


def test_hybridpar_balance_profiles_a_hugging_face_model(capsys):
    pytest.importorskip("transformers", reason="pip install 'hybridpar[hf]'")
    status = main(["balance", str(LLAMA), "--timeout", "0.5"])
    out, err = capsys.readouterr()
    assert status == 0, err[-2000:]
    assert "hf:llama (7 layers) over 2 stages" in out and "balance = [" in out


@pytest.mark.parametrize("overrides,message", [
    (["model.name=hf:bert"], "BertLMHeadModel (model_type 'bert', no base_model_pp_plan) has "
                             "no 'bert' trunk"),
    (["model.name=hf:nope"], "unknown Hugging Face model type 'nope'"),
    (["model.name=hf:deepseek_v3"], "DeepseekV3ForCausalLM has multi-head latent attention"),
    (["model.name=no_such_module:fn"], "cannot import module 'no_such_module'"),
    (["model.name=user_builders:missing"], "has no function 'missing'"),
    (["data.source=synthetic"], "set data.source = 'corpus'"),
    (["data.seq_len=0"], "data.seq_len"),
])
def test_a_model_that_cannot_be_built_is_a_config_error(overrides, message):
    pytest.importorskip("transformers", reason="pip install 'hybridpar[hf]'")
    with pytest.raises(ConfigError, match=None) as info:
        load_config(LLAMA, overrides)
    assert message in str(info.value)


def test_a_builder_without_its_loss_is_a_config_error(tmp_path):
    file = _user_config(tmp_path, "user_builders:bare")
    with pytest.raises(ConfigError, match=r"a builder returns \(nn.Sequential, loss_fn\)"):
        load_config(file, ["parallel.tp=1"])


def test_a_missing_sequence_length_is_named(tmp_path):
    pytest.importorskip("transformers", reason="pip install 'hybridpar[hf]'")
    text = LLAMA.read_text().replace("seq_len = 64\n", "")
    (tmp_path / "c.toml").write_text(text)
    with pytest.raises(ConfigError, match=r"set data\.seq_len"):
        load_config(tmp_path / "c.toml")


def test_pretrained_reads_a_local_checkpoint_directory(tmp_path):
    transformers = pytest.importorskip("transformers", reason="pip install 'hybridpar[hf]'")
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2)
    torch.manual_seed(3)
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(tmp_path)
    torch.manual_seed(4)   # another seed: the weights must come from the files
    sequential, _ = build("hf:llama", pretrained=str(tmp_path))
    ids = torch.randint(0, 256, (2, 8))
    with torch.no_grad():
        torch.testing.assert_close(sequential(ids), model(ids).logits)
    with pytest.raises(ValueError, match="holds a 'llama' model, not 'gpt2'"):
        build("hf:gpt2", pretrained=str(tmp_path))


def test_export_as_hugging_face_refuses_a_run_of_another_model(tmp_path, capsys):
    (tmp_path / "checkpoints" / "step-1").mkdir(parents=True)
    (tmp_path / "config.json").write_text(json.dumps({"model": {"name": "gpt"}}))
    status = main(["export", str(tmp_path / "checkpoints" / "step-1"), str(tmp_path / "hf"),
                   "--format", "hf"])
    assert status != 0
    assert "--format hf exports Hugging Face models" in capsys.readouterr().err
    assert not (tmp_path / "hf").exists()


def test_a_hugging_face_models_own_plan_trains_from_a_config(four_ranks):
    pytest.importorskip("transformers", reason="pip install 'hybridpar[hf]'")
    losses = [r["loss"] for r in read_metrics(four_ranks["hf plan"] / "metrics.jsonl")
              if "loss" in r]
    assert len(losses) == 2 and all(v == v for v in losses)


def test_the_hf_plan_of_a_model_that_is_not_hugging_faces_is_a_config_error():
    with pytest.raises(ConfigError, match="tp_plan = 'hf' is a Hugging Face model's own plan"):
        load_config(ROOT / "configs" / "quickstart.toml", ["parallel.tp_plan=hf"])
