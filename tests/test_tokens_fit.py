"""Token folders that do not fit the run, named before training (issue 27 section 5).

A token folder made by another tokenizer than a pretrained model's own is an error
(`hybridpar.data.match`): in the run config's check, and in `hybridpar tokenize --config` with
a --tokenizer of its own; the same tokenizer, or one the model's extends, fits. An HF model
without a vocab_size key is checked against its builder's default (256). A folder broken
after the check is named by every rank as it makes its batches; a corrupt meta.json, a corpus
too short for a window and an id past meta.json's vocabulary (`open_tokens(verify=True)`)
are each one error naming the fix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_tokenize import bpe_tokenizer, write_jsonl

from hybridpar.cli import main
from hybridpar.data import load_tokenizer, tokenize_corpus
from hybridpar.data.match import pretrained_mismatch
from hybridpar.train import load_config
from hybridpar.train.configs.config import ConfigError

pytest.importorskip("tokenizers")
ROOT = Path(__file__).resolve().parents[1]
LLAMA = {"model_type": "llama", "vocab_size": 320, "hidden_size": 16, "intermediate_size": 32,
         "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2}


def pretrained_folder(path: Path, *, specials=("<|endoftext|>",)) -> Path:
    """A save_pretrained-like folder: a tiny Llama's config.json and its BPE tokenizer."""
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(LLAMA))
    bpe_tokenizer(path / "tokenizer.json", specials=specials)
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": specials[0]}))
    return path


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """{"model": a pretrained folder, "own": its tokens, "other": another BPE's, "bytes"}."""
    root = tmp_path_factory.mktemp("match")
    model = pretrained_folder(root / "model")
    other = bpe_tokenizer(root / "other.json", specials=("<pad>", "<|endoftext|>"))
    corpus = write_jsonl(root / "a.jsonl", [f"document number {i}, some text" for i in range(40)])
    out = {"model": model, "other_tokenizer": other, "corpus": corpus}
    for name, tokenizer in (("own", model), ("other", other), ("bytes", "bytes")):
        out[name] = tokenize_corpus([corpus], root / name, tokenizer=str(tokenizer),
                                    val_fraction=0.1, workers=1).folder
    return out


def config(setup, tokens: str):
    return load_config(ROOT / "configs" / "finetune_llama.toml", [
        f"model.pretrained={setup['model']}", f"data.path={setup[tokens]}", "data.seq_len=8",
        "parallel.pp=2", "parallel.tp=1", "train.batch_size=4"])


def test_the_models_own_tokenizer_fits_and_another_is_named_with_a_token(setup):
    assert pretrained_mismatch(load_tokenizer(setup["model"]), setup["model"]) is None
    why = pretrained_mismatch(load_tokenizer(setup["other_tokenizer"]), setup["model"])
    assert why is not None and "(320 tokens) are not those of the tokenizer of model" in why
    assert "token '<pad>' is id 0 in the one and absent from the other" in why
    why = pretrained_mismatch(load_tokenizer("bytes"), setup["model"])
    assert why is not None and why.startswith("byte ids 0-255 are not the ids of the tokenizer of")


def test_a_model_tokenizer_that_extends_ours_fits_and_a_folder_without_one_is_not_checked(
        setup, tmp_path):
    from tokenizers import Tokenizer

    extended = pretrained_folder(tmp_path / "extended")
    tok = Tokenizer.from_file(str(extended / "tokenizer.json"))
    tok.add_special_tokens(["<|im_start|>"])                 # id 320: the model's extra token
    tok.save(str(extended / "tokenizer.json"))
    assert pretrained_mismatch(load_tokenizer(setup["model"]), extended) is None
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text(json.dumps(LLAMA))
    assert pretrained_mismatch(load_tokenizer("bytes"), bare) is None


def test_a_run_on_tokens_of_another_tokenizer_is_a_config_error(setup):
    assert config(setup, "own").data.path == str(setup["own"])
    for tokens, match in (("other", r"token '<pad>' is id 0 in the one and absent"),
                          ("bytes", r"byte ids 0-255 are not the ids of the tokenizer of model")):
        with pytest.raises(ConfigError, match=r"does not fit the pretrained model: .*" + match
                           + r".*tokenize the corpus with the model's tokenizer"):
            config(setup, tokens)


