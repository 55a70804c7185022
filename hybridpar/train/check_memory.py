"""Fake GPUs for a dry run, and what it measures on them: memory by kind and traffic per rank.

The fake GPU (`fake_gpu`). On a CPU-only build of torch, FakeTensorMode makes `cuda` tensors,
but autograd and indexing on them ask torch for a CUDA device guard, which such a build lacks.
So the fake GPU is torch's PrivateUse1 device registered as ``fakegpu``: a device guard and
hooks, no kernels, every op computed by FakeTensorMode. The registration lasts for the process
(`torch.accelerator` then reports the device), which is why `hybridpar.train.check.dry_run` runs in
a child process by default. bf16 autocast on it casts as CUDA's autocast does where memory is
concerned (matmuls, convolutions and attention in bf16; softmax, norms, losses, reductions in
fp32; weight casts cached for the step). `FakeFunctions` fills the gaps of FakeTensorMode
listed in its docstring.

What is measured (`RankReport`, `CheckReport`):

    column        bytes of                                        how
    params        this rank's parameters (its stage, its tp shard)  sum over pipe.parameters()
    grads         their gradients after the step                  sum over p.grad
    optimizer     AdamW's exp_avg and exp_avg_sq                  2 x the trainable parameters
    activations   the peak of tensors saved for backward          saved_tensors_hooks (below)
    peak          params + grads + optimizer + activations        checked against --memory
    p2p           pipeline payloads sent + received               hybridpar.comm_stats()
    collectives   all-reduce, all-gather, reduce-scatter, bcast   hybridpar.comm_stats()

Activations (`SavedActivations`): every tensor autograd saves during the step is keyed by
its storage (a view and its base count once, parameters and buffers not at all); a new one
counts the storages still alive, and the largest sum is the peak. Checkpointed micro-batches
save nothing in their first forward (no grad) and everything again while recomputed, so the
peak follows the schedule: without checkpointing it is the saved bytes of one micro-batch
times m on every stage under GPipe, times p - s on stage s under 1F1B (BENCH.md).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
from torch.multiprocessing.reductions import StorageWeakRef

__all__ = [
    "COLLECTIVES",
    "STANDIN",
    "CheckReport",
    "FakeFunctions",
    "GiB",
    "RankReport",
    "SavedActivations",
    "clear_cast_cache",
    "fake_gpu",
    "format_bytes",
    "memory_problem",
    "optimizer_bytes",
    "tensor_bytes",
]

GiB = 2**30
STANDIN = "fakegpu"   # the PrivateUse1 name of the fake GPU
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")
_P2P = ("p2p_send", "p2p_recv", "p2p_header")


def tensor_bytes(tensors: Iterable[Tensor | None]) -> int:
    """The bytes of `tensors` (None counts 0)."""
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def optimizer_bytes(module: nn.Module) -> int:
    """AdamW's state: exp_avg and exp_avg_sq, each like its (trainable) parameter."""
    return 2 * tensor_bytes(p for p in module.parameters() if p.requires_grad)


class SavedActivations:
    """The peak bytes of tensors saved for backward while `track()` is active (see above)."""

    def __init__(self, exclude: Iterable[Tensor] = ()) -> None:
        self.exclude = {_storage_key(t) for t in exclude}
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.total = 0   # of `live`, freed storages included until the next sweep
        self.peak = 0

    def _pack(self, t: Tensor) -> Tensor:
        key = _storage_key(t)
        known = self.live.get(key)
        if key in self.exclude or (known is not None and not known[0].expired()):
            return t
        if known is not None:   # a freed storage's address, reused
            self.total -= known[1]
        storage = t.untyped_storage()
        self.live[key] = (StorageWeakRef(storage), storage.nbytes())
        self.total += storage.nbytes()
        if self.total > self.peak:   # a new peak only if the freed ones do not hide it
            for k in [k for k, (ref, _) in self.live.items() if ref.expired()]:
                self.total -= self.live.pop(k)[1]
            self.peak = max(self.peak, self.total)
        return t

    @contextmanager
    def track(self) -> Iterator[SavedActivations]:
        with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
            yield self


def _storage_key(t: Tensor) -> int:
    return int(t.untyped_storage()._cdata)


