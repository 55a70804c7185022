"""Run configuration: TOML sections as typed dataclasses, read from a file and `--set` overrides.

    [model]       name = "gpt", init = "keyed" | "full", and the model's keyword options as
                  flat keys (n_layer = 4, ...)
    [data]        source, path, seq_len, val_fraction, seed, restart, pack
    [parallel]    pp, tp, dp, chunks, schedule, virtual_stages, checkpoint, balance, tp_plan,
                  deferred_batch_norm, timeout, check_replicas, replica_atol, zero
    [train]       steps, batch_size, lr, warmup_steps, min_lr, weight_decay, grad_clip, ...,
                  precision, param_dtype, nonfinite
    [checkpoint]  every, keep
    [logging]     tensorboard, wandb, wandb_mode, wandb_project (metrics.jsonl is always written)

Every key has a default. A value is checked against its field's type (``--set`` values are
parsed as TOML values, a bare word is a string), its choices and its range; then the whole
config against the model (`config_check`). Every failure is one `ConfigError` line naming the
file, the key and what would be valid, before any worker starts.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import json
import math
import os
import tomllib
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hybridpar.balance import BALANCERS
from hybridpar.io.files import atomic_write_text
from hybridpar.models.registry import builder
from hybridpar.packing import PACKS
from hybridpar.pipeline.schedules.layout import NAMES as SCHEDULES
from hybridpar.precision import PARAM_DTYPES
from hybridpar.train.configs.config_check import check_layout

__all__ = ["INITS", "SECTIONS", "CheckpointConfig", "Config", "ConfigError", "DataConfig",
           "LoggingConfig", "ModelConfig", "ParallelConfig", "TrainConfig", "Where", "load_config",
           "load_resolved", "write_resolved"]

SECTIONS = ("model", "data", "parallel", "train", "checkpoint", "logging")
_SET_BY_PARALLEL = ("tp", "group")   # model options the trainer fills from [parallel]
_RUN_KEYS = ("name", "init")         # [model] keys of the run, not options of the builder
INITS = ("keyed", "full")


class ConfigError(ValueError):
    """A config that cannot run: one line naming the file, the key and the valid choices."""


@dataclass(frozen=True)
class ModelConfig:
    """[model]: ``name`` (`hybridpar.models.registry`), ``init``; every other key is a
    keyword option of the builder."""

    name: str = "gpt"
    args: dict[str, Any] = field(default_factory=dict)  # resolved: all options, defaults filled
    init: str = "keyed"   # "keyed": built on meta, each rank draws its shard keyed by name
    # (a "package.module:function" builder is checked first: `train.configs.builder_check`); "full":
    # every rank builds the whole model on the CPU from train.seed, the builder's own values


@dataclass(frozen=True)
class DataConfig:
    """[data]: where the batches come from (text, corpus: byte tokens; tokens: a token folder)."""

    source: str = "synthetic"     # "synthetic" | "text" (bytes of `path`) | "corpus" (embedded)
    #                               | "tokens" (the token folder `path`)
    path: str | None = None       # the text file of "text", the token folder of "tokens"
    seq_len: int | None = None    # tokens per sample (gpt); default and maximum: block_size
    val_fraction: float = 0.05    # share of the text held out for the eval loss
    seed: int = 0                 # data order and synthetic batches
    restart: bool = False         # "tokens": a resume whose data changed starts its order over
    pack: str = "none"            # "tokens": "documents" keeps attention inside each document
    #                               (positions restart per document; gpt, hf:llama family)


@dataclass(frozen=True)
class ParallelConfig:
    """[parallel]: the layout (dp x pp x tp ranks) and the pipeline's options."""

    pp: int = 1                   # pipeline stages
    tp: int = 1                   # tensor-parallel ranks per stage
    dp: int | None = None         # replicas; None: world size / (pp * tp)
    chunks: int = 1               # micro-batches per replica's batch
    schedule: str = "gpipe"       # the order of the steps (docs/schedules.md)
    virtual_stages: int | None = None   # stages per rank: interleaved (default 2), zbv (2)
    checkpoint: str = "except_last"   # "always" | "except_last" | "never" (whole stages, per
    # micro-batch) | "layers" | "layers:K" (each / every K-th layer,
    # `pipeline.activations.layer_checkpoint`)
    # | "selective" (the attention core, `hybridpar.recompute`)
    balance: list[int] | str = "params"   # layers per stage, or "time" | "size" | ...
    tp_plan: dict[str, str | list[int]] | str | None = None   # None: the model's own tp
    # layers; "auto"; "hf" (an hf:<family> model's own plan, `hybridpar.hf.tp_plan`); or a
    # table: layer glob = "style" (ours or Hugging Face's), parameter name = [slices per dim]
    deferred_batch_norm: bool = False   # BatchNorm statistics of the whole mini-batch
    sequence_parallel: bool = False   # tp > 1, the built-in gpt or an hf: model under a tp
    # plan: norms, dropouts and residuals on 1 / tp of the tokens (Megatron's sequence
    # parallelism)
    timeout: float = 600.0        # seconds any rank waits for another before failing
    check_replicas: int = 0       # 0: off; N: after the backward of steps N, 2N, ... (before
    # clipping), check that the copies of every replicated parameter (over tp, over dp, a tie's
    # stages) agree in values and gradients (`HybridPipe.check_replicas`); a mismatch stops
    # the run with ReplicaMismatchError on every rank. A check all-reduces, per group, 2 x
    # (parameters + gradients) of its copies in >= fp32: on 2 CPU cores 20% of a step at
    # pp=1 x tp=2 x dp=2, 7.5% at pp=2 x tp=2 (docs/benchmarks.md); a large N makes it cheap
    replica_atol: float = 0.0     # the largest difference the check allows; 0.0: bit-identical,
    # as copies are on CPU / gloo; non-deterministic GPU kernels may need a small tolerance
    zero: int = 0                 # 0: every dp replica holds the optimizer state; 1: each holds
    # the state of 1 / dp of the parameters, and broadcasts them after its update (ZeRO-1,
    # `hybridpar.optim.zero`: AdamW 16 -> 8 + 8 / dp bytes per parameter in fp32); 2: and
    # only their gradients, reduced to it each micro-batch (`pipeline.parameters.grad_shards`: 4 +
    # 12 / dp)


