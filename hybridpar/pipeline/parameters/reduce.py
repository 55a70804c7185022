"""Data-parallel gradient averaging in buckets, launched during the last backward of a step.

The buckets are the gradients: each bucket is one flat buffer, and the ``.grad`` of each of
its parameters is a view of its slice (`attach`, before a step's first backward), so backward
accumulates straight into the buffer and the all-reduce runs on it in place, with no second
copy of the gradients (DDP's ``gradient_as_bucket_view``):

    bucket buffer   [ p5.grad | p4.grad ]      p5.grad = buffer[0 : n5].view_as(p5)
                                               p4.grad = buffer[n5 : n5 + n4].view_as(p4)

With ``grad_dtype`` (float32 for bf16 weights) the buffers are of that dtype, and a parameter
of another dtype keeps its slice as ``main_grad`` (`hybridpar.precision`): each accumulation's
``.grad`` is added into it and dropped, so gradients sum over micro-batches in float32, on
one rank too (dp = 1: buffers and hooks, no all-reduce).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup, Work
from torch.utils.hooks import RemovableHandle

from hybridpar import trace
from hybridpar.precision import MAIN_GRAD, grad_of, set_grad

__all__ = ["GradBuckets", "bucket_layout", "grad_dtype_of", "is_view"]

# Bucket order and launch rule. Buckets are cut once, from the parameters in reverse
# registration order (the order backward usually finishes them), one open bucket per
# (dtype, device), each filled up to `bucket_bytes` (a larger parameter sits alone):
#
#     registered   p0  p1  p2  p3  p4  p5            bucket_bytes ~ two of them
#     buckets      b0 = [p5, p4]   b1 = [p3, p2]   b2 = [p1, p0]
#
# While armed (the step's last backward), each accumulate hook marks its parameter ready; a
# full bucket is launched only once every bucket before it is launched (the ready prefix):
#
#     ready  p5 p4 -> launch b0 | p1 p0 -> b2 full, waits for b1 | p2 p3 -> launch b1, b2
#
# So every rank issues the all-reduces b0, b1, b2, ... in that order whatever the timing
# (NCCL needs one collective order on all ranks). `finish` launches the buckets still
# waiting (a parameter unused in the armed backward holds its bucket and those after it).


class GradBuckets:
    """Average the `.grad` of `params` over `group`, bucket by bucket, overlapping backward.

    Call `attach` before the step's first backward (each ``.grad`` becomes a view of its
    bucket's buffer: a grad that was None starts at zero there), `arm` before the step's last
    backward and `finish` after it; earlier backwards only accumulate. A parameter that no
    backward reached this step adds zeros to the sum and ends with a None grad again: that
    must hold on every rank alike, as it does for replicas of one model. A grad set from
    outside (not a view) is copied into the buffer when its bucket is launched, and then
    replaced by the view. `finish` without `arm` reduces every bucket after the fact; `arm`
    again before `finish` abandons the unfinished step. With `group` None or of size 1
    nothing is reduced; unless `grad_dtype` differs from a parameter's dtype (its gradient
    then accumulates in a buffer of `grad_dtype`: ``main_grad``), no buffer is made and no
    hook is installed either.
    """

    def __init__(self, params: Sequence[nn.Parameter], group: ProcessGroup | None, *,
                 bucket_bytes: int = 25 << 20, grad_dtype: torch.dtype | None = None,
                 divisor: int | None = None) -> None:
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
        self.params = list(params)
        self.group = group
        self.size = 1 if group is None else dist.get_world_size(group)
        # the sum is divided by the group's size (an average), or by `divisor`: experts
        # summed over the ranks holding them, divided by the whole dp size
        self.divisor = self.size if divisor is None else divisor
        self.grad_dtype = grad_dtype
        self._buckets = bucket_layout(self.params, bucket_bytes, grad_dtype)
        self._flats: list[Tensor | None] = [None] * len(self._buckets)
        self._unused: set[int] = set()          # attached from None, not accumulated since
        self._works: list[Work] = []
        self._where: dict[int, int] = {}        # param index -> bucket index
        for b, bucket in enumerate(self._buckets):
            self._where.update(dict.fromkeys(bucket, b))
        self._armed = False
        self._ready: set[int] = set()
        self._pending: list[int] = []           # per bucket: params not ready yet
        self._launched = 0                      # buckets 0 .. _launched-1 are in flight
        self._lock = threading.Lock()           # hooks may run on per-device autograd threads
        self._handles: list[RemovableHandle] = []
        #: parameters whose gradient accumulates in ``main_grad`` (of `grad_dtype`)
        self._main = {i for i in self._where if self.params[i].dtype != grad_dtype_of(
            self.params[i], grad_dtype)}
        for i in self._main:
            setattr(self.params[i], MAIN_GRAD, None)
        self._active = self.size > 1 or bool(self._main) or self.divisor != 1
        if self._active:
            for i in self._where:
                self._handles.append(
                    self.params[i].register_post_accumulate_grad_hook(self._hook(i)))

    @property
    def buckets(self) -> list[list[int]]:
        """The layout: per bucket, in launch order, the indices of its parameters in `params`."""
        return [list(b) for b in self._buckets]

    @property
    def launched(self) -> int:
        """How many buckets of the current step are launched so far."""
        return self._launched

    def buffers(self) -> list[Tensor]:
        """The buckets' flat buffers made so far (the gradients live in them)."""
        return [f for f in self._flats if f is not None]

    def attach(self) -> None:
        """Point every bucketed parameter's ``.grad`` (``main_grad``) at its slice of its
        bucket's buffer (a None grad: zeros there, and None again at `finish` unless a
        backward reaches it)."""
        if not self._active:
            return
        with self._lock, torch.no_grad():
            for b in range(len(self._buckets)):
                for i, view in self._views(b):
                    p = self.params[i]
                    grad = grad_of(p)
                    if grad is None:
                        view.zero_()
                        self._unused.add(i)
                    elif not is_view(grad, view):
                        view.copy_(grad)
                    set_grad(p, view)
                    if i in self._main and p.grad is not None:   # set from outside: fold it
                        view.add_(p.grad)
                        p.grad = None

    def _views(self, b: int) -> list[tuple[int, Tensor]]:
        """(parameter index, its slice of bucket `b`'s buffer shaped as the parameter)."""
        params = [self.params[i] for i in self._buckets[b]]
        flat = self._flats[b]
        if flat is None:
            flat = torch.empty(sum(p.numel() for p in params), device=params[0].device,
                               dtype=grad_dtype_of(params[0], self.grad_dtype))
            self._flats[b] = flat
        views, offset = [], 0
        for i, p in zip(self._buckets[b], params, strict=True):
            views.append((i, flat[offset:offset + p.numel()].view_as(p)))
            offset += p.numel()
        return views

    def arm(self) -> None:
        """The next backward is the step's last: reduce each bucket as its grads are final."""
        if self.size <= 1:
            return
        with self._lock:
            if self._works:                     # an armed step that failed before finish():
                for b in range(self._launched):     # its buffers may still be in flight
                    self._drop(b)
                self._works = []
            self._ready = set()
            self._pending = [len(b) for b in self._buckets]
            self._launched = 0
            self._armed = True

    def finish(self) -> None:
        """Launch the buckets not launched yet, wait for all, write the averages into `.grad`."""
        if not self._active:
            return
        with self._lock, torch.no_grad():
            self._armed = False
            while self.size > 1 and self._launched < len(self._buckets):
                self._launch(self._launched)
            works, self._works, self._launched = self._works, [], 0
            for b, work in enumerate(works):
                work.wait()
                flat = self._flats[b]
                assert flat is not None
                flat /= self.divisor            # the grads are views: averaged in place
            if self.size <= 1 and self.divisor != 1:    # nothing to sum: the division alone
                for flat in self._flats:
                    if flat is not None:
                        flat /= self.divisor
            for i in self._unused:              # no backward reached it: None, as before
                set_grad(self.params[i], None)
            self._unused = set()

    def _drop(self, b: int) -> None:
        """Forget bucket `b`'s buffer (a collective may still write it): its grads become
        copies of what they hold now."""
        for i, _ in self._views(b):
            p = self.params[i]
            grad = grad_of(p)
            if grad is not None:
                set_grad(p, grad.clone())
        self._flats[b] = None

    def remove(self) -> None:
        """Remove the hooks; `finish` still reduces every bucket when called."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._armed = False

    def _hook(self, i: int) -> Callable[[Tensor], None]:
        """The accumulate-grad hook of parameter `i`."""
        main = i in self._main

        def hook(param: Tensor) -> None:
            if main:                            # into the float32 gradient; drop the bf16 one
                with torch.no_grad():
                    grad, total = param.grad, getattr(param, MAIN_GRAD)
                    assert grad is not None
                    if total is None:           # a backward outside a step: no buffer yet
                        setattr(param, MAIN_GRAD, grad.to(self.grad_dtype))
                    else:
                        total.add_(grad)
                param.grad = None
            self._unused.discard(i)             # a backward reached it (set ops are atomic)
            if not self._armed or self.size <= 1:
                return
            with self._lock:
                if not self._armed or i in self._ready:
                    return
                self._ready.add(i)
                b = self._where[i]
                self._pending[b] -= 1
                if b == self._launched:
                    with torch.no_grad():
                        while (self._launched < len(self._buckets)
                               and self._pending[self._launched] == 0):
                            self._launch(self._launched)
        return hook

    def _launch(self, b: int) -> None:
        """Start bucket `b`'s all-reduce on its buffer (lock held); a grad that is not its
        view (set from outside, or no `attach`) is copied in first and replaced by it."""
        for i, view in self._views(b):
            p = self.params[i]
            grad = grad_of(p)
            if grad is None:                    # unused this step: zeros, and stays None
                view.zero_()
            elif not is_view(grad, view):
                view.copy_(grad)
                set_grad(p, view)
        flat = self._flats[b]
        assert flat is not None
        with trace.collective("all_reduce", flat.numel() * flat.element_size()):
            work = dist.all_reduce(flat, group=self.group, async_op=True)
        assert work is not None
        self._works.append(work)
        self._launched = b + 1


def is_view(grad: Tensor, view: Tensor) -> bool:
    """Whether `grad` is `view` (the same memory, shape and strides)."""
    return (grad.data_ptr() == view.data_ptr() and grad.shape == view.shape
            and grad.stride() == view.stride())


def grad_dtype_of(param: Tensor, grad_dtype: torch.dtype | None) -> torch.dtype:
    """The dtype `param`'s gradient accumulates in: `grad_dtype` for a floating parameter."""
    return grad_dtype if grad_dtype is not None and param.is_floating_point() else param.dtype


def bucket_layout(params: list[nn.Parameter], bucket_bytes: int,
            grad_dtype: torch.dtype | None = None,
            owners: Sequence[int] | None = None) -> list[list[int]]:
    """Buckets of parameter indices: reverse order, per (gradient dtype, device, and owner
    when `owners` gives one per parameter), up to `bucket_bytes`."""
    first: dict[int, int] = {}                  # a parameter listed twice counts once
    for i, p in enumerate(params):
        if p.requires_grad:
            first.setdefault(id(p), i)
    buckets: list[list[int]] = []
    open_: dict[tuple[torch.dtype, torch.device, int], tuple[list[int], int]] = {}
    for i in sorted(first.values(), reverse=True):
        p = params[i]
        key = (grad_dtype_of(p, grad_dtype), p.device, 0 if owners is None else owners[i])
        nbytes = p.numel() * key[0].itemsize
        bucket, used = open_.get(key, ([], 0))
        if not bucket or used + nbytes > bucket_bytes:
            bucket, used = [], 0
            buckets.append(bucket)
        bucket.append(i)
        open_[key] = (bucket, used + nbytes)
    return buckets
