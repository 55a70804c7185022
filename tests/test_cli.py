"""The `hybridpar` console script."""

import subprocess
import sys

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
    try:
        main(["frobnicate"])
    except SystemExit as e:
        assert e.code == 2
    assert "invalid choice: 'frobnicate'" in capsys.readouterr().err
