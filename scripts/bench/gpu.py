"""Helpers of scripts/gpu_check.py: device facts, peak FLOPs, timing and the rank workers.

Not one of bench_all's benchmarks. `single_rank` and `layout_rank` are `hybridpar.spawn`
targets (importable by name, as spawn needs): the first measures checks 1-6 of gpu_check on
one device, the second one pp x tp layout on pp * tp devices. They measure and return plain
dicts (numbers, strings, lists: what spawn's weights_only loading takes); gpu_check.py judges
and prints them. In `single_rank` a measurement that raises comes back as ``{"error": ...}``
so that the others still run.

Model FLOPs per token (6 N + 12 L h s) and the peak table live in `hybridpar.flops`, shared
with the trainer's MFU; they are re-exported here.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
import traceback
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

import hybridpar
from hybridpar import trace as hp_trace
from hybridpar.balance import balance_by_params, balance_by_time, balance_profiles, profile_layers
from hybridpar.balance.profile import DEFAULT_BANDWIDTH
from hybridpar.balance.table import stage_table
from hybridpar.flops import PEAK_BF16, flops_per_token, matmul_params, peak_bf16
from hybridpar.models import example_batch, gpt, gpt_loss
from hybridpar.models.gpt_layers import Block
from hybridpar.tensor_parallel.state import shard_of
from hybridpar.train.data import TokenBatches, byte_tokens, default_corpus

from .common import cpu_name

__all__ = ["GRAD_FLOOR", "MODES", "PEAK_BF16", "REFERENCE_MODE", "Clock", "clocked_spans",
           "environment", "flops_per_token", "layout_rank", "matmul_params", "norm_of",
           "peak_bf16", "plain", "relative_error", "side_by_side", "single_rank"]

MODES = ("always", "except_last", "never")
REFERENCE_MODE = "never"           # the checkpoint mode the others are compared with
TIMED_SPANS = ("forward", "backward", "recompute")
CORPUS_BYTES = 1_000_000           # of the embedded corpus, for the loss check
GRAD_FLOOR = 1e-2                  # gradient errors: relative to >= 1% of the model's norm

# device facts --------------------------------------------------------------------------------

def _nccl_version() -> str | None:
    try:
        version = torch.cuda.nccl.version()
    except (AttributeError, RuntimeError):
        return None
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def environment(device: torch.device) -> dict[str, Any]:
    """What every number is measured on: the device, torch, CUDA, NCCL, Python, the host."""
    env: dict[str, Any] = {"device": device.type, "torch": str(torch.__version__),
                           "cuda": torch.version.cuda, "python": platform.python_version(),
                           "cpu": cpu_name(), "cpus": os.cpu_count(), "gpu": None}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(gpu=props.name, gpus=torch.cuda.device_count(),
                   capability=f"{props.major}.{props.minor}",
                   memory_gib=round(props.total_memory / 2**30, 1),
                   multiprocessors=props.multi_processor_count, nccl=_nccl_version(),
                   cudnn=torch.backends.cudnn.version())
    return env


# timing --------------------------------------------------------------------------------------

class Clock:
    """Marks on the device's timeline: CUDA events on cuda, `time.perf_counter` on cpu.

    ``ms(a, b)`` is the time between two marks in milliseconds; on cuda it waits for `b`, so
    it measures the GPU's work between the marks, not the host's launches (DESIGN §9).
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def mark(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def ms(self, a: Any, b: Any) -> float:
        if self.cuda:
            b.synchronize()
            return float(a.elapsed_time(b))
        return (b - a) * 1e3

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


@contextmanager
def _marked(inner: AbstractContextManager[Any], clock: Clock,
            into: list[tuple[Any, Any]]) -> Iterator[Any]:
    with inner as value:
        start = clock.mark()
        yield value
        into.append((start, clock.mark()))


@contextmanager
def clocked_spans(clock: Clock) -> Iterator[dict[str, list[tuple[Any, Any]]]]:
    """Mark the start and end of every forward / backward / recompute span the executor opens.

    Wraps `hybridpar.trace.span` (the executor calls it through the module) while inside, so
    the marks sit just inside the traced spans: the same regions, timed by `clock`.
    """
    original = hp_trace.span
    marks: dict[str, list[tuple[Any, Any]]] = defaultdict(list)

    def span(kind: str, **kwargs: Any) -> AbstractContextManager[Any]:
        inner = original(kind, **kwargs)
        return _marked(inner, clock, marks[kind]) if kind in TIMED_SPANS else inner

    hp_trace.span = span
    try:
        yield marks
    finally:
        hp_trace.span = original


def _median_ms(clock: Clock, marks: list[tuple[Any, Any]]) -> float:
    return statistics.median(clock.ms(a, b) for a, b in marks)


# the model -----------------------------------------------------------------------------------

def _bf16(device: torch.device) -> torch.autocast:
    return torch.autocast(device.type, dtype=torch.bfloat16)


def _model(cfg: dict[str, Any], **overrides: Any) -> nn.Sequential:
    torch.manual_seed(0)
    return gpt(**{**cfg["model"], **overrides})


def _batch(cfg: dict[str, Any], seed: int) -> tuple[Tensor, Tensor]:
    return example_batch("gpt", cfg["batch"], seed=seed, **cfg["model"])


def _pipe(topo: Any, cfg: dict[str, Any], checkpoint: str, *, compile: bool | str = False,
          **model_overrides: Any) -> hybridpar.HybridPipe:
    """The one-stage pipe of the whole GPT (a world of one rank); `compile`: its blocks
    compiled (`HybridPipe(compile=...)`)."""
    model = _model(cfg, **model_overrides)
    return hybridpar.HybridPipe(model, [len(model)], chunks=cfg["chunks"], topology=topo,
                                schedule="1f1b", checkpoint=checkpoint, loss_fn=gpt_loss,
                                compile=compile)


def _adamw(params: Iterable[nn.Parameter], cfg: dict[str, Any]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=cfg["lr"], weight_decay=cfg["weight_decay"])


def norm_of(tensors: Iterable[Tensor | None]) -> float:
    """The 2-norm of `tensors` together (None skipped)."""
    return float(sum(t.double().pow(2).sum() for t in tensors if t is not None) ** 0.5)


def relative_error(a: Tensor, b: Tensor, whole: float) -> float:
    """‖a − b‖ / max(‖b‖, GRAD_FLOOR · `whole`), in float64 (`whole`: the model's grad norm).

    The floor keeps gradients that are zero in exact arithmetic from dividing noise by noise:
    the key biases' (softmax ignores a constant added to a whole row of scores).
    """
    a64, b64 = a.double(), b.double()
    return float((a64 - b64).norm()) / max(float(b64.norm()), GRAD_FLOOR * whole, 1e-30)


def plain(value: Any) -> Any:
    """`value` as builtin types only (what `hybridpar.spawn` loads back with weights_only)."""
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value)
    return str(value)


