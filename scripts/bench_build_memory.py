"""Peak host memory per rank while `hybridpar run` builds (and loads) the model, against the shard.

    python scripts/bench_build_memory.py [--rows gpt-1x1 gpt-pp2tp2 ...] [--repeats 3]
        [--out results/bench_build_memory.json] [--small | --size full|test|small]
        [--device cpu|cuda]

Each row runs its ranks with `hybridpar.spawn` (gloo, one thread each); every rank resets its
peak resident set (``/proc/self/clear_refs``: VmHWM := VmRSS) right before
`train.trainer.build_pipe` (what `hybridpar run` calls: build, tp plan, stage split, and with
``model.pretrained`` the checkpoint read; with ``--init-from`` the trainer's read of the
export follows, `hf.shard_load.load_plain_shards`, and is measured with it) and reads VmHWM
right after:

    column       what it is, per rank (median over the repeats, the largest rank shown)
    shard        the bytes of the parameters and buffers the rank keeps
    peak         VmHWM during the build, minus VmRSS just before it (what the build added)
    peak/shard   how far the build is from holding the shard alone
    gpu peak     (--device cuda) torch.cuda.max_memory_allocated during the build

`--device cuda` runs the one-rank rows on one GPU (nccl): the shard is materialized on the
device, so the host's peak shows whether a host copy of it was ever made (the CUDA context is
created before the reset, so it is not counted).

The rows (issue "Models larger than a host"), each a model, a layout and where its weights
come from: the seed, ``model.pretrained`` (a Hugging Face ``save_pretrained`` folder) or
``--init-from`` (a plain safetensors export of the model built whole, as `hybridpar export`
writes it), the checkpoints written once per run into a temporary folder:

    model       --size full (default)                    test          small (--small)
    gpt         C = 1024, L = 8, 4 heads (386 MiB)       C 512, L 16   C 256, L 2
    gpt-large   C = 1024, L = 24 (1.1 GiB), at pp4 x tp2 C 512, L 24   C 256, L 6
    llama       hf:llama, C 1024, MLP 2816, L 8,         C 512, MLP    widths / 4
                16 / 4 heads (95 M parameters, 346 MiB)  1408, L 16,
                                                         8 / 4 heads
    gpt2        hf:gpt2 (tied embedding and head),       C 512, L 16,  C 256, L 2,
                C 1024, L 8, 16 heads (390 MiB)          8 heads       4 heads

`test` is what tests/test_memory_bound.py measures: ~200 MiB models whose largest layer is
small, so that the bound (shard + largest layer + 64 MiB) stays far below the whole model.
Prints a markdown table, writes the rows as JSON (BENCH.md: machine, date, load).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any, NamedTuple

import torch

import hybridpar

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench.common import load, machine, markdown_table, write_json

ROOT = Path(__file__).resolve().parent.parent
MIB = 1 << 20

SIZES = ("full", "test", "small")


def _gpt(n_embd: int, n_layer: int) -> list[str]:
    return [f"model.n_embd={n_embd}", f"model.n_layer={n_layer}"]


def _hf(**options: int) -> list[str]:
    return [f"model.{k}={v}" for k, v in options.items()]


# model -> (config file, its overrides at each of SIZES); "gpt2.toml" is written by `_config`
MODELS: dict[str, tuple[str, dict[str, list[str]]]] = {
    "gpt": ("quickstart.toml", {"full": _gpt(1024, 8), "test": _gpt(512, 16),
                                "small": _gpt(256, 2)}),
    "gpt-large": ("quickstart.toml", {"full": _gpt(1024, 24), "test": _gpt(512, 24),
                                      "small": _gpt(256, 6)}),
    "llama": ("llama_tiny.toml", {
        "full": _hf(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                    num_attention_heads=16, num_key_value_heads=4),
        "test": _hf(hidden_size=512, intermediate_size=1408, num_hidden_layers=16,
                    num_attention_heads=8, num_key_value_heads=4),
        "small": _hf(hidden_size=256, intermediate_size=704, num_hidden_layers=8,
                     num_attention_heads=16, num_key_value_heads=4)}),
    "gpt2": ("gpt2.toml", {"full": _hf(n_embd=1024, n_layer=8, n_head=16),
                           "test": _hf(n_embd=512, n_layer=16, n_head=8),
                           "small": _hf(n_embd=256, n_layer=2, n_head=4)}),
}

# row -> (model, (pp, tp), weights)
ROWS: dict[str, tuple[str, tuple[int, int], str]] = {
    "gpt-1x1": ("gpt", (1, 1), "seed"),
    "gpt-pp2tp2": ("gpt", (2, 2), "seed"),
    "gpt-pp4tp1": ("gpt", (4, 1), "seed"),
    "gpt-pp2tp2-init-from": ("gpt", (2, 2), "init-from"),
    "gpt-large-pp4tp2": ("gpt-large", (4, 2), "seed"),
    "llama-pp2tp2": ("llama", (2, 2), "seed"),
    "llama-pp2tp2-pretrained": ("llama", (2, 2), "pretrained"),
    "llama-1x1-pretrained": ("llama", (1, 1), "pretrained"),
    "gpt2-pp2tp2": ("gpt2", (2, 2), "seed"),
    "gpt2-pp2tp2-pretrained": ("gpt2", (2, 2), "pretrained"),
}


class Case(NamedTuple):
    """What a row's ranks run: `_rank(config, overrides, init_from)` on `ranks` processes."""

    config: str
    ranks: int
    overrides: list[str]
    init_from: str | None


