"""Write docs/reference.md, the config and command-line reference, from the code itself.

    part                 read from
    config sections      the dataclasses of `hybridpar.train.configs.sections` (fields, types,
                         defaults,
                         the comment on each field's line, the choices the loader accepts)
    [model] options      each builder's keyword-only parameters (`hybridpar.models.registry`)
    commands             the argparse parsers of `hybridpar.cli`
    bad-input table      the rows of tests/test_bad_inputs.py, into docs/reliability.md

``python scripts/gen_reference.py`` rewrites the file; ``--check`` exits 1 when it is out of
date (tests/test_reference.py runs that, so a changed option fails the suite until the file
is regenerated).
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import re
import sys
import typing
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGET = ROOT / "docs" / "reference.md"
RELIABILITY = ROOT / "docs" / "reliability.md"
_BEGIN = ("<!-- bad-input rows: generated from tests/test_bad_inputs.py by "
          "scripts/gen_reference.py -->")
_END = "<!-- end of the generated rows -->"


def _comments(cls: type) -> dict[str, str]:
    """The comment on each field's line of a dataclass, continued by comment-only lines."""
    out: dict[str, str] = {}
    last = None
    for line in inspect.getsource(cls).splitlines():
        field = re.match(r"    (\w+): [^#]*?(?:#\s*(.*))?$", line)
        if field:
            last = field.group(1)
            if field.group(2):
                out[last] = field.group(2).strip()
        elif line.strip().startswith("#") and last is not None:
            out[last] = (out.get(last, "") + " " + line.strip().lstrip("# ")).strip()
        else:
            last = None
    return out


def _type(hint: object) -> str:
    text = str(hint).replace("typing.", "").replace("<class '", "").replace("'>", "")
    return text.replace(" | ", " or ")


def _config_tables() -> list[str]:
    from hybridpar.train.configs import sections as cfg

    lines: list[str] = []
    for section, cls in cfg.SECTION_CLASSES.items():
        doc = (cls.__doc__ or "").strip().splitlines()[0]
        lines += [f"### `[{section}]`", "", doc, "", "| key | type | default | meaning |",
                  "|---|---|---|---|"]
        hints = typing.get_type_hints(cls)
        notes = _comments(cls)
        for f in dataclasses.fields(cls):
            key = f"{section}.{f.name}"
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            meaning = notes.get(f.name, "")
            if key in cfg.CHOICES:
                meaning += ("; " if meaning else "") + "one of " + ", ".join(
                    f"`{c}`" for c in cfg.CHOICES[key])
            lines.append(f"| `{f.name}` | `{_type(hints[f.name])}` | `{default!r}` | "
                         f"{meaning.replace('|', '/')} |")
        lines.append("")
    return lines


def _model_tables() -> list[str]:
    from hybridpar.models import MODELS
    from hybridpar.models.hf import FAMILIES
    from hybridpar.train.configs import sections as cfg

    lines = ["### `[model]`", "", "`name` picks the builder; its keyword-only options are the "
             "other keys (`tp` and `group` come from `[parallel]`).", "",
             "`init` (one of " + ", ".join(f"`{c!r}`" for c in cfg.INITS) + "; default "
             f"`{cfg.ModelConfig.init!r}`): `'keyed'` builds the model on `meta` and draws each "
             "rank's shard keyed by `train.seed` and the module names (a "
             "`package.module:function` builder is checked first: "
             "`hybridpar/train/configs/builder_check.py`); `'full'` builds the whole model on "
             "every rank on the CPU, with the builder's own values.", ""]
    builders = {**MODELS, **{f"hf:{k}": v for k, v in FAMILIES.items()}}
    for name, fn in builders.items():
        params = [p for p in inspect.signature(fn).parameters.values()
                  if p.kind is inspect.Parameter.KEYWORD_ONLY and p.name not in ("tp", "group")]
        doc = (fn.__doc__ or "").strip().splitlines()[0] if fn.__doc__ else ""
        options = ", ".join(f"`{p.name}={p.default!r}`" for p in params)
        lines.append(f"- `{name}`: {doc} Options: {options}.")
    lines += ["- `package.module:function`: your builder, returning `(nn.Sequential, loss_fn)`;"
              " its keyword-only parameters are the options.", ""]
    return lines


def _cli() -> list[str]:
    from hybridpar import cli

    parser = cli.build_parser()
    lines = ["## Commands", ""]
    actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    for name, sub in actions[0].choices.items():
        sub.prog = f"hybridpar {name}"
        lines += [f"### `hybridpar {name}`", "", "```", sub.format_help().rstrip(), "```", ""]
    return lines


def render() -> str:
    lines = ["# Reference: config keys and commands", "",
             "Generated by `python scripts/gen_reference.py` from the code (the config "
             "dataclasses, the model builders and the argparse parsers); do not edit by hand.",
             "", "## Config keys", "", *_model_tables(), *_config_tables(), *_cli()]
    return "\n".join(lines).rstrip() + "\n"


def render_reliability() -> str:
    """docs/reliability.md with its bad-input table made from the tests' rows."""
    sys.path.insert(0, str(ROOT / "tests"))
    from test_bad_inputs import ROWS

    text = RELIABILITY.read_text(encoding="utf-8")
    head, rest = text.split(_BEGIN + "\n", 1)
    _, tail = rest.split(_END, 1)
    table = ["| where | bad input | error raised | message excerpt |", "|---|---|---|---|",
             *(row.line() for row in ROWS)]
    return head + _BEGIN + "\n" + "\n".join(table) + "\n" + _END + tail


def main(argv: list[str] | None = None) -> int:
    import os

    os.environ["COLUMNS"] = "100"   # argparse's help width: the same text on every terminal
    args = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    args.add_argument("--check", action="store_true", help="exit 1 if the file is out of date")
    opts = args.parse_args(argv)
    outputs = {TARGET: render(), RELIABILITY: render_reliability()}
    if opts.check:
        stale = [p for p, text in outputs.items()
                 if not p.exists() or p.read_text(encoding="utf-8") != text]
        for path in stale:
            print(f"{path.relative_to(ROOT)} is out of date: run python "
                  "scripts/gen_reference.py", file=sys.stderr)
        return 1 if stale else 0
    for path, text in outputs.items():
        path.write_text(text, encoding="utf-8")
        print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
