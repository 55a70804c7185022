"""Trace one training step of each schedule on sleep-simulated stages: Gantt charts.

    python scripts/trace_schedules.py [--pp 4] [--chunks 8] [--times 20,10,10] [--out docs/images]
                                      [--schedule gpipe 1f1b zb-h1 interleaved zbv] [--virtual 2]

Each stage is benchmark 8's (`scripts/bench/zero_bubble.py`): it sleeps T_F ms in forward,
T_B in the input-gradient backward and T_W in the weight-gradient backward. After two warm-up
steps, one step of each schedule is traced (`HybridPipe(trace=True)`) and drawn: OUT/NAME.png
(one row per rank: forward, backward (I), weight (W), waits) and OUT/NAME.txt, the bubble
table. The W fill of ZB-H1 shows as the weight bars in the drain, where 1F1B idles.

``--schedule`` picks the schedules (default: every one, `planned.PLANS`).
``interleaved`` (``--virtual`` chunks per rank, looped) and ``zbv`` (two per rank, V) run
benchmark 9's model (`scripts/bench/virtual.py`): pp x v chunks, each sleeping 1 / v of the
times, so a rank's work per micro-batch is the same as with one stage per rank.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench.zero_bubble import HIDDEN, ROWS, SEQ, SleepStage, _loss

import hybridpar
from hybridpar.pipeline.schedules.planned import PLANS

VIRTUAL = {"interleaved": None, "zbv": 2}   # chunks per rank (None: --virtual)


def _pipe(topo: hybridpar.Topology, schedule: str, pp: int, chunks: int,
          times: tuple[float, float, float], virtual: int) -> hybridpar.HybridPipe:
    v = (VIRTUAL[schedule] or virtual) if schedule in VIRTUAL else 1
    model = nn.Sequential(*[SleepStage(*(t / v for t in times), peer=False)
                            for _ in range(pp * v)])
    extra = {"virtual_stages": v} if schedule == "interleaved" else {}   # zbv: always 2
    return hybridpar.HybridPipe(model, [1] * (pp * v), chunks=chunks, topology=topo,
                                schedule=schedule, checkpoint="never", loss_fn=_loss, **extra)


def _worker(pp: int, chunks: int, times: tuple[float, float, float], out: str,
            schedules: list[str], virtual: int) -> None:
    topo = hybridpar.init(pp=pp, timeout=120)
    x = torch.randn(chunks * ROWS, SEQ, HIDDEN)
    y = torch.randn(chunks * ROWS, SEQ, HIDDEN)
    for schedule in schedules:
        pipe = _pipe(topo, schedule, pp, chunks, times, virtual)
        for _ in range(2):
            pipe.train_step(x, y)
        pipe.trace = True
        pipe.train_step(x, y)
        with tempfile.TemporaryDirectory() as folder:
            report = pipe.write_trace(folder, show=False)
            if topo.rank == 0:
                assert report is not None
                shutil.copy(Path(folder) / "gantt.png", Path(out) / f"{schedule}.png")
                (Path(out) / f"{schedule}.txt").write_text(report.table + "\n")
                print(f"{schedule}: {report.table}\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, default=4)
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--times", default="20,10,10", help="T_F,T_B,T_W in ms")
    parser.add_argument("--out", default="docs/images")
    parser.add_argument("--schedule", nargs="+", choices=list(PLANS), metavar="NAME",
                        default=list(PLANS),
                        help=f"of {', '.join(PLANS)} (default: all)")
    parser.add_argument("--virtual", type=int, default=2,
                        help="interleaved: chunks per rank (zbv always has 2)")
    args = parser.parse_args(argv)
    t_f, t_b, t_w = (float(v) / 1e3 for v in args.times.split(","))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    hybridpar.spawn(_worker, args.pp, args=(args.pp, args.chunks, (t_f, t_b, t_w), args.out,
                                            args.schedule, args.virtual), timeout=600)
    return 0


if __name__ == "__main__":
    sys.exit(main())
