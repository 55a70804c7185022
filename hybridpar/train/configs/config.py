"""Run configuration: TOML sections as typed dataclasses, read from a file and `--set` overrides.

    [model]       name = "gpt", init = "keyed" | "full", and the model's keyword options as
                  flat keys (n_layer = 4, ...)
    [data]        source, path, seq_len, val_fraction, seed, restart, pack
    [parallel]    pp, tp, dp, chunks, schedule, virtual_stages, checkpoint, balance, tp_plan,
                  deferred_batch_norm, timeout, check_replicas, replica_atol, zero
    [train]       steps, batch_size, lr, warmup_steps, min_lr, grad_clip, ..., precision,
                  param_dtype, nonfinite
    [optim]       name, weight_decay, betas, eps, momentum, nesterov (train.weight_decay: the
                  older name of optim.weight_decay, still read)
    [checkpoint]  every, keep
    [logging]     tensorboard, wandb, wandb_mode, wandb_project (metrics.jsonl is always written)

Every key has a default. A value is checked against its field's type (``--set`` values are
parsed as TOML values, a bare word is a string), its choices and its range, all declared
with the field (`sections`, `keys.key`); then the whole config against the model
(`config_check`) and the optimizer (`optimizer.check_optim`). Every failure is one
`ConfigError` line naming the file, the key and what would be valid, before any worker starts.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import json
import os
import tomllib
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hybridpar.io.files import atomic_write_text
from hybridpar.models.registry import builder
from hybridpar.train.configs.config_check import check_layout
from hybridpar.train.configs.keys import ConfigError, Where, check_value, typed
from hybridpar.train.configs.optimizer import check_optim
from hybridpar.train.configs.sections import (
    INITS,
    SECTION_CLASSES,
    SECTIONS,
    CheckpointConfig,
    DataConfig,
    LoggingConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    TrainConfig,
)

__all__ = ["INITS", "SECTIONS", "CheckpointConfig", "Config", "ConfigError", "DataConfig",
           "LoggingConfig", "ModelConfig", "OptimConfig", "ParallelConfig", "TrainConfig",
           "Where", "load_config", "load_resolved", "write_resolved"]


# model options the trainer fills from [parallel]
_SET_BY_PARALLEL = ("tp", "group", "ep", "ep_group")
_RUN_KEYS = ("name", "init")         # [model] keys of the run, not options of the builder


@dataclass(frozen=True)
class Config:
    """A whole run: `name` (the config file's stem) and one dataclass per section."""

    name: str = "config"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def to_dict(self) -> dict[str, Any]:
        """The config as plain data, shaped like the TOML file (model options flat)."""
        sections = {s: dataclasses.asdict(getattr(self, s)) for s in SECTION_CLASSES}
        return {"name": self.name, "model": {"name": self.model.name, "init": self.model.init,
                                             **self.model.args}, **sections}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, source: str = "<dict>") -> Config:
        """Check and resolve plain data shaped like `to_dict` (``name`` optional)."""
        raw = dict(data)
        return _build(raw, name=str(raw.pop("name", "config")), where=Where(source, {}))


def _section(cls: type, section: str, table: Mapping[str, Any], where: Where) -> Any:
    hints = typing.get_type_hints(cls)
    specs = {f.name: f for f in dataclasses.fields(cls)}
    fields = list(specs)
    values: dict[str, Any] = {}
    for key, raw in table.items():
        full = f"{section}.{key}"
        if key not in fields:
            raise where.unknown("key", key, fields, prefix=f"{section}.")
        values[key] = typed(raw, hints[key], full, where)
        check_value(values[key], full, specs[key], where)
    return cls(**values)


def _model_section(table: Mapping[str, Any], where: Where) -> ModelConfig:
    name = table.get("name", "gpt")
    try:
        fn = builder(name)
    except ValueError as e:
        message = str(e)
        message = message.replace("unknown model ", "unknown model.name ", 1) \
            if message.startswith("unknown model ") else f"model.name: {message}"
        raise where.error(message, "model.name") from None
    options = {n: p for n, p in inspect.signature(fn).parameters.items()
               if p.kind is inspect.Parameter.KEYWORD_ONLY
               and n not in (*_SET_BY_PARALLEL, *_RUN_KEYS)}
    try:
        hints = typing.get_type_hints(fn)
    except Exception:  # an annotation that does not resolve: fall back to the defaults' types
        hints = {}
    args = {n: p.default for n, p in options.items() if p.default is not inspect.Parameter.empty}
    init = typed(table.get("init", "keyed"), str, "model.init", where)
    check_value(init, "model.init", _INIT, where)
    for key, raw in table.items():
        full = f"model.{key}"
        if key in _RUN_KEYS:
            continue
        if key in _SET_BY_PARALLEL:
            raise where.error(f"{full} is set from [parallel]: use parallel."
                              f"{'ep' if key.startswith('ep') else 'tp'}", full)
        if key not in options:
            raise where.unknown(f"option of model {name!r}:", key, [*_RUN_KEYS, *options],
                                prefix="model.")
        default = options[key].default
        tp = hints.get(key, Any if default in (None, inspect.Parameter.empty) else type(default))
        args[key] = typed(raw, tp, full, where)
        check_value(args[key], full, None, where)   # finite, integers within int64
    return ModelConfig(name=name, args=args, init=init)

