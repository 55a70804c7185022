"""`hybridpar check` of Hugging Face models (``hf:*``): Llama and GPT-2 on fake GPUs.

A dry run of ``hf:llama`` used to die in native code ("free(): invalid next size", a
segmentation fault, at a random later point): `hf.sequential` gives each decoder block its
own copy of the rotary embedding with ``copy.deepcopy``, and torch deep-copies a FakeTensor's
``__dict__``, its FakeTensorMode with it: the mode's converter keys the constants it computed
by `StorageWeakRef`, whose raw weak reference (``cdata``, an int) the copy duplicates, and
both copies free it when collected: the storage's weak count goes below zero and its memory
is freed while in use. `train.check.fake_gpu.FakeFunctions` now keeps the mode out of the copy.

The dry runs run in a child process (the fake GPU's registration lasts for the process), the
CLI's after them in the same child, through the console script's entry (`hybridpar.cli.main`,
tests/cli_in_process.py; tests/test_check.py runs `hybridpar check` as a process). A fake
step's time goes with the number of ops it runs, not their sizes: the jobs' models have 2
blocks, and every dry run here takes 2 micro-batches.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hybridpar.train.check import CheckReport, dry_run
from hybridpar.train.configs.config import Config, load_config

pytest.importorskip("transformers", reason="pip install 'hybridpar[hf]'")

# the child's dry runs take about 250 s alone on a 2-core machine, more beside other tests:
# the module's tests (the first one waits for the child) get this instead of the suite's 300 s
TIMEOUT = 900
pytestmark = pytest.mark.timeout(TIMEOUT)
ROOT = Path(__file__).resolve().parents[1]
LLAMA = ROOT / "configs" / "llama_tiny.toml"
TWO_BLOCKS = ["model.num_hidden_layers=2", "parallel.chunks=2"]   # the jobs' tiny Llama


def gpt2(**parallel) -> Config:
    """A tiny HF GPT-2 (tied embedding and head, 2 blocks) at pp2 x tp2 unless told
    otherwise."""
    return Config.from_dict({
        "name": "gpt2_tiny",
        "model": {"name": "hf:gpt2", "vocab_size": 256, "n_embd": 64, "n_layer": 2,
                  "n_head": 4},
        "data": {"source": "corpus", "seq_len": 64},
        "parallel": {"pp": 2, "tp": 2, "chunks": 4, "schedule": "1f1b",
                     "tp_plan": "auto", **parallel},
        "train": {"batch_size": 16}})


JOBS = {   # two blocks and two micro-batches where the number is not the point keep them short
    "llama hf plan": lambda: dry_run(LLAMA, overrides=[
        *TWO_BLOCKS, "parallel.tp_plan=hf", "parallel.pp=1"], isolate=False),
    "llama 1x1": lambda: dry_run(LLAMA, overrides=[
        *TWO_BLOCKS, "parallel.pp=1", "parallel.tp=1"], isolate=False),
    "llama dp2": lambda: dry_run(LLAMA, overrides=[
        *TWO_BLOCKS, "parallel.dp=2", "parallel.pp=1", "parallel.tp=1"], isolate=False),
    "gpt2": lambda: dry_run(gpt2(chunks=2), isolate=False),
    # any decoder (no hybridpar code for Gemma 2): bf16 weights, ZeRO-2, recompute
    "gemma2 bf16 zero2": lambda: dry_run(ROOT / "configs" / "gemma2_tiny.toml", overrides=[
        "model.num_hidden_layers=2", "parallel.chunks=2", "train.param_dtype=bf16",
        "train.precision=bf16", "parallel.dp=2", "parallel.zero=2", "parallel.pp=1",
        "parallel.checkpoint=always", "data.seq_len=16"], isolate=False),
}


def pretrained_llama(folder: Path) -> CheckReport:
    """The tiny Llama's architecture saved by Hugging Face (`save_pretrained`), checked from
    ``model.pretrained`` at 1 x 1."""
    from transformers import LlamaConfig, LlamaForCausalLM

    options = {k: v for k, v in load_config(LLAMA, TWO_BLOCKS).model.args.items()
               if k != "pretrained"}
    LlamaForCausalLM(LlamaConfig(**options)).save_pretrained(folder)
    return dry_run(LLAMA, overrides=[*TWO_BLOCKS, f"model.pretrained={folder}",
                                     "parallel.pp=1", "parallel.tp=1"], isolate=False)


# `hybridpar check configs/llama_tiny.toml --memory 80 --set parallel.chunks=2 --json PATH`
CLI = ("check", str(LLAMA), "--memory", "80", "--set", "parallel.chunks=2", "--json")


def run_jobs(out: str) -> None:
    """In the child: every job's report as JSON in `out`, then the CLI's `CLI` (its JSON in
    cli.json, its exit status, stdout and stderr in cli.txt beside `out`)."""
    from cli_in_process import hybridpar

    reports = {name: job().to_dict() for name, job in JOBS.items()}
    reports["llama pretrained"] = pretrained_llama(Path(out).with_name("pretrained")).to_dict()
    Path(out).write_text(json.dumps(reports))
    done = hybridpar(*CLI, Path(out).with_name("cli.json"), timeout=300)
    Path(out).with_name("cli.txt").write_text(json.dumps(
        {"returncode": done.returncode, "stdout": done.stdout, "stderr": done.stderr}))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{job: CheckReport}, and the CLI's ``hybridpar check configs/llama_tiny.toml --memory
    80 --json`` (its 4 blocks, 2 micro-batches; exit status, stdout, its JSON as a
    CheckReport) as "cli": all in one child process."""
    folder = tmp_path_factory.mktemp("check_hf")
    code = (f"import sys; sys.path.insert(0, {str(ROOT / 'tests')!r}); import test_check_hf; "
            f"test_check_hf.run_jobs({str(folder / 'jobs.json')!r})")
    with open(folder / "jobs.err", "w") as err:
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=err, stderr=err, cwd=ROOT)
        try:
            proc.wait(timeout=TIMEOUT - 60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert proc.returncode == 0, (folder / "jobs.err").read_text()[-3000:]
    cli = json.loads((folder / "cli.txt").read_text())
    assert cli["returncode"] == 0, cli["stderr"][-3000:]
    reports = {name: CheckReport.from_dict(r)
               for name, r in json.loads((folder / "jobs.json").read_text()).items()}
    reports["cli"] = CheckReport.from_dict(json.loads((folder / "cli.json").read_text()))
    return reports, cli["stdout"]


def test_the_cli_checks_the_tiny_llama_at_pp2_x_tp2_and_prints_each_ranks_bytes(runs):
    reports, stdout = runs
    report = reports["cli"]
    assert report.dims == (1, 2, 2) and report.memory_gib == 80
    assert stdout.startswith("llama_tiny: dp=1 x pp=2 x tp=2 on 4 fake cuda devices")
    assert "fits --memory 80 GiB" in stdout and "NCCL replay of" in stdout
    for r in report.ranks:   # every parameter gets a gradient and AdamW's two moments
        assert 0 < r.grads < r.params                        # params: and the rotary buffers
        assert r.optimizer == 2 * r.grads and r.buckets == 0
        assert r.peak >= r.params + r.grads + r.optimizer and r.activations > 0
    stage = {s: [r for r in report.ranks if r.stage == s] for s in (0, 1)}
    for ranks in stage.values():   # tp peers hold halves of the same layers
        assert len({(r.params, r.peak) for r in ranks}) == 1


def test_the_hf_plan_and_one_device_pass_too(runs):
    reports, _ = runs
    assert reports["llama hf plan"].dims == (1, 1, 2)
    (alone,) = reports["llama 1x1"].ranks
    shards = reports["llama hf plan"].ranks
    # embedding, 2 blocks, norm, head
    assert alone.layers == tuple(range(5)) and all(r.layers == alone.layers for r in shards)
    assert alone.grads / 2 < shards[0].grads < alone.grads   # halves, norms and head whole


def test_a_pretrained_llama_is_checked_as_its_config_says_without_reading_its_weights(runs):
    reports, _ = runs
    report, plain = reports["llama pretrained"], reports["llama 1x1"]
    assert any("its weights are not read" in note for note in report.notes)
    assert report.ranks == plain.ranks   # the same architecture: the same numbers


def test_gpt2_with_its_tied_embedding_passes_at_pp2_x_tp2(runs):
    reports, _ = runs
    report = reports["gpt2"]
    assert report.dims == (1, 2, 2) and report.p2p_groups > 0
    first, last = report.ranks[0], report.ranks[-1]
    assert first.layers[0] == 0 and last.layers[-1] == sum(report.balance) - 1
    for r in report.ranks:   # the head's copy of the embedding trains on the last stage
        assert r.grads == r.params > 0 and r.optimizer == 2 * r.grads


def test_at_dp2_the_gradients_live_in_the_bucket_buffers_without_a_second_copy(runs):
    reports, _ = runs
    report = reports["llama dp2"]
    assert report.dims == (2, 1, 1)
    for r in report.ranks:
        assert r.grads == 0                              # every .grad is a view of a bucket
        assert 0 < r.buckets <= r.params and r.optimizer == 2 * r.buckets   # the trainable
        assert r.peak >= r.params + r.buckets + r.optimizer


@pytest.mark.filterwarnings("ignore:Accessing the data pointer of FakeTensor")
def test_any_decoder_is_probed_once_then_dry_run_at_bf16_zero_2(runs):
    """configs/gemma2_tiny.toml at dp 2 x tp 2: the parity probe ran once, on real CPU
    tensors, before the fake ranks (its note); the ranks then built it without probing."""
    reports, _ = runs
    report = reports["gemma2 bf16 zero2"]
    assert len(report.ranks) == 4 and report.precision == "bf16"
    assert any(n.startswith("model.verify: hf:gemma2 converts exactly") for n in report.notes)


def test_a_deep_copy_of_a_fake_tensor_keeps_the_dry_runs_fake_mode():
    # the regression behind the crash (module docstring): the copy shares the mode, so the
    # mode's StorageWeakRefs are never duplicated
    from torch._subclasses.fake_tensor import FakeTensorMode

    from hybridpar.train.check.fake_gpu import FakeFunctions

    with FakeTensorMode(allow_non_fake_inputs=True) as mode, FakeFunctions(mode):
        t = torch.arange(8, dtype=torch.float32) * 2
        weak_refs = len(mode.fake_tensor_converter.constant_storage_mapping)
        rotary = torch.nn.Module()
        rotary.register_buffer("inv_freq", t)
        copied = copy.deepcopy(rotary)
        assert copied.inv_freq is not t and copied.inv_freq.fake_mode is mode
        assert copied.inv_freq.shape == t.shape
        assert len(mode.fake_tensor_converter.constant_storage_mapping) == weak_refs