@dataclass(frozen=True)
class RankReport:
    """The numbers of one rank's step (bytes), and where it sits in the grid."""

    rank: int
    dp: int
    stage: int
    tp: int
    layers: tuple[int, int]           # [first, last + 1) of the model's layers
    params: int
    grads: int
    optimizer: int
    activations: int
    comm: dict[str, dict[str, int]]   # hybridpar.comm_stats() of the step

    @property
    def peak(self) -> int:
        """The memory the step needs at most: the four kinds together."""
        return self.params + self.grads + self.optimizer + self.activations

    @property
    def p2p(self) -> int:
        return sum(self.comm.get(k, {}).get("bytes", 0) for k in _P2P)

    @property
    def collectives(self) -> int:
        return sum(self.comm.get(k, {}).get("bytes", 0) for k in COLLECTIVES)

    @property
    def where(self) -> str:
        return f"rank {self.rank} (dp {self.dp}, stage {self.stage}, tp {self.tp})"


@dataclass
class CheckReport:
    """A dry run that passed: every rank's numbers, the layout, and notes for the reader."""

    config: str
    device: str
    dims: tuple[int, int, int]        # (dp, pp, tp)
    balance: list[int]
    chunks: int
    schedule: str
    checkpoint: str
    precision: str
    ranks: list[RankReport]
    memory_gib: float | None = None
    notes: list[str] = field(default_factory=list)
    p2p_groups: int = 0               # P2P groups replayed under NCCL's rules

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        for row, rank in zip(data["ranks"], self.ranks):
            row.update(peak=rank.peak, p2p=rank.p2p, collectives=rank.collectives)
        data["total"] = self.total()
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CheckReport:
        names = {f.name for f in dataclasses.fields(RankReport)}
        rows: list[dict[str, Any]] = [{k: v for k, v in r.items() if k in names}
                                      for r in data["ranks"]]
        ranks = [RankReport(**{**r, "layers": tuple(r["layers"])}) for r in rows]
        fields = {f.name for f in dataclasses.fields(cls)} - {"ranks", "dims"}
        return cls(**{k: data[k] for k in fields if k in data}, dims=tuple(data["dims"]),
                   ranks=ranks)

    def total(self) -> dict[str, int]:
        """The sums over all ranks."""
        keys = ("params", "grads", "optimizer", "activations", "peak", "p2p", "collectives")
        return {k: sum(getattr(r, k) for r in self.ranks) for k in keys}

    def write_json(self, path: str | os.PathLike[str]) -> None:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_dict(), f, indent=2)
            f.write("\n")

    def format(self) -> str:
        """The per-rank table, a total line and the notes."""
        dp, pp, tp = self.dims
        where = "cuda devices" if self.device == "cuda" else "CPU ranks"
        head = (f"{self.config}: dp={dp} x pp={pp} x tp={tp} on {len(self.ranks)} fake "
                f"{where}, balance {self.balance}, {self.chunks} micro-batches, "
                f"{self.schedule}, checkpoint={self.checkpoint}, {self.precision}")
        columns = ("rank", "dp", "stage", "tp", "layers", "params", "grads", "optimizer",
                   "activations", "peak", "p2p", "collectives")
        rows = [[str(r.rank), str(r.dp), str(r.stage), str(r.tp),
                 f"{r.layers[0]}-{r.layers[1] - 1}",
                 *(format_bytes(getattr(r, k)) for k in columns[5:])] for r in self.ranks]
        total = self.total()
        rows.append(["total", "", "", "", "", *(format_bytes(total[k]) for k in columns[5:])])
        widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(columns)]
        lines = [head, "  ".join(c.rjust(w) for c, w in zip(columns, widths))]
        lines += ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in rows]
        worst = max(self.ranks, key=lambda r: r.peak)
        fit = "no --memory given" if self.memory_gib is None else \
            f"{'fits' if memory_problem(self.ranks, self.memory_gib) is None else 'exceeds'}" \
            f" --memory {self.memory_gib:.3g} GiB"
        lines.append(f"largest peak: {worst.where}, {format_bytes(worst.peak)}; {fit}; "
                     f"NCCL replay of {self.p2p_groups} P2P groups: ok")
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


def format_bytes(n: int) -> str:
    """`n` bytes as B / KiB / MiB / GiB with three significant digits."""
    for unit, size in (("GiB", GiB), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n} B"


