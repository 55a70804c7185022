"""Checks of a config across its fields, against the model it names, before any worker starts.

The model is built on the meta device with tp=None (no memory, no init cost; a user's builder
checked as every rank will check it, `builder_check`): tp must divide what the model shards,
a tp plan must name known styles, pp must not exceed its layers, a list balance must cover
them; then the batch against dp, the learning rates, and the data against the model
(`data.seq_len` defaults to a gpt's block_size here), and packing against both. Every failure
is one `ConfigError` line (made by `Where`, which names the file and the ``--set`` of a key).
"""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from hybridpar.models.gpt import check_gpt_config
from hybridpar.models.packing import pack_problem
from hybridpar.models.registry import build, builder, has_synthetic_data, is_zoo, takes_tokens
from hybridpar.optim.zero import ZERO_LEVELS
from hybridpar.packing import SEQUENCE_PARALLEL_PACKED
from hybridpar.pipeline.activations.checkpoint import check_checkpoint
from hybridpar.pipeline.parameters.partition import balance_problem
from hybridpar.pipeline.schedules.layout import Layout
from hybridpar.tensor_parallel.embedding import sequence_length_problem
from hybridpar.tensor_parallel.plans.hf_plan import HF_STYLES, NO_OP_HF_STYLES
from hybridpar.tensor_parallel.plans.plan import DENSE_STYLES, STYLES
from hybridpar.tensor_parallel.plans.plan_read import pack_plan_problem
from hybridpar.tensor_parallel.plans.strategy import strategy_problem
from hybridpar.train.configs.builder_check import MetaBuildError, build_checked

if TYPE_CHECKING:   # config.py calls check_layout: the types only, not a cycle at run time
    from hybridpar.train.configs.config import Config, DataConfig, ModelConfig, Where

__all__ = ["check_layout"]


def _count_layers(model: ModelConfig, where: Where) -> int:
    """The model's nn.Sequential length, built on the meta device (no memory, no init cost).

    A user's builder with ``model.init = "keyed"`` is checked there as every rank will check
    it (`builder_check`); with ``"full"``, one that cannot build on meta is built on the CPU,
    as every rank will build it."""
    user = not (is_zoo(model.name) or model.name.startswith("hf:"))
    try:
        if user and model.init == "keyed":
            return len(build_checked(model.name, lambda: build(model.name, **model.args))[0])
        try:
            with torch.device("meta"):
                return len(build(model.name, **model.args)[0])
        except (ValueError, OSError):
            raise
        except Exception:
            if not (user and model.init == "full"):
                raise
        return len(build(model.name, **model.args)[0])
    except MetaBuildError as e:
        raise where.error(str(e), "model.init", "model.name") from None
    except (ValueError, TypeError, OSError) as e:
        message = str(e).removeprefix(f"{model.name}: ")
        raise where.error(f"model {model.name!r}: {message}",
                          *[f"model.{k}" for k in model.args]) from None


def _check_tp(model: ModelConfig, tp: int, where: Where) -> None:
    """Raise if tp does not divide what the model's own parallel layers shard."""
    args = model.args
    try:
        if model.name == "gpt":
            check_gpt_config(tp=tp, **{k: args[k] for k in (
                "vocab_size", "block_size", "n_layer", "n_head", "n_embd", "dropout")})
        elif model.name == "mlp" and args["hidden"] % tp:
            valid = [d for d in range(1, args["hidden"] + 1) if args["hidden"] % d == 0]
            raise ValueError(f"hidden={args['hidden']} is not divisible by tp={tp}; valid "
                             f"tp sizes are {valid}")
    except ValueError as e:
        message = str(e).removeprefix(f"{model.name}: ")
        raise where.error(f"parallel.tp={tp} does not fit model {model.name!r}: {message}",
                          "parallel.tp", *[f"model.{k}" for k in args]) from None


