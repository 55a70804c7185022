"""A config key's declaration (`key`: its default, meaning, choices and `Range`), a value as
the key's type, checked against them; the `ConfigError` line naming the file, the key and the
``--set`` it came from (`Where`)."""

from __future__ import annotations

import copy
import dataclasses
import difflib
import math
import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["INT64_MAX", "ConfigError", "Range", "Where", "check_value", "key", "numeric",
           "typed"]

INT64_MAX = 2**63 - 1   # torch's (and TOML's) widest integer: every integer key's ceiling


@dataclass(frozen=True)
class Range:
    """The numbers a key takes: ``low <= v <= high``, an open end excluding its bound (None:
    unbounded); `note` says why a bound is where it is. Integers stop at `INT64_MAX`."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    note: str = ""

    def __contains__(self, value: float) -> bool:
        above = self.low is None or (value > self.low if self.low_open else value >= self.low)
        below = self.high is None or (value < self.high if self.high_open else value <= self.high)
        return above and below

    def text(self, *, integer: bool = False) -> str:
        """``">= 1"``, ``"> 0"``, ``"in [0, 1)"``: what the docs and errors say."""
        high = None if self.high == INT64_MAX else self.high
        if high is None and self.low is not None:
            if (self.low == 0 and self.low_open) or (integer and self.low == 1):
                return "positive"
            return f"{'>' if self.low_open else '>='} {_num(self.low)}"
        if self.low is None:
            return f"{'<' if self.high_open else '<='} {_num(self.high)}"
        return (f"in {'(' if self.low_open else '['}{_num(self.low)}, {_num(high)}"
                f"{')' if self.high_open else ']'}")


def _num(value: float | None) -> str:
    return repr(int(value)) if value is not None and float(value).is_integer() else repr(value)


def key(default: Any, *, doc: str, range: Range | None = None,
        choices: Sequence[Any] | None = None) -> Any:
    """A dataclass field: `default` (a list or table: copied per instance), its meaning `doc`
    (markdown: the docs' tables are made of it, `scripts/gen_reference.py`), the `choices` a
    value must be one of, the `range` each of its numbers must be in."""
    meta = {"doc": doc, "range": range, "choices": tuple(choices) if choices else None}
    if isinstance(default, list | dict):
        return dataclasses.field(default_factory=lambda: copy.deepcopy(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def numeric(tp: Any) -> bool:
    """Whether a field of type `tp` holds numbers (int, float, or a list of them; with None or a
    string beside), so its declaration needs a `Range`."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return any(numeric(a) for a in args if a not in (type(None), str))
    if origin is list:
        return numeric(args[0])
    return tp in (int, float)


class ConfigError(ValueError):
    """A config that cannot run: one line naming the file, the key and the valid choices."""



class _Mismatch(Exception):
    """A value that is not of the expected type."""


_TYPE_NAMES: dict[Any, tuple[str, str]] = {
    bool: ("true or false", "booleans"), int: ("an integer", "integers"),
    float: ("a number", "numbers"), str: ("a string", "strings"), type(None): ("none", "none")}


def _describe(tp: Any, plural: bool = False) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in args)
    if origin is list:
        return f"a list of {_describe(args[0], plural=True)}"
    if origin is dict:
        return f"a table of {_describe(args[1], plural=True)}"
    names = _TYPE_NAMES.get(tp)
    return names[plural] if names else getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any) -> Any:
    """`value` as type `tp` (int -> float widens; "none" is None where allowed) or _Mismatch."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if type(None) in args and (value is None or str(value).lower() == "none"):
            return None
        for member in args:
            try:
                return _coerce(value, member)
            except _Mismatch:
                pass
        raise _Mismatch
    if origin is list and isinstance(value, list):
        return [_coerce(v, args[0]) for v in value]
    if origin is dict and isinstance(value, dict):
        return {_coerce(k, args[0]): _coerce(v, args[1]) for k, v in value.items()}
    if tp is float and type(value) in (int, float):             # not bool: type() is exact
        return float(value)
    if tp in (int, bool, str, type(None)) and type(value) is tp:
        return value
    raise _Mismatch


@dataclass
class Where:
    """The file being read, and which keys came from which ``--set``."""

    source: str
    overrides: dict[str, str]

    def error(self, message: str, *keys: str) -> ConfigError:
        for key in keys:
            if key in self.overrides:
                return ConfigError(f"{self.source}: {message} (from --set {self.overrides[key]})")
        return ConfigError(f"{self.source}: {message}")

    def unknown(self, what: str, key: str, valid: Sequence[str], *, prefix: str = "",
                origin: str = "") -> ConfigError:
        """Unknown `prefix + key`: the closest of `valid` (bare names), and all of them."""
        close = difflib.get_close_matches(key, valid, n=1)
        hint = f"did you mean {prefix}{close[0]}? " if close else ""
        return self.error(f"unknown {what} {prefix}{key}; {hint}valid: "
                          f"{', '.join(prefix + v for v in valid)}", origin or prefix + key)


def typed(value: Any, tp: Any, key: str, where: Where) -> Any:
    try:
        return _coerce(value, tp)
    except _Mismatch:
        raise where.error(f"{key} must be {_describe(tp)}, got {value!r}", key) from None


def check_value(value: Any, name: str, spec: dataclasses.Field[Any] | None,
                where: Where) -> None:
    """Raise if `value` (typed) of key `name` is not one of its field's choices or a number
    outside its range (each number of a list); numbers must be finite."""
    meta = spec.metadata if spec is not None else {}
    choices = meta.get("choices")
    if value is None or isinstance(value, dict | bool):
        return
    if choices and isinstance(value, str) and value not in choices:
        raise where.error(f"{name} must be one of {', '.join(map(repr, choices))}, "
                          f"got {value!r}", name)
    for number in value if isinstance(value, list) else [value]:
        if isinstance(number, str | bool):
            continue
        if isinstance(number, float) and not math.isfinite(number):
            raise where.error(f"{name} must be a finite number, got {value!r}", name)
        bounds: Range | None = meta.get("range")
        integer = isinstance(number, int)
        if integer and (bounds is None or bounds.high is None):   # torch's int64, declared or not
            bounds = dataclasses.replace(bounds or Range(), high=INT64_MAX)
        if bounds is not None and number not in bounds:
            what = bounds.text(integer=integer) + (f" ({bounds.note})" if bounds.note else "")
            if integer and number > INT64_MAX and bounds.high == INT64_MAX:
                what = f"<= {INT64_MAX} (a 64-bit integer)"
            raise where.error(f"{name} must be {what}, got {value!r}", name)
        if choices and not isinstance(choices[0], str) and number not in choices:
            raise where.error(f"{name} must be one of {', '.join(map(repr, choices))} "
                              f"(docs/reference.md says what each does), got {value!r}", name)
