"""The run config's sections as frozen dataclasses: each key's type, default, meaning, choices
and range, declared once (`keys.key`); the loader checks them, the docs' tables are made of them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hybridpar.balance import BALANCERS
from hybridpar.data.windows import OVERLONG
from hybridpar.optim.zero import ZERO_LEVELS
from hybridpar.packing import PACKS
from hybridpar.pipeline.schedules.layout import NAMES as SCHEDULES
from hybridpar.precision import PARAM_DTYPES
from hybridpar.train.configs.keys import Range, key

__all__ = ["INITS", "SECTIONS", "SECTION_CLASSES", "CheckpointConfig", "DataConfig",
           "LoggingConfig", "ModelConfig", "OptimConfig", "ParallelConfig", "TrainConfig"]

SECTIONS = ("model", "data", "parallel", "train", "optim", "checkpoint", "logging")
INITS = ("keyed", "full")

_POSITIVE = Range(1)                                   # an integer count
_COUNT = Range(0)                                      # an integer, 0 allowed (often: off)
_NONNEGATIVE = Range(0.0)
_ABOVE_0 = Range(0.0, low_open=True)
_FRACTION = Range(0.0, 1.0, high_open=True)
_SEED = Range(0, 2**32 - 1, note="torch's CPU generator keeps 32 bits of a seed")


@dataclass(frozen=True)
class ModelConfig:
    """[model]: ``name`` (`hybridpar.models.registry`), ``init``; every other key is a
    keyword option of the builder."""

    name: str = "gpt"
    args: dict[str, Any] = field(default_factory=dict)  # resolved: all options, defaults filled
    init: str = key("keyed", choices=INITS, doc=(
        "`\"keyed\"`: built on `meta`, each rank draws its shard keyed by `train.seed` and the "
        "module names (a `package.module:function` builder is checked first: "
        "`train/configs/builder_check.py`); `\"full\"`: every rank builds the whole model on "
        "the CPU, with the builder's own values"))


@dataclass(frozen=True)
class DataConfig:
    """[data]: where the batches come from (text, corpus: byte tokens; tokens: a token folder)."""

    source: str = key("synthetic", choices=("synthetic", "text", "corpus", "tokens"), doc=(
        "`\"synthetic\"` (the model's learnable synthetic task), `\"text\"` (the bytes of "
        "`path`), `\"corpus\"` (the embedded corpus: the standard library's `.py` sources, "
        "first 2 MB), `\"tokens\"` (the token folder `path`, written by `hybridpar tokenize`: "
        "[data.md](data.md#training-on-a-token-folder)); text and corpus are byte tokens for "
        "gpt"))
    path: str | None = key(None, doc=(
        "the text file of `source = \"text\"`, the token folder of `\"tokens\"`; relative to "
        "the working directory"))
    seq_len: int | None = key(None, range=_POSITIVE, doc=(
        "tokens per sample; none: a gpt's `block_size` (also its maximum); required for "
        "`hf:` and user models on tokens"))
    val_fraction: float = key(0.05, range=_FRACTION, doc=(
        "the tail share of the text held out for the eval loss and the sample's prompt (not "
        "`\"tokens\"`: its folder's val split)"))
    seed: int = key(0, range=_SEED, doc=(
        "data order (epoch e is shuffled with seed + e) and synthetic batches"))
    restart: bool = key(False, doc=(
        "resume a checkpoint whose data changed (`data.source`; of a token folder its "
        "corpus, tokenizer, `seq_len`, `seed`), keeping its weights and starting the new "
        "data's order from the beginning; without it such a resume is an error naming what "
        "changed"))
    pack: str = key("none", choices=PACKS, doc=(
        "`\"documents\"` (with `\"tokens\"`; gpt and the rotary `hf:` decoders, all but "
        "GPT-2's learned positions): positions restart at each document and attention stays "
        "inside it "
        "([data.md](data.md#packing-documents)); `\"pad\"` (with `\"tokens\"`): a document "
        "per row, padded on the right to the batch's longest, the padding never counted "
        "([data.md](data.md#padded-batches))"))
    overlong: str = key("truncate", choices=OVERLONG, doc=(
        "with `pack = \"pad\"`, a document longer than `seq_len + 1` tokens: cut to its "
        "first `seq_len + 1` (`\"truncate\"`) or left out (`\"drop\"`); the log counts them"))


@dataclass(frozen=True)
class ParallelConfig:
    """[parallel]: the layout (dp x pp x tp ranks) and the pipeline's options."""

    pp: int = key(1, range=_POSITIVE, doc="pipeline stages")
    tp: int = key(1, range=_POSITIVE, doc="tensor-parallel ranks per stage")
    dp: int | None = key(None, range=_POSITIVE, doc=(
        "replicas; none: 1 under `hybridpar run`, `WORLD_SIZE / (pp × tp)` under torchrun"))
    ep: int = key(1, range=_POSITIVE, doc=(
        "expert parallelism, carved out of dp: each group of `ep` dp replicas holds every "
        "expert once (`n_experts / ep` per rank) and sends each token to its experts by "
        "all-to-all ([moe.md](moe.md)); the built-in gpt with `n_experts`"))
    chunks: int = key(1, range=_POSITIVE, doc="micro-batches per replica's batch")
    schedule: str = key("gpipe", choices=SCHEDULES, doc=(
        "the order of the forwards and backwards ([schedules.md](schedules.md)): `\"gpipe\"` "
        "(all forwards, then all backwards), `\"1f1b\"` (one forward, one backward: at most pp "
        "micro-batches in flight), `\"zb-h1\"` (1F1B with the weight gradients deferred into "
        "the bubble), `\"interleaved\"` (virtual stages per rank, round robin), `\"zbv\"` (two "
        "virtual stages per rank in a V, zero bubble)"))
    virtual_stages: int | None = key(None, range=_POSITIVE, doc=(
        "model stages per rank, for `\"interleaved\"` (none: 2) and `\"zbv\"` (2 only); other "
        "schedules: 1"))
    checkpoint: str = key("except_last", doc=(
        "activation recomputation: whole stages per micro-batch `\"always\"`, "
        "`\"except_last\"`, `\"never\"`; layer by layer `\"layers\"`, `\"layers:K\"` (every "
        "K-th layer, `pipeline/activations/layer_checkpoint.py`); the attention core only "
        "`\"selective\"` (`hybridpar/recompute.py`)"))
    # (RUF009: `key` returns a dataclasses.field, as `field(...)` would)
    balance: list[int] | str = key(  # noqa: RUF009
        "params", range=_COUNT, choices=BALANCERS, doc=(
        "layers per stage (pp entries, each at least 1, summing to the model's layers: "
        "checked against the model), or "
        "`\"time\"` / `\"size\"` (profiled on a training batch), `\"params\"`, `\"uniform\"`"))
    tp_plan: dict[str, str | list[int]] | str | None = key(  # noqa: RUF009
        None, choices=("auto", "hf"), doc=(
        "none: the model's own tp layers; `\"auto\"`; `\"hf\"` (an `hf:` model's own plan: "
        "`hybridpar.hf.tp_plan`); or a table of layer glob = `\"column\"` / `\"row\"` / "
        "`\"vocab\"` / `\"replicate\"` (or Hugging Face's style names) and parameter name = "
        "slices per dimension (`\"0.weight\" = [4, 1]`: 1 or tp, at most one split)"))
    deferred_batch_norm: bool = key(False, doc=(
        "BatchNorm statistics of the whole mini-batch, committed once per step"))
    sequence_parallel: bool = key(False, doc=(
        "tp > 1, the built-in gpt or an `hf:` model under a tp plan: norms, dropouts and "
        "residual adds run on 1 / tp of the tokens (Megatron's sequence parallelism): each "
        "block's all-reduces become an all-gather and a reduce-scatter of the same bytes, and "
        "those regions' activations shrink tp times; the exact one-device numbers "
        "([gpt](../hybridpar/models/gpt.py), [hf/sequence.py](../hybridpar/hf/sequence.py)); "
        "not yet tp plans on custom models, or packed documents"))
    timeout: float = key(600.0, range=Range(0.0, 7 * 86400.0, low_open=True, note="a week"),
                         doc="seconds any rank waits for another before failing")
    check_replicas: int = key(0, range=_COUNT, doc=(
        "0: off; N: after the backward of steps N, 2N, ... (before clipping), check that the "
        "copies of every replicated parameter (over tp, over dp, a tie's stages) agree in "
        "values and gradients (`HybridPipe.check_replicas`, the replica check below); a "
        "mismatch stops the run with `ReplicaMismatchError` on every rank"))
    replica_atol: float = key(0.0, range=_NONNEGATIVE, doc=(
        "the largest difference the replica check allows; 0.0: bit-identical (copies are, on "
        "CPU / gloo); on GPUs, non-deterministic kernels may need a small tolerance"))
    zero: int = key(0, range=_COUNT, choices=ZERO_LEVELS, doc=(
        "0: every dp replica holds the optimizer state; 1: each holds the state of 1 / dp of "
        "the parameters and broadcasts them after its update (ZeRO-1); 2: and only their "
        "gradients, reduced to it each micro-batch (ZeRO-2); "
        "[state per parameter](training.md#state-per-parameter-dp-buckets-"
        "parallelzero-trainparam_dtype)"))


