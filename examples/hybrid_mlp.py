"""Train an MLP on 4 CPU ranks: 2 pipeline stages x 2 tensor-parallel shards.

    python examples/hybrid_mlp.py [configs/example_mlp.toml] [--steps N]
"""

import argparse
import tomllib

import torch
from torch import nn

import hybridpar
from hybridpar.nn import ParallelCrossEntropyLoss, ParallelLinear, RegisterParallelDim


def block(width: int) -> nn.Sequential:
    # column-parallel -> GELU -> re-tag the shard -> row-parallel (all-reduced, full width)
    return nn.Sequential(ParallelLinear(width, 4 * width, dim=-1), nn.GELU(),
                         RegisterParallelDim(-1), ParallelLinear(4 * width, width, dim=0))


def train(cfg: dict) -> float:
    par, m, t = cfg["parallel"], cfg["model"], cfg["train"]
    topo = hybridpar.init(pp=par["pp"], tp=par["tp"])
    torch.manual_seed(t["seed"])  # same seed everywhere: every shard is a slice of one model
    w = m["width"]
    head = ParallelLinear(w, m["classes"], dim=-1)  # class-sharded logits
    model = nn.Sequential(block(w), nn.LayerNorm(w), block(w), head)
    pipe = hybridpar.HybridPipe(model, "params", chunks=par["chunks"], topology=topo,
                                schedule=par["schedule"], loss_fn=ParallelCrossEntropyLoss())
    opt = torch.optim.AdamW(pipe.parameters(), lr=t["lr"])
    x = torch.randn(t["batch_size"], w, generator=torch.Generator().manual_seed(1))
    y = x[:, :m["classes"]].argmax(dim=1)  # learnable: the largest of the first features
    for step in range(t["steps"]):
        opt.zero_grad()
        loss = pipe.train_step(x, y)
        opt.step()
        if topo.rank == 0 and step % 10 == 0:
            print(f"step {step:3d}  loss {loss.item():.4f}", flush=True)
    return loss.item()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("config", nargs="?", default="configs/example_mlp.toml")
    parser.add_argument("--steps", type=int, help="override train.steps")
    args = parser.parse_args()
    with open(args.config, "rb") as f:
        cfg = tomllib.load(f)
    if args.steps:
        cfg["train"]["steps"] = args.steps
    world = cfg["parallel"]["pp"] * cfg["parallel"]["tp"]
    losses = hybridpar.spawn(train, world, args=(cfg,), timeout=600)
    print(f"final loss {losses[0]:.4f} (same on every rank: {len(set(losses)) == 1})")