def test_tokenize_with_a_config_refuses_another_tokenizer_than_its_models(setup, tmp_path,
                                                                            capsys):
    run = tmp_path / "run.toml"
    run.write_text(f'[model]\nname = "hf:llama"\npretrained = "{setup["model"]}"\n')
    args = ["tokenize", str(setup["corpus"]), "-o", str(tmp_path / "out"), "--config", str(run),
            "--quiet"]
    assert main([*args, "--tokenizer", str(setup["other_tokenizer"])]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "are not those of the tokenizer of model.pretrained" in err
    assert "leave out --tokenizer to use the model's own" in err
    assert not (tmp_path / "out").exists()
    assert main([*args, "--tokenizer", str(setup["model"] / "tokenizer.json")]) == 0


def test_an_hf_model_without_vocab_size_is_checked_against_its_builders_default(setup, tmp_path):
    import shutil

    wide = tmp_path / "wide"
    shutil.copytree(setup["bytes"], wide)
    meta = json.loads((wide / "meta.json").read_text())
    meta["tokenizer"]["vocab_size"] = 320                    # as a 320-id tokenizer's folder says
    (wide / "meta.json").write_text(json.dumps(meta))
    dims = "".join(f"{k} = {v}\n" for k, v in LLAMA.items() if k not in ("model_type",
                                                                         "vocab_size"))
    run = tmp_path / "run.toml"
    run.write_text(f'[model]\nname = "hf:llama"\n{dims}\n'
                   f'[data]\nsource = "tokens"\npath = "{wide}"\nseq_len = 8\n')
    with pytest.raises(ConfigError, match=r"320-token vocabulary .* has vocab_size=256: "
                                          r"ids >= 256 have no embedding"):
        load_config(run)
    meta["tokenizer"]["vocab_size"] = 256
    (wide / "meta.json").write_text(json.dumps(meta))
    assert load_config(run).data.path == str(wide)


# the folder itself, at the config check and on every rank -------------------------------------

def _train_error(cfg, run_dir):
    """What `train` raised on this rank, as "Type: message" (each rank reports its own)."""
    from hybridpar.train.trainer import train

    try:
        train(cfg, run_dir, progress=False)
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "trained"


def bytes_config(folder: Path, *overrides: str):
    return load_config(ROOT / "configs" / "quickstart.toml", [
        "model.block_size=8", "model.n_embd=16", "model.n_layer=2", "model.n_head=2",
        "data.source=tokens", f"data.path={folder}", "parallel.pp=2", "parallel.tp=1",
        "parallel.chunks=2", "parallel.timeout=60", "train.steps=1", "train.batch_size=2",
        "train.sample_tokens=0", "checkpoint.every=0", *overrides])


def test_a_folder_broken_after_the_check_is_named_on_every_rank_before_training(setup,
                                                                               tmp_path):
    import shutil

    import hybridpar

    folder = tmp_path / "tokens"
    shutil.copytree(setup["bytes"], folder)
    cfg = bytes_config(folder)
    shard = folder / "train-00000.bin"
    shard.write_bytes(shard.read_bytes()[:-2])                 # truncated after load_config
    errors = hybridpar.spawn(_train_error, 2, args=(cfg, str(tmp_path / "run")), timeout=90)
    assert len(errors) == 2
    for error in errors:                                     # the first stage and the last
        assert error.startswith(f"ValueError: data.path '{folder}': {shard} holds ")
        assert "but meta.json says" in error and "tokenize the corpus again" in error
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_a_corrupt_meta_json_and_a_corpus_too_short_for_a_window_are_named(setup, tmp_path):
    import shutil

    from hybridpar.train.data import make_batches

    folder = tmp_path / "tokens"
    shutil.copytree(setup["bytes"], folder)
    with pytest.raises(ValueError, match=r"the train split of .* has no window of seq_len \+ 1 "
                                         r"= 2049 tokens \(its longest shard holds \d+\); use a "
                                         r"shorter data.seq_len or a larger corpus"):
        make_batches(bytes_config(folder, "model.block_size=2048"))
    (folder / "meta.json").write_text('{"format": "hybridpar-tokens", ')
    with pytest.raises(ConfigError, match=r"meta.json is corrupt: not JSON .*tokenize the "
                                          r"corpus again \(hybridpar tokenize ... --overwrite\)"):
        bytes_config(folder)


def test_verify_finds_an_id_past_the_vocabulary_that_meta_json_gives(setup, tmp_path):
    import shutil

    from hybridpar.data import TokenFolderError, open_tokens

    folder = tmp_path / "tokens"
    shutil.copytree(setup["bytes"], folder)
    meta = json.loads((folder / "meta.json").read_text())
    meta["tokenizer"]["vocab_size"] = 100                    # the text holds 'u' = 117 and more
    (folder / "meta.json").write_text(json.dumps(meta))
    open_tokens(folder)                                      # sizes agree: ids not read
    with pytest.raises(TokenFolderError, match=r"train-00000.bin holds token id 1\d\d, past "
                                               r"the tokenizer's 100 ids"):
        open_tokens(folder, verify=True)
