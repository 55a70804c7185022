"""docs/reference.md is generated from the code and up to date (scripts/gen_reference.py)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_config_and_command_reference_is_up_to_date():
    done = subprocess.run([sys.executable, "scripts/gen_reference.py", "--check"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_every_config_key_has_a_row_in_the_training_and_reference_tables():
    import dataclasses

    from hybridpar.train.configs.sections import SECTION_CLASSES

    docs = ROOT / "docs"
    training = (docs / "training.md").read_text(encoding="utf-8")
    tables = training.split("<!-- config tables: generated", 1)[1].split(
        "<!-- end of the generated tables -->", 1)[0]
    reference = (docs / "reference.md").read_text(encoding="utf-8")
    for section, cls in SECTION_CLASSES.items():
        for text, heading in ((tables, f"**`[{section}]`**"), (reference, f"### `[{section}]`")):
            table = next(chunk for chunk in text.split(heading, 1)[1].split("\n\n")
                         if chunk.startswith("| key"))
            rows = [line.split("|")[1].strip().strip("`") for line in table.splitlines()
                    if line.startswith("| `")]
            assert rows == [f.name for f in dataclasses.fields(cls)], section
    for key in ("`schedule`", "`zero`", "`virtual_stages`", "`param_dtype`", "`max_skipped`",
                "`on_signal`", "`betas`", "`momentum`"):
        assert f"| {key} |" in tables, key
    assert '"zb-h1"' in tables and '"interleaved"' in tables and '"zbv"' in tables
