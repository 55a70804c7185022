"""Bad input, one row each: a clear error on every rank, no partial file, nothing left running.

Each row names where the input goes (library API, CLI, config, checkpoint, training), the bad
input, the error raised, a phrase saying what is wrong and one saying how to fix it. The
docs/reliability.md's table lists the same rows (`test_the_readme_table_lists_every_row`).

Multi-rank rows share a few spawns (module fixtures): each worker runs its cases in turn,
catches what each raised and returns its type and message, so a row checks every rank. A
case that stops a pipeline mid-step leaves unmatched P2P messages behind, so each of those
gets a spawn of its own.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from spawn_cases import spawn_cases
from torch import nn
from torchgpipe.skip import pop, skippable, stash

import hybridpar
from hybridpar.cli import main as cli
from hybridpar.nn import ParallelLinear, TPDense
from hybridpar.train import Config, ConfigError, load_config
from hybridpar.train.launcher import worker_pids
from hybridpar.train.metrics import read_metrics

TIMEOUT = 10          # the topology timeout of every spawned pipeline here: never waited out


@dataclass(frozen=True)
class Row:
    id: str
    where: str        # API | CLI | config | checkpoint | training
    bad: str          # the bad input, as in the docs/reliability.md table
    error: str        # the exception type every rank raises (CLI: the exit status)
    what: str         # a phrase of the message saying what is wrong
    fix: str          # a phrase saying how to fix it
    peers: str = ""   # what the other ranks raise when only one rank fails (else: `error`)

    def line(self) -> str:
        """This row in docs/reliability.md's table (scripts/gen_reference.py writes it)."""
        error = f"`{self.error}`" + (f" (its peers: `{self.peers}`)" if self.peers else "")
        return f"| {self.where} | {self.bad} | {error} | {_code(self.what)} … {_code(self.fix)} |"


def _code(text: str) -> str:
    """`text` as inline code (double backticks when it holds one)."""
    return f"`` {text} ``" if "`" in text else f"`{text}`"


# library API: one spawn of 2 ranks (pp=2) runs every case -------------------------------------

@skippable(stash=["a"])
class StashA(nn.Module):
    def forward(self, x):
        yield stash("a", x)
        return x


@skippable(pop=["a"])
class PopA(nn.Module):
    def forward(self, x):
        a = yield pop("a")
        return x + a


