"""`hybridpar tokenize` end to end: the command writes, says when it is up to date, takes the
tokenizer from a run config, and prints one line for an error (exit 2)."""

from __future__ import annotations

import json

from test_tokenize import DOCS, bpe_tokenizer, documents, write_jsonl, write_txt

from hybridpar.cli import main
from hybridpar.data import open_tokens


def test_tokenize_writes_a_folder_then_says_it_is_up_to_date(tmp_path, capsys):
    write_txt(tmp_path / "corpus")
    (tmp_path / "corpus" / "more.txt").write_text("one\n\ntwo\n\nthree")
    args = ["tokenize", str(tmp_path / "corpus"), "-o", str(tmp_path / "out"),
            "--separator", "\\n\\n", "--eos", "\\n", "--val-fraction", "0", "--quiet"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"wrote {tmp_path / 'out'}: 8 documents, ")
    assert "uint16 tokens" in out and "EOS id 10" in out
    assert documents(tmp_path / "out") == [*DOCS, "one", "two", "three"]
    assert main([*args, "--workers", "2"]) == 0
    assert "is up to date" in capsys.readouterr().out


def test_tokenize_takes_the_tokenizer_of_a_run_config(tmp_path, capsys):
    model = tmp_path / "model"
    model.mkdir()
    bpe_tokenizer(model / "tokenizer.json", specials=("<s>", "</s>"))
    (model / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "</s>"}}))
    (model / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 320}))
    config = tmp_path / "run.toml"
    config.write_text(f'[model]\nname = "hf:llama"\npretrained = "{model}"\n')
    write_jsonl(tmp_path / "a.jsonl")
    assert main(["tokenize", str(tmp_path / "a.jsonl"), "-o", str(tmp_path / "out"),
                 "--config", str(config), "--val-fraction", "0", "--quiet"]) == 0
    meta = open_tokens(tmp_path / "out").meta
    assert (meta["tokenizer"]["name"], meta["tokenizer"]["eos"]) == (str(model), "</s>")
    assert documents(tmp_path / "out") == DOCS
    capsys.readouterr()
    small = tmp_path / "small.toml"
    small.write_text('[model]\nname = "gpt"\nvocab_size = 256\n')
    assert main(["tokenize", str(tmp_path / "a.jsonl"), "-o", str(tmp_path / "o2"),
                 "--config", str(small), "--tokenizer", str(model), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "has 320 ids, but the model of" in err
    assert "a vocabulary of 256" in err
    assert main(["tokenize", str(tmp_path / "a.jsonl"), "-o", str(tmp_path / "o2"),
                 "--config", str(small), "--quiet"]) == 2
    assert "has no model.pretrained" in capsys.readouterr().err
    assert not (tmp_path / "o2").exists()


def test_a_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    path = tmp_path / "a.jsonl"
    path.write_text('{"text": "fine"}\n{"txt": "typo"}\n')
    assert main(["tokenize", str(path), "-o", str(tmp_path / "out"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err == (f"hybridpar tokenize: error: {path}:2: no field 'text' (its fields: 'txt'); "
                   "name the text field with --field\n")
    assert not (tmp_path / "out").exists()
