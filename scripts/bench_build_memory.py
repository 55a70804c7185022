"""Peak host memory per rank while `hybridpar run` builds (and loads) the model, against the shard.

    python scripts/bench_build_memory.py [--rows gpt-1x1 gpt-pp2tp2 ...] [--repeats 3]
        [--out results/bench_build_memory.json] [--small] [--device cpu|cuda]

Each row runs its ranks with `hybridpar.spawn` (gloo, one thread each); every rank resets its
peak resident set (``/proc/self/clear_refs``: VmHWM := VmRSS) right before
`train.trainer.build_pipe` (what `hybridpar run` calls: build, tp plan, stage split, and with
``model.pretrained`` the checkpoint read) and reads VmHWM right after:

    column       what it is, per rank (median over the repeats, the largest rank shown)
    shard        the bytes of the parameters and buffers the rank keeps
    peak         VmHWM during the build, minus VmRSS just before it (what the build added)
    peak/shard   how far the build is from holding the shard alone
    gpu peak     (--device cuda) torch.cuda.max_memory_allocated during the build

`--device cuda` runs the one-rank rows on one GPU (nccl): the shard is materialized on the
device, so the host's peak shows whether a host copy of it was ever made (the CUDA context is
created before the reset, so it is not counted).

The rows (issue "Models larger than a host"): a GPT of C = 1024, L = 8 (386 MiB in fp32) at
1 x 1, pp2 x tp2 and pp4 x tp1; an HF Llama of ~95 M parameters at pp2 x tp2 ("auto"), from
the seed and from a checkpoint (`save_pretrained`, written once per run into a temporary
folder). `--small` shrinks every model 16x (the smoke test's size). Prints a markdown table,
writes the rows as JSON (BENCH.md: machine, date, load).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

import hybridpar

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench.common import load, machine, markdown_table, write_json

ROOT = Path(__file__).resolve().parent.parent
MIB = 1 << 20

# row -> (config file, (pp, tp), overrides); {p} is the pretrained folder
ROWS: dict[str, tuple[str, tuple[int, int], list[str]]] = {
    "gpt-1x1": ("quickstart.toml", (1, 1), ["model.n_embd=1024", "model.n_layer=8"]),
    "gpt-pp2tp2": ("quickstart.toml", (2, 2), ["model.n_embd=1024", "model.n_layer=8"]),
    "gpt-pp4tp1": ("quickstart.toml", (4, 1), ["model.n_embd=1024", "model.n_layer=8"]),
    "llama-pp2tp2": ("llama_tiny.toml", (2, 2), []),
    "llama-pp2tp2-pretrained": ("llama_tiny.toml", (2, 2), ["model.pretrained={p}"]),
    "llama-1x1-pretrained": ("llama_tiny.toml", (1, 1), ["model.pretrained={p}"]),
}
LLAMA = {"hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 8,
         "num_attention_heads": 16, "num_key_value_heads": 4}


def _llama_sizes(small: bool) -> dict[str, int]:
    """The Llama row's sizes; `small`: widths / 4 (the head counts kept)."""
    return {k: (v // 4 if small and k.endswith("_size") else v) for k, v in LLAMA.items()}


def _llama(small: bool) -> list[str]:
    return [f"model.{k}={v}" for k, v in _llama_sizes(small).items()]


def _overrides(row: str, small: bool, pretrained: str) -> list[str]:
    file, (pp, tp), extra = ROWS[row]
    out = [f"parallel.pp={pp}", f"parallel.tp={tp}", "parallel.dp=1", "parallel.balance=params",
           "parallel.timeout=300"]
    if file.startswith("llama"):
        out += _llama(small)
    elif small:
        extra = ["model.n_embd=256", "model.n_layer=2"]
    return out + [e.format(p=pretrained) for e in extra]


def _status(field: str) -> int:
    """A ``/proc/self/status`` field in bytes (VmRSS, VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def _rank(file: str, overrides: list[str]) -> dict[str, int]:
    from hybridpar.train import load_config
    from hybridpar.train.trainer import build_pipe

    config = load_config(ROOT / "configs" / file, overrides)
    par = config.parallel
    topo = hybridpar.init(pp=par.pp, tp=par.tp, dp=par.dp, timeout=par.timeout)
    on_gpu = topo.device.type == "cuda"
    if on_gpu:   # the CUDA context (hundreds of MiB of host memory) before the reset
        torch.zeros(1, device=topo.device)
        torch.cuda.reset_peak_memory_stats(topo.device)
    gpu_before = torch.cuda.memory_allocated(topo.device) if on_gpu else 0
    Path("/proc/self/clear_refs").write_text("5")   # VmHWM := VmRSS
    before = _status("VmRSS")
    pipe = build_pipe(config, topo)
    peak = _status("VmHWM") - before
    gpu_peak = torch.cuda.max_memory_allocated(topo.device) - gpu_before if on_gpu else 0
    shard = sum(t.numel() * t.element_size() for t in [*pipe.parameters(), *pipe.buffers()])
    pipe.close()
    return {"peak": peak, "shard": shard, "gpu_peak": gpu_peak}


def _save_pretrained(folder: str, small: bool) -> None:
    """The Llama row's checkpoint: the config's model from the seed, saved as safetensors."""
    import transformers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(vocab_size=256,
                                                                   **_llama_sizes(small)))
    model.save_pretrained(folder)


def run(rows: list[str], *, repeats: int, small: bool, device: str = "cpu") -> dict[str, Any]:
    results = []
    with tempfile.TemporaryDirectory() as folder:
        if any("pretrained" in r for r in rows):
            _save_pretrained(folder, small)
        for row in rows:
            file, (pp, tp), _ = ROWS[row]
            if device == "cuda" and pp * tp > 1:
                raise SystemExit(f"row {row!r} needs {pp * tp} GPUs; --device cuda runs the "
                                 "one-rank rows (gpt-1x1, llama-1x1-pretrained)")
            samples = [hybridpar.spawn(_rank, pp * tp, args=(file, _overrides(row, small, folder)),
                                       backend="nccl" if device == "cuda" else "gloo",
                                       timeout=600) for _ in range(repeats)]
            ranks = [{k: statistics.median(s[r][k] for s in samples)
                      for k in ("peak", "shard", "gpu_peak")} for r in range(pp * tp)]
            worst = max(ranks, key=lambda d: d["peak"])
            results.append({"row": row, "ranks": ranks, "peak": worst["peak"],
                            "shard": worst["shard"], "gpu_peak": worst["gpu_peak"],
                            "repeats": repeats})
    return {"rows": results, "machine": machine(), "load": load(), "small": small,
            "device": device}


def table(result: dict[str, Any]) -> str:
    gpu = result.get("device") == "cuda"
    return markdown_table(
        ["row", "shard MiB", "host peak MiB (largest rank)", "host peak / shard"]
        + (["gpu peak MiB"] if gpu else []),
        [[r["row"], f"{r['shard'] / MIB:.0f}", f"{r['peak'] / MIB:.0f}",
          f"{r['peak'] / r['shard']:.2f}"] + ([f"{r['gpu_peak'] / MIB:.0f}"] if gpu else [])
         for r in result["rows"]])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--out", default="results/bench_build_memory.json")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = parser.parse_args(argv)
    result = run(args.rows, repeats=args.repeats, small=args.small, device=args.device)
    print(table(result))
    write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