@dataclass(frozen=True)
class TrainConfig:
    """[train]: the loop: linear warm-up to `lr`, cosine decay towards `min_lr` (`train/lr.py`),
    clipping, evaluation, precision."""

    steps: int = key(100, range=_POSITIVE, doc=(
        "optimizer steps of the whole run (a resumed run continues to it)"))
    batch_size: int = key(16, range=_POSITIVE, doc=(
        "samples per step over all replicas; divides by dp"))
    lr: float = key(3e-4, range=_ABOVE_0, doc="peak learning rate, reached after the warm-up")
    warmup_steps: int = key(0, range=_COUNT, doc=(
        "steps of linear warm-up: step k (1-based) of it runs at lr × k / warmup_steps, so the "
        "first step already trains and step warmup_steps runs at `lr`"))
    min_lr: float = key(0.0, range=_NONNEGATIVE, doc=(
        "the floor of the cosine decay, ≤ `lr`; the decay would reach it one step after the "
        "last, so every step trains (the last at a small rate above `min_lr`)"))
    grad_clip: float = key(1.0, range=_NONNEGATIVE, doc=(
        "clip the global gradient 2-norm over stages and shards; 0: off"))
    seed: int = key(0, range=_SEED, doc="weights and dropout, the same on every rank")
    log_every: int = key(10, range=_POSITIVE, doc=(
        "steps between metrics records (the last step and eval steps are logged too)"))
    eval_every: int = key(0, range=_COUNT, doc="steps between eval losses; 0: none")
    eval_batches: int = key(4, range=_POSITIVE, doc=(
        "validation batches per eval loss (the same batches every time)"))
    precision: str = key("fp32", choices=("fp32", "bf16"), doc=(
        "`\"bf16\"`: each step under `torch.autocast(dtype=torch.bfloat16)`; weights, "
        "gradients, optimizer state and checkpoints stay fp32 unless `param_dtype` says "
        "otherwise; eval and sampling run in fp32"))
    param_dtype: str = key("fp32", choices=tuple(PARAM_DTYPES), doc=(
        "the weights' dtype: `\"bf16\"` (with precision `\"bf16\"`) keeps float32 gradients, "
        "master weights and optimizer state (`hybridpar/optim/master.py`; "
        "[bf16 weights](training.md#state-per-parameter-dp-buckets-"
        "parallelzero-trainparam_dtype))"))
    sample_tokens: int = key(200, range=_COUNT, doc=(
        "tokens sampled after the last step into `RUN_DIR/sample.txt`, prompted by the start "
        "of the validation text, for a model on tokens (text, corpus, a token folder; gpt or "
        "`hf:`); 0: none"))
    nonfinite: str = key("stop", choices=("stop", "skip"), doc=(
        "a NaN / inf loss or gradient norm: `\"stop\"` (`FloatingPointError` naming the step, "
        "on every rank) or `\"skip\"` (drop that step's update, log a warning, `\"skipped\": "
        "true` in its metrics record); see [NaN and inf](reliability.md#nan-and-inf)"))
    max_skipped: int = key(5, range=_COUNT, doc=(
        "`\"skip\"`: this many skipped steps in a row stop the run with an error; 0: no cap"))
    compile: bool = key(False, doc=(
        "`torch.compile` each repeated block of each stage (a gpt's `Block`), once per class, "
        "in place; a block that cannot compile runs eager with a warning; see "
        "[compile](compile.md)"))


