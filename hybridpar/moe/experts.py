"""Experts stored as fused 3-D weights, as transformers 5.x stores them.

    layout       parameter            shape          an expert's MLP on rows x (n, H)
    "fused"      gate_up_proj         (E, 2I, H)     gate, up = (x @ gate_up_projᵀ).chunk(2)
                 down_proj            (E, H, I)      (act(gate) * up) @ down_projᵀ
    "gpt_oss"    gate_up_proj (+bias) (E, H, 2I)     gate, up = (x @ gate_up_proj + b)[::2, 1::2]
                 down_proj (+bias)    (E, I, H)      (clamped swiglu) @ down_proj + b

GPT-OSS's activation: gate clamped above at `limit`, up to [-limit, limit],
``(up + 1) * gate * sigmoid(alpha * gate)``. A module holds the experts `first` ..
`first + local - 1` of `n_experts` (all of them without expert parallelism); its input is
already grouped by expert (`counts` rows each, `hybridpar.moe.grouped`).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hybridpar.moe.grouped import grouped_linear
from hybridpar.sharded.attrs import register_expert_shard

__all__ = ["ACTIVATIONS", "LAYOUTS", "Experts", "expert_mlp", "gated"]

LAYOUTS = ("fused", "gpt_oss")
ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {"silu": F.silu, "gelu": F.gelu,
                                                    "relu": F.relu}


class Experts(nn.Module):
    """`local` experts of hidden size H and intermediate size I (module docstring)."""

    def __init__(self, n_experts: int, hidden: int, intermediate: int, *,
                 layout: str = "fused", activation: str = "silu", first: int = 0,
                 local: int | None = None, alpha: float = 1.702, limit: float = 7.0) -> None:
        super().__init__()
        if layout not in LAYOUTS:
            raise ValueError(f"experts layout {layout!r} is not one of {', '.join(LAYOUTS)}")
        if layout == "fused" and activation not in ACTIVATIONS:
            raise ValueError(f"experts activation {activation!r} is not one of "
                             f"{', '.join(ACTIVATIONS)}")
        local = n_experts if local is None else local
        if not (0 <= first and 1 <= local and first + local <= n_experts):
            raise ValueError(f"experts {first}..{first + local - 1} are not among the "
                             f"{n_experts} experts")
        if first % local or n_experts % local:
            raise ValueError(f"experts {first}..{first + local - 1} are not one of equal "
                             f"slices of the {n_experts} experts (an ep rank's)")
        self.n_experts, self.first, self.local = n_experts, first, local
        self.hidden, self.intermediate = hidden, intermediate
        self.layout, self.activation, self.alpha, self.limit = layout, activation, alpha, limit
        #: the share of these weights one token multiplies (top_k / E: set by its `MoE`);
        #: model FLOPs count the active parameters (`hybridpar.flops.matmul_params`)
        self.routed = 1.0
        gpt_oss = layout == "gpt_oss"
        self.gate_up_proj = nn.Parameter(torch.empty(
            (local, hidden, 2 * intermediate) if gpt_oss else (local, 2 * intermediate, hidden)))
        self.down_proj = nn.Parameter(torch.empty(
            (local, intermediate, hidden) if gpt_oss else (local, hidden, intermediate)))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(local, 2 * intermediate)) \
            if gpt_oss else None
        self.down_proj_bias = nn.Parameter(torch.empty(local, hidden)) if gpt_oss else None
        if local < n_experts:
            for p in self.parameters():
                register_expert_shard(p, rank=first // local, ep=n_experts // local)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Each expert as an nn.Linear pair would be: uniform(±1/√fan_in), biases zero. A
        shard draws the whole (E, ...) tensor and keeps its experts: the values of the
        unsharded layer, whatever ep (one layer's experts in memory at a time)."""
        for p, fan_in in ((self.gate_up_proj, self.hidden), (self.down_proj, self.intermediate)):
            bound = 1 / math.sqrt(fan_in)
            if self.local == self.n_experts:
                nn.init.uniform_(p, -bound, bound)
                continue
            full = torch.empty((self.n_experts, *p.shape[1:]), dtype=p.dtype, device=p.device)
            nn.init.uniform_(full, -bound, bound)
            with torch.no_grad():
                p.copy_(full[self.first:self.first + self.local])
        for b in (self.gate_up_proj_bias, self.down_proj_bias):
            if b is not None:
                nn.init.zeros_(b)

    def forward(self, x: Tensor, counts: Tensor) -> Tensor:
        """x (N, H) grouped by local expert, counts (local,) -> (N, H) each row's expert MLP."""
        if self.layout == "gpt_oss":
            return expert_mlp(x, counts, self.gate_up_proj, self.down_proj,
                              gate=self._clamped_swiglu, transposed=True,
                              biases=(self.gate_up_proj_bias, self.down_proj_bias))
        act = ACTIVATIONS[self.activation]
        return expert_mlp(x, counts, self.gate_up_proj, self.down_proj,
                          gate=lambda h: gated(h, act))

    def _clamped_swiglu(self, h: Tensor) -> Tensor:
        gate = h[..., ::2].clamp(max=self.limit)
        up = h[..., 1::2].clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))

    def extra_repr(self) -> str:
        return (f"experts {self.first}..{self.first + self.local - 1} of {self.n_experts}, "
                f"hidden={self.hidden}, intermediate={self.intermediate}, layout={self.layout}")


def gated(h: Tensor, act: Callable[[Tensor], Tensor]) -> Tensor:
    """The fused layout's gate: h (N, 2I) = [gate | up] -> act(gate) * up (N, I)."""
    gate, up = h.chunk(2, dim=-1)
    return act(gate) * up


def expert_mlp(x: Tensor, counts: Tensor, gate_up: Tensor, down: Tensor, *,
               gate: Callable[[Tensor], Tensor], transposed: bool = False,
               biases: tuple[Tensor | None, Tensor | None] = (None, None)) -> Tensor:
    """Each expert's MLP on its rows: x (N, H) grouped by expert (`counts`), the fused
    weights `gate_up` / `down` of the layout (module docstring), `gate` (N, 2I) -> (N, I),
    optional biases (E, 2I) / (E, H) -> (N, H). What `Experts` runs, and the Hugging Face
    blocks with their own weights and gates (`hybridpar.moe.hf_blocks`)."""
    n = x.shape[0]    # each bias row repeated for its expert's rows (N known: no host read)
    h = grouped_linear(x, gate_up, counts, transposed=transposed)         # (N, 2I)
    if biases[0] is not None:
        h = h + biases[0].repeat_interleave(counts, dim=0, output_size=n)
    out = grouped_linear(gate(h), down, counts, transposed=transposed)    # (N, H)
    if biases[1] is not None:
        out = out + biases[1].repeat_interleave(counts, dim=0, output_size=n)
    return out