@dataclass(frozen=True)
class TrainConfig:
    """[train]: the loop: AdamW, linear warm-up to `lr`, cosine decay to `min_lr`."""

    steps: int = 100             # optimizer steps of the run
    batch_size: int = 16          # global: samples per step over all replicas
    lr: float = 3e-4              # peak, reached after warmup_steps
    warmup_steps: int = 0         # linear warm-up from 0 to lr
    min_lr: float = 0.0           # at the last step
    weight_decay: float = 0.0     # AdamW's, on matrices only (not biases, norms)
    grad_clip: float = 1.0        # global gradient norm; 0: off
    seed: int = 0                 # weights and dropout, the same on every rank
    log_every: int = 10           # steps between metric records
    eval_every: int = 0           # 0: no eval
    eval_batches: int = 4         # batches per eval loss
    precision: str = "fp32"       # "fp32" | "bf16" (autocast)
    param_dtype: str = "fp32"     # the weights: "fp32" | "bf16" (precision "bf16"; float32
    # gradients and master weights, `hybridpar.optim.master`: 18 -> 6 + 12 / dp bytes with zero 1)
    sample_tokens: int = 200      # gpt: tokens sampled at the end; 0: none
    nonfinite: str = "stop"       # a NaN / inf loss or grad norm: "stop" (raise) | "skip" the step
    max_skipped: int = 5          # "skip": this many skipped steps in a row stop the run; 0: no cap
    compile: bool = False         # torch.compile each repeated block, once (`hybridpar.compile`)


@dataclass(frozen=True)
class CheckpointConfig:
    """[checkpoint]: reshardable checkpoints in RUN_DIR/checkpoints/step-N/."""

    every: int = 100              # steps between checkpoints (and one at the end); 0: none
    keep: int = 2                 # the newest complete checkpoints kept
    on_signal: bool = True        # SIGTERM / SIGINT: finish the step, save a checkpoint, exit


@dataclass(frozen=True)
class LoggingConfig:
    """[logging]: copies of the metrics records, written by the reporting rank (metrics.jsonl
    stays the record)."""

    tensorboard: bool = False     # RUN_DIR/tensorboard/ event files (the `log` extra)
    wandb: bool = False           # Weights & Biases, files under RUN_DIR/wandb/ (pip install wandb)
    wandb_mode: str = "offline"   # "offline" (sync later: wandb sync) | "online" | "disabled"
    wandb_project: str = "hybridpar"   # the W&B project; the run is named after the config


_CLASSES: dict[str, type] = {"data": DataConfig, "parallel": ParallelConfig,
                             "train": TrainConfig, "checkpoint": CheckpointConfig,
                             "logging": LoggingConfig}
