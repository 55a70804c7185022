"""A module holding one pipeline stage: sequence-like over its layers, kept on its device."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Self

import torch
from torch import Tensor, nn

__all__ = ["StageModule"]


class StageModule(nn.Module):
    """torchgpipe's GPipe habits for one stage: ``len``, ``[i]`` and ``iter`` over the stage's
    layers, and moving denied (the stage lives on `device`; casts are allowed).

    A subclass sets `device` and provides `partition`.
    """

    device: torch.device   # the stage's device (topology.device)

    @property
    def partition(self) -> nn.Sequential:
        """This rank's stage as an `nn.Sequential` (original layer names)."""
        raise NotImplementedError

    # sequence-like over this stage's layers, as torchgpipe's GPipe over the whole model
    def __len__(self) -> int:
        return len(self.partition)

    def __getitem__(self, index: int) -> nn.Module:
        return self.partition[index]

    def __iter__(self) -> Iterator[nn.Module]:
        return iter(self.partition)

    # moving is denied (as torchgpipe): the stage lives on `topology.device`; casts are allowed
    def cuda(self, device: int | torch.device | None = None) -> Self:
        target = torch.device("cuda", device) if isinstance(device, int) else \
            torch.device(device if device is not None else "cuda")
        self._deny_move(target)
        return super().cuda(device)

    def cpu(self) -> Self:
        self._deny_move(torch.device("cpu"))
        return super().cpu()

    def to(self, *args: Any, **kwargs: Any) -> Self:
        device = kwargs.get("device", args[0] if args else None)
        tensor = kwargs.get("tensor", device if isinstance(device, Tensor) else None)
        if tensor is not None:
            self._deny_move(tensor.device)
        elif isinstance(device, int) and not isinstance(device, bool):
            self._deny_move(torch.device(
                "cuda" if self.device.type == "cpu" else self.device.type, device))
        elif isinstance(device, (str, torch.device)):
            self._deny_move(torch.device(device))
        return super().to(*args, **kwargs)

    def _deny_move(self, target: torch.device) -> None:
        """A `TypeError` unless `target` is this stage's device (then nothing moves)."""
        if target.type == self.device.type and target.index in (None, self.device.index):
            return
        raise TypeError(
            f"HybridPipe keeps its stage on {self.device} (topology.device) and cannot move it "
            f"to {target}: the stage's messages and micro-batches live there. Choose the device "
            "through hybridpar.init (one device per rank, cuda:LOCAL_RANK with NCCL); casting is "
            "allowed (pipe.to(torch.bfloat16))")