def _check_experts(cfg: Config, where: Where) -> None:
    """The gpt's experts (`model.n_experts`, `model.top_k`) and `parallel.ep`: ep shards the
    gpt's experts, dividing them and dp; not yet with sequence parallelism."""
    model, par = cfg.model, cfg.parallel
    experts = model.args.get("n_experts", 0) if model.name == "gpt" else 0
    if model.name == "gpt":
        try:
            check_gpt_config(tp=None, n_experts=experts, top_k=model.args.get("top_k", 2),
                             **{k: model.args[k] for k in (
                                 "router", "z_loss_coef", "bias_update_rate",
                                 "capacity_factor", "drop_policy")
                                if k in model.args},
                             **{k: model.args[k] for k in (
                                 "vocab_size", "block_size", "n_layer", "n_head", "n_embd",
                                 "dropout")})
        except ValueError as e:
            raise where.error(str(e), "model.n_experts", "model.top_k", "model.router",
                              "model.bias_update_rate", "model.capacity_factor") from None
    if experts and par.sequence_parallel:
        raise where.error("parallel.sequence_parallel does not take experts yet (each tp rank "
                          "would route a part of the tokens): set it false, or "
                          "model.n_experts = 0", "parallel.sequence_parallel", "model.n_experts")
    if par.ep == 1:
        return
    if model.name.startswith("hf:"):   # a Hugging Face MoE family (its pretrained config's)
        from hybridpar.models.hf import expert_count

        try:
            experts = expert_count(model.name, model.args)
        except (ValueError, OSError) as e:
            raise where.error(str(e), "model.name", "model.pretrained") from None
    if not experts:
        raise where.error(f"parallel.ep={par.ep} shards experts: the built-in gpt with "
                          f"model.n_experts > 0, or a Hugging Face MoE family (Mixtral, "
                          f"Qwen2/3-MoE, OLMoE, GraniteMoE, GPT-OSS); got model "
                          f"{model.name!r} without experts", "parallel.ep", "model.n_experts")
    if experts % par.ep:
        count = "model.n_experts" if model.name == "gpt" else (
            "the pretrained config.json's experts" if model.args.get("pretrained")
            else "model.num_local_experts / num_experts")
        raise where.error(f"parallel.ep={par.ep} does not divide {count}={experts}: each ep "
                          f"rank holds E / ep of the experts", "parallel.ep",
                          "model.n_experts" if model.name == "gpt" else "model.name")
    if par.dp is not None and par.dp % par.ep:
        raise where.error(f"parallel.ep={par.ep} does not divide parallel.dp={par.dp}: ep is "
                          "carved out of the dp replicas", "parallel.ep", "parallel.dp")


def _check_sequence_parallel(cfg: Config, where: Where) -> None:
    """parallel.sequence_parallel: the built-in gpt's own tp layers, tp > 1, whole documents,
    sequences divisible by tp."""
    model, par, data = cfg.model, cfg.parallel, cfg.data
    key = "parallel.sequence_parallel"
    if par.tp == 1:
        raise where.error(f"{key} = true shards the sequence over the tp ranks: it needs "
                          "parallel.tp > 1 (or set it false)", key, "parallel.tp")
    hf = model.name.startswith("hf:")     # any decoder `hf.sequence` takes
    if not ((model.name == "gpt" and par.tp_plan is None) or (hf and par.tp_plan is not None)):
        raise where.error(f"{key} is implemented for the built-in gpt (model.name = 'gpt', its "
                          f"own tp layers) and the Hugging Face models ('hf:...')"
                          f" under a tp plan; not yet for model {model.name!r} with "
                          f"parallel.tp_plan = {par.tp_plan!r}: set it false", key, "model.name")
    if data.pack == "documents":
        raise where.error(SEQUENCE_PARALLEL_PACKED, key, "data.pack")
    length = data.seq_len or (model.args.get("block_size", 64) if model.name == "gpt" else 0)
    problem = sequence_length_problem(length, par.tp)
    if problem is not None:
        raise where.error(problem, key, "data.seq_len")


