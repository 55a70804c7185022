"""What a dry run sets up around its ranks: the config's balance as a list, the process's
state given back afterwards, C++'s stderr quieted, a pretrained checkpoint not read, a
`--model` builder standing in for the config's model, and an ``hf:`` model probed once."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.util
import os
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch import nn

from hybridpar.pipeline.schedules.layout import Layout
from hybridpar.topology import Topology
from hybridpar.train.configs.config import Config

__all__ = ["model_override", "preserved_state", "probed_once", "quiet_stderr",
           "resolve_balance", "unread_checkpoint"]


def resolve_balance(config: Config, topo: Topology, notes: list[str]) -> Config:
    """`config` with a list balance, chosen as rank 0 chooses it (HybridPipe broadcasts the
    choice and reads it on the host: no data in a fake run). "time" and "size" profile real
    kernels, so the dry run splits by "params" and says so."""
    from hybridpar.balance import balance_by
    from hybridpar.models.registry import build

    par = config.parallel
    if not isinstance(par.balance, str):
        return config
    name = par.balance if par.balance in ("params", "uniform") else "params"
    args = dict(config.model.args)
    if par.tp > 1 and par.tp_plan is None:   # as train.trainer.build_pipe
        args.update(tp=par.tp, group=topo.tp_group)
    module, _ = build(config.model.name, **args)
    if par.tp_plan is not None:   # as HybridPipe applies it ("hf" included)
        from hybridpar.pipe.build import apply_plan

        module, _ = apply_plan(module, par.tp_plan, group=topo.tp_group)
    stages = Layout.of(par.schedule, par.pp, par.virtual_stages).stages
    balance = [int(b) for b in balance_by(name, stages, module)]
    if name != par.balance:
        notes.append(f"balance={par.balance!r} profiles real kernels; the dry run split by "
                     f"'params': {balance} (pin a split with --set parallel.balance="
                     f"{balance.__repr__().replace(' ', '')})")
    return dataclasses.replace(config, parallel=dataclasses.replace(par, balance=balance))


@contextlib.contextmanager
def preserved_state() -> Iterator[None]:
    """Give back the RNG streams, the warning filters and the process-group generation
    afterwards (a fake rank's failed step marks it broken: `hybridpar.process.generation`)."""
    from hybridpar.process import generation
    from hybridpar.tensor_parallel.random import get_rng_tracker

    tracker = get_rng_tracker()
    streams = tracker.get_states()
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings(), generation.kept():
        warnings.simplefilter("ignore")
        try:
            yield
        finally:
            tracker.set_states(streams)


@contextlib.contextmanager
def quiet_stderr() -> Iterator[None]:
    """Silence what C++ writes to stderr (file descriptor 2) during the block."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


@contextlib.contextmanager
def unread_checkpoint(config: Config, notes: list[str]) -> Iterator[None]:
    """``model.pretrained``: the model as its ``config.json`` says, but none of its tensors
    read (values a fake run does not hold: the ranks agree on the read through collectives
    whose results they read on the host), noted."""
    pretrained = config.model.args.get("pretrained") if config.model.name.startswith(
        "hf:") else None
    if pretrained is None:
        yield
        return
    import hybridpar.hf
    from hybridpar.hf.shard_load import ShardLoad

    read = hybridpar.hf.load_hf_shards
    hybridpar.hf.load_hf_shards = lambda *args, **kwargs: ShardLoad(0, 0, ())
    note = (f"model.pretrained {pretrained}: the model is built as its config.json says, its "
            "weights are not read (a fake run holds no values); `hybridpar run` reads them")
    if note not in notes:
        notes.append(note)
    try:
        yield
    finally:
        hybridpar.hf.load_hf_shards = read


@contextlib.contextmanager
def model_override(config: Config, spec: str | None) -> Iterator[None]:
    """`spec` (module:function or file.py:function) builds the config's model meanwhile."""
    from hybridpar.models import MODELS

    if spec is None:
        yield
        return
    where, _, attr = spec.rpartition(":")
    try:
        if where.endswith(".py"):
            found = importlib.util.spec_from_file_location(Path(where).stem, where)
            assert found is not None and found.loader is not None
            module = importlib.util.module_from_spec(found)
            found.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
        build: Callable[..., nn.Sequential] = getattr(module, attr)
    except (ImportError, OSError, AttributeError, AssertionError, ValueError) as e:
        raise ValueError(f"--model {spec!r} names no function (MODULE:FUNCTION or "
                         f"FILE.py:FUNCTION): {e}") from None
    name = config.model.name
    before, MODELS[name] = MODELS[name], build
    try:
        yield
    finally:
        MODELS[name] = before



def probed_once(config: Config, notes: list[str]) -> Config:
    """An ``hf:`` model's parity probe (`hybridpar.hf.probe`) run here, once, on real CPU
    tensors (the ranks' fake ones cannot compare values), its verdict a note; the config the
    ranks build then skips it. A model it refuses is a ValueError, as in `hybridpar run`."""
    args = config.model.args
    if not config.model.name.startswith("hf:") or not args.get("verify", True):
        return config
    from hybridpar.hf.probe import probe
    from hybridpar.models.hf import hf_config

    with torch.device("cpu"):
        result = probe(hf_config(config.model.name.removeprefix("hf:"), args))
    notes.append(f"model.verify: {config.model.name} converts exactly ({result.layers}-layer "
                 f"float64 probe, max difference {result.max_difference:.1e}, "
                 f"{result.seconds:.2f} s)")
    model = dataclasses.replace(config.model, args={**args, "verify": False})
    return dataclasses.replace(config, model=model)
