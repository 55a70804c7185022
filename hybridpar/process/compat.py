"""The torch names that differ between the torch releases hybridpar supports (2.11 and newer).

hybridpar runs on torch >= 2.11 (setup.cfg); CI tests the pinned 2.13.0, and
tests/test_torch_floor.py runs the parity tests with every name newer than 2.11 removed. A
name that is newer than the floor is used here only, through a function that takes the new
name where torch has it and the old one otherwise:

    function here           new name (came in)                 fallback (came in)
    all_gather_single       dist.all_gather_single (2.13)      dist.all_gather_into_tensor (1.13)
    reduce_scatter_single   dist.reduce_scatter_single (2.13)  dist.reduce_scatter_tensor (1.13)
    is_fake_device_mismatch fake_tensor.FakeTensorDeviceMismatchError (after 2.11: absent
                            there, found by running the suite on a GPU machine's 2.11)
                                                               the RuntimeError's message

torch 2.13 deprecates both fallbacks (a FutureWarning on each call), so the new name must win
where it exists. Each name is looked up when called, not at import: `hybridpar.spawn`'s ranks
fork from a process that imported hybridpar already, and a test that removes or wraps a
``torch.distributed`` name in a rank must still be heard (a getattr per collective).
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

__all__ = ["all_gather_single", "is_fake_device_mismatch", "reduce_scatter_single"]


def _newest(new: str, old: str) -> Any:
    """``dist.<new>`` where this torch has it, else ``dist.<old>``."""
    found = getattr(dist, new, None)
    return found if found is not None else getattr(dist, old)


def all_gather_single(output: Tensor, input: Tensor, group: ProcessGroup | None) -> None:
    """Every rank's `input` (equal sizes on all ranks), one after another, into `output`."""
    _newest("all_gather_single", "all_gather_into_tensor")(output, input, group=group)


def reduce_scatter_single(output: Tensor, input: Tensor, group: ProcessGroup | None) -> None:
    """Sum `input` over the group; this rank's 1/n of it (the rank-th block) into `output`."""
    _newest("reduce_scatter_single", "reduce_scatter_tensor")(output, input, group=group)


def is_fake_device_mismatch(error: BaseException) -> bool:
    """Whether `error` is a fake tensor's "two different devices meet" error (`hybridpar
    check`): its own class where torch has one, else the RuntimeError's message."""
    from torch._subclasses import fake_tensor

    mismatch = getattr(fake_tensor, "FakeTensorDeviceMismatchError", None)
    return (mismatch is not None and isinstance(error, mismatch)) \
        or "found two different devices" in str(error)
