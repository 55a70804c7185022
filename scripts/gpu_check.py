"""One command for a machine with GPUs: does hybridpar compute right there, and how fast.

    python scripts/gpu_check.py [--out DIR] [--device cuda|cpu] [--quick] [--ranks N]
                                [--config TOML] [--batch B] [--peak-tflops T]

On one device, a world of one rank (nccl on cuda, gloo on cpu, via `hybridpar.spawn`), the
quick-start GPT (the model of configs/quickstart.toml) under bf16 autocast:

    1 loss      the loss falls over 30 AdamW steps (fresh batches of the embedded corpus)
    2 grads     every parameter gets a finite gradient, checkpoint 'always' / 'except_last' /
                'never', without and with dropout (the RNG replay of recomputation)
    3 modes     the three modes agree: loss and gradients within the bf16 tolerance below
    4 balance   `balance_by_time` on the device: the split it chose and every layer's time
    5 trace     a traced step (`trace=True`, `write_trace`): its forward / backward spans
                against CUDA events (perf_counter on cpu) taken inside the same spans
    6 mfu       per-stage forward / backward ms, TFLOP/s and MFU of the GPT blocks; tokens/s
                of a training step (model FLOPs 6 N + 12 L h s per token: scripts/bench/gpu.py),
                eager and with compiled blocks (inductor; --quick: aot_eager), and the host
                time per micro-batch of each

With N >= 2 devices (cuda; or --ranks N on cpu, gloo): every pp x tp layout of powers of two
with 2 <= pp * tp <= N that the model allows, launched with `hybridpar.spawn`: fp32 parity with
the plain model on one device (losses of 3 AdamW steps, gradients of the first; TF32 off), then
bf16 tokens/s and MFU; then every schedule (GPipe, 1F1B, interleaved, ZB-H1, ZBV) on pp =
min(N, 4) ranks (a power of two) with skips over stages, new shapes twice, against one device
(scripts/bench/gpu_schedules.py): NCCL running the P2P orders the tests replay on CPU. Each
check prints PASS or FAIL with its numbers; every table names the
device, torch and CUDA. Writes DIR/gpu_check.json, DIR/gpu_check.md (the docs/gpu.md section) and
DIR/trace/ (default DIR: runs/gpu_check). Exit code 1 when a check fails, 2 on bad arguments.
--quick: a batch of 8, fewer warm-ups, repeats and parity steps, shorter profiling
(tests/test_gpu_check_smoke.py: 43 s alone on a 2-core AMD EPYC, at 32 tokens a sequence and a batch
of 4; its numbers mean nothing).
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import shlex
import statistics
import sys
import time
import tomllib
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from bench.common import markdown_table, write_json
from bench.gpu import GRAD_FLOOR, MODES, REFERENCE_MODE, layout_rank, peak_bf16, single_rank
from bench.gpu_schedules import SCHEDULES, schedule_rank

import hybridpar
from hybridpar.models.gpt import check_gpt_config

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG = ROOT / "configs" / "quickstart.toml"

# What every check is judged by.
LOSS_FALL = 0.8              # mean of the last 3 losses < LOSS_FALL x the first loss
BF16_LOSS_REL = 1e-2         # checkpoint modes vs 'never': |Δloss| / loss
BF16_GRAD_REL = 2e-2         # ... and ‖Δg‖ / ‖g‖ of every parameter
FP32_LOSS_REL = 1e-4         # a layout vs one device, fp32: |Δloss| / loss at every step
FP32_GRAD_REL = 1e-4         # ... and ‖Δg‖ / ‖g‖ of every local gradient (its slice)
F64_LOSS_REL = 1e-6          # a schedule vs one device, float64 (the loss is reported in fp32)
F64_GRAD_REL = 1e-10         # ... and its gradients (float64 sums: ~1e-15)
TRACE_RATIO = (0.9, 1.1)     # traced span ms / clocked ms of the same spans
TOLERANCES = {"loss_fall": LOSS_FALL, "bf16_loss_rel": BF16_LOSS_REL,
              "bf16_grad_rel": BF16_GRAD_REL, "fp32_loss_rel": FP32_LOSS_REL,
              "fp32_grad_rel": FP32_GRAD_REL, "f64_loss_rel": F64_LOSS_REL,
              "f64_grad_rel": F64_GRAD_REL, "trace_ratio": list(TRACE_RATIO)}
BF16_WHY = "bf16 keeps 8 significant bits: one rounding is up to 2^-8 = 3.9e-3"
GRAD_ERROR = (f"gradient error ‖Δg‖ / max(‖g‖, {GRAD_FLOOR:g} · ‖whole model's gradient‖) per "
              "parameter: the floor keeps gradients that are zero in exact arithmetic (the "
              "key biases': softmax ignores a constant added to a row of scores) from "
              "dividing noise by noise")


@dataclass
class Check:
    """One PASS / FAIL verdict with the numbers behind it."""

    name: str
    passed: bool
    summary: str
    numbers: dict[str, Any] = field(default_factory=dict)

    @property
    def status(self) -> str:
        return "PASS" if self.passed else "FAIL"


@dataclass
class Section:
    """A titled part of the report: its tables, notes, verdicts and the raw measurements."""

    title: str
    tables: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    checks: list[Check] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)


# settings ------------------------------------------------------------------------------------

def settings(config: dict[str, Any], *, quick: bool, out: Path,
             batch: int | None = None) -> dict[str, Any]:
    """The workers' settings: the config's model and optimizer, sizes by mode."""
    train, parallel = config.get("train", {}), config.get("parallel", {})
    return {
        "model": {k: v for k, v in config["model"].items() if k != "name"},
        "batch": batch or (8 if quick else int(train.get("batch_size", 16))),
        "chunks": int(parallel.get("chunks", 4)),
        "lr": float(train.get("lr", 3e-3)),
        "weight_decay": float(train.get("weight_decay", 0.1)),
        "grad_clip": float(train.get("grad_clip", 1.0)),
        "loss_steps": 30,
        "mode_dropouts": [0.0, 0.1],
        "balance_timeout": 0.2 if quick else 1.0,
        "warmup": 1 if quick else 5,
        "iters": 3 if quick else 20,
        "parity_steps": 2 if quick else 3,
        "timeout": 180 if quick else 900,
        "hang_timeout": 60 if quick else 120,   # check 8: the watchdog names a stuck P2P op
        "trace_dir": str((out / "trace").resolve()),
        # check 6's compiled row (`HybridPipe(compile=...)`): --quick checks the script, and
        # aot_eager needs no C++ compiler and compiles in seconds
        "compile_backend": "aot_eager" if quick else "inductor",
    }


def layouts(n: int, model: dict[str, Any]) -> list[tuple[int, int]]:
    """(pp, tp) of powers of two with 2 <= pp * tp <= n that split and shard `model`."""
    powers = [2**k for k in range(n.bit_length()) if 2**k <= n]
    found = []
    for pp in powers:
        for tp in powers:
            if not 2 <= pp * tp <= n or pp > model["n_layer"] + 3:
                continue
            try:
                check_gpt_config(**{**model, "tp": tp})
            except ValueError:
                continue
            found.append((pp, tp))
    return sorted(found, key=lambda layout: (layout[0] * layout[1], layout[0]))


# formatting ----------------------------------------------------------------------------------

def env_line(env: dict[str, Any]) -> str:
    """The device, torch and CUDA versions, as every table is captioned."""
    if env.get("gpu"):
        return (f"{env['gpu']} (compute {env.get('capability')}, {env.get('memory_gib')} GiB) · "
                f"torch {env['torch']} · CUDA {env['cuda']} · NCCL {env.get('nccl')}")
    return (f"CPU: {env.get('cpu')} ({env.get('cpus')} cores, 1 thread a rank) · "
            f"torch {env['torch']} · CUDA {env.get('cuda') or 'none'}")


def ms(x: float) -> str:
    return f"{x:.3f}"


def sci(x: float) -> str:
    return f"{x:.1e}"


def tflops(flops: float, milliseconds: float) -> str:
    return f"{flops / (milliseconds / 1e3) / 1e12:.3g}" if milliseconds > 0 else "n/a"


def mfu(flops: float, milliseconds: float, peak: float | None, devices: int = 1) -> float | None:
    """Achieved model FLOP/s over the peak of `devices` devices (None when unknown)."""
    if peak is None or milliseconds <= 0:
        return None
    return flops / (milliseconds / 1e3) / (peak * devices)


def pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.2f}%"


def finite(*values: float) -> bool:
    return all(isinstance(v, (int, float)) and math.isfinite(v) for v in values)


def short(error: str) -> str:
    """The last line of an error (a traceback's exception line), at most 300 characters."""
    lines = [line.strip() for line in error.splitlines() if line.strip()]
    return (lines[-1] if lines else error)[:300]


def failed(title: str, name: str, error: str) -> Section:
    """A section whose measurement raised: one FAIL with the error (all of it in the data)."""
    return Section(title, checks=[Check(name, False, f"error: {short(error)}")],
                   data={"error": error})


# checks 1-6 ----------------------------------------------------------------------------------

def loss_section(r: dict[str, Any]) -> Section:
    title = "1. The loss falls (bf16 autocast, AdamW)"
    if "error" in r:
        return failed(title, "loss_falls", r["error"])
    losses = r["losses"]
    n, first = len(losses), losses[0]
    last = statistics.fmean(losses[-3:])
    every = max(1, n // 8)
    shown = sorted({0, *range(every - 1, n, every), n - 1})
    table = markdown_table(["step", *(i + 1 for i in shown)],
                           [["loss", *(f"{losses[i]:.3f}" for i in shown)]])
    ok = finite(*losses) and last < LOSS_FALL * first
    summary = (f"loss {first:.3f} at step 1 → {last:.3f} (mean of the last 3 of {n} steps) = "
               f"{last / first:.2f} × the first; needs < {LOSS_FALL}")
    notes = [f"A fresh batch each step from {r['data']}, "
             f"lr {r['lr']:g} constant, weight decay {r['weight_decay']:g}, "
             f"`clip_grad_norm_({r['grad_clip']:g})`, checkpoint 'except_last', 1F1B."]
    return Section(title, [table], notes, [Check("loss_falls", ok, summary, {
        "first": first, "last3_mean": last, "ratio": last / first, "steps": n})], r)


def modes_table(rows: list[dict[str, Any]]) -> str:
    body = [[f"{r['dropout']:g}", r["mode"], f"{r['loss']:.5f}",
             f"{r['params'] - len(r['missing'])}/{r['params']}", len(r["nonfinite"]),
             sci(r["loss_rel"]), sci(r["grad_rel"]),
             (r["worst_param"] if r["grad_rel"] > 0 else None) or "-"] for r in rows]
    return markdown_table(["dropout", "checkpoint", "loss", "grads", "non-finite",
                           f"Δloss / loss vs '{REFERENCE_MODE}'",
                           "max ‖Δg‖ / ‖g‖", "worst parameter"], body)


def modes_section(r: dict[str, Any]) -> Section:
    title = "2–3. Gradients under bf16 in every checkpoint mode, and the modes agree"
    if "error" in r:
        section = failed(title, "grads_finite", r["error"])
        section.checks.append(Check("checkpoint_modes_agree", False,
                                    f"error: {short(r['error'])}"))
        return section
    rows = r["rows"]
    bad = [(row["mode"], row["dropout"], name) for row in rows
           for name in row["missing"] + row["nonfinite"]]
    grads_ok = not bad and len(rows) == len(MODES) * len(set(x["dropout"] for x in rows))
    grads = Check("grads_finite", grads_ok, (
        f"every one of {rows[0]['params']} parameters has a finite gradient in each of "
        f"{len(rows)} runs" if grads_ok else
        f"{len(bad)} missing or non-finite gradients, e.g. " +
        ", ".join(f"{n} ({m}, dropout {d:g})" for m, d, n in bad[:5])),
        {"runs": len(rows), "bad": [list(b) for b in bad]})
    loss_rel = max(row["loss_rel"] for row in rows)
    worst = max(rows, key=lambda row: row["grad_rel"])
    agree_ok = finite(loss_rel, worst["grad_rel"]) and loss_rel <= BF16_LOSS_REL \
        and worst["grad_rel"] <= BF16_GRAD_REL
    where = (f" ({worst['worst_param']} in '{worst['mode']}', dropout {worst['dropout']:g})"
             if worst["grad_rel"] > 0 else " (bit for bit)" if loss_rel == 0 else "")
    agree = Check("checkpoint_modes_agree", agree_ok, (
        f"largest relative difference from '{REFERENCE_MODE}': loss {sci(loss_rel)}, gradient "
        f"{sci(worst['grad_rel'])}{where}; tolerance {BF16_LOSS_REL:g} and "
        f"{BF16_GRAD_REL:g}"), {"loss_rel": loss_rel, "grad_rel": worst["grad_rel"],
                                "worst_param": worst["worst_param"]})
    notes = [f"One training step per row from the same weights and batch, "
             f"`hybridpar.model_parallel_manual_seed(1)` before each (the same dropout masks); "
             f"grads: parameters with a gradient / all. Tolerance: loss {BF16_LOSS_REL:g}, "
             f"every gradient {BF16_GRAD_REL:g} relative ({BF16_WHY}; recomputation re-runs "
             "the same kernels, so the modes differ only where kernels are not deterministic); "
             f"{GRAD_ERROR}."]
    return Section(title, [modes_table(rows)], notes, [grads, agree], r)


def balance_section(r: dict[str, Any], n_layers: int) -> Section:
    title = "4. balance_by_time on the device (2 stages, bf16)"
    if "error" in r:
        return failed(title, "balance_by_time", r["error"])
    chosen, layers = r["balance"], r["layers"]
    ok = (len(chosen) == 2 and sum(chosen) == n_layers and min(chosen) >= 1
          and len(layers) == n_layers and all(finite(x["time_ms"]) and x["time_ms"] > 0
                                              for x in layers))
    per_layer = markdown_table(["layer", "kind", "params", "fwd+bwd ms"],
                               [[x["index"], x["kind"], x["params"], ms(x["time_ms"])]
                                for x in layers])
    stages = markdown_table(["stage", "layers", "fwd+bwd ms", "send ms", "share"],
                            [[s["stage"], s["layers"], ms(s["time_ms"]), ms(s["send_ms"]),
                              f"{100 * s['share']:.1f}%"] for s in r["stages"]])
    times = " / ".join(ms(s["time_ms"]) for s in r["stages"])
    summary = (f"balance_by_time chose {chosen} (stages {times} ms forward + backward); a "
               f"second profile splits {r['resplit']}")
    notes = [f"Each layer's forward + backward on the whole batch, lower median of runs "
             f"filling {r['timeout_s']:g} s in all; the per-layer table is that second "
             "profile (`profile_layers`), the split is `balance_by_time`'s own."]
    return Section(title, [per_layer, stages], notes, [Check("balance_by_time", ok, summary, {
        "balance": chosen, "resplit": r["resplit"]})], r)


def trace_section(r: dict[str, Any], cuda: bool) -> Section:
    title = "5. A traced step against the device clock"
    if "error" in r:
        return failed(title, "trace_vs_clock", r["error"])
    lo, hi = TRACE_RATIO
    body, ratios, counts_ok = [], {}, True
    for row in r["rows"]:
        ratio = row["trace_ms"] / row["clock_ms"] if row["clock_ms"] > 0 else float("inf")
        ratios[row["span"]] = ratio
        counts_ok &= row["traced"] == row["clocked"]
        body.append([row["span"], row["traced"], row["clocked"], ms(row["trace_ms"]),
                     ms(row["clock_ms"]), f"{ratio:.3f}"])
    table = markdown_table(["span", "traced", "clocked", "traced ms", "clocked ms",
                            "traced / clocked"], body)
    ok = counts_ok and {"forward", "backward"} <= set(ratios) \
        and all(lo <= x <= hi for x in ratios.values())
    summary = ("traced / clocked: " + ", ".join(f"{k} {v:.3f}" for k, v in ratios.items())
               + f" (tolerance {lo}–{hi}; clock: {r['clock']})"
               + ("" if counts_ok else "; the span counts differ"))
    notes = [f"`HybridPipe(trace=True)`, one train_step after {r['warmup']} warm-up "
             f"step(s), checkpoint '{r['checkpoint']}', {r['chunks']} micro-batches; "
             f"traced step {ms(r['step_ms'])} ms. Marks ({r['clock']}) sit just inside each "
             "span; sums over the step's spans.",
             "Written: " + ", ".join(f"`{Path(f).name}`" for f in r["files"]) +
             f" in `{os.path.relpath(Path(r['files'][0]).parent)}`."]
    notes.append("On a GPU the trace times its spans with CUDA events anchored to the host "
                 "clock (`hybridpar.trace.DeviceClock`); a ratio far from 1 there means the "
                 "trace shows something else than the GPU's work (host launches: DESIGN §9)."
                 if cuda else "On the CPU the trace's spans are `time.time_ns` around the "
                 "same code.")
    return Section(title, [table], notes, [Check("trace_vs_clock", ok, summary, {
        "ratios": ratios})], r)


def stage_rows(rows: list[dict[str, Any]], peak: float | None
               ) -> tuple[str, list[float], list[float]]:
    """The per-part table, every time in it (ms) and every known MFU."""
    body, times, utils = [], [], []
    for x in rows:
        util = mfu(x["fwd_flops"] + x["bwd_flops"], x["fwd_ms"] + x["bwd_ms"], peak)
        times += [x["fwd_ms"], x["bwd_ms"]]
        utils += [] if util is None else [util]
        body.append([x["part"], x["layers"], x["params"], x["blocks"], ms(x["fwd_ms"]),
                     ms(x["bwd_ms"]), tflops(x["fwd_flops"], x["fwd_ms"]),
                     tflops(x["bwd_flops"], x["bwd_ms"]), pct(util)])
    return markdown_table(["part", "layers", "N", "blocks", "fwd ms", "bwd ms", "fwd TFLOP/s",
                           "bwd TFLOP/s", "MFU"], body), times, utils


def mfu_section(stages: dict[str, Any], steps: dict[str, Any], peak: float | None,
                peak_label: str) -> Section:
    title = "6. Per-stage time and model FLOPs utilization (bf16)"
    errors = list(dict.fromkeys(r["error"] for r in (stages, steps) if "error" in r))
    if errors:
        return failed(title, "stage_mfu", "\n".join(errors))
    table, times, utils = stage_rows(stages["rows"], peak)
    body = []
    for x in steps["rows"]:
        util = mfu(x["flops"], x["step_ms"], peak)
        times.append(x["step_ms"])
        utils += [] if util is None else [util]
        body.append([x["checkpoint"], x["compiled"] or "eager", x["chunks"], ms(x["step_ms"]),
                     ms(x["host_ms"] / x["chunks"]), f"{x['tokens'] / (x['step_ms'] / 1e3):,.0f}",
                     tflops(x["flops"], x["step_ms"]), pct(util)])
    step_table = markdown_table(["checkpoint", "blocks", "micro-batches", "step ms",
                                 "host ms / micro-batch", "tokens/s", "TFLOP/s", "MFU"], body)
    # MFU above 1 would mean wrong FLOPs or a clock that misses work
    ok = all(finite(t) and t > 0 for t in times) and all(0 < u <= 1 for u in utils)
    blocks = next(x for x in stages["rows"] if x["part"] == "blocks")
    blocks_mfu = mfu(blocks["fwd_flops"] + blocks["bwd_flops"],
                     blocks["fwd_ms"] + blocks["bwd_ms"], peak)
    best = steps["rows"][0]
    tokens_per_s = best["tokens"] / (best["step_ms"] / 1e3)
    compiled = next(x for x in steps["rows"] if x["compiled"])
    speedup = best["step_ms"] / compiled["step_ms"]
    peak_text = f"{peak / 1e12:.0f} TFLOP/s ({peak_label})" if peak else f"unknown ({peak_label})"
    summary = (f"blocks: forward {ms(blocks['fwd_ms'])} ms, backward {ms(blocks['bwd_ms'])} ms, "
               f"MFU {pct(blocks_mfu)}; training step ({best['checkpoint']!r}) "
               f"{tokens_per_s:,.0f} tokens/s, MFU {pct(mfu(best['flops'], best['step_ms'], peak))}"
               f"; compiled blocks ({compiled['compiled']}) {speedup:.2f}x the eager step; "
               f"peak {peak_text}")
    notes = [
        "Model FLOPs per token 6 N + 12 L h s (forward a third, backward two thirds): N the "
        "parameters that multiply (all but the token and position embeddings), L the blocks, "
        "h = n_embd, s the sequence length; recomputation not counted. MFU = model FLOP/s / "
        f"peak dense bf16 FLOP/s, peak {peak_text}.",
        f"Parts run alone on the device (median of {stages['iters']} after warm-up, "
        f"{stages['clock']}): the stages of balance "
        f"{stages['balance']} (check 4), the blocks alone, the whole model; a part's forward "
        "includes the loss when it ends the model. Steps: the one-stage pipe, "
        "train_step + clip_grad_norm_ + AdamW, 1F1B; 'blocks': eager, or each GPT block "
        "compiled with that backend (`HybridPipe(compile=...)`, compiled before the timed "
        "steps); host ms: the time train_step takes on the host (no device sync inside it on "
        "one rank), per micro-batch: what compiling is meant to cut."]
    return Section(title, [table, step_table], notes, [Check("stage_mfu", ok, summary, {
        "blocks_mfu": blocks_mfu, "tokens_per_s": tokens_per_s, "peak_flops": peak,
        "compiled_speedup": speedup,
        "max_mfu": max(utils) if utils else None})], {"stages": stages, "steps": steps})


# several devices -----------------------------------------------------------------------------

def layout_result(per_rank: list[dict[str, Any]], peak: float | None) -> dict[str, Any]:
    """One layout's row: the worst rank's parity numbers, the slowest rank's step."""
    parity = [r["parity"] for r in per_rank]
    speed = per_rank[0]["speed"]
    loss_rel = max(abs(a - b) / max(abs(b), 1e-30) for p in parity
                   for a, b in zip(p["losses"], p["ref_losses"]))
    worst = max(parity, key=lambda p: p["grad_rel"])
    return {"balance": parity[0]["balance"], "loss_rel": loss_rel, "grad_rel": worst["grad_rel"],
            "worst_param": worst["worst_param"], "losses": parity[0]["losses"],
            "ref_losses": parity[0]["ref_losses"], "step_ms": speed["step_ms"],
            "time_balance": speed["balance"],
            "tokens": speed["tokens"], "flops": speed["flops"],
            "mfu": mfu(speed["flops"], speed["step_ms"], peak, len(per_rank))}


def run_layout(pp: int, tp: int, cfg: dict[str, Any], backend: str,
               peak: float | None) -> dict[str, Any]:
    world = pp * tp
    print(f"- layout pp={pp} × tp={tp}: {world} ranks, {backend} ...", flush=True)
    try:
        per_rank = hybridpar.spawn(layout_rank, world, args=({**cfg, "pp": pp, "tp": tp},),
                                   backend=backend, timeout=cfg["timeout"],
                                   threads=threads(backend, world))
    except Exception as e:  # a rank raised, hung or returned what cannot load: FAIL
        return {"pp": pp, "tp": tp, "ranks": world, "error": describe(e)}
    return {"pp": pp, "tp": tp, "ranks": world, **layout_result(per_rank, peak),
            "environment": per_rank[0]["environment"]}


def parity(name: str, what: str, r: dict[str, Any], loss_tol: float, grad_tol: float) -> Check:
    """The verdict on a multi-device run's parity with one device; `what` names the run."""
    ok = finite(r["loss_rel"], r["grad_rel"]) and r["loss_rel"] <= loss_tol \
        and r["grad_rel"] <= grad_tol
    return Check(name, ok, (
        f"{what}: loss {sci(r['loss_rel'])}, gradient {sci(r['grad_rel'])} "
        f"({r['worst_param']}) relative to one device; tolerance {loss_tol:g} and "
        f"{grad_tol:g}"), {"loss_rel": r["loss_rel"], "grad_rel": r["grad_rel"]})


def layouts_section(rows: list[dict[str, Any]], cfg: dict[str, Any], backend: str) -> Section:
    title = f"7. Layouts on several devices ({backend}): parity with one device, tokens/s, MFU"
    body, checks = [], []
    for r in rows:
        name = f"layout_pp{r['pp']}_tp{r['tp']}"
        if "error" in r:
            body.append([f"{r['pp']} × {r['tp']}", r["ranks"], "error", *[""] * 7])
            checks.append(Check(name, False, f"pp={r['pp']} tp={r['tp']}: {short(r['error'])}"))
            continue
        checks.append(parity(name, f"pp={r['pp']} tp={r['tp']}", r, FP32_LOSS_REL,
                             FP32_GRAD_REL))
        body.append([f"{r['pp']} × {r['tp']}", r["ranks"], str(r["balance"]), sci(r["loss_rel"]),
                     sci(r["grad_rel"]), str(r["time_balance"]), ms(r["step_ms"]),
                     f"{r['tokens'] / (r['step_ms'] / 1e3):,.0f}",
                     tflops(r["flops"], r["step_ms"]), pct(r["mfu"])])
    table = markdown_table(["pp × tp", "ranks", "balance (parity)", "Δloss / loss",
                            "max ‖Δg‖ / ‖g‖", "balance (time)", "step ms", "tokens/s",
                            "TFLOP/s", "MFU per device"], body)
    notes = [f"Parity in fp32 (TF32 off): {cfg['parity_steps']} AdamW steps of "
             "`HybridPipe(gpt(tp=...), 'params', schedule='1f1b', checkpoint='except_last')` "
             "against `gpt()` on each rank's own device, same weights and batches; the worst "
             "step and rank, gradients of the first step (each rank's shard against its slice). "
             f"Tolerance {FP32_LOSS_REL:g} (loss) and {FP32_GRAD_REL:g} (gradients); "
             f"{GRAD_ERROR}.",
             "Speed in bf16 autocast, `balance='time'` (profiled on the device, broadcast), "
             f"checkpoint 'never', the slowest rank's median of {cfg['iters']} steps between "
             "barriers; MFU = model FLOP/s / (peak × ranks)."]
    return Section(title, [table], notes, checks, {"rows": rows})


def schedule_pp(n: int) -> int:
    """The ranks of check 8: the largest power of two <= min(n, 4) (0: fewer than 2)."""
    return 0 if n < 2 else 1 << (min(n, 4).bit_length() - 1)


def run_schedule(schedule: str, pp: int, cfg: dict[str, Any], backend: str) -> dict[str, Any]:
    """One schedule of check 8 on pp ranks: the worst rank's errors, or the error."""
    print(f"- schedule {schedule}: {pp} ranks, {backend} ...", flush=True)
    start = time.perf_counter()
    try:
        per_rank = hybridpar.spawn(schedule_rank, pp,
                                   args=({**cfg, "pp": pp, "schedule": schedule},),
                                   backend=backend, timeout=cfg["timeout"],
                                   threads=threads(backend, pp))
    except Exception as e:  # a rank raised or hung (a P2P order NCCL cannot progress)
        return {"schedule": schedule, "pp": pp, "error": describe(e)}
    loss_rel = max(abs(a - b) / max(abs(b), 1e-30) for r in per_rank
                   for a, b in zip(r["losses"], r["ref_losses"]))
    worst = max(per_rank, key=lambda r: r["grad_rel"])
    return {"schedule": schedule, "pp": pp, "stages": per_rank[0]["stages"],
            "loss_rel": loss_rel, "grad_rel": worst["grad_rel"],
            "worst_param": worst["worst_param"], "losses": per_rank[0]["losses"],
            "seconds": time.perf_counter() - start}


def schedules_section(rows: list[dict[str, Any]], backend: str) -> Section:
    title = f"8. Every schedule on several devices ({backend}), skips over stages: parity"
    body, checks = [], []
    for r in rows:
        name = f"schedule_{r['schedule']}"
        if "error" in r:
            body.append([r["schedule"], r["pp"], "error", "", "", ""])
            checks.append(Check(name, False, f"{r['schedule']}: {short(r['error'])}"))
            continue
        checks.append(parity(name, f"{r['schedule']} on {r['pp']} ranks, {r['stages']} stages",
                             r, F64_LOSS_REL, F64_GRAD_REL))
        body.append([r["schedule"], r["pp"], r["stages"], sci(r["loss_rel"]),
                     sci(r["grad_rel"]), f"{r['seconds']:.1f}"])
    table = markdown_table(["schedule", "ranks", "stages", "Δloss / loss", "max ‖Δg‖ / ‖g‖",
                            "s (launch included)"], body)
    notes = ["The model zoo's U-Net of depth 3 without BatchNorm (9 layers, nested skips "
             "over stages: `scripts/bench/gpu_schedules.py`) in float64, "
             "3 SGD steps of 32, 32 and 29 rows in 2 × ranks micro-batches (the first and the "
             "third send headers: new shapes), checkpoint 'except_last', against the plain model "
             "on each rank's device; the worst step and rank, gradients of the first step. "
             f"Tolerance {F64_LOSS_REL:g} (the loss, reported in fp32) and {F64_GRAD_REL:g} "
             "(float64 gradients): a wrong message moves them by far more. "
             "One launch per schedule: a P2P order the backend cannot progress hangs that "
             "schedule alone, until the timeout."]
    return Section(title, [table], notes, checks, {"rows": rows})


# running -------------------------------------------------------------------------------------

def describe(error: Exception) -> str:
    """An error in a line or a few: its type and the end of its message (a traceback)."""
    return f"{type(error).__name__}: {str(error)[-1500:]}"


def threads(backend: str, ranks: int) -> int:
    """Threads per rank: 1 on cpu (ranks share the cores), a few on GPUs."""
    return 1 if backend == "gloo" else max(1, min(4, (os.cpu_count() or 1) // ranks))


def run_single(cfg: dict[str, Any], backend: str) -> dict[str, Any]:
    print(f"- checks 1-6: one rank, {backend} ...", flush=True)
    try:
        (result,) = hybridpar.spawn(single_rank, 1, args=(cfg,), backend=backend,
                                    timeout=cfg["timeout"], threads=threads(backend, 1))
    except Exception as e:  # the rank raised, hung or returned what cannot load: all FAIL
        return {"error": describe(e)}
    return dict(result)


def single_sections(single: dict[str, Any], cfg: dict[str, Any], peak: float | None,
                    peak_label: str, cuda: bool) -> list[Section]:
    if "error" in single:
        whole = {"error": single["error"]}
        single = {k: whole for k in ("loss", "modes", "balance", "trace", "stages",
                                     "throughput")}
    return [loss_section(single["loss"]), modes_section(single["modes"]),
            balance_section(single["balance"], cfg["model"]["n_layer"] + 3),
            trace_section(single["trace"], cuda),
            mfu_section(single["stages"], single["throughput"], peak, peak_label)]


def render(section: Section, env: str) -> str:
    lines = [f"### {section.title}", "", f"_{env}_", ""]
    for table in section.tables:
        lines += [table, ""]
    lines += [f"- {note}" for note in section.notes]
    if section.notes:
        lines.append("")
    lines += [f"**{c.status}** `{c.name}`: {c.summary}  " for c in section.checks]
    return "\n".join(lines).rstrip() + "\n"


def summary_table(checks: Sequence[Check]) -> str:
    return markdown_table(["check", "result", "numbers"],
                          [[c.name, c.status, " ".join(c.summary.replace("|", "/").split())]
                           for c in checks])


def fallback_env(device: str) -> dict[str, Any]:
    return {"device": device, "torch": str(torch.__version__), "cuda": torch.version.cuda,
            "gpu": None, "cpu": None, "cpus": os.cpu_count()}


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--out", default="runs/gpu_check", help="folder for the results")
    parser.add_argument("--device", choices=("cuda", "cpu"), default=None,
                        help="default: cuda (cpu: the smoke run, gloo)")
    parser.add_argument("--quick", action="store_true", help="fewer steps (smoke test)")
    parser.add_argument("--ranks", type=int, default=None,
                        help="devices for the layouts (default: every GPU; cpu: 1, no layouts)")
    parser.add_argument("--config", default=str(DEFAULT_CONFIG),
                        help="the model and optimizer settings (default: quickstart.toml)")
    parser.add_argument("--batch", type=int, default=None,
                        help="sequences per step (default: the config's; --quick: 8)")
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="peak dense bf16 TFLOP/s of one device, if not in the table")
    return parser.parse_args(argv)


def bad_arguments(args: argparse.Namespace) -> str | None:
    """Why the arguments cannot run here, or None."""
    if (args.device or "cuda") == "cuda" and not torch.cuda.is_available():
        return (f"no CUDA device here (torch {torch.__version__}, CUDA {torch.version.cuda}); "
                "run `python scripts/gpu_check.py --device cpu --quick` for the CPU smoke run")
    for flag, value in (("--ranks", args.ranks), ("--batch", args.batch)):
        if value is not None and value < 1:
            return f"{flag} must be a positive integer, got {value}"
    return None


def layout_devices(args: argparse.Namespace, device: str) -> int:
    """How many devices the layouts may use: the GPUs (at most --ranks); on cpu --ranks."""
    if device == "cuda":
        count = torch.cuda.device_count()
        return min(args.ranks, count) if args.ranks else count
    return args.ranks or 1


def run_checks(args: argparse.Namespace, cfg: dict[str, Any], device: str
               ) -> tuple[list[Section], dict[str, Any], float | None, str]:
    """Every check's section, the environment, and the peak FLOP/s used for MFU."""
    backend = "nccl" if device == "cuda" else "gloo"
    single = run_single(cfg, backend)
    env = single.get("environment") or fallback_env(device)
    peak, peak_label = peak_bf16(env.get("gpu")) if device == "cuda" else (None, "cpu")
    if args.peak_tflops:
        peak, peak_label = args.peak_tflops * 1e12, "--peak-tflops"
    sections = single_sections(single, cfg, peak, peak_label, device == "cuda")
    devices = layout_devices(args, device)
    grid = layouts(devices, cfg["model"])
    if grid:
        rows = [run_layout(pp, tp, cfg, backend, peak) for pp, tp in grid]
        sections.append(layouts_section(rows, cfg, backend))
    if schedule_pp(devices):
        rows = [run_schedule(s, schedule_pp(devices), cfg, backend) for s in SCHEDULES]
        sections.append(schedules_section(rows, backend))
    return sections, env, peak, peak_label


def report(sections: list[Section], header: dict[str, Any], out: Path) -> bool:
    """Print the sections and the summary; write gpu_check.md and gpu_check.json."""
    line = env_line(header["environment"])
    checks = [c for s in sections for c in s.checks]
    passed = all(c.passed for c in checks)
    body = "\n".join(render(s, line) for s in sections)
    summary = (f"### Summary\n\n{summary_table(checks)}\n\n**{sum(c.passed for c in checks)} "
               f"of {len(checks)} checks pass** ({header['seconds']:.0f} s).\n")
    print(f"{body}\n{summary}", flush=True)
    (out / "gpu_check.md").write_text(f"## GPU check\n\n`{header['command']}` — "
                                      f"{header['date']}; {line}\n\n{body}\n{summary}")
    write_json(out / "gpu_check.json", {
        **header, "env_line": line, "tolerances": TOLERANCES, "passed": passed,
        "checks": [{**asdict(c), "status": c.status, "environment": line} for c in checks],
        "sections": [{"title": s.title, "tables": s.tables, "notes": s.notes,
                      "checks": [c.name for c in s.checks], "data": s.data} for s in sections]})
    print(f"wrote {out / 'gpu_check.json'} and {out / 'gpu_check.md'}")
    return passed


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    problem = bad_arguments(args)
    if problem:
        print(problem, file=sys.stderr)
        return 2
    start, device, out = time.perf_counter(), args.device or "cuda", Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(args.config, "rb") as f:
        cfg = settings(tomllib.load(f), quick=args.quick, out=out, batch=args.batch)
    command = "python " + shlex.join(["scripts/gpu_check.py",
                                      *(sys.argv[1:] if argv is None else argv)])
    date = datetime.datetime.now().isoformat(timespec="seconds")
    print(f"## GPU check\n\n`{command}` — {date}\n", flush=True)
    sections, env, peak, peak_label = run_checks(args, cfg, device)
    header = {"command": command, "date": date, "device": device,
              "backend": "nccl" if device == "cuda" else "gloo",
              "mode": "quick" if args.quick else "full", "environment": env,
              "peak_bf16_flops": peak, "peak_source": peak_label, "settings": cfg,
              "seconds": time.perf_counter() - start}
    return 0 if report(sections, header, out) else 1


if __name__ == "__main__":
    raise SystemExit(main())