def _guarded(fn: Callable[..., dict[str, Any]], *args: Any) -> dict[str, Any]:
    """`fn(*args)`, or ``{"error": ...}`` when it raises (printed with its traceback)."""
    try:
        return fn(*args)
    except Exception as e:
        traceback.print_exc()
        return {"error": f"{type(e).__name__}: {e}".strip()[:2000]}


# checks 1-6: one device ----------------------------------------------------------------------

def _training_batches(cfg: dict[str, Any]) -> tuple[Callable[[int], tuple[Tensor, Tensor]], str]:
    """Step -> (x, y): the embedded corpus as bytes (the quick start's data), or synthetic
    sequences when the vocabulary is smaller than a byte."""
    model = cfg["model"]
    if model["vocab_size"] < 256:
        return (lambda step: _batch(cfg, seed=step)), "synthetic sequences (example_batch)"
    corpus = TokenBatches(byte_tokens(default_corpus(CORPUS_BYTES)), seq_len=model["block_size"],
                          batch_size=cfg["batch"], seed=0)
    return (lambda step: corpus.next_batch()), \
        f"the embedded corpus (stdlib sources, first {CORPUS_BYTES:,} bytes)"


def loss_curve(topo: Any, cfg: dict[str, Any]) -> dict[str, Any]:
    """1. AdamW steps under bf16 autocast, a fresh batch each step: the losses."""
    pipe = _pipe(topo, cfg, "except_last")
    opt = _adamw(pipe.parameters(), cfg)
    batches, data = _training_batches(cfg)
    losses = []
    for step in range(cfg["loss_steps"]):
        x, y = batches(step)
        opt.zero_grad(set_to_none=True)
        with _bf16(topo.device):
            losses.append(pipe.train_step(x, y))
        pipe.clip_grad_norm_(cfg["grad_clip"])
        opt.step()
    return {"losses": [float(loss) for loss in losses], "data": data, "lr": cfg["lr"],
            "weight_decay": cfg["weight_decay"], "grad_clip": cfg["grad_clip"]}


