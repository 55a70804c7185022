"""Train an MLP on 4 CPU ranks: 2 pipeline stages x 2 tensor-parallel shards."""

import torch
from torch import nn

import hybridpar
from hybridpar.nn import ParallelCrossEntropyLoss, ParallelLinear, RegisterParallelDim


def block(width: int) -> nn.Sequential:
    # column-parallel -> GELU -> re-tag the shard -> row-parallel (all-reduced, full width)
    return nn.Sequential(ParallelLinear(width, 4 * width, dim=-1), nn.GELU(),
                         RegisterParallelDim(-1), ParallelLinear(4 * width, width, dim=0))


def train(steps: int = 60) -> float:
    topo = hybridpar.init(pp=2, tp=2)
    torch.manual_seed(0)  # same seed everywhere: every shard is a slice of the same model
    model = nn.Sequential(block(32), nn.LayerNorm(32), block(32), ParallelLinear(32, 8, dim=-1))
    pipe = hybridpar.HybridPipe(model, [2, 2], chunks=4, topology=topo, schedule="1f1b",
                                loss_fn=ParallelCrossEntropyLoss())
    opt = torch.optim.AdamW(pipe.parameters(), lr=3e-3)
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(1))
    y = (x[:, :8].argmax(dim=1))  # a learnable target: the largest of the first 8 features
    for step in range(steps):
        opt.zero_grad()
        loss = pipe.train_step(x, y)
        opt.step()
        if topo.rank == 0 and step % 10 == 0:
            print(f"step {step:3d}  loss {loss.item():.4f}", flush=True)
    return loss.item()


if __name__ == "__main__":
    import sys

    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 60
    losses = hybridpar.spawn(train, 4, args=(steps,), timeout=600)
    print(f"final loss {losses[0]:.4f} (same on every rank: {len(set(losses)) == 1})")
