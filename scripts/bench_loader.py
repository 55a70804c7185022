"""Benchmark the token loader: time per training step spent getting a batch, against a plain
memmap read of the same kind of windows and against the quick-start GPT's training step.

    python scripts/bench_loader.py [--mbytes 300] [--sizes 16x64 8x1024 32x2048] [--dp 1 2]
        [--steps 40] [--warmup 5] [--repeats 5] [--train-runs 3] [--train-steps 24]
        [--threads 1] [--out results/bench_loader.json] [--smoke]

The corpus: `mbytes` MB of uint16 token ids (random byte ids 1-255, documents of 64-4095
tokens each ending with EOS 0), written as a token folder of `data.source = "tokens"` by the
repository's own `ShardWriter` in shards of `hybridpar tokenize`'s default 100 M tokens
(300 MB: 150 M tokens, two train shards and a val shard), far larger than any CPU cache.
Each row is one rank's side of a step, per (batch_size x seq_len, dp, what the rank reads):

    side          what is timed, per step                                 from
    loader        `make_batches(config, dp_rank=0, dp=dp, inputs=first,   hybridpar.train.data
                  targets=last).next_batch()`: the window order, each of   (TokenWindows)
                  this replica's B / dp windows read through the shard
                  memmaps, x and y as contiguous int64
    memmap floor  the peer, the minimum possible: this replica's window    numpy + torch
                  ids of a shuffled order, np.searchsorted to their
                  shards, a slice of an np.memmap per window copied into
                  one int64 array, torch.from_numpy, x / y as views

A first-stage rank reads x, a last-stage rank y (both read the windows: the same cost); a
middle stage reads nothing. Loader and floor alternate step by step (the order swapped every
other step) and read random windows of the same folder (the floor in its own shuffled order,
so neither reads what the other just cached; their first batches of the same ids are checked
equal); each repeat takes the median of `steps` steps, the rows rotating between repeats.
The page cache holds the corpus (it was just written, and a run's second epoch reads it so).
Torch runs one thread (`--threads`), as each rank of `hybridpar run` does on a CPU.

Context: the quick-start GPT (configs/quickstart.toml, pp2 x tp2, 4 ranks) trained by
`hybridpar run` on this folder at the first size (16 x 64: the quick start's own), `train-runs`
runs interleaved with the repeats; a run's step time is the median of its metrics.jsonl
records (each the mean over `log_every` steps; the first window dropped as warm-up). The
share column is the loader's time over that step at the same size. Reported: medians over
the repeats and half their range. Prints the table, writes the numbers as JSON with the
machine and its load.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

ROOT = Path(__file__).resolve().parent.parent
QUICKSTART = ROOT / "configs" / "quickstart.toml"
ROLES = {"first": (True, False), "last": (False, True)}   # role -> (inputs, targets)
_CHUNK = 1 << 24                                           # tokens generated at a time


def make_corpus(folder: Path, *, mbytes: float, shard_tokens: int, seed: int = 0) -> Path:
    """A token folder of about `mbytes` MB of uint16 ids under `folder`; its path."""
    from hybridpar.data.shards import FORMAT, VERSION, ShardWriter, write_meta
    from hybridpar.data.tokenizer import load_tokenizer
    from hybridpar.io.staged import staged_folder

    spec = load_tokenizer("bytes")                  # vocab 256, EOS 0, uint16 shards
    rng = np.random.default_rng(seed)
    total = int(mbytes * 1e6) // 2
    sizes = {"train": total - total // 20, "val": total // 20}
    out = folder / "tokens"
    with staged_folder(out) as tmp:
        records = {}
        for split, tokens in sizes.items():
            writer = ShardWriter(tmp, split, dtype=spec.dtype, shard_tokens=shard_tokens)
            while tokens > 0:
                n = min(tokens, _CHUNK)
                lengths = rng.integers(64, 4096, size=n // 64 + 1)
                lengths = lengths[:int(np.searchsorted(np.cumsum(lengths), n)) + 1]
                lengths[-1] -= int(lengths.sum()) - n                      # (docs,), sum n
                lengths = lengths[lengths > 0]
                ids = rng.integers(1, 256, size=n, dtype=np.uint16)        # (n,)
                ids[np.cumsum(lengths) - 1] = spec.eos_id                  # each doc ends EOS
                writer.write(ids, lengths)
                tokens -= n
            records[split] = writer.close()
        shards = {s: [x["sha256"] for x in r["shards"]] for s, r in records.items()}
        digest = hashlib.sha256(json.dumps(shards, sort_keys=True).encode()).hexdigest()
        write_meta(tmp, {
            "format": FORMAT, "version": VERSION, "tokenizer": spec.record(),
            "dtype": spec.dtype, "documents": sum(r["documents"] for r in records.values()),
            "tokens": sum(r["tokens"] for r in records.values()), "splits": records,
            "fingerprint": digest, "request": f"bench_loader mbytes={mbytes} seed={seed}",
            "sources": {"synthetic": "scripts/bench_loader.py"}})
    return out


class MemmapFloor:
    """The peer: one replica's windows read by np.memmap slices and torch.from_numpy."""

    def __init__(self, folder: Path, *, ends: np.ndarray, seq_len: int, batch_size: int,
                 dp_rank: int, dp: int, seed: int) -> None:
        meta = json.loads((folder / "meta.json").read_text())
        self.maps = [np.memmap(folder / s["file"], dtype=meta["dtype"], mode="r")
                     for s in meta["splits"]["train"]["shards"]]
        self.ends, self.seq_len = ends, seq_len
        self.global_batch, self.b, self.r = batch_size, batch_size // dp, dp_rank
        self.order = np.random.default_rng(seed).permutation(int(ends[-1]))   # (windows,)
        self.index = 0

    def read(self, ids: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """The windows `ids` as (x, y), ``(len(ids), seq_len)`` int64 views of one array."""
        s = np.searchsorted(self.ends, ids, side="right")                       # (b,) shard
        starts = (ids - np.where(s > 0, self.ends[s - 1], 0)) * self.seq_len    # (b,)
        rows = np.empty((len(ids), self.seq_len + 1), dtype=np.int64)          # (b, T + 1)
        for k, (shard, start) in enumerate(zip(s.tolist(), starts.tolist())):
            rows[k] = self.maps[shard][start:start + self.seq_len + 1]
        chunk = torch.from_numpy(rows)
        return chunk[:, :-1], chunk[:, 1:]                                     # (b, T) twice

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.index + self.global_batch > len(self.order):
            self.index = 0
        ids = self.order[self.index:self.index + self.global_batch]
        self.index += self.global_batch
        return self.read(ids[self.r * self.b:(self.r + 1) * self.b])


def _overrides(folder: Path, batch: int, seq_len: int) -> list[str]:
    return ['data.source="tokens"', f"data.path={json.dumps(str(folder))}",
            f"data.seq_len={seq_len}", f"model.block_size={seq_len}",
            f"train.batch_size={batch}"]


def make_row(folder: Path, config: Any, *, dp: int, role: str, seed: int) -> dict[str, Any]:
    """One row's loader (the training side's `make_batches` of `config`) and its floor."""
    from hybridpar.data.windows import TokenWindows
    from hybridpar.train.data import make_batches

    batch, seq_len = config.train.batch_size, config.data.seq_len
    inputs, targets = ROLES[role]
    loader = make_batches(config, split="train", dp_rank=0, dp=dp, inputs=inputs,
                          targets=targets)
    assert isinstance(loader, TokenWindows)
    floor = MemmapFloor(folder, ends=loader.ends, seq_len=seq_len, batch_size=batch,
                        dp_rank=0, dp=dp, seed=seed + 1)
    ids = loader.order(0)[:batch // dp].numpy()           # the loader's first batch, replica 0
    x, y = loader.next_batch()
    fx, fy = floor.read(ids)
    if not (isinstance(x, torch.Tensor) and torch.equal(x, fx) and torch.equal(y, fy)):
        raise SystemExit(f"{batch}x{seq_len} dp={dp}: the floor read other tokens than the "
                         "loader for the same windows")
    return {"batch": batch, "seq_len": seq_len, "dp": dp, "role": role,
            "tokens": batch // dp * seq_len, "steps": {"loader": loader.next_batch,
                                                        "floor": floor.next_batch},
            "times": {"loader": [], "floor": []}}


def time_rows(rows: list[dict[str, Any]], *, steps: int, warmup: int, shift: int) -> None:
    """One repeat: per row, the median of `steps` timed steps of each side, appended."""
    order = rows[shift % len(rows):] + rows[:shift % len(rows)]
    for row in order:
        sides: list[tuple[str, Callable[[], Any]]] = list(row["steps"].items())
        for _ in range(warmup):
            for _, step in sides:
                step()
        times: dict[str, list[float]] = {name: [] for name, _ in sides}
        for i in range(steps):
            for name, step in sides if i % 2 == 0 else sides[::-1]:
                t0 = time.perf_counter()
                step()
                times[name].append(time.perf_counter() - t0)
        for name, ts in times.items():
            row["times"][name].append(statistics.median(ts))


def train_step_time(folder: Path, run_dir: Path, *, batch: int, seq_len: int, steps: int,
                    log_every: int, extra: list[str]) -> float:
    """The quick-start GPT's step time on `folder` by `hybridpar run`: the median record."""
    sets = [*_overrides(folder, batch, seq_len), f"train.steps={steps}",
            f"train.log_every={log_every}", "train.eval_every=0", "checkpoint.every=0",
            "train.sample_tokens=0", *extra]
    cmd = [sys.executable, "-m", "hybridpar.cli", "run", str(QUICKSTART), "--run-dir",
           str(run_dir)]
    for s in sets:
        cmd += ["--set", s]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    if done.returncode:
        raise SystemExit(f"hybridpar run failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    from hybridpar.train.metrics import read_metrics

    times = [r["step_time"] for r in read_metrics(run_dir / "metrics.jsonl")]
    return statistics.median(times[1:] if len(times) > 1 else times)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mbytes", type=float, default=300.0, help="MB of uint16 tokens (300)")
    p.add_argument("--shard-tokens", type=int, default=100_000_000)
    p.add_argument("--sizes", nargs="+", default=["16x64", "8x1024", "32x2048"],
                   help="batch_size x seq_len (global batch); the first is the training run's")
    p.add_argument("--dp", type=int, nargs="+", default=[1, 2])
    p.add_argument("--steps", type=int, default=40, help="timed steps per side per repeat")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps per repeat")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--train-runs", type=int, default=3,
                   help="hybridpar run of the quick start (0: none)")
    p.add_argument("--train-steps", type=int, default=24)
    p.add_argument("--train-log-every", type=int, default=4)
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (default 1: what a rank of hybridpar run has on a CPU)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="results/bench_loader.json")
    p.add_argument("--smoke", action="store_true",
                   help="the smallest run (2 MB, 1 repeat, no training run): checks the "
                        "script, not speed")
    args = p.parse_args(argv)
    from bench.common import fmt, load, markdown_table, spread, write_json

    from hybridpar.train.configs.config import load_config

    train_extra: list[str] = []
    if args.smoke:
        args.mbytes, args.shard_tokens, args.sizes, args.dp = 2.0, 400_000, ["4x16"], [1, 2]
        args.steps, args.warmup, args.repeats, args.train_runs = 5, 1, 1, 0
        args.train_steps, args.train_log_every = 4, 2
        train_extra = ["parallel.pp=1", "parallel.tp=1", "model.n_layer=1"]
    sizes = [tuple(int(v) for v in s.lower().split("x")) for s in args.sizes]
    torch.set_num_threads(args.threads)   # more: a (32, 2049) copy forks onto busy cores
    load_before, started = load(), time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench_loader_") as tmp:
        t0 = time.perf_counter()
        folder = make_corpus(Path(tmp), mbytes=args.mbytes, shard_tokens=args.shard_tokens,
                             seed=args.seed)
        meta = json.loads((folder / "meta.json").read_text())
        corpus = {"tokens": meta["tokens"], "bytes": meta["tokens"] * 2,
                  "train_shards": len(meta["splits"]["train"]["shards"]),
                  "seconds_to_write": time.perf_counter() - t0}
        configs = [load_config(QUICKSTART, _overrides(folder, b, t)) for b, t in sizes]
        rows = [make_row(folder, config, dp=dp, role=role, seed=args.seed)
                for config in configs for dp in args.dp for role in ROLES]
        train: list[float] = []
        for r in range(max(args.repeats, args.train_runs)):
            if r < args.repeats:
                time_rows(rows, steps=args.steps, warmup=args.warmup, shift=r)
            if r < args.train_runs:
                b, t = sizes[0]
                train.append(train_step_time(
                    folder, Path(tmp) / f"run-{r}", batch=b, seq_len=t, steps=args.train_steps,
                    log_every=args.train_log_every, extra=train_extra))
    step = spread(train) if train else None
    results = []
    for row in rows:
        loader, floor = spread(row["times"]["loader"]), spread(row["times"]["floor"])
        ratios = [a / b for a, b in zip(row["times"]["loader"], row["times"]["floor"])]
        same = step is not None and (row["batch"], row["seq_len"]) == sizes[0]
        results.append({
            "batch": row["batch"], "seq_len": row["seq_len"], "dp": row["dp"],
            "role": row["role"], "tokens": row["tokens"], "loader_s": loader, "floor_s": floor,
            "loader_over_floor": statistics.median(ratios),
            "ns_per_token": loader["median"] / row["tokens"] * 1e9,
            "share_of_step": loader["median"] / step["median"] if same and step else None})
    reads = {"first": "first stage: x", "last": "last stage: y"}
    table = markdown_table(
        ["batch x seq_len", "dp", "rank reads", "tokens / rank", "loader (µs / step)",
         "memmap floor (µs / step)", "loader / floor", "loader ns / token",
         "share of the quick-start step"],
        [[f"{r['batch']} x {r['seq_len']}", r["dp"], reads[r["role"]], f"{r['tokens']:,}",
          fmt(r["loader_s"], 1e6, 1), fmt(r["floor_s"], 1e6, 1),
          f"{r['loader_over_floor']:.2f}", f"{r['ns_per_token']:.1f}",
          f"{100 * r['share_of_step']:.3f}%" if r["share_of_step"] is not None else "—"]
         for r in results])
    b, t = sizes[0]
    layout = "1 rank (smoke)" if args.smoke else "pp2 x tp2"
    note = (f"quick-start GPT step (hybridpar run, {layout}, {b} x {t}, data.source = 'tokens'): "
            + (f"{fmt(step, 1e3, 1)} ms, median of {len(train)} run(s)" if step else "not run"))
    print(table + "\n\n" + note)
    result: dict[str, Any] = {
        "name": "loader", "rows": results, "table": table, "train_step_s": step,
        "note": note, "corpus": corpus,
        "config": {"mbytes": args.mbytes, "shard_tokens": args.shard_tokens,
                   "sizes": args.sizes, "dp": args.dp, "steps": args.steps,
                   "warmup": args.warmup, "repeats": args.repeats,
                   "train_runs": args.train_runs, "train_steps": args.train_steps,
                   "train_log_every": args.train_log_every, "threads": args.threads,
                   "smoke": args.smoke},
        "load_before": load_before, "load_after": load(),
        "seconds": time.perf_counter() - started}
    out = write_json(args.out, result)
    m = result["machine"]
    print(f"\ncorpus {corpus['tokens']:,} tokens ({corpus['bytes'] / 1e6:.0f} MB, "
          f"{corpus['train_shards']} train shard(s)); {m['processor']}, {m['cpus']} CPUs; load "
          f"{load_before} before, {result['load_after']} after; wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