_CHOICES: dict[str, Sequence[str]] = {
    "data.source": ("synthetic", "text", "corpus", "tokens"), "data.pack": PACKS,
    "parallel.schedule": tuple(SCHEDULES),
    "parallel.balance": BALANCERS,
    "parallel.tp_plan": ("auto", "hf"), "train.precision": ("fp32", "bf16"),
    "train.param_dtype": tuple(PARAM_DTYPES),
    "train.nonfinite": ("stop", "skip"), "model.init": INITS,
    "logging.wandb_mode": ("offline", "online", "disabled")}
_POSITIVE = {"data.seq_len", "parallel.pp", "parallel.tp", "parallel.dp", "parallel.chunks",
             "parallel.virtual_stages",
             "parallel.timeout", "train.steps", "train.batch_size", "train.lr", "train.log_every",
             "train.eval_batches", "checkpoint.keep"}
_FRACTION = {"data.val_fraction"}     # in [0, 1); every other number must be >= 0


@dataclass(frozen=True)
class Config:
    """A whole run: `name` (the config file's stem) and one dataclass per section."""

    name: str = "config"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def to_dict(self) -> dict[str, Any]:
        """The config as plain data, shaped like the TOML file (model options flat)."""
        sections = {s: dataclasses.asdict(getattr(self, s)) for s in _CLASSES}
        return {"name": self.name, "model": {"name": self.model.name, "init": self.model.init,
                                             **self.model.args}, **sections}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, source: str = "<dict>") -> Config:
        """Check and resolve plain data shaped like `to_dict` (``name`` optional)."""
        raw = dict(data)
        return _build(raw, name=str(raw.pop("name", "config")), where=Where(source, {}))


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


def _typed(value: Any, tp: Any, key: str, where: Where) -> Any:
    try:
        return _coerce(value, tp)
    except _Mismatch:
        raise where.error(f"{key} must be {_describe(tp)}, got {value!r}", key) from None


def _check_value(value: Any, key: str, where: Where) -> None:
    choices = _CHOICES.get(key)
    if choices and isinstance(value, str) and value not in choices:
        raise where.error(f"{key} must be one of {', '.join(map(repr, choices))}, "
                          f"got {value!r}", key)
    if value is None or isinstance(value, list | dict | str | bool):
        return
    if not math.isfinite(value):
        raise where.error(f"{key} must be a finite number, got {value!r}", key)
    if key in _POSITIVE and value <= 0:
        raise where.error(f"{key} must be positive, got {value!r}", key)
    if key in _FRACTION and not 0 <= value < 1:
        raise where.error(f"{key} must be in [0, 1), got {value!r}", key)
    if value < 0:
        raise where.error(f"{key} must be >= 0, got {value!r}", key)


def _section(cls: type, section: str, table: Mapping[str, Any], where: Where) -> Any:
    hints = typing.get_type_hints(cls)
    fields = [f.name for f in dataclasses.fields(cls)]
    values: dict[str, Any] = {}
    for key, raw in table.items():
        full = f"{section}.{key}"
        if key not in fields:
            raise where.unknown("key", key, fields, prefix=f"{section}.")
        values[key] = _typed(raw, hints[key], full, where)
        _check_value(values[key], full, where)
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
    init = _typed(table.get("init", "keyed"), str, "model.init", where)
    _check_value(init, "model.init", where)
    for key, raw in table.items():
        full = f"model.{key}"
        if key in _RUN_KEYS:
            continue
        if key in _SET_BY_PARALLEL:
            raise where.error(f"{full} is set from [parallel]: use parallel.tp", full)
        if key not in options:
            raise where.unknown(f"option of model {name!r}:", key, [*_RUN_KEYS, *options],
                                prefix="model.")
        default = options[key].default
        tp = hints.get(key, Any if default in (None, inspect.Parameter.empty) else type(default))
        args[key] = _typed(raw, tp, full, where)
    return ModelConfig(name=name, args=args, init=init)

def _build(raw: Mapping[str, Any], *, name: str, where: Where, check: bool = True) -> Config:
    for section, table in raw.items():
        if section not in SECTIONS:
            raise where.unknown("section", section, SECTIONS, origin=next(
                (k for k in where.overrides if k.startswith(section + ".")), section))
        if not isinstance(table, dict):
            raise where.error(f"[{section}] must be a table of keys, got {table!r}", section)
    model = _model_section(raw.get("model", {}), where)
    parts = {s: _section(cls, s, raw.get(s, {}), where) for s, cls in _CLASSES.items()}
    config = Config(name=name, model=model, **parts)
    if check:
        _check_logging(config, where)
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
