"""Train the quick-start GPT at pp=2 x tp=2, export its checkpoint, sample from the plain model.

    python examples/export_plain.py [--steps 30] [--tokens 100]

Trains configs/quickstart.toml (shortened: --steps, batch 8) on 4 CPU ranks, then, in this one
process: `export_checkpoint` gathers the sharded checkpoint into the state dict of the
unsharded nn.Sequential, `torch.load(weights_only=True)` reads it into
``build_model("gpt", **config.model.args)`` and `generate` samples text from it. With the
trainer's prompt, temperature, top-k and seed it writes the text the pipeline sampled.
"""

import argparse
import tempfile
from pathlib import Path
from typing import Any

import torch

import hybridpar
from hybridpar.models import build_model, generate
from hybridpar.train import Config, load_config, make_batches
from hybridpar.train.data import TokenBatches, decode
from hybridpar.train.export import export_checkpoint
from hybridpar.train.trainer import train

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "quickstart.toml"


def run(config: Config, run_dir: str) -> dict[str, Any]:
    """One worker: the whole run; its losses and the text the pipeline sampled at the end."""
    summary = train(config, run_dir, progress=False)
    return {"losses": summary["losses"], "sample": summary["sample"]}


def sample_plain(config: Config, weights: Path) -> str:
    """Text from the plain one-device GPT holding the exported weights."""
    model = build_model("gpt", **config.model.args)
    model.load_state_dict(torch.load(weights, weights_only=True))
    model.eval()
    val = make_batches(config, split="val")
    assert isinstance(val, TokenBatches)
    prompt = val.tokens[:8].view(1, -1)                                   # (1, 8)
    out = generate(model, prompt, config.train.sample_tokens, temperature=0.8, top_k=32,
                   generator=torch.Generator().manual_seed(config.train.seed))  # (1, 8 + n)
    return decode(out[0])


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30, help="training steps")
    parser.add_argument("--tokens", type=int, default=100, help="tokens to sample")
    args = parser.parse_args()
    config = load_config(CONFIG, [f"train.steps={args.steps}", f"checkpoint.every={args.steps}",
                                  "train.batch_size=8", "train.eval_every=0",
                                  f"train.sample_tokens={args.tokens}"])
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        summary = hybridpar.spawn(run, 4, args=(config, str(run_dir)), timeout=600)[0]
        losses = summary["losses"]
        print(f"trained {len(losses)} steps at pp=2 x tp=2: loss {losses[0]:.4f} -> "
              f"{losses[-1]:.4f}")
        checkpoint = run_dir / "checkpoints" / f"step-{args.steps}"
        state = export_checkpoint(checkpoint, Path(tmp) / "gpt.pt")
        count = sum(t.numel() for t in state.values())
        print(f"exported {checkpoint.name}: {len(state)} tensors, {count:,} values")
        text = sample_plain(config, Path(tmp) / "gpt.pt")
    print(f"plain model sample:\n{text}")
    print(f"same text as the pipeline's sample: {text == summary['sample']}")