class _Scale(nn.Module):
    """A parameter and no reset_parameters (as Hugging Face's LlamaRMSNorm)."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(8))

    def forward(self, x):
        return x * self.weight


def _meta(*layers):
    with torch.device("meta"):
        return nn.Sequential(*(layer() for layer in layers))


def _tied():
    model = _mlp()
    model[3] = nn.Linear(8, 8)
    model[3].weight = model[0].weight
    return model


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Linear(8, 3))


def _api_cases(topo):
    ce = nn.functional.cross_entropy
    x, y = torch.randn(4, 8), torch.zeros(4, dtype=torch.long)

    def pipe(model=None, balance=(2, 2), **options):
        balance = list(balance) if isinstance(balance, tuple) else balance
        return hybridpar.HybridPipe(_mlp() if model is None else model, balance,
                                    topology=topo, **options)

    return {
        "api-not-sequential": lambda: hybridpar.HybridPipe(nn.ModuleList(_mlp()), [2, 2],
                                                           topology=topo),
        "api-empty-model": lambda: pipe(nn.Sequential(), [1, 1]),
        "api-balance-length": lambda: pipe(balance=[4]),
        "api-balance-sum": lambda: pipe(balance=[2, 3]),
        "api-balance-zero": lambda: pipe(balance=[4, 0]),
        "api-balance-type": lambda: pipe(balance=[2.0, 2.0]),
        "api-balance-name": lambda: pipe(balance="fastest"),
        "api-balance-sample": lambda: pipe(balance="time"),
        "api-chunks": lambda: pipe(chunks=0),
        "api-checkpoint": lambda: pipe(checkpoint="sometimes"),
        "api-schedule": lambda: pipe(schedule="zb"),
        "api-pop-without-stash": lambda: pipe(nn.Sequential(nn.Linear(2, 2), PopA()), [1, 1]),
        "api-stash-without-pop": lambda: pipe(nn.Sequential(StashA(), nn.Linear(2, 2)), [1, 1]),
        "api-duplicate-skip": lambda: pipe(nn.Sequential(StashA(), StashA(), PopA()), [2, 1]),
        "api-no-loss": lambda: pipe().train_step(x, y),
        "api-rows-differ": lambda: pipe(loss_fn=ce).train_step(x, y[:3]),
        "api-empty-batch": lambda: pipe(loss_fn=ce).train_step(x[:0], y[:0]),
        "api-input-type": lambda: pipe(loss_fn=ce).train_step(x.tolist(), y),
        "api-tuple-rows": lambda: pipe()((x, x[:3])),
        "api-clip-norm-type": lambda: pipe().clip_grad_norm_(1.0, norm_type=1.0),
        "api-state-dict": lambda: pipe().load_consolidated_state_dict({"9.weight": x}),
        "api-layout": lambda: hybridpar.init(pp=3),
        "api-meta-bare": lambda: pipe(_meta(lambda: nn.Linear(8, 8), _Scale), [1, 1]),
        "api-meta-uninitialized": lambda: pipe(_meta(lambda: nn.Linear(8, 8), _Scale), [1, 1],
                                               init_fn=lambda m: None),
        "api-tied-differ": lambda: pipe(_tied()).load_consolidated_state_dict(
            {**_tied().state_dict(), "3.weight": torch.zeros(8, 8)}),
    }


def _tp_cases(topo):
    return {
        "tp-linear": lambda: ParallelLinear(8, 7, dim=-1),
        "tp-dense": lambda: TPDense(7, 8, mode="scatter"),
        "tp-dim": lambda: ParallelLinear(4, 4, dim=2),
        "tp-plan-style": lambda: hybridpar.HybridPipe(_mlp(), [4], topology=topo,
                                                      tp_plan={"0": "diagonal"}),
        "tp-plan-divide": lambda: hybridpar.HybridPipe(
            nn.Sequential(nn.Linear(8, 7), nn.Linear(7, 3)), [2], topology=topo,
            tp_plan={"0": "column"}),
        "tp-shard-slices": lambda: hybridpar.shard(nn.Sequential(nn.Linear(8, 8)),
                                                   parameter_plan={"0.weight": (3, 1)}),
        "tp-shard-layer": lambda: hybridpar.shard(nn.Sequential(nn.LayerNorm(8)),
                                                  parameter_plan={"0.weight": (2,)}),
    }


def _caught(fn):
    try:
        fn()
    except Exception as e:   # a failing stage's own error carries the step's block as a note
        return [type(e).__name__, "\n".join([str(e), *getattr(e, "__notes__", [])])]
    return ["no error", ""]


def _run_cases(group):
    if group == "api":
        topo = hybridpar.init(pp=2, timeout=TIMEOUT)
        cases = _api_cases(topo)
    else:
        topo = hybridpar.init(tp=2, timeout=TIMEOUT)
        cases = _tp_cases(topo)
    return {name: _caught(fn) for name, fn in cases.items()}


# pipelines that stop mid-step: one spawn each ----------------------------------------------

class ReturnsDict(nn.Module):
    def forward(self, x):
        return {"x": x}


def _failing_pipeline(case):
    topo = hybridpar.init(pp=2, timeout=TIMEOUT)
    torch.manual_seed(0)
    x, y = torch.randn(4, 4), torch.zeros(4, dtype=torch.long)
    ce = nn.functional.cross_entropy
    if case == "pipe-dict-stage":
        model = nn.Sequential(nn.Linear(4, 4), ReturnsDict(), nn.Linear(4, 3))
        run = lambda pipe: pipe.train_step(x, y)  # noqa: E731
        balance, loss = [2, 1], ce
    elif case == "pipe-dict-last":
        model = nn.Sequential(nn.Linear(4, 4), ReturnsDict())
        run, balance, loss = (lambda pipe: pipe(x)), [1, 1], ce
    elif case == "pipe-shapes":
        model = nn.Sequential(nn.Linear(4, 8), nn.Linear(4, 3))
        run, balance, loss = (lambda pipe: pipe.train_step(x, y)), [1, 1], ce
    elif case == "pipe-loss-vector":
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 3))
        loss = lambda out, t: nn.functional.cross_entropy(out, t, reduction="none")  # noqa: E731
        run, balance = (lambda pipe: pipe.train_step(x, y)), [1, 1]
    else:  # pipe-complex
        model = nn.Sequential(nn.Linear(4, 4), Complex(), nn.Linear(4, 3))
        run, balance, loss = (lambda pipe: pipe.train_step(x, y)), [2, 1], ce
    pipe = hybridpar.HybridPipe(model, balance, chunks=2, topology=topo, loss_fn=loss)
    start = time.monotonic()
    result = _caught(lambda: run(pipe))
    return [*result, time.monotonic() - start]


class Complex(nn.Module):
    def forward(self, x):
        return torch.complex(x, x)


# training runs and checkpoints: a saved run, then one spawn over every case ------------------

MLP = {"name": "mlp", "in_features": 8, "hidden": 8, "out_features": 4, "n_layer": 2}


def _config(**changes):
    data = {"model": dict(MLP), "parallel": {"pp": 2, "chunks": 2, "timeout": float(TIMEOUT)},
            "train": {"steps": 2, "batch_size": 4, "log_every": 1, "sample_tokens": 0,
                      "lr": 0.01},
            "checkpoint": {"every": 1, "keep": 5}}
    for dotted, value in changes.items():
        section, key = dotted.split("__")
        data[section][key] = value
    return Config.from_dict(data, source="<test>")


def _poison(kind, step):
    """Make step `step` non-finite: NaN in the batch (the loss) or inf in a gradient."""
    from hybridpar.train import state as trainer  # the run's state builds its data and pipe

    if kind == "nan loss":
        real = trainer.make_batches

        def make_batches(config, *, split, **kw):
            batches = real(config, split=split, **kw)
            next_batch, calls = batches.next_batch, [0]

            def poisoned():
                x, y = next_batch()
                calls[0] += 1
                return (x * float("nan"), y) if calls[0] == step else (x, y)

            batches.next_batch = poisoned
            return batches

        trainer.make_batches = make_batches
        return lambda: setattr(trainer, "make_batches", real)
    real_build = trainer.build_pipe

    def build_pipe(config, topo, **kw):
        pipe = real_build(config, topo, **kw)
        steps, train_step = [0], pipe.train_step

        def counted(x, y):
            steps[0] += 1
            return train_step(x, y)

        pipe.train_step = counted
        if topo.pp_rank == 0:                 # one stage's gradient; the norm is global
            next(pipe.parameters()).register_hook(
                lambda g: torch.full_like(g, float("inf")) if steps[0] == step else g)
        return pipe

    trainer.build_pipe = build_pipe
    return lambda: setattr(trainer, "build_pipe", real_build)


def _train_cases(cases):
    """Each (run_dir, config changes, init_from, poison) trained in turn: "Type: message"."""
    from hybridpar.train.trainer import train

    out = []
    for run_dir, changes, init_from, poison in cases:
        undo = _poison(*poison) if poison else (lambda: None)
        try:
            train(_config(**changes), run_dir, init_from=init_from, progress=False)
        except Exception as e:
            out.append([type(e).__name__, str(e)])
        else:
            out.append(["no error", ""])
        finally:
            undo()
    return out


def _train(run_dir, changes, poison=None):
    from hybridpar.train.trainer import train

    undo = _poison(*poison) if poison else (lambda: None)
    try:
        return train(_config(**changes), run_dir, progress=False)
    finally:
        undo()


# the table ----------------------------------------------------------------------------------

ROWS = [
    # library API (HybridPipe, balance, skips, batches), 2 ranks, pp=2
    Row("api-not-sequential", "API", "a model that is not an `nn.Sequential` (a ModuleList)",
        "TypeError", "needs an nn.Sequential, got ModuleList",
        "express the model as nn.Sequential"),
    Row("api-empty-model", "API", "an empty `nn.Sequential`", "ValueError",
        "the model is an empty nn.Sequential", "give it at least one layer"),
    Row("api-balance-length", "API", "a balance with the wrong number of stages (`[4]`, pp=2)",
        "ValueError", "has 1 stages but the pipeline has pp=2", "give one layer count per stage"),
    Row("api-balance-sum", "API", "a balance that does not cover the model (`[2, 3]`, 4 layers)",
        "ValueError", "covers 5 layers but the model has 4", "summing to the 4 layers"),
    Row("api-balance-zero", "API", "a balance with an empty stage (`[4, 0]`)", "ValueError",
        "has a stage with no layer", "each at least 1"),
    Row("api-balance-type", "API", "a balance of floats (`[2.0, 2.0]`)", "TypeError",
        "balance must hold integers", "give one layer count per stage"),
    Row("api-balance-name", "API", "an unknown balance name (`'fastest'`)", "ValueError",
        "unknown balance 'fastest'", "or one of 'time', 'size', 'params', 'uniform'"),
    Row("api-balance-sample", "API", "`balance='time'` without `balance_sample`", "ValueError",
        "profiles the model on a sample", "pass balance_sample="),
    Row("api-chunks", "API", "`chunks=0`", "ValueError", "got 0",
        "chunks must be a positive integer"),
    Row("api-checkpoint", "API", "`checkpoint='sometimes'`", "ValueError",
        "checkpoint must be one of", "'always'"),
    Row("api-schedule", "API", "`schedule='zb'`", "ValueError", "unknown schedule 'zb'",
        "choose one of 1f1b, gpipe"),
    Row("api-pop-without-stash", "API", "a skip popped but never stashed", "TypeError",
        "declared 'a' as poppable but it was not stashed", "every pop a stash before it"),
    Row("api-stash-without-pop", "API", "a skip stashed but never popped", "TypeError",
        "no module declared 'a' as poppable but stashed", "needs one pop('name')"),
    Row("api-duplicate-skip", "API", "a skip name stashed twice in one namespace", "TypeError",
        "redeclared 'a' as stashable but not isolated by namespace",
        "layer.isolate(Namespace())"),
    Row("api-no-loss", "API", "`train_step` without `loss_fn`", "ValueError",
        "train_step needs a loss", "HybridPipe(..., loss_fn=fn)"),
    Row("api-rows-differ", "API", "input and target of different batch sizes (4 and 3 rows)",
        "ValueError", "input has 4 rows but target has 3", "must have the same batch size"),
    Row("api-empty-batch", "API", "an empty batch (0 rows)", "ValueError", "has no rows",
        "pass a batch with at least one row"),
    Row("api-input-type", "API", "an input that is not a Tensor (a list)", "TypeError",
        "got list", "must be a Tensor or a tuple of Tensors"),
    Row("api-tuple-rows", "API", "a tuple input whose tensors differ in rows", "ValueError",
        "have different batch sizes [4, 3]", "they must agree on dim 0"),
    Row("api-clip-norm-type", "API", "`clip_grad_norm_(norm_type=1)`", "ValueError",
        "supports the 2-norm only, got norm_type=1.0", "leave norm_type at 2.0"),
    Row("api-state-dict", "API", "`load_consolidated_state_dict` of another model's keys",
        "KeyError", "state dict does not match the model", "give the full state dict"),
    Row("api-layout", "API", "a layout that does not fit the world (pp=3 on 2 ranks)",
        "ValueError", "world size 2 is not divisible by pp * tp", "launch a multiple of 3 ranks"),
    Row("api-meta-bare", "API", "a `meta`-built module with parameters and no "
        "`reset_parameters` (no `init_fn`)", "ValueError",
        "module '1' (_Scale) holds parameters or buffers but has no reset_parameters()",
        "Pass HybridPipe(..., init_fn=fn)"),
    Row("api-meta-uninitialized", "API", "an `init_fn` that leaves a `meta`-built tensor "
        "uninitialized", "ValueError", "'0.weight' is not initialized",
        "make the initializer cover it"),
    Row("api-tied-differ", "API", "`load_consolidated_state_dict` with different values under "
        "two names of one tied parameter", "ValueError",
        "different values for '0.weight' and '3.weight'", "give them equal values"),
    # tensor parallelism, 2 ranks, tp=2
    Row("tp-linear", "API", "tp that does not divide a layer (`ParallelLinear(8, 7, dim=-1)`, "
        "tp=2)", "ValueError", "out_features=7 is not divisible by the tp size 2",
        "choose out_features as a multiple of 2"),
    Row("tp-dense", "API", "tp that does not divide a `TPDense(7, 8, mode='scatter')`",
        "ValueError", "in_features=7 is not divisible by the tp size 2",
        "choose in_features as a multiple of 2"),
    Row("tp-dim", "API", "`ParallelLinear(dim=2)`", "ValueError", "dim=2",
        "dim=None"),
    Row("tp-plan-style", "API", "a `tp_plan` with an unknown style (`'diagonal'`)",
        "ValueError", "'diagonal' is not a style", "valid styles: 'column' / 'row'"),
    Row("tp-plan-divide", "API", "a `tp_plan` column split of a layer tp does not divide",
        "ValueError", "layer '0'", "choose a size that is a multiple of 2"),
    Row("tp-shard-slices", "API", "a `shard` strategy of 3 slices at tp=2", "ValueError",
        "strategy (3, 1)", "give 2 for the split dimension"),
    Row("tp-shard-layer", "API", "a `shard` strategy for a LayerNorm weight", "ValueError",
        "only the weight and bias of nn.Linear", "give all ones to replicate it"),
    # pipelines that stop mid-step, 2 ranks, pp=2: every rank raises at once, the failing one
    # its own error (the step's block as a note), the other a PipelineError naming it
    Row("pipe-dict-stage", "API", "a stage that returns a dict (not Tensors)", "TypeError",
        "stage 0 returned dict", "a stage must return a Tensor or a tuple of Tensors",
        peers="PipelineError"),
    Row("pipe-dict-last", "API", "a last stage that returns a dict, in `pipe(x)`", "TypeError",
        "the last stage returned dict", "make the last layer return one"),
    Row("pipe-shapes", "API", "inconsistent stage shapes (`Linear(4, 8)`, then `Linear(4, 3)`)",
        "RuntimeError", "mat1 and mat2 shapes cannot be multiplied",
        "check that the layers on both sides of the stage boundary fit", peers="PipelineError"),
    Row("pipe-loss-vector", "API", "a `loss_fn` that returns a vector (`reduction='none'`)",
        "TypeError", "loss_fn returned a torch.float32 tensor of shape (2,)",
        "reduction='mean'", peers="PipelineError"),
    Row("pipe-complex", "API", "a complex tensor between stages", "TypeError",
        "cannot send a tensor of dtype torch.complex64 between stages", "torch.view_as_real",
        peers="PipelineError"),
    # config files (load_config; `hybridpar run` checks them before any worker starts)
    Row("cfg-unknown-section", "config", "an unknown section (`[bogus]`)", "ConfigError",
        "unknown section bogus", "valid: model, data, parallel"),
    Row("cfg-unknown-key", "config", "an unknown key (`train.stepz`)", "ConfigError",
        "unknown key train.stepz", "did you mean train.steps?"),
    Row("cfg-type-string", "config", "a string for an integer (`train.steps = \"ten\"`)",
        "ConfigError", "got 'ten'", "train.steps must be an integer"),
    Row("cfg-type-bool", "config", "a boolean for an integer (`parallel.pp = true`)",
        "ConfigError", "got True", "parallel.pp must be an integer"),
    Row("cfg-range", "config", "a negative batch size", "ConfigError", "got -1",
        "train.batch_size must be positive"),
    Row("cfg-choice", "config", "an unknown schedule (`parallel.schedule = \"zb\"`)",
        "ConfigError", "got 'zb'", "must be one of 'gpipe', '1f1b'"),
    Row("cfg-nonfinite", "config", "`train.nonfinite = \"ignore\"`", "ConfigError",
        "got 'ignore'", "must be one of 'stop', 'skip'"),
    Row("cfg-toml", "config", "a file that is not TOML", "ConfigError", "invalid TOML",
        "(at line 1"),
    Row("cfg-missing", "config", "a config file that does not exist (a typo)", "ConfigError",
        "no such config file", "did you mean"),
    Row("cfg-tp", "config", "tp that does not divide the model (`parallel.tp = 3`)",
        "ConfigError", "hidden=8 is not divisible by tp=3", "valid tp sizes are [1, 2, 4, 8]"),
    Row("cfg-tp-no-layers", "config", "tp > 1 for a model without tp layers (unet)",
        "ConfigError", "has no tensor-parallel layers", "set parallel.tp_plan = \"auto\""),
    Row("cfg-pp", "config", "an impossible layout: more stages than layers (`parallel.pp = 9`)",
        "ConfigError", "is more stages than the 3 layers", "choose pp between 1 and 3"),
    Row("cfg-balance", "config", "a balance that does not cover the model (`[1, 1]`)",
        "ConfigError", "covers 2 layers", "summing to the 3 layers"),
    Row("cfg-dp", "config", "a batch size dp does not divide", "ConfigError",
        "is not divisible by parallel.dp=3", "each replica takes batch_size / dp samples"),
    Row("cfg-min-lr", "config", "`train.min_lr` above `train.lr`", "ConfigError",
        "is above train.lr", "set min_lr <= lr"),
    Row("cfg-model-option", "config", "an unknown model option (`model.n_layers`)",
        "ConfigError", "unknown option of model 'mlp'", "did you mean model.n_layer?"),
    Row("cfg-model-tp", "config", "`model.tp` set directly", "ConfigError",
        "model.tp is set from [parallel]", "use parallel.tp"),
    Row("cfg-set", "config", "a `--set` without `=`", "ConfigError",
        "is not section.key=value", "e.g. --set train.steps=100"),
    # the command line, in process: one line on stderr, exit status 2, nothing written
    Row("cli-run-dir", "CLI", "`hybridpar run --run-dir` naming a file", "exit 2",
        "is a file", "give a folder"),
    Row("cli-run-trace-step", "CLI", "`hybridpar run --trace-step 0`", "exit 2",
        "--trace-step 0 is not a step of this run", "give 1..2"),
    Row("cli-run-nnodes", "CLI", "`hybridpar run --nnodes 3` (2 workers)", "exit 2",
        "--nnodes 3 does not divide the 2 workers", "choose a divisor of it"),
    Row("cli-run-restarts", "CLI", "`hybridpar run --max-restarts -1`", "exit 2",
        "--max-restarts must be", ">= 0"),
    Row("cli-export-missing", "CLI", "`hybridpar export` of a folder that does not exist",
        "exit 2", "no such checkpoint folder", "RUN_DIR/checkpoints/step-N"),
    Row("cli-export-incomplete", "CLI", "`hybridpar export` of a checkpoint without `.metadata`",
        "exit 2", "incomplete checkpoint (no .metadata)", "use an earlier step-N folder"),
    Row("cli-export-truncated", "CLI", "`hybridpar export` of a truncated `.distcp` file",
        "exit 2", "is truncated", "restore it, or delete the folder"),
    Row("cli-export-out", "CLI", "`hybridpar export` to a path that is a folder", "exit 2",
        "is a folder", "give the path of the .pt file"),
    Row("cli-balance-partitions", "CLI", "`hybridpar balance --partitions 0`", "exit 2",
        "cannot split 3 layers into 0 stages", "choose --partitions between 1 and 3"),
    Row("cli-balance-tp", "CLI", "`hybridpar balance --tp 0`", "exit 2",
        "--tp 0 must be a positive integer", "positive integer"),
    Row("cli-balance-write", "CLI", "`hybridpar balance --write --partitions 3` (pp=2)",
        "exit 2", "--write stores a balance for the config's 2 stages", "drop --partitions 3"),
    Row("cli-run-workers", "CLI", "`hybridpar run` on a run dir whose checkpoint is damaged",
        "exit 1", "CheckpointError", "restore it, or delete the folder"),
    # checkpoints and --init-from, 2 ranks: raised on every rank
    Row("ckpt-truncated", "checkpoint", "a truncated `.distcp` file", "CheckpointError",
        "is truncated", "delete the folder to use an earlier step-N"),
    Row("ckpt-missing", "checkpoint", "a deleted `.distcp` file", "CheckpointError",
        "is missing", "restore it"),
    Row("ckpt-garbled", "checkpoint", "a `.distcp` file overwritten with zeros (same size)",
        "CheckpointError", "cannot be read", "restore them, or delete the folder"),
    Row("ckpt-metadata", "checkpoint", "a garbled `.metadata` index", "CheckpointError",
        "unreadable checkpoint index .metadata", "delete it to use an earlier step-N"),
    Row("ckpt-other-model", "checkpoint", "a checkpoint of another model (hidden 16, not 8)",
        "CheckpointError", "does not match this model", "saved from another model config?"),
    Row("init-from-garbage", "checkpoint", "`--init-from` a file that is not a state dict",
        "CheckpointError", "cannot be read as a state dict",
        "give a .pt file written by `hybridpar export`"),
    # training
    Row("train-nan-loss", "training", "a NaN loss (`train.nonfinite = \"stop\"`)",
        "FloatingPointError", "the loss is nan at step 2", "set train.nonfinite = 'skip'"),
    Row("train-inf-grad", "training", "an inf gradient norm (`train.nonfinite = \"stop\"`)",
        "FloatingPointError", "the gradient norm is inf", "lower train.lr"),
]
BY_ID = {row.id: row for row in ROWS}


def check(row: Row, results) -> None:
    """Every rank raised `row.error` with a message saying what is wrong and how to fix it."""
    assert results, row.id
    for rank, (kind, message) in enumerate(results):
        assert kind == row.error, (row.id, rank, kind, message)
        assert row.what in message, (row.id, rank, message)
        assert row.fix in message, (row.id, rank, message)


def rows(prefix):
    return [pytest.param(row, id=row.id) for row in ROWS if row.id.startswith(prefix)]


def test_the_table_has_at_least_30_distinct_rows():
    assert len(ROWS) >= 30 and len(BY_ID) == len(ROWS)
    assert len({row.bad for row in ROWS}) == len(ROWS)


# API rows ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def api_results():
    """Both groups on one spawn of 2 ranks, in turn (pp=2, then tp=2 on the same ranks)."""
    return spawn_cases(_run_cases, 2, {group: (group,) for group in ("api", "tp")},
                       timeout=180)


@pytest.mark.parametrize("row", rows("api-") + rows("tp-"))
def test_library_api(row, api_results):
    group = "api" if row.id.startswith("api-") else "tp"
    check(row, [per_rank[row.id] for per_rank in api_results[group]])


@pytest.mark.parametrize("row", rows("pipe-"))
def test_a_pipeline_that_stops_mid_step_raises_on_every_rank_at_once(row):
    start = time.monotonic()
    results = hybridpar.spawn(_failing_pipeline, 2, args=(row.id,), timeout=120)
    assert time.monotonic() - start < TIMEOUT            # nobody waited out the timeout
    # the failing stage raises its own error (the step's block as a note), its peer a
    # PipelineError naming it
    kinds = [kind for kind, _, _ in results]
    assert row.error in kinds and set(kinds) <= {row.error, row.peers}, (row.id, results)
    check(row, [(row.error, message) for _, message, _ in results])
    assert all(elapsed < 3 for *_, elapsed in results), results


# config rows ------------------------------------------------------------------------------

MLP_TOML = """[model]
name = "mlp"
in_features = 8
hidden = 8
out_features = 4
n_layer = 2

