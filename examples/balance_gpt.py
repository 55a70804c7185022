"""Balance a GPT over pipeline stages by measured time, print the split, train with it.

    python examples/balance_gpt.py [--stages 2] [--steps 20]
"""

import argparse

import torch

import hybridpar
from hybridpar.balance import (
    DEFAULT_BANDWIDTH,
    balance_profiles,
    format_table,
    profile_layers,
    stage_table,
)
from hybridpar.models import example_batch, gpt, gpt_loss

SIZE = {"vocab_size": 64, "block_size": 32, "n_layer": 4, "n_head": 4, "n_embd": 64}


def train(balance: list[int], steps: int) -> float:
    topo = hybridpar.init(pp=len(balance))
    torch.manual_seed(0)
    pipe = hybridpar.HybridPipe(gpt(**SIZE), balance, chunks=4, topology=topo,
                                schedule="1f1b", loss_fn=gpt_loss)
    opt = torch.optim.AdamW(pipe.parameters(), lr=3e-3)
    for step in range(steps):
        x, y = example_batch("gpt", 16, seed=step, **SIZE)
        opt.zero_grad()
        loss = pipe.train_step(x, y)
        opt.step()
    return loss.item()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = gpt(**SIZE)
    sample, _ = example_batch("gpt", 4, **SIZE)  # one micro-batch of the training batch
    profiles = profile_layers(model, sample, timeout=2.0, progress=True)
    balance = balance_profiles(profiles, args.stages, by="time")
    print(format_table(stage_table(profiles, balance, p2p_bandwidth=DEFAULT_BANDWIDTH["cpu"])))
    print(f"balance = {balance}")
    first = gpt_loss(model(example_batch("gpt", 16, seed=0, **SIZE)[0]),
                     example_batch("gpt", 16, seed=0, **SIZE)[1]).item()
    losses = hybridpar.spawn(train, args.stages, args=(balance, args.steps), timeout=600)
    print(f"trained {args.steps} steps on {args.stages} stages: loss {first:.3f} -> "
          f"{losses[0]:.3f}")