def _mode_step(topo: Any, cfg: dict[str, Any], mode: str, dropout: float,
               x: Tensor, y: Tensor) -> tuple[float, dict[str, Tensor | None]]:
    pipe = _pipe(topo, cfg, mode, dropout=dropout)
    hybridpar.model_parallel_manual_seed(1)        # the same dropout masks in every mode
    with _bf16(topo.device):
        loss = pipe.train_step(x, y)
    grads = {name: None if p.grad is None else p.grad.detach().float().clone()
             for name, p in pipe.named_parameters()}
    return float(loss), grads


def checkpoint_modes(topo: Any, cfg: dict[str, Any]) -> dict[str, Any]:
    """2 and 3. One bf16 step per checkpoint mode from the same weights and batch: the loss,
    which gradients are missing or not finite, and the distance to the 'never' mode."""
    x, y = _batch(cfg, seed=10_000)
    rows = []
    for dropout in cfg["mode_dropouts"]:
        ref: tuple[float, dict[str, Tensor | None]] | None = None
        for mode in sorted(MODES, key=lambda m: m != REFERENCE_MODE):
            loss, grads = _mode_step(topo, cfg, mode, dropout, x, y)
            ref = ref or (loss, grads)
            whole = norm_of(ref[1].values())
            errors = {name: relative_error(g, ref_g, whole) for name, g in grads.items()
                      if g is not None and (ref_g := ref[1].get(name)) is not None}
            worst = max(errors, key=errors.__getitem__) if errors else None
            rows.append({
                "dropout": dropout, "mode": mode, "loss": loss, "params": len(grads),
                "missing": [n for n, g in grads.items() if g is None],
                "nonfinite": [n for n, g in grads.items()
                              if g is not None and not bool(torch.isfinite(g).all())],
                "loss_rel": abs(loss - ref[0]) / max(abs(ref[0]), 1e-30),
                "grad_rel": errors[worst] if worst else 0.0, "worst_param": worst})
    order = {m: i for i, m in enumerate(MODES)}
    rows.sort(key=lambda r: (r["dropout"], order[r["mode"]]))
    return {"rows": rows, "reference": REFERENCE_MODE}


def balance_on_device(topo: Any, cfg: dict[str, Any]) -> dict[str, Any]:
    """4. `balance_by_time` into 2 stages on the device under bf16, and each layer's time."""
    device, timeout = topo.device, cfg["balance_timeout"]
    model = _model(cfg).to(device)
    sample = _batch(cfg, seed=0)[0].to(device)
    with _bf16(device):
        chosen = balance_by_time(2, model, sample, timeout=timeout, device=device)
        profiles = profile_layers(model, sample, timeout=timeout, device=device,
                                  measure_size=False)
    bandwidth = DEFAULT_BANDWIDTH.get(device.type, DEFAULT_BANDWIDTH["cpu"])
    stages = stage_table(profiles, chosen, p2p_bandwidth=bandwidth)
    return {
        "balance": list(chosen), "timeout_s": timeout,
        "resplit": balance_profiles(profiles, 2, by="time", p2p_bandwidth=bandwidth),
        "layers": [{"index": p.index, "kind": p.kind, "params": p.params,
                    "time_ms": p.time_ms} for p in profiles],
        "stages": [{"stage": r.stage, "layers": f"{r.first}-{r.last}", "time_ms": r.time_ms,
                    "send_ms": r.send_ms, "share": r.share} for r in stages]}


