"""An MLP of TPDense layers (gather → scatter) on 2 CPU ranks against plain nn.Linear layers.

    python examples/tp_dense.py [--async-comm]

Activations stay sharded on features: each rank feeds its half of the input features and
gets its half of the output features. Built under the same seed, the sharded MLP holds the
slices of the plain one, so outputs and gradients agree to float rounding.
"""

import argparse

import torch
import torch.distributed as dist
from torch import nn

import hybridpar
from hybridpar.nn import TPDense

WIDTH, HIDDEN, TP = 16, 64, 2


def mlp(*, async_comm: bool) -> nn.Sequential:
    # gather: all-gather the input shard, keep hidden / tp features; scatter: sum the
    # partial outputs, keep width / tp features
    return nn.Sequential(TPDense(WIDTH, HIDDEN, mode="gather", async_comm=async_comm),
                         nn.GELU(),
                         TPDense(HIDDEN, WIDTH, mode="scatter", async_comm=async_comm))


def plain_mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(WIDTH, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, WIDTH))


def run(async_comm: bool) -> float:
    topo = hybridpar.init(tp=TP)
    rank = topo.tp_rank
    torch.manual_seed(0)
    sharded = mlp(async_comm=async_comm)
    torch.manual_seed(0)
    plain = plain_mlp()

    x = torch.randn(4, 8, WIDTH, generator=torch.Generator().manual_seed(1))    # (B, T, C)
    y = sharded(x.chunk(TP, dim=-1)[rank])                                      # (B, T, C / tp)
    y_plain = plain(x)                                                          # (B, T, C)
    # the loss is a sum over the output features: each rank holds its part of the sum
    y.pow(2).sum().backward()
    y_plain.pow(2).sum().backward()

    diffs = [(y - y_plain.chunk(TP, dim=-1)[rank]).abs().max(),
             (sharded[0].weight.grad - plain[0].weight.grad.chunk(TP, dim=0)[rank]).abs().max(),
             (sharded[2].weight.grad - plain[2].weight.grad.chunk(TP, dim=1)[rank]).abs().max()]
    worst = torch.stack(diffs).max()
    dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=topo.tp_group)
    return worst.item()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--async-comm", action="store_true", help="overlap over a ring")
    args = parser.parse_args()
    worst = hybridpar.spawn(run, TP, args=(args.async_comm,), timeout=120)[0]
    print(f"TPDense MLP on {TP} ranks (async_comm={args.async_comm}) vs nn.Linear: "
          f"max difference {worst:.3g}")