def memory_problem(ranks: list[RankReport], memory_gib: float) -> str | None:
    """Why some rank does not fit `memory_gib` per device (None: all fit)."""
    limit = memory_gib * GiB
    over = sorted((r for r in ranks if r.peak > limit), key=lambda r: -r.peak)
    if not over:
        return None
    worst = over[0]
    parts = ", ".join(f"{k} {format_bytes(getattr(worst, k))}"
                      for k in ("params", "grads", "optimizer", "activations"))
    others = ", ".join(str(r.rank) for r in over[1:])
    also = "" if not others else \
        f"; rank {others} does not fit either" if len(over) == 2 else \
        f"; ranks {others} do not fit either"
    return (f"{worst.where} needs {format_bytes(worst.peak)}, "
            f"{format_bytes(int(worst.peak - limit))} more than --memory {memory_gib:.3g} GiB "
            f"({parts}){also}; use more stages or tp, more micro-batches with 1f1b, "
            "checkpoint='always', or a smaller batch")


# the fake GPU ---------------------------------------------------------------------------------
def fake_gpu() -> str:
    """Register the fake GPU (PrivateUse1 as ``fakegpu``, with bf16 autocast) once; its
    device type."""
    name = torch._C._get_privateuse1_backend_name()
    if name == STANDIN:
        return STANDIN
    if name != "privateuseone":
        raise RuntimeError(f"this process already uses PrivateUse1 as {name!r}; run the dry "
                           "run in its own process (dry_run(..., isolate=True))")
    from torch.utils.backend_registration import (
        _DummyBackendModule,
        _setup_privateuseone_for_python_backend,
    )

    class Module(_DummyBackendModule):
        def get_amp_supported_dtype(self) -> list[torch.dtype]:
            return [torch.float16, torch.bfloat16]

    _setup_privateuseone_for_python_backend(rename=STANDIN, backend_module=Module())
    _register_autocast()
    return STANDIN


# CUDA autocast's op lists (autocast_mode.cpp), the part that shapes memory
_LOWER = ("mm", "bmm", "addmm", "baddbmm", "addbmm", "matmul", "linear", "mv", "addmv",
          "einsum", "conv1d", "conv2d", "conv3d", "convolution", "conv_transpose1d",
          "conv_transpose2d", "conv_transpose3d", "prelu", "scaled_dot_product_attention")
_FP32 = ("softmax", "log_softmax", "layer_norm", "native_layer_norm", "group_norm", "nll_loss",
         "nll_loss_nd", "nll_loss2d", "mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss",
         "binary_cross_entropy_with_logits", "kl_div", "exp", "expm1", "log", "log1p", "log2",
         "log10", "reciprocal", "rsqrt", "pow", "softplus", "logsumexp", "cumsum", "cumprod",
         "prod", "sum", "norm", "linalg_vector_norm", "cosine_similarity", "cdist", "renorm")
_LIBRARY: list[Any] = []
_CAST_CACHE: dict[int, tuple[Tensor, Tensor]] = {}


def _register_autocast() -> None:
    """Autocast kernels for the fake GPU: CUDA's casts of the ops above, others fall through."""
    everything, lib = torch.library.Library("_", "IMPL"), torch.library.Library("aten", "IMPL")
    _LIBRARY.extend((everything, lib))   # registrations live as long as the library objects
    everything.fallback(torch.library.fallthrough_kernel, dispatch_key="AutocastPrivateUse1")
    for names, lower in ((_LOWER, True), (_FP32, False)):
        for name in names:
            packet = getattr(torch.ops.aten, name, None)
            for overload in packet.overloads() if packet is not None else ():
                if "out" in overload:
                    continue
                op = getattr(packet, overload)
                qualified = name if overload == "default" else f"{name}.{overload}"
                lib.impl(qualified, _autocast_kernel(op, lower), "AutocastPrivateUse1")


def _autocast_kernel(op: Any, lower: bool) -> Callable[..., Any]:
    key = torch._C.DispatchKey.AutocastPrivateUse1   # type: ignore[attr-defined]
    keys = torch._C.DispatchKeySet(key)

    def cast(a: Any) -> Any:
        if not isinstance(a, Tensor) or not a.is_floating_point() or a.device.type != STANDIN:
            return a
        target = torch.get_autocast_dtype(STANDIN) if lower else torch.float32
        if a.dtype in (target, torch.float64) or (not lower and a.dtype == torch.float32):
            return a
        cacheable = lower and a.is_leaf and a.requires_grad and \
            torch.is_autocast_cache_enabled()
        if cacheable and id(a) in _CAST_CACHE and _CAST_CACHE[id(a)][0] is a:
            return _CAST_CACHE[id(a)][1]
        out = a.to(target)
        if cacheable:
            _CAST_CACHE[id(a)] = (a, out)
        return out

    def kernel(*args: Any, **kwargs: Any) -> Any:
        with torch._C._ExcludeDispatchKeyGuard(keys):
            args = tuple(cast(a) if not isinstance(a, (list, tuple)) else
                         type(a)(cast(b) for b in a) for a in args)
            return op(*args, **{k: cast(v) for k, v in kwargs.items()})

    return kernel