[parallel]
pp = 2

[train]
steps = 2
batch_size = 4
"""

UNET_TOML = """[model]
name = "unet"

[parallel]
tp = 2
"""

CONFIG_CASES = {
    "cfg-unknown-section": ("mlp.toml", ["bogus.x=1"]),
    "cfg-unknown-key": ("mlp.toml", ["train.stepz=3"]),
    "cfg-type-string": ("mlp.toml", ['train.steps="ten"']),
    "cfg-type-bool": ("mlp.toml", ["parallel.pp=true"]),
    "cfg-range": ("mlp.toml", ["train.batch_size=-1"]),
    "cfg-choice": ("mlp.toml", ["parallel.schedule=zb"]),
    "cfg-nonfinite": ("mlp.toml", ["train.nonfinite=ignore"]),
    "cfg-toml": ("broken.toml", []),
    "cfg-missing": ("mlp.tml", []),
    "cfg-tp": ("mlp.toml", ["parallel.tp=3"]),
    "cfg-tp-no-layers": ("unet.toml", []),
    "cfg-pp": ("mlp.toml", ["parallel.pp=9"]),
    "cfg-balance": ("mlp.toml", ["parallel.balance=[1,1]"]),
    "cfg-dp": ("mlp.toml", ["parallel.dp=3"]),
    "cfg-min-lr": ("mlp.toml", ["train.min_lr=1.0"]),
    "cfg-model-option": ("mlp.toml", ["model.n_layers=3"]),
    "cfg-model-tp": ("mlp.toml", ["model.tp=2"]),
    "cfg-set": ("mlp.toml", ["train.steps"]),
}


@pytest.fixture
def configs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mlp.toml").write_text(MLP_TOML)
    (tmp_path / "unet.toml").write_text(UNET_TOML)
    (tmp_path / "broken.toml").write_text("this is not toml\n")
    return tmp_path


def files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


@pytest.mark.parametrize("row", rows("cfg-"))
def test_config(row, configs):
    name, overrides = CONFIG_CASES[row.id]
    before = files(configs)
    with pytest.raises(ConfigError) as info:
        load_config(configs / name, overrides)
    check(row, [(type(info.value).__name__, str(info.value))])
    assert "\n" not in str(info.value)                   # one line
    assert files(configs) == before                      # nothing written


# CLI rows ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A finished 2-step run of the mlp on 2 stages, checkpoints step-1 and step-2."""
    root = tmp_path_factory.mktemp("saved")
    hybridpar.spawn(_train, 2, args=(str(root), {}), timeout=120)
    assert sorted(p.name for p in (root / "checkpoints").iterdir()) == ["step-1", "step-2"]
    return root


