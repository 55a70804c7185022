"""Activations kept per micro-batch per rank, by recompute mode and sequence parallelism.

    python scripts/bench_activations.py [--modes never always layers selective]
        [--set model.n_embd=256 ...] [--out results/bench_activations.json] [--smoke]

The model and run: configs/quickstart.toml (GPT n_embd 64, 4 layers, 4 heads, block 64, pp2
x tp2, 1F1B) with ``model.dropout = 0.1`` (the attention's dropout makes the core worth
recomputing: ``"selective"``) and one micro-batch a step (``parallel.chunks = 1``, batch 4),
so a rank's peak is one micro-batch's; its ranks CPU gloo processes (`hybridpar.spawn`, one
torch thread each). For each mode, without and with ``parallel.sequence_parallel``:

    measured   a real step of every rank (`train.trainer.build_pipe`, ``trace`` on): the
               most bytes the rank held saved for backward at once (`pipeline.activations.kept`; a
               recomputing mode's peak is during its backward, when the recomputed layers'
               tensors are back)
    check      `hybridpar check --device cpu`'s activations column for the same config
               (fake CPU ranks, the same count): must equal the measured bytes

The counts are exact (autograd's saved tensors by storage, not an allocator's view), so one
run each; the table gives the largest rank's MiB and the ratio to "never" without sequence
parallelism. Prints the table, writes the numbers as JSON with the machine. `--smoke`: a tiny
model (checks the script, not the numbers).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import hybridpar

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench.common import load, machine, machine_line, markdown_table, write_json

ROOT = Path(__file__).resolve().parent.parent
QUICKSTART = ROOT / "configs" / "quickstart.toml"
BASE = ["model.dropout=0.1", "parallel.chunks=1", "train.batch_size=4"]
SMOKE_MODEL = ["model.n_embd=16", "model.n_layer=2", "model.n_head=2", "model.block_size=16"]
MODES = ("never", "always", "layers", "selective")


def _rank(overrides: list[str]) -> int:
    """One traced step of this rank: the peak bytes it kept for backward."""
    from hybridpar.train import load_config
    from hybridpar.train.data import make_batches
    from hybridpar.train.trainer import build_pipe

    config = load_config(QUICKSTART, overrides)
    par = config.parallel
    topo = hybridpar.init(pp=par.pp, tp=par.tp, dp=par.dp, timeout=par.timeout)
    batches = make_batches(config, split="train", dp_rank=topo.dp_rank, dp=topo.dp)
    pipe = build_pipe(config, topo)
    pipe.trace = True
    x, y = batches.next_batch()
    pipe.train_step(x, y)
    kept = int(pipe.recorder.meta["kept"])
    pipe.close()
    return kept


def run_row(mode: str, sequence_parallel: bool, model: list[str]) -> dict[str, Any]:
    """The measured and the checked bytes of every rank for one mode."""
    from hybridpar.train.check import dry_run

    overrides = [*BASE, *model, f"parallel.checkpoint={mode}",
                 f"parallel.sequence_parallel={str(sequence_parallel).lower()}"]
    measured = hybridpar.spawn(_rank, 4, args=(overrides,), timeout=600)
    check = dry_run(QUICKSTART, device="cpu", overrides=overrides)
    return {"mode": mode, "sequence_parallel": sequence_parallel, "measured": measured,
            "check": [r.activations for r in check.ranks]}


def table(rows: list[dict[str, Any]]) -> str:
    base = max(rows[0]["measured"])

    def mib(n: int) -> str:
        return f"{n / 2**20:.2f}"

    return markdown_table(
        ["checkpoint", "sequence parallel", "kept, each rank (MiB)", "largest (MiB)",
         "/ never", "check = measured"],
        [[r["mode"], "yes" if r["sequence_parallel"] else "no",
          " ".join(mib(n) for n in r["measured"]), mib(max(r["measured"])),
          f"{max(r['measured']) / base:.3f}", "yes" if r["check"] == r["measured"] else "NO"]
         for r in rows])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--set", dest="overrides", action="append", default=[],
                   metavar="SECTION.KEY=VALUE", help="a config override (repeatable)")
    p.add_argument("--out", default="results/bench_activations.json")
    p.add_argument("--smoke", action="store_true", help="a tiny model: checks the script")
    args = p.parse_args(argv)
    model = [*SMOKE_MODEL, *args.overrides] if args.smoke else list(args.overrides)
    started, load_before = time.perf_counter(), load()
    rows = [run_row(mode, sp, model) for sp in (False, True) for mode in args.modes]
    result = {"rows": rows, "base_overrides": BASE, "model_overrides": model,
              "smoke": args.smoke, "config": str(QUICKSTART.relative_to(ROOT)),
              "machine": machine(), "load_before": load_before, "load_after": load(),
              "seconds": round(time.perf_counter() - started, 1)}
    print("bytes kept for backward per rank, one micro-batch (pp2 x tp2, dropout 0.1), "
          "measured on a real step and counted by hybridpar check --device cpu:\n")
    print(table(rows))
    print(f"\n{machine_line(result)}")
    write_json(args.out, result)
    if any(r["check"] != r["measured"] for r in rows):
        raise SystemExit("hybridpar check's activations differ from the measured bytes")
    return result


if __name__ == "__main__":
    main()
