"""`HybridPipe.forward`'s output: the last stage's micro-batch outputs, whole, on every rank.

    last stage   concatenate the micro-batches; all-gather class-sharded (tagged -1) ones
                 over tp; a flag says a bare Tensor (1) or a tuple (0)
    every rank   a broadcast over the pp group (`broadcast_tensors`: shapes, no pickles)

A last stage that returns anything else raises `TypeError` on every rank: it broadcasts the
error in place of the output.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from hybridpar.comm.broadcast import broadcast_tensors
from hybridpar.pipeline.runtime.loss import Guard
from hybridpar.pipeline.runtime.microbatch import TensorOrTensors
from hybridpar.sharded.attrs import get_parallel_dim
from hybridpar.sharded.mappings import all_gather_along
from hybridpar.topology import Topology

__all__ = ["gather_outputs", "share_output"]


def gather_outputs(outputs: Sequence[object], topology: Topology) -> TensorOrTensors:
    """Concatenate the micro-batch outputs; all-gather class-sharded ones over tp."""
    kinds = {type(o).__name__ for o in outputs}
    if not all(isinstance(o, Tensor) or (isinstance(o, tuple) and o and all(
            isinstance(t, Tensor) for t in o)) for o in outputs) or len(kinds) != 1:
        raise TypeError(f"the last stage returned {' / '.join(sorted(kinds))}; "
                        "HybridPipe's forward returns a Tensor or a tuple of Tensors (make "
                        "the last layer return one, or use train_step / eval_step with a "
                        "loss_fn that reads this output)")

    def full(parts: list[Tensor]) -> Tensor:
        whole = torch.cat(parts)  # cat drops the tag: read it from a part
        if get_parallel_dim(parts[0]) in (-1, 1) and topology.tp > 1:
            return all_gather_along(whole, -1, topology.tp_group)
        return whole

    first = outputs[0]
    if isinstance(first, tuple):
        return tuple(full([o[k] for o in outputs if isinstance(o, tuple)])
                     for k in range(len(first)))
    return full([o for o in outputs if isinstance(o, Tensor)])


def share_output(outputs: Sequence[object] | None, topology: Topology, guard: Guard, *,
                 last: int | None = None) -> TensorOrTensors:
    """The whole output on every rank (`outputs`: the last stage's micro-batch outputs, on
    pipeline rank `last`, by default pp - 1)."""
    source = topology.pp - 1 if last is None else last
    last = topology.pp_rank == source
    if topology.pp == 1:
        assert outputs is not None
        return gather_outputs(outputs, topology)
    output: TensorOrTensors | TypeError | None = None
    if last:
        assert outputs is not None
        try:
            output = gather_outputs(outputs, topology)
        except TypeError as e:
            output = e
    payload: tuple[Tensor, ...] | TypeError | None = output \
        if isinstance(output, TypeError) else None
    if isinstance(output, (Tensor, tuple)):   # a flag first: a bare Tensor or a tuple
        single = torch.tensor([int(isinstance(output, Tensor))], dtype=torch.int64)
        payload = (single, output) if isinstance(output, Tensor) else (single, *output)
    with guard("the broadcast of the output from the last stage", topology.pp_group):
        tensors = broadcast_tensors(payload, topology.stage_rank(source),
                                    group=topology.pp_group, device=topology.device)
    return tensors[1] if int(tensors[0]) else tuple(tensors[1:])