def damage(run_dir: Path, how: str) -> Path:
    """Damage the latest checkpoint of `run_dir` (step-2); returns its folder."""
    folder = run_dir / "checkpoints" / "step-2"
    data = sorted(folder.glob("*.distcp"))[-1]
    if how == "truncate":
        data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    elif how == "delete":
        data.unlink()
    elif how == "zeros":
        data.write_bytes(bytes(data.stat().st_size))
    elif how == "metadata":
        (folder / ".metadata").write_bytes(b"not a pickle")
    elif how == "no metadata":
        (folder / ".metadata").unlink()
    return folder


def copy_run(saved: Path, to: Path) -> Path:
    shutil.copytree(saved, to)
    return to


CLI_CASES = {
    "cli-run-dir": ["run", "mlp.toml", "--run-dir", "a-file"],
    "cli-run-trace-step": ["run", "mlp.toml", "--trace-step", "0"],
    "cli-run-nnodes": ["run", "mlp.toml", "--nnodes", "3"],
    "cli-run-restarts": ["run", "mlp.toml", "--max-restarts", "-1"],
    "cli-export-missing": ["export", "nowhere/step-2", "out.pt"],
    "cli-export-incomplete": ["export", "incomplete/checkpoints/step-2", "out.pt"],
    "cli-export-truncated": ["export", "truncated/checkpoints/step-2", "out.pt"],
    "cli-export-out": ["export", "run/checkpoints/step-2", "a-folder"],
    "cli-balance-partitions": ["balance", "mlp.toml", "--partitions", "0", "--by", "params"],
    "cli-balance-tp": ["balance", "mlp.toml", "--tp", "0", "--by", "params"],
    "cli-balance-write": ["balance", "mlp.toml", "--write", "--partitions", "3", "--by",
                          "params"],
}


