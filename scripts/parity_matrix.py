"""Parity campaign: the GPT pipeline against one device over every layout, schedule and mode.

    python scripts/parity_matrix.py [--steps 3] [--out results/parity_matrix.json]

Prints one row per (pp, tp, dp, schedule, checkpoint) with the largest loss and weight
difference from the plain single-device run, and writes the rows as JSON. The test suite runs
a slice of this matrix; this script runs all of it (a few minutes on 2 cores).
"""

import argparse
import itertools
import json
import time
from pathlib import Path

import torch

import hybridpar
from hybridpar.models import example_batch, gpt, gpt_loss
from hybridpar.pipeline.schedules.schedule import SCHEDULES

SMALL = {"vocab_size": 32, "block_size": 8, "n_layer": 2, "n_head": 4, "n_embd": 16}
LAYOUTS = [(2, 1, 1), (4, 1, 1), (1, 2, 1), (2, 2, 1), (2, 1, 2), (2, 2, 2)]
BALANCES = {1: [5], 2: [2, 3], 4: [1, 1, 1, 2]}
BATCH = 4


def run(layout, schedule, checkpoint, steps):
    """Losses and the consolidated state after `steps` SGD steps (layout None: one device)."""
    pp, tp, dp = layout or (1, 1, 1)
    topo = hybridpar.init(pp=pp, tp=tp, dp=dp, timeout=120) if layout else None
    torch.manual_seed(0)
    model = gpt(**SMALL, tp=tp if layout else None)
    if layout:
        model = hybridpar.HybridPipe(model, BALANCES[pp], chunks=2, topology=topo,
                                     schedule=schedule, checkpoint=checkpoint, loss_fn=gpt_loss)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    rows, dp_rank = BATCH // dp, topo.dp_rank if topo else 0
    losses = []
    for step in range(steps):
        x, y = example_batch("gpt", BATCH, seed=step, **SMALL)
        x, y = x[dp_rank * rows:(dp_rank + 1) * rows], y[dp_rank * rows:(dp_rank + 1) * rows]
        opt.zero_grad()
        if layout:
            loss = model.train_step(x, y)
        else:
            loss = gpt_loss(model(x), y)
            loss.backward()
        opt.step()
        losses.append(loss.item())
    state = model.consolidated_state_dict() if layout else model.state_dict()
    return {"losses": losses, "state": state}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", default="results/parity_matrix.json")
    args = parser.parse_args()
    ref = run(None, "", "", args.steps)
    rows = []
    print(f"{'pp tp dp':>9} {'schedule':>8} {'checkpoint':>11} {'loss diff':>10} "
          f"{'weight diff':>11} {'seconds':>8}")
    for layout, schedule, checkpoint in itertools.product(
            LAYOUTS, tuple(SCHEDULES), ("always", "except_last", "never")):
        start = time.perf_counter()
        results = hybridpar.spawn(run, layout[0] * layout[1] * layout[2],
                                  args=(layout, schedule, checkpoint, args.steps), timeout=300)
        loss_diff = max(abs(a - b) for r in results for a, b in zip(r["losses"], ref["losses"]))
        weight_diff = max((r["state"][k] - v).abs().max().item()
                          for r in results for k, v in ref["state"].items())
        row = {"layout": layout, "schedule": schedule, "checkpoint": checkpoint,
               "loss_diff": loss_diff, "weight_diff": weight_diff,
               "seconds": time.perf_counter() - start}
        rows.append(row)
        print(f"{' '.join(map(str, layout)):>9} {schedule:>8} {checkpoint:>11} "
              f"{loss_diff:10.2e} {weight_diff:11.2e} {row['seconds']:8.1f}", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"steps": args.steps, "rows": rows}, indent=1))
    worst = max(max(r["loss_diff"], r["weight_diff"]) for r in rows)
    print(f"worst difference {worst:.2e} over {len(rows)} runs; wrote {out}")


if __name__ == "__main__":
    main()
