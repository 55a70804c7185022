"""Model FLOPs per token and the peak FLOP/s they are measured against (MFU).

Model FLOPs (PaLM's MFU, Chowdhery et al. 2022, appendix B), per token of a training step::

    6 N + 12 L h s    N: parameters that multiply (all but those of embedding lookups;
                      of experts, the top_k / E a token routes through);
                      L blocks; h the hidden size; s the sequence length
                      (attention: q k^T and att v, 2 s h FLOPs each per token per block,
                      forward; the causal half is counted too)

The forward is one third (2 N + 4 L h s), the backward two thirds; recomputation is not
counted (model FLOPs, not hardware FLOPs). MFU = model FLOPs per second / the peak:

    device   peak                                         source
    GPU      dense bf16 of the device name (`PEAK_BF16`)  "H100 SXM", ... ("unknown": no MFU)
    CPU      a measured fp32 matmul (`cpu_matmul_peak`)   "measured fp32 matmul"
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import torch
from torch import nn

__all__ = ["PEAK_BF16", "cpu_matmul_peak", "flops_per_token", "matmul_params", "peak_bf16"]

# Peak dense bf16 FLOP/s (no sparsity), by a substring of the device name, first match wins.
PEAK_BF16: tuple[tuple[str, float | None, str], ...] = (
    ("H200", 989e12, "H200"),
    ("H100 PCIe", 756e12, "H100 PCIe"),
    ("H100 NVL", None, "H100 NVL (not in the table)"),
    ("H100", 989e12, "H100 SXM"),
    ("A100", 312e12, "A100"),
)

_CPU_PEAK: dict[int, float] = {}   # threads -> FLOP/s, measured once per process


def peak_bf16(name: str | None) -> tuple[float | None, str]:
    """(peak dense bf16 FLOP/s, which table entry) of a device name; None when unknown."""
    for key, peak, label in PEAK_BF16:
        if name and key in name:
            return peak, label
    return None, "unknown"


def _is_lookup(module: nn.Module) -> bool:
    from hybridpar.tensor_parallel.embedding import ParallelEmbedding

    return isinstance(module, nn.Embedding | ParallelEmbedding)


def matmul_params(layers: Iterable[nn.Module]) -> int:
    """Parameters of `layers` that multiply a token: all but those only embedding lookups
    hold (a head tied to the token embedding multiplies, so its weight counts once), and of
    a mixture of experts' experts the share a token goes through (their `routed`: top_k / E,
    set by `hybridpar.moe.MoE`): the active parameters."""
    seen: set[int] = set()
    total = 0.0
    for layer in layers:
        for module in layer.modules():
            if _is_lookup(module):
                continue
            share = float(getattr(module, "routed", 1.0))
            for p in module.parameters(recurse=False):
                if id(p) not in seen:
                    seen.add(id(p))
                    total += p.numel() * share
    return round(total)


def flops_per_token(params: int, blocks: int, n_embd: int, seq: int) -> float:
    """Model FLOPs of one token's forward + backward: 6 N + 12 L h s (module docstring)."""
    return 6.0 * params + 12.0 * blocks * n_embd * seq


def cpu_matmul_peak(size: int = 512, seconds: float = 0.1) -> float:
    """This process's fp32 matmul FLOP/s with its current torch threads: (size x size) @
    (size x size) products back to back for about `seconds` after one warm-up, their FLOPs
    over their time (a mean, not the best product: ranks that measure together share the
    cores for the whole time, as their training does, so the sum over a host's ranks is what
    they reach together). Measured once per process and thread count, then cached. Its
    operands come from a generator of its own: the run's random streams (dropout) must not
    depend on when the first metrics record is written (exact resume)."""
    threads = torch.get_num_threads()
    if threads not in _CPU_PEAK:
        g = torch.Generator().manual_seed(0)
        a, b = torch.randn(size, size, generator=g), torch.randn(size, size, generator=g)
        torch.mm(a, b)   # warm-up: the first product allocates and picks the kernel
        count, began = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - began) < seconds:
            torch.mm(a, b)
            count += 1
        _CPU_PEAK[threads] = 2.0 * size**3 * count / max(elapsed, 1e-9)
    return _CPU_PEAK[threads]