@pytest.mark.parametrize("row", [r for r in rows("cli-") if r.id != "cli-run-workers"])
def test_command_line(row, configs, saved, capsys):
    copy_run(saved, configs / "run")
    (configs / "a-file").write_text("not a folder")
    (configs / "a-folder").mkdir()
    damage(copy_run(saved, configs / "incomplete"), "no metadata")
    damage(copy_run(saved, configs / "truncated"), "truncate")
    before = files(configs)
    capsys.readouterr()
    assert cli(CLI_CASES[row.id]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"hybridpar {CLI_CASES[row.id][0]}: error: "), err
    check(row, [("exit 2", err[0])])
    assert files(configs) == before                      # no run dir, no out file, no .tmp
    assert not worker_pids(configs / "runs")


def test_a_run_whose_workers_fail_ends_in_one_line_and_leaves_nothing_running(saved, configs):
    row = BY_ID["cli-run-workers"]
    run_dir = copy_run(saved, configs / "run")
    damage(run_dir, "truncate")
    checkpoints = files(run_dir / "checkpoints")
    done = subprocess.run([sys.executable, "-m", "hybridpar.cli", "run", "mlp.toml",
                           "--run-dir", str(run_dir), "--set", "train.steps=4",
                           "--set", "parallel.timeout=10"],
                          capture_output=True, text=True, cwd=configs, timeout=120)
    assert done.returncode == 1, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("hybridpar run: worker rank ") and "failed first" in last, last
    check(row, [("exit 1", last)])
    assert files(run_dir / "checkpoints") == checkpoints          # nothing saved or partial
    assert not worker_pids(run_dir)