def check_layout(cfg: Config, where: Where) -> Config:
    """`cfg` checked across its fields and against its model; `data.seq_len` resolved."""
    model, par, data, train = cfg.model, cfg.parallel, cfg.data, cfg.train
    layers = _count_layers(model, where)
    if par.tp > 1 and par.tp_plan is None:
        if "tp" not in inspect.signature(builder(model.name)).parameters:
            raise where.error(f"parallel.tp={par.tp} but model {model.name!r} has no tensor-"
                              "parallel layers; set parallel.tp_plan = \"auto\" (or a table of "
                              "layer globs), or parallel.tp = 1", "parallel.tp")
        _check_tp(model, par.tp, where)
    if par.sequence_parallel:
        _check_sequence_parallel(cfg, where)
    _check_experts(cfg, where)
    if par.tp_plan == "hf" and not model.name.startswith("hf:"):
        raise where.error(f"parallel.tp_plan = 'hf' is a Hugging Face model's own plan; model "
                          f"{model.name!r} is not one (model.name = 'hf:...'): use 'auto'",
                          "parallel.tp_plan", "model.name")
    if isinstance(par.tp_plan, dict):
        for glob, style in par.tp_plan.items():
            if isinstance(style, list):   # a strategy: slices per dimension (hybridpar.shard)
                problem = strategy_problem(style, par.tp)
                if problem:
                    raise where.error(f"parallel.tp_plan[{glob!r}] = {style}: {problem}",
                                      "parallel.tp_plan", "parallel.tp")
            elif style not in (*STYLES, *DENSE_STYLES, *HF_STYLES, *NO_OP_HF_STYLES):
                raise where.error(f"parallel.tp_plan[{glob!r}] must be one of "
                                  f"{', '.join(map(repr, STYLES))}, a TPDense style "
                                  f"({', '.join(map(repr, DENSE_STYLES))}) or a Hugging Face style "
                                  f"({', '.join(map(repr, HF_STYLES))}), got {style!r}",
                                  "parallel.tp_plan")
    try:
        layout = Layout.of(par.schedule, par.pp, par.virtual_stages)
    except ValueError as e:
        raise where.error(str(e), "parallel.schedule", "parallel.virtual_stages") from None
    if layout.stages > layers:
        count, fix = (f"parallel.pp={par.pp}", f"pp between 1 and {layers}") \
            if layout.virtual == 1 else (f"parallel.pp * virtual_stages={layout.stages}",
                                         f"pp * virtual_stages at most {layers}")
        raise where.error(f"{count} is more stages than the {layers} layers of "
                          f"model {model.name!r}; choose {fix}",
                          "parallel.pp", "parallel.virtual_stages")
    if isinstance(par.balance, list):
        problem = balance_problem(par.balance, layout.stages, layers, name="parallel.balance",
                                  model=f"model {model.name!r}", unit=layout.unit)
        if problem is not None:
            raise where.error(problem, "parallel.balance", "parallel.pp")
    if par.dp is not None and train.batch_size % par.dp:
        raise where.error(f"train.batch_size={train.batch_size} is not divisible by "
                          f"parallel.dp={par.dp}; each replica takes batch_size / dp samples",
                          "train.batch_size", "parallel.dp")
    if train.min_lr > train.lr:
        raise where.error(f"train.min_lr={train.min_lr} is above train.lr={train.lr}; the "
                          "learning rate decays from lr to min_lr: set min_lr <= lr",
                          "train.min_lr", "train.lr")
    _check_pack(cfg, where)
    try:
        check_checkpoint(par.checkpoint)
    except ValueError as e:
        raise where.error(f"parallel.{e}", "parallel.checkpoint") from None
    if par.zero not in ZERO_LEVELS:
        raise where.error(f"parallel.zero must be one of {', '.join(map(str, ZERO_LEVELS))} "
                          f"(0: the optimizer state on every dp replica, 1: sharded over dp, "
                          f"2: the gradients too), got {par.zero}", "parallel.zero")
    if train.param_dtype != "fp32" and train.precision != train.param_dtype:
        raise where.error(f"train.param_dtype={train.param_dtype!r} needs train.precision="
                          f"{train.param_dtype!r} (the layers compute under autocast with "
                          f"{train.param_dtype} weights); set both, or param_dtype = 'fp32'",
                          "train.param_dtype", "train.precision")
    evaluates = train.eval_every if train.eval_every <= train.steps else 0
    return dataclasses.replace(cfg, data=_check_data(model, data, where, eval_every=evaluates))


def _check_pack(cfg: Config, where: Where) -> None:
    """``data.pack = "documents"``: a token folder (its .idx gives the documents), a model
    whose layers carry positions, and a tp plan that leaves layer 0 (which passes them on);
    ``"pad"``: a token folder."""
    data, plan = cfg.data, cfg.parallel.tp_plan
    if data.pack == "none":
        return
    if data.source != "tokens":
        raise where.error(f"data.pack = {data.pack!r} packs the documents of a token folder, "
                          f"but data.source = {data.source!r} has no document boundaries: set "
                          "data.source = 'tokens' (a folder written by hybridpar tokenize, whose "
                          ".idx files give them), or data.pack = 'none'", "data.pack",
                          "data.source")
    if data.pack == "pad":      # a document per row: any causal model, any plan
        return
    problem = pack_problem(cfg.model.name)
    if problem is not None:
        raise where.error(problem, "data.pack", "model.name")
    if isinstance(plan, dict):
        problem = pack_plan_problem(plan, "parallel.tp_plan")
        if problem is not None:
            raise where.error(problem, "parallel.tp_plan", "data.pack")


def _model_vocab(model: ModelConfig) -> int | None:
    """The model's vocabulary size: a ``model.pretrained`` folder's config.json (the model is
    built from it, whatever the other keys say), else its ``vocab_size`` option; None when
    neither says (`hybridpar.data.ids.model_vocab`, which every rank checks again)."""
    from hybridpar.data.ids import model_vocab

    return model_vocab(model.args)


