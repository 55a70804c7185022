"""Write docs/reference.md, the config and command-line reference, from the code itself.

    part                 read from
    config sections      the declarations of `hybridpar.train.configs.sections` (each field's
                         type, default, range, choices and doc: `keys.key`), into
                         docs/reference.md and docs/training.md's tables
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
import sys
import typing
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGET = ROOT / "docs" / "reference.md"
RELIABILITY = ROOT / "docs" / "reliability.md"
_BEGIN = ("<!-- bad-input rows: generated from tests/test_bad_inputs.py by "
          "scripts/gen_reference.py -->")
_END = "<!-- end of the generated rows -->"
TRAINING = ROOT / "docs" / "training.md"
_TABLES = ("<!-- config tables: generated from hybridpar/train/configs/sections.py by "
           "scripts/gen_reference.py -->")
_TABLES_END = "<!-- end of the generated tables -->"
INTEGERS = ("Every integer is at most 2^63 − 1 (9223372036854775807); every number is "
            "finite. A value outside its range or choices is one `ConfigError` naming the key.")


def _type(hint: object) -> str:
    text = str(hint).replace("typing.", "").replace("<class '", "").replace("'>", "")
    return text.replace(" | ", " or ").replace("None", "none")


def _default(value: object) -> str:
    """A default as TOML writes it."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    return repr(value)


def _range(spec: dataclasses.Field, hint: object) -> str:
    """The range and choices column: what the loader accepts (`keys.check_value`)."""
    bounds, choices = spec.metadata.get("range"), spec.metadata.get("choices")
    parts = []
    if bounds is not None:
        integer = "int" in str(hint) and "float" not in str(hint)
        note = f" ({bounds.note})" if bounds.note else ""
        parts.append(bounds.text(integer=integer).replace(">=", "≥").replace("<=", "≤") + note)
    if choices:
        parts.append("one of " + ", ".join(f"`{_default(c)}`" for c in choices))
    return "; ".join(parts) or "—"


def config_tables(*, heading: str = "**`[{}]`**: ") -> list[str]:
    """One table per section: key, type, default, range / choices, meaning; all from the
    declarations in `hybridpar.train.configs.sections` (`keys.key`)."""
    from hybridpar.train.configs import sections as cfg

    lines: list[str] = []
    for section, cls in cfg.SECTION_CLASSES.items():
        doc = " ".join((cls.__doc__ or "").split()).split(": ", 1)[1]
        lines += [heading.format(section) + doc, "",
                  "| key | type | default | range / choices | meaning |",
                  "|---|---|---|---|---|"]
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            meaning = f.metadata["doc"].replace("|", "/")
            lines.append(f"| `{f.name}` | {_type(hints[f.name])} | `{_default(default)}` | "
                         f"{_range(f, hints[f.name])} | {meaning} |")
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
                  if p.kind is inspect.Parameter.KEYWORD_ONLY
                  and p.name not in ("tp", "group", "ep", "ep_group")]
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
             "", "## Config keys", "", *_model_tables(), INTEGERS, "",
             *config_tables(heading="### `[{}]`\n\n"),
             *_cli()]
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


def render_training() -> str:
    """docs/training.md with its config tables made from the declarations."""
    text = TRAINING.read_text(encoding="utf-8")
    head, rest = text.split(_TABLES + "\n", 1)
    _, tail = rest.split(_TABLES_END, 1)
    return head + _TABLES + "\n" + "\n".join([INTEGERS, "", *config_tables()]) + _TABLES_END \
        + tail


def main(argv: list[str] | None = None) -> int:
    import os

    os.environ["COLUMNS"] = "100"   # argparse's help width: the same text on every terminal
    args = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    args.add_argument("--check", action="store_true", help="exit 1 if the file is out of date")
    opts = args.parse_args(argv)
    outputs = {TARGET: render(), RELIABILITY: render_reliability(),
               TRAINING: render_training()}
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
