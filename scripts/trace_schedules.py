"""Trace one training step of each runnable schedule on sleep-simulated stages: Gantt charts.

    python scripts/trace_schedules.py [--pp 4] [--chunks 8] [--times 20,10,10] [--out docs/images]

Each stage is benchmark 8's (`scripts/bench/zero_bubble.py`): it sleeps T_F ms in forward,
T_B in the input-gradient backward and T_W in the weight-gradient backward. After two warm-up
steps, one step of each schedule is traced (`HybridPipe(trace=True)`) and drawn: OUT/NAME.png
(one row per rank: forward, backward (I), weight (W), waits) and OUT/NAME.txt, the bubble
table. The W fill of ZB-H1 shows as the weight bars in the drain, where 1F1B idles.
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


def _worker(pp: int, chunks: int, times: tuple[float, float, float], out: str) -> None:
    topo = hybridpar.init(pp=pp, timeout=120)
    x = torch.randn(chunks * ROWS, SEQ, HIDDEN)
    y = torch.randn(chunks * ROWS, SEQ, HIDDEN)
    for schedule in hybridpar.pipeline.schedule.SCHEDULES:
        model = nn.Sequential(*[SleepStage(*times, peer=False) for _ in range(pp)])
        pipe = hybridpar.HybridPipe(model, [1] * pp, chunks=chunks, topology=topo,
                                    schedule=schedule, checkpoint="never", loss_fn=_loss)
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
    args = parser.parse_args(argv)
    t_f, t_b, t_w = (float(v) / 1e3 for v in args.times.split(","))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    hybridpar.spawn(_worker, args.pp, args=(args.pp, args.chunks, (t_f, t_b, t_w), args.out),
                    timeout=600)
    return 0


if __name__ == "__main__":
    sys.exit(main())