def trace_vs_clock(topo: Any, cfg: dict[str, Any]) -> dict[str, Any]:
    """5. One traced bf16 step (after warm-up) with `Clock` marks inside its compute spans."""
    pipe = _pipe(topo, cfg, "except_last")
    x, y = _batch(cfg, seed=0)
    clock = Clock(topo.device)
    for _ in range(cfg["warmup"]):
        with _bf16(topo.device):
            pipe.train_step(x, y)
    pipe.zero_grad(set_to_none=True)
    clock.sync()
    pipe.trace = True
    with clocked_spans(clock) as marks, _bf16(topo.device):
        pipe.train_step(x, y)
    pipe.trace = False
    clock.sync()
    report = pipe.write_trace(cfg["trace_dir"], show=False)
    assert report is not None, "rank 0 of a world of one writes the trace"
    traced: dict[str, list[float]] = defaultdict(list)
    for event in report.events[0]:
        if event.kind in TIMED_SPANS:
            traced[event.kind].append((event.end - event.start) / 1e6)
    rows = []
    for kind in TIMED_SPANS:
        clocked = [clock.ms(a, b) for a, b in marks.get(kind, [])]
        if traced[kind] or clocked:
            rows.append({"span": kind, "traced": len(traced[kind]), "clocked": len(clocked),
                         "trace_ms": sum(traced[kind]), "clock_ms": sum(clocked)})
    return {"rows": rows, "step_ms": report.step_ms, "files": [str(f) for f in report.files],
            "clock": "CUDA events" if clock.cuda else "perf_counter",
            "checkpoint": "except_last", "chunks": cfg["chunks"], "warmup": cfg["warmup"]}


def _hidden(layers: list[nn.Module], upto: int, x: Tensor, device: torch.device) -> Tensor:
    """The input of layer `upto`: `x` through the layers before it (no grad, bf16)."""
    with torch.no_grad(), _bf16(device):
        for layer in layers[:upto]:
            x = layer(x)
    return x


def _time_part(part: nn.Sequential, x: Tensor, y: Tensor | None, clock: Clock,
               cfg: dict[str, Any], device: torch.device) -> tuple[float, float]:
    """Median forward and backward ms of `part` on `x` (its loss on `y` when it is last)."""
    grad_out: Tensor | None = None
    marks: list[tuple[Any, Any, Any]] = []
    for i in range(cfg["warmup"] + cfg["iters"]):
        inp = x.detach().requires_grad_(x.is_floating_point())
        part.zero_grad(set_to_none=True)
        a = clock.mark()
        with _bf16(device):
            out = part(inp)
            loss = gpt_loss(out, y) if y is not None else None
        b = clock.mark()
        if loss is not None:
            loss.backward()
        else:
            grad_out = torch.randn_like(out) if grad_out is None else grad_out
            out.backward(grad_out)
        c = clock.mark()
        if i >= cfg["warmup"]:
            marks.append((a, b, c))
    return (_median_ms(clock, [(a, b) for a, b, _ in marks]),
            _median_ms(clock, [(b, c) for _, b, c in marks]))


def stage_times(topo: Any, cfg: dict[str, Any], balance: list[int] | None) -> dict[str, Any]:
    """6. Forward / backward ms and model FLOPs of each stage of `balance`, of the blocks
    alone and of the whole model, each run on its own on the device under bf16."""
    device, clock = topo.device, Clock(topo.device)
    model = _model(cfg).to(device)
    layers = list(model)
    balance = balance or balance_by_params(2, model)
    x, y = (t.to(device) for t in _batch(cfg, seed=0))
    blocks = [i for i, layer in enumerate(layers) if isinstance(layer, Block)]
    parts = [(f"stage {s}", sum(balance[:s]), sum(balance[:s + 1])) for s in range(len(balance))]
    parts += [("blocks", blocks[0], blocks[-1] + 1), ("model", 0, len(layers))]
    tokens, seq = y.numel(), y.shape[1]
    rows = []
    for name, start, stop in parts:
        span = layers[start:stop]
        fwd_ms, bwd_ms = _time_part(nn.Sequential(*span), _hidden(layers, start, x, device),
                                    y if stop == len(layers) else None, clock, cfg, device)
        n = matmul_params(span)
        n_blocks = sum(isinstance(layer, Block) for layer in span)
        fwd_flops = flops_per_token(n, n_blocks, cfg["model"]["n_embd"], seq) / 3 * tokens
        rows.append({"part": name, "layers": f"{start}-{stop - 1}", "params": n,
                     "blocks": n_blocks, "tokens": tokens, "fwd_ms": fwd_ms, "bwd_ms": bwd_ms,
                     "fwd_flops": fwd_flops, "bwd_flops": 2 * fwd_flops})
    return {"balance": list(balance), "rows": rows, "iters": cfg["iters"],
            "clock": "CUDA events" if clock.cuda else "perf_counter"}


