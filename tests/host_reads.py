"""Host reads of tensor values (what would synchronise a GPU), seen by a callback."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from types import CodeType

import torch

SYNCS = ("item", "tolist", "__bool__", "__int__", "__float__")


@contextlib.contextmanager
def watching_reads(on_read: Callable[[str, CodeType], None]) -> Iterator[None]:
    """Call ``on_read(method name, caller's code)`` before every host read of a tensor's
    values in the block (it may raise), then read as usual."""
    originals = {name: getattr(torch.Tensor, name) for name in SYNCS}

    def watched(name):
        def read(self, *args, **kwargs):
            on_read(name, sys._getframe(1).f_code)
            return originals[name](self, *args, **kwargs)
        return read

    for name in SYNCS:
        setattr(torch.Tensor, name, watched(name))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
