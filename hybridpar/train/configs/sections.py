"""The run config's sections as frozen dataclasses: each key's type, default and meaning."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from hybridpar.balance import BALANCERS
from hybridpar.packing import PACKS
from hybridpar.pipeline.schedules.layout import NAMES as SCHEDULES
from hybridpar.precision import PARAM_DTYPES

__all__ = ["CHOICES", "FRACTION", "INITS", "POSITIVE", "SECTIONS", "SECTION_CLASSES",
           "CheckpointConfig", "DataConfig", "LoggingConfig", "ModelConfig", "ParallelConfig",
           "TrainConfig"]

SECTIONS = ("model", "data", "parallel", "train", "checkpoint", "logging")
INITS = ("keyed", "full")


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


SECTION_CLASSES: dict[str, type] = {"data": DataConfig, "parallel": ParallelConfig,
                             "train": TrainConfig, "checkpoint": CheckpointConfig,
                             "logging": LoggingConfig}
CHOICES: dict[str, Sequence[str]] = {
    "data.source": ("synthetic", "text", "corpus", "tokens"), "data.pack": PACKS,
    "parallel.schedule": tuple(SCHEDULES),
    "parallel.balance": BALANCERS,
    "parallel.tp_plan": ("auto", "hf"), "train.precision": ("fp32", "bf16"),
    "train.param_dtype": tuple(PARAM_DTYPES),
    "train.nonfinite": ("stop", "skip"), "model.init": INITS,
    "logging.wandb_mode": ("offline", "online", "disabled")}
POSITIVE = {"data.seq_len", "parallel.pp", "parallel.tp", "parallel.dp", "parallel.chunks",
             "parallel.virtual_stages",
             "parallel.timeout", "train.steps", "train.batch_size", "train.lr", "train.log_every",
             "train.eval_batches", "checkpoint.keep"}
FRACTION = {"data.val_fraction"}     # in [0, 1); every other number must be >= 0