def clear_cast_cache() -> None:
    """Forget the weight casts of the step that ended (autocast clears its cache so)."""
    _CAST_CACHE.clear()


class FakeFunctions(torch.overrides.TorchFunctionMode):
    """What FakeTensorMode needs on top, at the torch-function level:

        call                            does
        ops on real tensors only        run for real (RNG states are real CPU tensors)
        torch.tensor(..., fake GPU)     made on the CPU, then moved (no fake-GPU kernels)
        Tensor.detach                   its result leaves FakeTensorMode's memo (a weak
                                        reference there stops Module.to swapping params)
        Tensor.data_ptr of a fake       a zero byte (comm's abort check reads one on CPU)
        scaled_dot_product_attention    CUDA's fused kernels (`_attention`), not the math one
        an op moving a small constant   run without the constant (FakeTensorMode computes
        to the fake GPU                 constants for real; the fake GPU has no kernels)
    """

    _ZERO = torch.zeros(8, dtype=torch.uint8)

    def __init__(self, mode: Any) -> None:
        super().__init__()
        self.memo = mode.fake_tensor_converter.meta_converter.tensor_memo

    def __torch_function__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is Tensor.data_ptr and isinstance(args[0], FakeTensor):
            return self._ZERO.data_ptr()
        if func is F.scaled_dot_product_attention and isinstance(args[0], FakeTensor) and \
                args[0].device.type == STANDIN:
            return _attention(*args, **kwargs)
        if func in (torch.tensor, torch.as_tensor) and _on_standin(kwargs.get("device")):
            device = kwargs.pop("device")
            return func(*args, **kwargs, device="cpu").to(device)
        real = False
        for a in (*args, *kwargs.values()):
            for b in a if isinstance(a, (list, tuple)) else (a,):
                if isinstance(b, FakeTensor) or _on_standin(b):
                    break
                real = real or isinstance(b, Tensor)
            else:
                continue
            break
        else:
            if real:   # only real tensors, nothing for the fake GPU: run it for real
                with unset_fake_temporarily():
                    return func(*args, **kwargs)
        try:
            out = func(*args, **kwargs)
        except NotImplementedError as e:   # FakeTensorMode ran it on a constant's real data
            constants = [a for a in (*args, *kwargs.values())
                         if isinstance(a, FakeTensor) and a.constant is not None]
            if f"'{STANDIN}' backend" not in str(e) or not constants:
                raise
            saved = [a.constant for a in constants]
            for a in constants:
                a.constant = None
            try:
                out = func(*args, **kwargs)
            finally:
                for a, constant in zip(constants, saved):
                    a.constant = constant
        if func is Tensor.detach:
            for key in [k for k, v in self.memo.items() if v is out]:
                del self.memo[key]
        return out


def _attention(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None = None,
               dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
               enable_gqa: bool = False) -> Tensor:
    """`F.scaled_dot_product_attention` as CUDA runs it: the flash kernel (fp16 / bf16, no
    mask) or the memory-efficient one, which save O(T) per head, not the math kernel's
    (B, h, T, T) probabilities, which a device without fused kernels would fall back to."""
    if torch.is_autocast_enabled(STANDIN):   # attention is on autocast's lower-precision list
        low = torch.get_autocast_dtype(STANDIN)
        q, k, v = (t.to(low) if t.dtype == torch.float32 else t for t in (q, k, v))
    grads = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    if enable_gqa or q.dim() != 4 or q.shape[1] != k.shape[1] or \
            q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return F.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal,
                                              scale=scale, enable_gqa=enable_gqa)
    if attn_mask is None and q.dtype != torch.float32 and q.shape[-1] <= 256:
        return torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, dropout_p, is_causal, False, scale=scale)[0]
    if attn_mask is not None and attn_mask.dtype == torch.bool:   # as CUDA: a float bias
        attn_mask = torch.zeros(attn_mask.shape, dtype=q.dtype, device=q.device) \
            .masked_fill(~attn_mask, float("-inf"))
    return torch.ops.aten._scaled_dot_product_efficient_attention(
        q, k, v, attn_mask, grads, dropout_p, is_causal, scale=scale)[0]


def _on_standin(device: Any) -> bool:
    if isinstance(device, str):
        return device.split(":")[0] == STANDIN
    return isinstance(device, torch.device) and device.type == STANDIN