# checkpoint and training rows: one spawn over every case ----------------------------------

TRAIN_CASES = {
    "ckpt-truncated": ("truncate", {"train__steps": 4}, None, None),
    "ckpt-missing": ("delete", {"train__steps": 4}, None, None),
    "ckpt-garbled": ("zeros", {"train__steps": 4}, None, None),
    "ckpt-metadata": ("metadata", {"train__steps": 4}, None, None),
    "ckpt-other-model": (None, {"train__steps": 4, "model__hidden": 16}, None, None),
    "init-from-garbage": ("fresh", {}, "garbage.pt", None),
    "train-nan-loss": ("fresh", {"train__steps": 3}, None, ("nan loss", 2)),
    "train-inf-grad": ("fresh", {"train__steps": 3}, None, ("inf grad", 2)),
}


@pytest.fixture(scope="module")
def train_results(saved, tmp_path_factory):
    root = tmp_path_factory.mktemp("train_cases")
    (root / "garbage.pt").write_bytes(b"\x00not a torch file" * 8)
    cases, dirs = [], {}
    for name, (how, changes, init_from, poison) in TRAIN_CASES.items():
        run_dir = root / name
        if how != "fresh":
            copy_run(saved, run_dir)
            if how:
                damage(run_dir, how)
        dirs[name] = (run_dir, files(run_dir))
        cases.append((str(run_dir), changes, init_from and str(root / init_from), poison))
    results = hybridpar.spawn(_train_cases, 2, args=(cases,), timeout=120)
    return {name: ([per_rank[i] for per_rank in results], *dirs[name])
            for i, name in enumerate(TRAIN_CASES)}