_INIT = next(f for f in dataclasses.fields(ModelConfig) if f.name == "init")


def _moved_weight_decay(raw: Mapping[str, Any], where: Where) -> Mapping[str, Any]:
    """`raw` with ``train.weight_decay`` (its older place) moved to ``optim.weight_decay``;
    both set to different values is an error."""
    train = raw.get("train")
    if not isinstance(train, dict) or "weight_decay" not in train:
        return raw
    train = dict(train)
    value = train.pop("weight_decay")
    optim = dict(raw.get("optim") or {})
    if "weight_decay" in optim and optim["weight_decay"] != value:
        raise where.error(f"train.weight_decay = {value!r} and optim.weight_decay = "
                          f"{optim['weight_decay']!r}: train.weight_decay is the older name "
                          "of optim.weight_decay; set one of them", "train.weight_decay",
                          "optim.weight_decay")
    optim["weight_decay"] = value
    if "train.weight_decay" in where.overrides:
        where.overrides.setdefault("optim.weight_decay", where.overrides["train.weight_decay"])
    return {**raw, "train": train, "optim": optim}


def _build(raw: Mapping[str, Any], *, name: str, where: Where, check: bool = True) -> Config:
    for section, table in raw.items():
        if section not in SECTIONS:
            raise where.unknown("section", section, SECTIONS, origin=next(
                (k for k in where.overrides if k.startswith(section + ".")), section))
        if not isinstance(table, dict):
            raise where.error(f"[{section}] must be a table of keys, got {table!r}", section)
    raw = _moved_weight_decay(raw, where)
    model = _model_section(raw.get("model", {}), where)
    parts = {s: _section(cls, s, raw.get(s, {}), where) for s, cls in SECTION_CLASSES.items()}
    config = Config(name=name, model=model, **parts)
    if check:
        _check_logging(config, where)
        check_optim(config, where)
    return check_layout(config, where) if check else config


def _check_logging(config: Config, where: Where) -> None:
    """[logging] outputs whose package is missing: one error before any worker starts."""
    import importlib.util

    wanted = [("logging.tensorboard", "tensorboard", "pip install -e '.[log]' (tensorboard)"),
              ("logging.wandb", "wandb", "pip install wandb")]
    for key, module, fix in wanted:
        if getattr(config.logging, key.split(".")[1]) and importlib.util.find_spec(module) is None:
            raise where.error(f"{key} = true but the {module} package is not installed: "
                              f"{fix}, or set {key} = false", key)


def _parse_override(text: str, source: str) -> tuple[str, str, Any]:
    """``"section.key=value"`` -> (section, key, value parsed as TOML, else the bare string)."""
    dotted, sep, value = text.partition("=")
    section, dot, key = dotted.strip().partition(".")
    if not sep or not dot or not section or not key:
        raise ConfigError(f"{source}: --set {text!r} is not section.key=value "
                          "(e.g. --set train.steps=100)")
    try:
        parsed = tomllib.loads(f"v = {value.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        parsed = value.strip()
    return section, key.strip(), parsed


def load_config(path: str | os.PathLike[str], overrides: Sequence[str] = ()) -> Config:
    """Read a TOML config, apply ``--set section.key=value`` overrides, check and resolve it."""
    file = Path(path)
    if not file.is_file():
        near = difflib.get_close_matches(file.name, [p.name for p in file.parent.glob("*.toml")],
                                         n=1) if file.parent.is_dir() else []
        hint = f"; did you mean {file.parent / near[0]}?" if near else ""
        raise ConfigError(f"{path}: no such config file{hint}")
    try:
        raw = tomllib.loads(file.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: invalid TOML: {e}") from None
    where = Where(str(path), {})
    for text in overrides:
        section, key, value = _parse_override(text, str(path))
        table = raw.setdefault(section, {})
        if not isinstance(table, dict):
            raise ConfigError(f"{path}: --set {text}: {section} is not a section")
        table[key] = value
        where.overrides[f"{section}.{key}"] = text
    return _build(raw, name=file.stem, where=where)


def load_resolved(path: str | os.PathLike[str]) -> Config:
    """The config a launcher resolved and checked (RUN_DIR/config.json): read, not checked
    again (its values are typed, the layout against the model was checked once)."""
    raw = json.loads(Path(path).read_text(encoding="utf-8"))
    return _build(raw, name=str(raw.pop("name", "config")), where=Where(str(path), {}),
                  check=False)


def write_resolved(config: Config, run_dir: str | os.PathLike[str]) -> Path:
    """Write `config` as RUN_DIR/config.json atomically (a temporary file, then os.replace)."""
    target = Path(run_dir) / "config.json"
    target.parent.mkdir(parents=True, exist_ok=True)
    return atomic_write_text(target, json.dumps(config.to_dict(), indent=2) + "\n", fsync=True)