def _check_tokens(model: ModelConfig, data: DataConfig, where: Where) -> None:
    """data.path is a token folder (meta.json and file sizes) whose ids fit the model: its
    vocabulary, a ``model.pretrained`` folder's own tokenizer (`hybridpar.data.match`), and
    every shard's largest id (`hybridpar.data.ids`: computed here once and cached for the
    ranks, which check it again)."""
    from hybridpar.data.ids import check_ids
    from hybridpar.data.shards import TokenFolderError
    from hybridpar.data.windows import check_folder

    if data.path is None:
        raise where.error("data.path is required with data.source = 'tokens': a folder written "
                          "by hybridpar tokenize", "data.source")
    try:
        folder = check_folder(data.path)
    except TokenFolderError as e:
        raise where.error(f"data.path {data.path!r}: {e}", "data.path") from None
    vocab = _model_vocab(model)
    if vocab is not None and folder.vocab_size > vocab:
        raise where.error(f"data.path {data.path!r} holds ids of a {folder.vocab_size}-token "
                          f"vocabulary ({folder.meta['tokenizer']['name']}, meta.json) but model "
                          f"{model.name!r} has vocab_size={vocab}: ids >= {vocab} have no "
                          f"embedding; set model.vocab_size >= {folder.vocab_size}, or tokenize "
                          "with the model's own tokenizer", "data.path", "model.vocab_size")
    try:
        check_ids(folder, model_vocab=vocab, model=f"model {model.name!r}")
    except TokenFolderError as e:
        raise where.error(f"data.path {data.path!r}: {e}", "data.path") from None
    pretrained = model.args.get("pretrained")
    if isinstance(pretrained, str):
        from hybridpar.data.match import pretrained_mismatch

        why = pretrained_mismatch(folder.encoder.spec, pretrained)
        if why is not None:
            raise where.error(f"data.path {data.path!r} does not fit the pretrained model: "
                              f"{why}, so they would train the wrong embeddings; tokenize the "
                              f"corpus with the model's tokenizer (hybridpar tokenize ... "
                              f"--tokenizer {pretrained}, or --config with this config)",
                              "data.path", "model.pretrained")


def _check_data(model: ModelConfig, data: DataConfig, where: Where, *,
                eval_every: int = 0) -> DataConfig:
    """The data against the model; `data.seq_len` resolved (a gpt's block_size); with
    `eval_every`, a validation split that holds a window (else evaluation would fail at its
    first step: `--val-fraction 0`, `data.val_fraction = 0`)."""
    if data.source == "synthetic" and not has_synthetic_data(model.name):
        raise where.error(f"data.source = 'synthetic' has batches for the zoo's models only; "
                          f"model {model.name!r} trains on tokens: set data.source = 'corpus' "
                          "(or 'text' with data.path)", "data.source", "model.name")
    if data.source != "synthetic":
        if not takes_tokens(model.name):
            raise where.error(f"data.source={data.source!r} gives token ids; model "
                              f"{model.name!r} takes data.source = 'synthetic'",
                              "data.source", "model.name")
        if data.source == "tokens":
            _check_tokens(model, data, where)
        elif model.args.get("vocab_size", 256) < 256:
            raise where.error(f"data.source={data.source!r} gives bytes (256 values) but "
                              f"model.vocab_size={model.args['vocab_size']}; use at least 256",
                              "data.source", "model.vocab_size")
    if data.source == "text":
        if data.path is None:
            raise where.error("data.path is required with data.source = 'text'", "data.source")
        if not Path(data.path).is_file():
            raise where.error(f"data.path {data.path!r}: no such file", "data.path")
    if data.source != "synthetic" and model.name != "gpt" and data.seq_len is None:
        raise where.error(f"model {model.name!r} needs the sequence length of its samples: "
                          "set data.seq_len (e.g. 64)", "data.seq_len")
    if model.name == "gpt":
        block = model.args["block_size"]
        if data.seq_len is None:
            data = dataclasses.replace(data, seq_len=block)
        elif data.seq_len > block:
            raise where.error(f"data.seq_len={data.seq_len} is longer than model.block_size="
                              f"{block}; use at most {block}", "data.seq_len")
    if eval_every and data.seq_len:   # a validation window, or no evaluation can run
        from hybridpar.data.windows import check_folder, no_val_window

        why, length = None, data.seq_len
        if data.source == "tokens" and data.path is not None:
            why = no_val_window(check_folder(data.path), length)
        elif data.source == "text" and data.path is not None:
            held = int(Path(data.path).stat().st_size * data.val_fraction)
            if held <= length:
                why = (f"data.val_fraction = {data.val_fraction} holds out {held} bytes of "
                       f"data.path, fewer than data.seq_len + 1 = {length + 1}: set a larger "
                       "data.val_fraction")
        elif data.source == "corpus" and data.val_fraction == 0:   # 2 MB: any other holds one
            why = "data.val_fraction = 0 holds out nothing: set it above 0 (e.g. 0.05)"
        if why is not None:
            raise where.error(f"train.eval_every = {eval_every} evaluates on the validation "
                              f"split, but {why}; or set train.eval_every = 0 (no evaluation; "
                              "the end-of-run sample is then skipped too)", "train.eval_every",
                              "data.val_fraction", "data.path")
    return data