@dataclass(frozen=True)
class OptimConfig:
    """[optim]: the optimizer over each rank's shard (`train.lr` and its schedule set its rate;
    `train/configs/optimizer.py`)."""

    name: str = key("adamw", doc=(
        "`\"adamw\"` (`torch.optim.AdamW`), `\"adam\"`, `\"sgd\"`, or any "
        "`torch.optim.Optimizer` subclass as `\"package.module:Class\"` (it gets `lr` and "
        "those of the keys below its constructor takes; one whose step needs a closure, as "
        "LBFGS, is refused, and so is one that keeps state other than tensors, which a "
        "checkpoint cannot hold). Any of them works with checkpoints and resumes, "
        "`parallel.zero` 1 and 2 and bf16 weights (float32 masters)"))
    weight_decay: float = key(0.0, range=_NONNEGATIVE, doc=(
        "on matrices only (none on biases and norms): AdamW's is decoupled, Adam's and SGD's "
        "are torch's L2 term in the gradient; `train.weight_decay` is its older name, still "
        "read"))
    betas: list[float] = key([0.9, 0.999], range=_FRACTION, doc=(  # noqa: RUF009
        "adamw, adam: the decay rates of the first and second moments (two numbers)"))
    eps: float = key(1e-8, range=_ABOVE_0, doc=(
        "adamw, adam: added to the square root of the second moment"))
    momentum: float = key(0.0, range=_FRACTION, doc="sgd: momentum; 0: plain SGD")
    nesterov: bool = key(False, doc="sgd: Nesterov momentum (needs `momentum` > 0)")


