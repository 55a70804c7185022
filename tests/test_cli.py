"""The `hybridpar` console script."""

import subprocess
import sys

import pytest

import hybridpar
from hybridpar.cli import main


def test_version_and_env_are_printed(capsys):
    out = subprocess.run([sys.executable, "-m", "hybridpar.cli", "--version"],
                         capture_output=True, text=True, check=True).stdout
    assert out.strip() == f"hybridpar {hybridpar.__version__}"
    assert main(["env"]) == 0
    printed = capsys.readouterr().out
    assert "torch" in printed and "default backend" in printed


def test_an_unknown_command_is_an_error_naming_the_choices(capsys):
    with pytest.raises(SystemExit) as info:
        main(["frobnicate"])
    assert info.value.code == 2
    assert "invalid choice: 'frobnicate'" in capsys.readouterr().err


SMALL_GPT = """# a tiny GPT for the balance CLI tests
[model]
name = "gpt"   # kept
n_layer = 2
n_embd = 32
block_size = 16

[parallel]
pp = 2
balance = "params"   # replaced by --write

[train]
batch_size = 4
"""


def test_balance_prints_the_stage_table_and_writes_the_split(tmp_path, capsys):
    from hybridpar.train import load_config

    config = tmp_path / "small.toml"
    config.write_text(SMALL_GPT)
    assert main(["balance", str(config), "--timeout", "0.3", "--write"]) == 0
    out = capsys.readouterr().out
    assert "gpt (5 layers) over 2 stages by time" in out
    assert "slowest / fastest stage:" in out
    written = load_config(config).parallel.balance
    assert f"balance = {written}" in out and sum(written) == 5
    text = config.read_text()
    assert '# a tiny GPT' in text and 'name = "gpt"   # kept' in text  # the rest is untouched


def test_balance_by_params_and_size_needs_no_write(tmp_path, capsys):
    config = tmp_path / "small.toml"
    config.write_text(SMALL_GPT)
    for by in ("params", "size"):
        assert main(["balance", str(config), "--by", by, "--partitions", "3",
                     "--timeout", "0.2"]) == 0
        assert "over 3 stages by " + by in capsys.readouterr().out
    assert config.read_text() == SMALL_GPT


def test_balance_errors_are_one_line_with_exit_code_two(tmp_path, capsys):
    config = tmp_path / "small.toml"
    config.write_text(SMALL_GPT)
    cases = [
        (["balance", str(tmp_path / "missing.toml")], "missing.toml"),
        (["balance", str(config), "--partitions", "9"], "cannot split 5 layers into 9 stages"),
        (["balance", str(config), "--partitions", "3", "--write"],
         "--write stores a balance for the config's 2 stages"),
        (["balance", str(config), "--set", "parallel.nope=1"], "nope"),
    ]
    for argv, phrase in cases:
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("hybridpar balance: error:") and phrase in err
        assert len(err.splitlines()) == 1


def test_write_balance_adds_a_parallel_table_when_there_is_none(tmp_path):
    from hybridpar.train.commands.balance import write_balance

    config = tmp_path / "bare.toml"
    config.write_text('[model]\nname = "mlp"\n')
    write_balance(config, [2, 3])
    assert config.read_text() == '[model]\nname = "mlp"\n[parallel]\nbalance = [2, 3]\n'
