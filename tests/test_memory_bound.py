"""Building and loading a model costs each rank its shard, one layer and a little: measured.

Each rank resets its peak resident set (``/proc/self/clear_refs``) right before
`train.trainer.build_pipe` and reads VmHWM right after it and, with ``--init-from``, the read
of the export (`scripts/bench_build_memory.py`'s `_rank`): what the build added must stay
within the rank's shard + the largest single layer of the full model + 64 MiB, and below half
the model. At pp2 x tp2, for the gpt, an HF Llama and an HF GPT-2 (tied embedding and head),
each from the seed and from a checkpoint (``model.pretrained``: `save_pretrained`; the gpt:
``--init-from`` a safetensors export). The models are the benchmark's ``--size test`` (181-194
MiB, layers of 11-12 MiB): the bound, ~124 MiB, is two thirds of the model; measured, 58-73
MiB (2-core Xeon). Before the meta build, every rank built the whole model (and read every
file of a checkpoint).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import hybridpar
from hybridpar.models.registry import build
from hybridpar.train import load_config

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import bench_build_memory as bench

try:   # imported at collection, the ranks find Hugging Face's families imported (conftest.py)
    import transformers  # noqa: F401
except ImportError:
    pass

MIB = 1 << 20
ROWS = ["gpt-pp2tp2", "gpt-pp2tp2-init-from", "llama-pp2tp2", "llama-pp2tp2-pretrained",
        "gpt2-pp2tp2", "gpt2-pp2tp2-pretrained"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """Where the rows' checkpoints are written (once per model and kind)."""
    return tmp_path_factory.mktemp("checkpoints")


def _model_bytes(case: bench.Case) -> tuple[int, int]:
    """(the full model's bytes, its largest top-level layer's), built on meta: no storage."""
    config = load_config(case.config, case.overrides)
    args = {k: v for k, v in config.model.args.items() if k != "pretrained"}
    with torch.device("meta"):
        model, _ = build(config.model.name, **args)
    layer = max(sum(p.numel() * p.element_size() for p in layer.parameters())
                for layer in model.children())
    return sum(p.numel() * p.element_size() for p in model.parameters()), layer


@pytest.mark.parametrize("row", ROWS)
def test_a_rank_builds_and_loads_in_its_shard_plus_one_layer(row, folder):
    if not row.startswith("gpt-"):
        pytest.importorskip("transformers", reason="pip install 'hybridpar[hf]'")
    case = bench.cases([row], size="test", folder=folder)[row]
    full, layer = _model_bytes(case)
    assert full / case.ranks + layer + 64 * MIB < 0.7 * full   # the bound says something
    ranks = hybridpar.spawn(bench._rank, case.ranks,
                            args=(case.config, case.overrides, case.init_from), timeout=300)
    for rank, r in enumerate(ranks):
        bound = r["shard"] + layer + 64 * MIB
        assert r["peak"] <= bound, (rank, r["peak"] / MIB, r["shard"] / MIB, layer / MIB)
        assert r["peak"] < full / 2, (rank, r["peak"] / MIB, full / MIB)
