"""docs/reference.md is generated from the code and up to date (scripts/gen_reference.py)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_config_and_command_reference_is_up_to_date():
    done = subprocess.run([sys.executable, "scripts/gen_reference.py", "--check"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
