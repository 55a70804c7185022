"""A config value as its key's type, checked against the key's choices and range; the
`ConfigError` line naming the file, the key and the ``--set`` it came from (`Where`)."""

from __future__ import annotations

import difflib
import math
import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hybridpar.train.configs.sections import CHOICES, FRACTION, POSITIVE

__all__ = ["ConfigError", "Where", "check_value", "typed"]


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


def check_value(value: Any, key: str, where: Where) -> None:
    choices = CHOICES.get(key)
    if choices and isinstance(value, str) and value not in choices:
        raise where.error(f"{key} must be one of {', '.join(map(repr, choices))}, "
                          f"got {value!r}", key)
    if value is None or isinstance(value, list | dict | str | bool):
        return
    if not math.isfinite(value):
        raise where.error(f"{key} must be a finite number, got {value!r}", key)
    if key in POSITIVE and value <= 0:
        raise where.error(f"{key} must be positive, got {value!r}", key)
    if key in FRACTION and not 0 <= value < 1:
        raise where.error(f"{key} must be in [0, 1), got {value!r}", key)
    if value < 0:
        raise where.error(f"{key} must be >= 0, got {value!r}", key)