def step_throughput(topo: Any, cfg: dict[str, Any]) -> dict[str, Any]:
    """6. Training steps (schedule + grad clip + AdamW) of the one-stage pipe under bf16:
    median step ms, host ms of train_step and the step's model FLOPs, per checkpoint mode,
    eager and with compiled blocks (the first step, which compiles, is a warm-up step)."""
    device, clock = topo.device, Clock(topo.device)
    x, y = _batch(cfg, seed=0)
    if device.type == "cuda":
        x, y = x.pin_memory(), y.pin_memory()
    rows = []
    backend = cfg["compile_backend"]
    for mode, compiled in (("never", ""), ("except_last", ""), ("never", backend)):
        pipe = _pipe(topo, cfg, mode, compile=compiled or False)
        opt = _adamw(pipe.parameters(), cfg)
        marks, host = [], []
        for i in range(cfg["warmup"] + cfg["iters"]):
            a = clock.mark()
            opt.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            with _bf16(device):
                pipe.train_step(x, y)
            t1 = time.perf_counter()
            pipe.clip_grad_norm_(cfg["grad_clip"])
            opt.step()
            if i >= cfg["warmup"]:
                marks.append((a, clock.mark()))
                host.append((t1 - t0) * 1e3)
        n = matmul_params(pipe.partition)
        blocks = sum(isinstance(layer, Block) for layer in pipe.partition)
        per_token = flops_per_token(n, blocks, cfg["model"]["n_embd"], y.shape[1])
        rows.append({"checkpoint": mode, "compiled": compiled, "tokens": y.numel(),
                     "step_ms": _median_ms(clock, marks), "host_ms": statistics.median(host),
                     "flops": per_token * y.numel(), "chunks": cfg["chunks"]})
    return {"rows": rows, "iters": cfg["iters"]}


def single_rank(cfg: dict[str, Any]) -> dict[str, Any]:
    """Checks 1-6 on a world of one rank (spawn target); each measurement guarded."""
    topo = hybridpar.init(timeout=cfg["timeout"])
    results: dict[str, Any] = {"environment": environment(topo.device)}
    start = time.perf_counter()

    def measure(name: str, fn: Callable[..., dict[str, Any]], *args: Any) -> None:
        results[name] = _guarded(fn, *args)
        outcome = "error" if "error" in results[name] else "done"
        print(f"  {name}: {outcome} at {time.perf_counter() - start:.1f} s", flush=True)

    measure("loss", loss_curve, topo, cfg)
    measure("modes", checkpoint_modes, topo, cfg)
    measure("balance", balance_on_device, topo, cfg)
    measure("trace", trace_vs_clock, topo, cfg)
    measure("stages", stage_times, topo, cfg, results["balance"].get("balance"))
    measure("throughput", step_throughput, topo, cfg)
    return plain(results)


# several devices: one pp x tp layout ---------------------------------------------------------

def _grad_errors(pipe: hybridpar.HybridPipe, ref: nn.Module, topo: Any) -> dict[str, float]:
    """Each local gradient against its slice of the one-device gradient (inf when missing)."""
    refs = dict(ref.named_parameters())
    group = topo.tp_group if topo.tp > 1 else None
    whole = norm_of(p.grad for p in refs.values())
    errors = {}
    for name, p in pipe.named_parameters():
        full = refs[name].grad
        if p.grad is None or full is None:
            errors[name] = float("inf")
            continue
        errors[name] = relative_error(p.grad, shard_of(full, p, group), whole)
    return errors


