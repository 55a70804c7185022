"""HybridPipe's construction steps that need no pipe: options checked, tp plan, skip routes."""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from typing import Any

from torch import nn
from torch.distributed import ProcessGroup

from hybridpar.device import is_cuda
from hybridpar.packing import is_packed
from hybridpar.pipeline.parameters.partition import check_sequential
from hybridpar.pipeline.parameters.tied import check_kept, names_by_id
from hybridpar.pipeline.runtime.skip import SkipRoute, skip_routes
from hybridpar.topology import Topology

__all__ = ["WATCHDOG_SHARE", "apply_plan", "as_chunks", "check_layer_names", "hf_plan",
           "stage_routes", "watchdog_timeout"]


WATCHDOG_SHARE = 0.9   # the watchdog's timeout, as a share of the process groups'


def as_chunks(chunks: object) -> int:
    """`chunks` as an int: an int or an integral number (torchgpipe takes ``int(chunks)``),
    at least 1; a bool, a fraction or anything else is a `ValueError`."""
    if isinstance(chunks, bool) or (not isinstance(chunks, (int, float)) and not hasattr(
            chunks, "__index__")):
        raise ValueError(f"chunks must be a positive integer, got {chunks!r}")
    value = int(chunks)
    if value != chunks or value < 1:
        raise ValueError(f"chunks must be a positive integer, got {chunks!r}")
    return value


def check_layer_names(pipe: nn.Module, names: Sequence[str]) -> None:
    """A `ValueError` when a layer's name is an attribute of the pipe (``"checkpoint"``).

    The pipe holds its stage's layers under their own names (layout-free parameter names), so
    a layer may not take the name of one of its attributes. Every rank checks every layer's
    name, so a clash on one stage stops all of them alike.
    """
    clash = [name for name in names if hasattr(pipe, name)]
    if clash:
        raise ValueError(
            f"layer name(s) {clash} are attributes of HybridPipe (it keeps every layer under "
            "its own name, so that parameter names stay those of the model); rename them, e.g. "
            "nn.Sequential(OrderedDict([('ckpt', layer), ...])) instead of 'checkpoint'")


def watchdog_timeout(watchdog: bool | float | None, topo: Topology
                     ) -> datetime.timedelta | None:
    """None / True / seconds / False -> how long a step may make no progress (None: off).

    By default the watchdog runs on GPUs only: on gloo every wait is bounded already. On, it
    fires at `WATCHDOG_SHARE` of the topology timeout: before NCCL's own watchdog, which tears
    the process down at the process groups' timeout without saying where the step was.
    """
    if watchdog is None:
        watchdog = is_cuda(topo.device, branch="watchdog")
    if watchdog is False:
        return None
    if watchdog is True:
        return topo.timeout * WATCHDOG_SHARE
    if isinstance(watchdog, (int, float)) and watchdog > 0:
        return datetime.timedelta(seconds=float(watchdog))
    raise ValueError(f"watchdog must be True, False, None or positive seconds, got {watchdog!r}")


def apply_plan(module: nn.Sequential, tp_plan: Any, *, group: ProcessGroup | None
               ) -> tuple[nn.Sequential, list[str]]:
    """`module` with `tp_plan` applied over the tp `group` (tied parameters stay tied), and
    the plan's decisions; without a plan, `module` as it is and no decisions.

    ``tp_plan="hf"`` is the Hugging Face model's own plan (`hf_plan`); None, "auto" and dicts
    go to `tensor_parallel.plans.plan.apply_tp_plan` as they are.
    """
    if tp_plan is None:
        return module, []
    from hybridpar.tensor_parallel.plans.plan import apply_tp_plan, plan_decisions
    from hybridpar.tensor_parallel.plans.plan_read import pack_plan_problem

    if isinstance(tp_plan, str) and tp_plan == "hf":
        tp_plan = hf_plan(module)
    if is_packed(module) and isinstance(tp_plan, Mapping):   # the config check's, too
        problem = pack_plan_problem(tp_plan)
        if problem is not None:
            raise ValueError(problem)
    tied = names_by_id(module)
    module = check_sequential(apply_tp_plan(module, tp_plan, group=group))
    check_kept(tied, module)
    return module, plan_decisions(module)


def hf_plan(module: nn.Module) -> dict[str, str]:
    """``tp_plan="hf"``: `module`'s own Hugging Face plan, ``hybridpar.hf.tp_plan(module)``
    (for a `hybridpar.hf.to_sequential` model, in its layer names); a `ValueError` that says
    what to do for a module that is not one."""
    try:
        from hybridpar.hf import config_of, tp_plan
    except ImportError as e:
        raise ValueError(f"tp_plan='hf' is a Hugging Face model's own plan, "
                         f"hybridpar.hf.tp_plan(model), which needs the extra hybridpar[hf] "
                         f"(transformers): {e}") from e
    try:
        config_of(module)
    except ValueError:
        raise ValueError(
            f"tp_plan='hf' is a Hugging Face model's own plan, hybridpar.hf.tp_plan(model), "
            f"but this {type(module).__name__} holds no Hugging Face config: pass the "
            "nn.Sequential that hybridpar.hf.to_sequential(model) made, or use tp_plan='auto' "
            "or a dict {'layer name pattern': style}") from None
    return tp_plan(module)


def stage_routes(module: nn.Sequential, balance: Sequence[int]) -> list[SkipRoute]:
    """The cross-stage skips of `module` split by `balance` (`pipeline.runtime.skip.skip_routes`);
    a stash without its pop is a `TypeError` that says how to fix it."""
    try:
        return skip_routes(module, balance)
    except TypeError as e:   # torchgpipe's verify_skippables says what, not how to fix
        raise TypeError(f"{e}\nEvery stash('name') needs one pop('name') in a later layer "
                        "and every pop a stash before it; a skippable layer used twice needs "
                        "its own namespace: layer.isolate(Namespace())") from None
