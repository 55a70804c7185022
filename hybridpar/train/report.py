"""What a run shows and records: the progress bar, metrics.jsonl and its copies (TensorBoard,
W&B), throughput over the log window, MFU and every rank's peak memory."""

from __future__ import annotations

import logging
import sys
from typing import Any

from tqdm import tqdm

from hybridpar.models.registry import takes_tokens
from hybridpar.train.build import loss_rank
from hybridpar.train.configs.config import Config
from hybridpar.train.metrics import (
    MetricsLog,
    ScalarSinks,
    gather_peak_memory,
    job_peak_flops,
    model_flops,
)
from hybridpar.train.state import RunState

__all__ = ["Reporter", "tokens_per_sample"]

log = logging.getLogger(__name__)


def tokens_per_sample(config: Config) -> int:
    return int(config.data.seq_len or 1) if takes_tokens(config.model.name) else 1



class Reporter:
    """Progress bar, metrics.jsonl and throughput over the log window (rank `loss_rank` only);
    MFU and every rank's peak memory (`train.metrics`: the gather runs on every rank, at log
    steps only); TensorBoard / W&B copies as [logging] asks."""

    def __init__(self, run: RunState, *, start: int, progress: bool) -> None:
        cfg = run.config
        self.active = run.reporter
        self.metrics = MetricsLog(run.run_dir / "metrics.jsonl", after=start) \
            if self.active else None
        self.bar = tqdm(total=cfg.train.steps, initial=start, desc=cfg.name, unit="step",
                        disable=not (self.active and progress), file=sys.stderr,
                        dynamic_ncols=True, mininterval=0.5)
        self.items = cfg.train.batch_size * tokens_per_sample(cfg)    # per step, global
        self.unit = "tokens_per_s" if takes_tokens(cfg.model.name) else "samples_per_s"
        self.window_time, self.window_steps = 0.0, 0
        self.device, self.dst = run.pipe.device, loss_rank(run.topo)
        self.peak, source = job_peak_flops(self.device, run.topo.world_size)   # every rank
        self.flops, how = model_flops(cfg) if self.active else (None, "")
        if self.active:
            log.info("MFU: %s model FLOPs per %s over a peak of %s FLOP/s (%s)",
                     "unknown" if self.flops is None else f"{self.flops:.4g} ({how})",
                     self.unit.split("_")[0][:-1], "unknown" if self.peak is None
                     else f"{self.peak:.4g}", source)
        self.sinks = ScalarSinks(cfg, run.run_dir) if self.active else None

    def step(self, record: dict[str, Any], elapsed: float, *, log: bool) -> None:
        """Count a step; when `log`, write its record with the window's throughput."""
        self.window_time, self.window_steps = self.window_time + elapsed, self.window_steps + 1
        if log:
            step_time = self.window_time / self.window_steps
            rate = self.items / step_time
            mfu = None if self.flops is None or not self.peak else self.flops * rate / self.peak
            memory = gather_peak_memory(self.device, self.dst)   # a collective: every rank
            record = {**record, self.unit: rate, "step_time": step_time, "mfu": mfu,
                      **(memory or {})}
            if self.metrics is not None:
                self.metrics.write(record)
            if self.sinks is not None:
                self.sinks.write(record)
            self.bar.set_postfix({"loss": f"{record['loss']:.4f}",
                                  self.unit.split("_")[0] + "/s": f"{rate:,.0f}"})
            self.window_time, self.window_steps = 0.0, 0
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()
        if self.metrics is not None:
            self.metrics.close()
        if self.sinks is not None:
            self.sinks.close()