@dataclass(frozen=True)
class CheckpointConfig:
    """[checkpoint]: reshardable checkpoints in RUN_DIR/checkpoints/step-N/."""

    every: int = key(100, range=_COUNT, doc=(
        "steps between checkpoints, plus one at the last step; 0: none"))
    keep: int = key(2, range=_POSITIVE, doc="the newest complete checkpoints kept")
    on_signal: bool = key(True, doc=(
        "SIGTERM / SIGINT: finish the step, save a checkpoint, exit"))


@dataclass(frozen=True)
class LoggingConfig:
    """[logging]: copies of the metrics records, written by the reporting rank (metrics.jsonl
    stays the record)."""

    tensorboard: bool = key(False, doc=(
        "write `RUN_DIR/tensorboard/` event files (the `log` extra)"))
    wandb: bool = key(False, doc=(
        "log to Weights & Biases (`pip install wandb`), files under `RUN_DIR/wandb/`"))
    wandb_mode: str = key("offline", choices=("offline", "online", "disabled"), doc=(
        "`\"offline\"` (`wandb sync` later), `\"online\"` or `\"disabled\"`"))
    wandb_project: str = key("hybridpar", doc=(
        "the W&B project; the run is named after the config"))


SECTION_CLASSES: dict[str, type] = {"data": DataConfig, "parallel": ParallelConfig,
                                    "train": TrainConfig, "optim": OptimConfig,
                                    "checkpoint": CheckpointConfig, "logging": LoggingConfig}