@pytest.mark.parametrize("row", rows("ckpt-") + rows("init-") + rows("train-"))
def test_checkpoints_and_training(row, train_results):
    results, run_dir, before = train_results[row.id]
    check(row, results)
    after = files(run_dir)
    assert not [f for f in after if ".partial" in f or f.endswith(".tmp")], after

    def steps(listing):
        return [f for f in listing if re.fullmatch(r"checkpoints/step-\d+", f)]

    if row.id.startswith("train-"):     # step 1 saved; the non-finite step 2 saved nothing
        assert all("at step 2;" in message for _, message in results), results
        assert steps(after) == ["checkpoints/step-1"], after
        assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")] == [1]
    else:                               # the run stopped before a step: nothing new
        assert steps(after) == steps(before), after


# NaN / inf: skip instead of stop ----------------------------------------------------------

@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_skip_drops_the_updates_of_non_finite_steps_and_goes_on(tmp_path):
    from hybridpar.train.checkpoints.checkpoint import allocate_like, read_metadata
    from hybridpar.train.checkpoints.shards import ShardLoadPlanner

    zero2 = {"parallel__pp": 1, "parallel__dp": 2, "parallel__zero": 2}   # sharded gradients
    cases, dirs = {}, {}
    for poison, layout in ((("nan loss", 2), {}), (("inf grad", 3), {}),
                           (("inf grad", 3), zero2)):
        run_dir = tmp_path / (poison[0].replace(" ", "-") + ("-zero2" if layout else ""))
        dirs[(*poison, bool(layout))] = run_dir
        cases[(*poison, bool(layout))] = (str(run_dir), {
            "train__steps": 4, "train__nonfinite": "skip", "checkpoint__every": 4, **layout},
            poison)
    out = spawn_cases(_train, 2, cases, timeout=180)     # the three runs on the same 2 ranks
    runs = {key: (dirs[key], out[key]) for key in cases}
    for (kind, step, _), (run_dir, result) in runs.items():
        assert all(r["steps"] == 4 for r in result)                     # it went on
        records = {r["step"]: r for r in read_metrics(run_dir / "metrics.jsonl")}
        assert sorted(records) == [1, 2, 3, 4]
        assert records[step].get("skipped") is True
        assert not any(records[s].get("skipped") for s in records if s != step)
        assert all(json.dumps(records[s]["loss"]) != "NaN" for s in records if s != step)
        # AdamW counted three updates: the skipped step changed nothing
        path = run_dir / "checkpoints" / "step-4"
        key = "optim/0.fc1.weight/step"
        state = allocate_like(read_metadata(path), [key])
        dcp.load(state, checkpoint_id=str(path), planner=ShardLoadPlanner(), no_dist=True)
        assert state[key].item() == 3, (kind, state[key])


def test_a_skipped_step_is_logged_as_a_warning_naming_it(tmp_path):
    (result,) = hybridpar.spawn(_skip_one_rank, 1, args=(str(tmp_path),), timeout=120)
    assert result["steps"] == 3 and result["warned"], result


def _skip_one_rank(run_dir):
    import logging

    messages = []

    class Keep(logging.Handler):
        def emit(self, record):
            messages.append(record.getMessage())

    logging.getLogger("hybridpar.train").addHandler(Keep())
    from hybridpar.train.trainer import train

    undo = _poison("nan loss", 2)
    try:
        cfg = Config.from_dict({"model": dict(MLP), "train": {
            "steps": 3, "batch_size": 4, "sample_tokens": 0, "nonfinite": "skip"},
            "checkpoint": {"every": 0}})
        result = train(cfg, run_dir, progress=False)
    finally:
        undo()
    warned = [m for m in messages if m.startswith("skipped step 2: the loss is nan")]
    return {"steps": result["steps"], "warned": bool(warned)}
