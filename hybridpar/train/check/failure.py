"""A dry run's failures: `CheckError`, and the one line naming the rank, layer and code site."""

from __future__ import annotations

import contextlib
import os
import traceback
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from hybridpar.comm.p2p_spec import NCCLDtypeError
from hybridpar.process.compat import is_fake_device_mismatch
from hybridpar.train.check.fake_gpu import STANDIN
from hybridpar.train.check.memory import CheckReport

__all__ = ["CheckError", "LayerStack", "failure"]

# the dry run's own modules (this room's): a failure's site is the deepest frame outside them
# (and torch)
_DRY_RUN_FILES = tuple(str(p) for p in Path(__file__).parent.glob("*.py"))


class CheckError(RuntimeError):
    """A dry run that failed: `rank` (None: not one rank's), `report` when numbers exist."""

    def __init__(self, message: str, *, rank: int | None = None,
                 report: CheckReport | None = None) -> None:
        super().__init__(message)
        self.rank, self.report = rank, report


class LayerStack:
    """Which module of the partition runs (forward pre-hooks push, forward hooks pop); after
    an exception the stack still names the innermost one."""

    def __init__(self, partition: nn.Module) -> None:
        self.partition = partition
        self.stack: list[tuple[str, nn.Module]] = []

    @contextlib.contextmanager
    def tracking(self) -> Iterator[None]:
        self.stack = []
        handles = []
        for name, module in self.partition.named_modules():
            if module is not self.partition:
                handles.append(module.register_forward_pre_hook(
                    lambda m, a, name=name: self.stack.append((name, m))))
                handles.append(module.register_forward_hook(lambda m, a, o: self._pop(m)))
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def _pop(self, module: nn.Module) -> None:
        if self.stack and self.stack[-1][1] is module:
            self.stack.pop()

    def describe(self) -> str | None:
        if not self.stack:
            return None
        (top, outer), (name, inner) = self.stack[0], self.stack[-1]
        text = f"layer {name} ({type(inner).__name__})"
        return text if top == name else f"{text} inside layer {top} ({type(outer).__name__})"


def failure(error: BaseException, where: str, layers: LayerStack | None, during: str, *,
            cpu: bool = False) -> CheckError:
    """The one-line CheckError of an exception of a rank's step (`cpu`: on fake CPU ranks,
    where a value read on the host is no fault, but a fake run cannot follow it)."""
    from torch._subclasses.fake_tensor import (
        DataDependentOutputException,
        DynamicOutputShapeException,
    )

    rank = int(where.split()[1])
    chain: list[BaseException] = []
    cause: BaseException | None = error
    while cause is not None and cause not in chain:
        chain.append(cause)
        cause = cause.__cause__ or cause.__context__
    layer = layers.describe() if layers is not None else None
    place = f"in {layer}" if layer else f"in {during} (outside the stage's layers)"
    for e in reversed(chain):   # the root cause first
        if isinstance(e, NCCLDtypeError):   # names the layer and the tensor itself
            return CheckError(f"{where}: {e}", rank=rank)
        if is_fake_device_mismatch(e):
            return CheckError(f"{where}: tensors on the GPU and the CPU meet {place}{_site(e)}"
                              "; create tensors on the input's device (torch.zeros(..., "
                              "device=x.device)) or register them as buffers", rank=rank)
        if isinstance(e, (DataDependentOutputException, DynamicOutputShapeException)) or \
                type(e).__name__ == "GuardOnDataDependentSymNode":
            if cpu:
                return CheckError(f"{where}: a value is read on the host {place}{_site(e)}; "
                                  "fine on CPU ranks, but a fake run cannot follow it: check "
                                  "this config with --device cuda", rank=rank)
            return CheckError(f"{where}: host synchronisation {place}{_site(e)}: .item(), "
                              ".tolist(), bool(t), float(t) or a value-dependent shape of a "
                              "device tensor waits for the GPU; keep values on the device "
                              "(torch.where, masks) or read them once per step", rank=rank)
    root = chain[-1]
    text = str(root).replace(f"{STANDIN}:0", "cuda:0").replace(STANDIN, "cuda")
    return CheckError(f"{where}: {during} failed {place}{_site(root)}: "
                      f"{type(root).__name__}: {(text.splitlines() or [''])[0]}", rank=rank)


def _site(error: BaseException) -> str:
    """The deepest frame of `error` outside torch and this dry run: `` at file:line `code` ``."""
    skip = (str(Path(torch.__file__).parent), "torchgpipe", *_DRY_RUN_FILES)
    frames = [f for f in traceback.extract_tb(error.__traceback__)
              if not any(f.filename.startswith(s) or s in f.filename for s in skip)]
    if not frames:
        return ""
    f = frames[-1]
    path = os.path.relpath(f.filename)
    code = (f.line or "").split("  #")[0].strip()   # without an inline comment
    return f" at {f.filename if path.startswith('..') else path}:{f.lineno} `{code}`"