def side_by_side(pipe: hybridpar.HybridPipe, ref: nn.Module,
                 opts: tuple[torch.optim.Optimizer, torch.optim.Optimizer],
                 batches: Iterable[tuple[Tensor, Tensor]], loss_fn: Callable[..., Tensor],
                 topo: Any) -> dict[str, Any]:
    """Train `pipe` and the plain `ref` (on this rank's device) on the same `batches`, with
    `opts` (the pipe's, the reference's): both losses of every step and the worst local
    gradient error of the first step (against its slice of the one-device gradient)."""
    opt, ref_opt = opts
    losses, ref_losses, errors = [], [], {}
    for step, (x, y) in enumerate(batches):
        ref_opt.zero_grad(set_to_none=True)
        opt.zero_grad(set_to_none=True)
        ref_loss = loss_fn(ref(x.to(topo.device)), y.to(topo.device))
        ref_loss.backward()
        losses.append(float(pipe.train_step(x, y)))
        ref_losses.append(ref_loss.item())
        if step == 0:
            errors = _grad_errors(pipe, ref, topo)
        ref_opt.step()
        opt.step()
    worst = max(errors, key=errors.__getitem__) if errors else None
    return {"losses": losses, "ref_losses": ref_losses,
            "grad_rel": errors[worst] if worst else 0.0, "worst_param": worst,
            "params": len(errors)}


def layout_parity(topo: Any, cfg: dict[str, Any]) -> dict[str, Any]:
    """fp32 steps of the pipe against the plain model on this rank's device, same batches."""
    tp = topo.tp
    # no dropout: a micro-batch's masks are not the slices of the whole batch's
    ref = _model(cfg, dropout=0.0).to(topo.device)
    model = _model(cfg, dropout=0.0, tp=tp if tp > 1 else None)
    pipe = hybridpar.HybridPipe(model, "params", chunks=cfg["chunks"], topology=topo,
                                schedule="1f1b", checkpoint="except_last", loss_fn=gpt_loss)
    batches = (_batch(cfg, seed=step) for step in range(cfg["parity_steps"]))
    result = side_by_side(pipe, ref, (_adamw(pipe.parameters(), cfg),
                                      _adamw(ref.parameters(), cfg)), batches, gpt_loss, topo)
    return {**result, "balance": list(pipe.balance)}


def layout_speed(topo: Any, cfg: dict[str, Any]) -> dict[str, Any]:
    """bf16 training steps (1F1B, no recomputation, AdamW) split by ``balance="time"``
    (profiled on the device under bf16, broadcast from rank 0): the slowest rank's median ms."""
    device, clock, tp = topo.device, Clock(topo.device), topo.tp
    model = _model(cfg, tp=tp if tp > 1 else None)
    x, y = _batch(cfg, seed=0)
    with _bf16(device):
        pipe = hybridpar.HybridPipe(model, "time", chunks=cfg["chunks"], topology=topo,
                                    schedule="1f1b", checkpoint="never", loss_fn=gpt_loss,
                                    balance_sample=x)
    opt = _adamw(pipe.parameters(), cfg)
    times = []
    for i in range(cfg["warmup"] + cfg["iters"]):
        dist.barrier()
        clock.sync()
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with _bf16(device):
            pipe.train_step(x, y)
        opt.step()
        clock.sync()
        dist.barrier()
        if i >= cfg["warmup"]:
            times.append((time.perf_counter() - start) * 1e3)
    slowest = torch.tensor([statistics.median(times)], dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    full = _model(cfg)
    per_token = flops_per_token(matmul_params(full), cfg["model"]["n_layer"],
                                cfg["model"]["n_embd"], y.shape[1])
    return {"step_ms": float(slowest), "tokens": y.numel(), "flops": per_token * y.numel(),
            "checkpoint": "never", "chunks": cfg["chunks"], "balance": list(pipe.balance)}


def layout_rank(cfg: dict[str, Any]) -> dict[str, Any]:
    """One pp x tp layout (spawn target): fp32 parity, then bf16 speed. Not guarded: a rank
    that raised would leave its peers waiting in a collective, so the layout fails whole."""
    topo = hybridpar.init(pp=cfg["pp"], tp=cfg["tp"], timeout=cfg["timeout"])
    torch.backends.cuda.matmul.allow_tf32 = False     # parity in true fp32
    torch.backends.cudnn.allow_tf32 = False
    result: dict[str, Any] = {"rank": topo.rank, "environment": environment(topo.device)}
    result["parity"] = layout_parity(topo, cfg)
    result["speed"] = layout_speed(topo, cfg)
    return plain(result)
