"""TPDense: a dense layer whose activations stay sharded on features (xlstm-jax's TPDense).

Input and output are both feature-sharded, (*, in / tp) → (*, out / tp), so a stack of
these layers never holds a full activation between layers; each mode communicates only what
it must (rank r of tp; ``I_r`` / ``O_r``: its slice of the in / out features):

    mode      weight (local)   bias (local)   forward                            backward of x
    gather    W[O_r, :]        b[O_r]         all-gather x, x W[O_r, :]ᵀ         reduce-scatter
              (out / tp, in)                  (skip_communication: x is full)    (skip: left out)
    scatter   W[:, I_r]        b[O_r]         x W[:, I_r]ᵀ, reduce-scatter       all-gather dy
              (out, in / tp)                  (skip: the (*, out) partial sum,   (skip: dy is full)
                                              b[O_r] added at O_r only)
    none      W (out, in)      b              x Wᵀ + b on whatever it is given   -

A gather layer then a scatter layer is the Megatron MLP with sharded (not replicated) ends.
Built under the same seed on every rank, the layer holds the slices of
``nn.Linear(in_features, out_features)`` (the full layer is initialized, consuming the RNG as
on one device, and sliced), its weight multiplied by `init_scale` (xlstm's
kernel_init_adjustment); outputs and gradients are the slices of the plain layer's.

``async_comm=True`` overlaps the communication with the matmuls over a ring
(`dense_async`): gather mode multiplies each received input block while the next travels;
scatter mode sends partial sums around the ring while the next partial is computed.
`bidirectional` passes pieces both ways at once (gather: whole blocks,
`async_gather_bidirectional`; scatter: feature halves, `async_scatter_split`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from hybridpar.sharded.attrs import register_parallel_attribute, register_parallel_dim
from hybridpar.sharded.mappings import (
    gather_grad_scatter,
    reduce_scatter_group,
    shard_range,
)
from hybridpar.tensor_parallel.base import ParallelLayer
from hybridpar.tensor_parallel.feature.dense_async import async_gather_linear, async_scatter_linear
from hybridpar.tensor_parallel.sliced_init import init_from_full
from hybridpar.tensor_parallel.state import register_full_shape, shard_of

__all__ = ["MODES", "TPDense"]

MODES = ("gather", "scatter", "none")


class TPDense(ParallelLayer):
    """Dense layer on feature-sharded activations: mode 'gather', 'scatter' or 'none'.

    Options (keyword-only): `bias`; `skip_communication` leaves the all-gather (gather mode:
    the input comes already full) or the reduce-scatter (scatter mode: the output is the
    un-reduced partial, reduced by the caller) out; `init_scale` multiplies the initial
    weight; `async_comm` overlaps communication and compute over a ring, `bidirectional`
    using both directions (both have no effect in mode 'none' or on one rank); `group` is
    the tp group (default: `hybridpar.init`'s). `mode` defaults to 'none', as in xlstm-jax.
    Sharded features must divide by tp. The output of gather / scatter is tagged -1.
    """

    def __init__(self, in_features: int, out_features: int, *, mode: str = "none",
                 bias: bool = True, skip_communication: bool = False, init_scale: float = 1.0,
                 async_comm: bool = False, bidirectional: bool = True,
                 group: ProcessGroup | None = None, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        if mode not in MODES:
            raise ValueError(
                f"TPDense mode must be one of {MODES}, got {mode!r}: 'gather' all-gathers the "
                "sharded input features, 'scatter' reduce-scatters the partial outputs, "
                "'none' is a plain dense layer"
            )
        if async_comm and skip_communication and mode != "none":
            raise ValueError(
                f"TPDense(mode={mode!r}, skip_communication=True, async_comm=True): with the "
                "communication skipped there is nothing to overlap; drop async_comm or "
                "skip_communication"
            )
        self._setup_group(None if mode == "none" else -1, group, "TPDense")
        self.in_features, self.out_features, self.mode = in_features, out_features, mode
        self.skip_communication, self.init_scale = skip_communication, float(init_scale)
        self.async_comm, self.bidirectional = async_comm, bidirectional
        tp, rank = self.tp_size, self.tp_rank
        self._check_divisible(tp)
        w_shape = {"gather": (out_features // tp, in_features),
                   "scatter": (out_features, in_features // tp),
                   "none": (out_features, in_features)}[mode]
        # the bias slice b[O_r]; uneven only for scatter + skip_communication (out any size)
        start, stop = shard_range(out_features, tp, rank) if mode != "none" else (0, out_features)
        self._bias_range = (start, stop)
        kw: dict[str, Any] = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(w_shape, **kw))
        if bias:
            self.bias = nn.Parameter(torch.empty(stop - start, **kw))
        else:
            self.register_parameter("bias", None)
        self._tag_parameters()
        self.reset_parameters()

    @classmethod
    def from_module(cls, module: nn.Linear, *, mode: str, group: ProcessGroup | None = None,
                    async_comm: bool = False, bidirectional: bool = True) -> TPDense:
        """A TPDense holding this rank's slice of the `nn.Linear` `module` (no random number).

        The values are kept (a meta `module` gives a meta layer); `requires_grad` and the
        training mode follow `module`'s. What `tp_plan`'s dense styles build.
        """
        w, b = module.weight, module.bias
        new = cls(module.in_features, module.out_features, mode=mode, bias=b is not None,
                  async_comm=async_comm, bidirectional=bidirectional, group=group,
                  device="meta", dtype=w.dtype)
        if not w.is_meta:
            new.to_empty(device=w.device)
            with torch.no_grad():
                new.weight.copy_(shard_of(w.detach(), new.weight, new.group))
                if new.bias is not None and b is not None:
                    new.bias.copy_(shard_of(b.detach(), new.bias, new.group))
        new.weight.requires_grad_(w.requires_grad)
        if new.bias is not None and b is not None:
            new.bias.requires_grad_(b.requires_grad)
        new.train(module.training)
        return new

    def _check_divisible(self, tp: int) -> None:
        mode, skip = self.mode, self.skip_communication
        needs = []
        if mode == "gather":
            needs = [("out_features", self.out_features, "the output is sharded")]
            if not skip:
                needs.append(("in_features", self.in_features, "the input is sharded"))
        elif mode == "scatter":
            needs = [("in_features", self.in_features, "the input is sharded")]
            if not skip:
                needs.append(("out_features", self.out_features, "the output is sharded"))
        for name, value, why in needs:
            if value % tp != 0:
                raise ValueError(
                    f"TPDense({self.in_features}, {self.out_features}, mode={mode!r}): "
                    f"{name}={value} is not divisible by the tp size {tp} ({why} over the "
                    f"tp group); choose {name} as a multiple of {tp}, or change tp or mode"
                )

    def _tag_parameters(self) -> None:
        if self.mode == "none":
            return
        # order type 0: the weight (out, in) is read as (in, out); -1 = rows, 0 = columns
        register_parallel_attribute(self.weight, -1 if self.mode == "gather" else 0, 0)
        register_full_shape(self.weight, (self.out_features, self.in_features))
        if self.bias is not None:
            register_parallel_attribute(self.bias, -1, 0)
            register_full_shape(self.bias, (self.out_features,))

    def reset_parameters(self) -> None:
        """Initialize as `nn.Linear` would the full layer (weight × init_scale), keep the slice."""
        if self.weight.is_meta:
            return
        full = nn.Linear(self.in_features, self.out_features, self.bias is not None,
                         device="meta", dtype=self.weight.dtype)

        def init(linear: nn.Linear) -> None:
            linear.reset_parameters()
            linear.weight.mul_(self.init_scale)

        init_from_full(self, full, init, group=self.group)

    def _expected_width(self) -> int:
        if self.mode == "none" or (self.mode == "gather" and self.skip_communication):
            return self.in_features
        return self.in_features // self.tp_size

    def forward(self, x: Tensor) -> Tensor:
        width = self._expected_width()
        if x.shape[-1] != width:
            sharded = width != self.in_features
            raise ValueError(
                f"TPDense(mode={self.mode!r}, skip_communication={self.skip_communication}) "
                f"on tp={self.tp_size} takes inputs with {width} features (the "
                f"{'in_features / tp shard' if sharded else 'full in_features'}), got "
                f"shape {tuple(x.shape)}"
                + ("; pass this rank's feature shard, e.g. x.chunk(tp, -1)[tp_rank]"
                   if sharded else "")
            )
        if self.mode == "none":
            return F.linear(x, self.weight, self.bias)
        group = self.group
        if self.mode == "gather":
            if self.async_comm and self.tp_size > 1:
                y = async_gather_linear(x, self.weight, self.bias, group,
                                        bidirectional=self.bidirectional)
            else:
                if not self.skip_communication:
                    x = gather_grad_scatter(x, group, dim=-1)              # (*, in)
                y = F.linear(x, self.weight, self.bias)                    # (*, out / tp)
        elif self.async_comm and self.tp_size > 1:
            y = async_scatter_linear(x, self.weight, self.bias, group,
                                     bidirectional=self.bidirectional)
        else:
            y = F.linear(x, self.weight)                                   # (*, out) partial
            if self.skip_communication:
                if self.bias is not None:  # each O_r once in the sum the caller takes
                    start, stop = self._bias_range
                    y = y + F.pad(self.bias, (start, self.out_features - stop))
                return y
            y = reduce_scatter_group(y, group, dim=-1)                     # (*, out / tp)
            if self.bias is not None:
                y = y + self.bias
        register_parallel_dim(y, -1)
        return y

    def extra_repr(self) -> str:
        s = (f"in_features={self.in_features}, out_features={self.out_features}, "
             f"mode={self.mode!r}, bias={self.bias is not None}")
        if self.skip_communication:
            s += ", skip_communication=True"
        if self.init_scale != 1.0:
            s += f", init_scale={self.init_scale:g}"
        if self.async_comm:
            s += f", async_comm=True, bidirectional={self.bidirectional}"
        return s
