"""Shard a plain module by strategies (slices per dimension) on 2 ranks; same numbers as before.

    python examples/shard_strategy.py [--tp 2]

`hybridpar.shard` turns the Linears and the Embedding named in `parameter_plan` into
`hybridpar.nn` layers: ``(tp, 1)`` splits a weight's first dimension (a Linear's output
features: column-parallel; an Embedding's vocabulary), ``(1, tp)`` its second (a Linear's input
features: row-parallel). The column -> row pair keeps its intermediate sharded; the final
column layer is followed by nothing, so its output is gathered: every rank gets the plain
module's output, and the same gradients.
"""

import argparse
import copy

import torch
from torch import nn

import hybridpar
from hybridpar.tensor_parallel.plans.plan import plan_decisions
from hybridpar.tensor_parallel.state import gather_full


def model() -> nn.Sequential:
    torch.manual_seed(0)  # the same seed everywhere: the shards are slices of one model
    return nn.Sequential(
        nn.Embedding(64, 16),                              # 0  ids -> (B, T, 16)
        nn.Linear(16, 64), nn.GELU(), nn.Dropout(0.1),     # 1  column: (B, T, 64 / tp)
        nn.Linear(64, 16),                                 # 4  row: (B, T, 16), all-reduced
        nn.LayerNorm(16),
        nn.Linear(16, 8),                                  # 6  column, then gathered
    )


def worker(tp: int) -> dict[str, float]:
    topo = hybridpar.init(tp=tp)
    plain = model()
    sharded = hybridpar.shard(copy.deepcopy(plain), parameter_plan={
        "0.weight": (tp, 1),                     # vocab-parallel embedding
        "1.weight": (tp, 1), "1.bias": (tp,),    # column: the bias follows the weight
        "4.weight": (1, tp),                     # row: the bias stays whole
        "6.weight": (tp, 1), "6.bias": (tp,),
    })
    if topo.rank == 0:
        print("\n".join(plan_decisions(sharded)))
    ids = torch.randint(0, 64, (4, 5), generator=torch.Generator().manual_seed(1))
    errors = {}
    outputs = []
    for m in (plain, sharded):
        torch.manual_seed(2)                     # the same dropout masks
        out = m(ids)                             # (4, 5, 8) full on every rank
        out.square().mean().backward()
        outputs.append(out)
    errors["output"] = (outputs[0] - outputs[1]).abs().max().item()
    params = dict(sharded.named_parameters())
    for name, p in plain.named_parameters():
        full = gather_full(params[name].grad, params[name], topo.tp_group)
        errors[name + ".grad"] = (full - p.grad).abs().max().item()
    return errors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=2)
    args = parser.parse_args()
    results = hybridpar.spawn(worker, args.tp, args=(args.tp,), timeout=120)
    worst = max(max(r.values()) for r in results)
    for name, err in results[0].items():
        print(f"  {name:14s} max |sharded - plain| = {err:.1e}")
    print(f"outputs and gradients equal the plain module's: {worst < 1e-5}")


if __name__ == "__main__":
    main()