def _config(model: str, folder: Path) -> Path:
    """The model's config file; hf:gpt2's is llama_tiny.toml with its [model] table replaced."""
    file = MODELS[model][0]
    if file != "gpt2.toml":
        return ROOT / "configs" / file
    path = folder / file
    if not path.exists():
        text = (ROOT / "configs" / "llama_tiny.toml").read_text()
        head, rest = text.split("[model]\n", 1)
        path.write_text(head + '[model]\nname = "hf:gpt2"\nvocab_size = 256\n\n'
                        + rest[rest.index("[data]"):])
    return path


def _model_overrides(model: str, size: str) -> list[str]:
    return MODELS[model][1][size]


def _fill(module: torch.nn.Module) -> torch.nn.Module:
    """`module` (on meta) given storage and values, quickly: uniform, vectors 1 (what is
    measured is memory, not the weights)."""
    module = module.to_empty(device="cpu")
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in module.parameters():
            p.fill_(1.0) if p.dim() == 1 else p.uniform_(-0.03, 0.03, generator=generator)
    return module


def _save_pretrained(folder: Path, model: str, size: str) -> None:
    """`model` (an hf: family) as ``save_pretrained`` writes it."""
    import transformers

    from hybridpar.models.hf import hf_config
    from hybridpar.train import load_config

    config = load_config(_config(model, folder.parent), _model_overrides(model, size))
    family = config.model.name.removeprefix("hf:")
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(hf_config(family, config.model.args))
    _fill(hf).save_pretrained(folder)


def _save_export(folder: Path, model: str, size: str) -> None:
    """`model` as `hybridpar export` writes a checkpoint of it: the plain Sequential's names,
    in safetensors files (`hybridpar.io.weight_files`)."""
    from hybridpar.io.weight_files import write_shards
    from hybridpar.models.registry import build
    from hybridpar.train import load_config

    config = load_config(_config(model, folder.parent), _model_overrides(model, size))
    with torch.device("meta"):
        sequential, _ = build(config.model.name, **config.model.args)
    state = _fill(sequential).state_dict()
    write_shards(folder, [(k, v.numel() * v.element_size()) for k, v in state.items()],
                 iter(state.values()))


def cases(rows: list[str], *, size: str, folder: str | Path) -> dict[str, Case]:
    """Each row's `Case`, the checkpoints it reads written into `folder` (once per model)."""
    folder = Path(folder)
    out = {}
    for row in rows:
        model, (pp, tp), weights = ROWS[row]
        overrides = [f"parallel.pp={pp}", f"parallel.tp={tp}", "parallel.dp=1",
                     "parallel.balance=params", "parallel.timeout=300",
                     *_model_overrides(model, size)]
        saved = folder / f"{model}-{weights}"
        if weights != "seed" and not saved.exists():
            (_save_pretrained if weights == "pretrained" else _save_export)(saved, model, size)
        if weights == "pretrained":
            overrides.append(f"model.pretrained={saved}")
        out[row] = Case(str(_config(model, folder)), pp * tp, overrides,
                        str(saved) if weights == "init-from" else None)
    return out


def _status(field: str) -> int:
    """A ``/proc/self/status`` field in bytes (VmRSS, VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def _rank(config_file: str, overrides: list[str], init_from: str | None = None
          ) -> dict[str, int]:
    from hybridpar.train import load_config
    from hybridpar.train.trainer import build_pipe

    config = load_config(config_file, overrides)
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
    if init_from is not None:   # as the trainer's --init-from of a safetensors export
        from hybridpar.hf.shard_load import load_plain_shards

        load_plain_shards(pipe, init_from, model=f"model {config.model.name!r}")
    peak = _status("VmHWM") - before
    gpu_peak = torch.cuda.max_memory_allocated(topo.device) - gpu_before if on_gpu else 0
    shard = sum(t.numel() * t.element_size() for t in [*pipe.parameters(), *pipe.buffers()])
    pipe.close()
    return {"peak": peak, "shard": shard, "gpu_peak": gpu_peak}


def run(rows: list[str], *, repeats: int, size: str, device: str = "cpu") -> dict[str, Any]:
    results = []
    with tempfile.TemporaryDirectory() as folder:
        for row, case in cases(rows, size=size, folder=folder).items():
            if device == "cuda" and case.ranks > 1:
                raise SystemExit(f"row {row!r} needs {case.ranks} GPUs; --device cuda runs the "
                                 "one-rank rows (gpt-1x1, llama-1x1-pretrained)")
            samples = [hybridpar.spawn(_rank, case.ranks,
                                       args=(case.config, case.overrides, case.init_from),
                                       backend="nccl" if device == "cuda" else "gloo",
                                       timeout=600) for _ in range(repeats)]
            ranks = [{k: statistics.median(s[r][k] for s in samples)
                      for k in ("peak", "shard", "gpu_peak")} for r in range(case.ranks)]
            worst = max(ranks, key=lambda d: d["peak"])
            results.append({"row": row, "ranks": ranks, "peak": worst["peak"],
                            "shard": worst["shard"], "gpu_peak": worst["gpu_peak"],
                            "repeats": repeats})
    return {"rows": results, "machine": machine(), "load": load(), "size": size,
            "small": size == "small", "device": device}


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
    parser.add_argument("--small", action="store_true", help="--size small")
    parser.add_argument("--size", choices=SIZES, default="full")
    parser.add_argument("--out", default="results/bench_build_memory.json")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = parser.parse_args(argv)
    size = "small" if args.small else args.size
    result = run(args.rows, repeats=args.repeats, size=size, device=args.device)
    print(table(result))
    write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
