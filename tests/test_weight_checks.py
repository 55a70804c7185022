"""Loaded weights are checked (issue 40, points 4 and 8): a NaN or inf in a parameter, or an
integer / bool tensor where the model has float weights, is an error naming the tensor and
the file, raised on every rank, on every loading path: ``--init-from`` a safetensors export
(`load_plain_shards`), ``--init-from`` a ``.pt`` file (`load_exported` +
`load_consolidated_state_dict`), ``model.pretrained`` (`load_hf_shards`: cases in
tests/test_hf_shard_load.py). Before, each of these loaded silently: a NaN start trained
nothing under ``nonfinite = "skip"`` and exited 0; an int32 ``q.weight`` was cast to float.

Integer buffers (BatchNorm's ``num_batches_tracked``) still load.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from cli_in_process import CliResult
from cli_in_process import hybridpar as hybridpar_cli
from torch import nn

import hybridpar
from hybridpar.io.weight_checks import check_finite, check_kind

pytest.importorskip("safetensors", reason="safetensors exports")

TINY = Path(__file__).parent / "data" / "tiny_gpt.toml"   # pp=2: rank 1 holds the last block


def _save_safetensors(state: dict[str, torch.Tensor], folder: Path) -> Path:
    from safetensors.torch import save_file

    folder.mkdir()
    save_file({k: v.clone().contiguous() for k, v in state.items()},
              str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def _tiny_state() -> dict[str, torch.Tensor]:
    from hybridpar.models import build_model
    from hybridpar.train import load_config

    torch.manual_seed(0)
    return dict(build_model("gpt", **load_config(TINY).model.args).state_dict())


def _run(tmp_path: Path, init_from: Path) -> CliResult:
    """`hybridpar run tiny.toml --init-from INIT_FROM` in this process (the agent's line that
    names the failing worker's error is what the tests read)."""
    config = tmp_path / "tiny.toml"
    config.write_text(TINY.read_text())
    return hybridpar_cli("run", config, "--init-from", init_from, cwd=tmp_path, timeout=180)


# as a user meets it: `hybridpar run --init-from`, 2 workers ------------------------------------

def test_init_from_a_pt_export_with_a_nan_weight_fails_naming_tensor_and_file(tmp_path):
    state = _tiny_state()
    name = "2.attn.q.weight"                 # the last block: stage 1 (rank 1) alone holds it
    state[name] = state[name].clone()
    state[name][3, :2] = float("nan")
    torch.save(state, tmp_path / "nan.pt")
    done = _run(tmp_path, tmp_path / "nan.pt")
    assert done.returncode == 1, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("hybridpar run: worker rank ") and "CheckpointError" in last, last
    assert f"{name} in " in last and "nan.pt" in last and "holds 2 NaN" in last, last
    assert not list((tmp_path / "runs").glob("*/checkpoints/step-*"))   # nothing trained


def test_init_from_safetensors_with_an_int32_weight_fails_naming_tensor_and_file(tmp_path):
    state = _tiny_state()
    name = "1.attn.q.weight"                 # the first block: stage 0 (rank 0)
    state[name] = (state[name] * 100).to(torch.int32)      # right shape, wrong kind
    folder = _save_safetensors(state, tmp_path / "int32")
    done = _run(tmp_path, folder)
    assert done.returncode == 1, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert "CheckpointError" in last, last
    assert f"{name} in {folder / 'model.safetensors'} is I32" in last, last
    assert "never cast into float weights" in last, last


# every path, every rank: 2 ranks, pp=2, in one spawn ------------------------------------------

def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 4), nn.BatchNorm1d(4))


def _load_cases(folder: str) -> dict[str, object]:
    """Each file of `folder` loaded into a pp=2 pipe, safetensors and .pt; what each rank got
    (an error's message, or the state dict it holds)."""
    from hybridpar.hf.shard_load import load_plain_shards
    from hybridpar.train.export import load_exported

    topo = hybridpar.init(pp=2, timeout=30)
    out: dict[str, object] = {}
    for case in ("good", "nan", "bool", "inf"):
        pipe = hybridpar.HybridPipe(_model(), [2, 2], topology=topo)
        for kind in ("safetensors", "pt"):
            path = Path(folder) / (f"{case}_st" if kind == "safetensors" else f"{case}.pt")
            try:
                if kind == "safetensors":
                    load_plain_shards(pipe, path)
                else:
                    pipe.load_consolidated_state_dict(load_exported(path))
                out[f"{case} {kind}"] = {k: v.clone() for k, v in pipe.state_dict().items()}
            except ValueError as e:
                out[f"{case} {kind}"] = str(e)
        pipe.close()
    return out


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    root = tmp_path_factory.mktemp("weights")
    good = _model().state_dict()
    good["1.num_batches_tracked"] = torch.tensor(7)        # an int64 buffer, legitimately
    cases = {"good": good}
    cases["nan"] = {**good, "2.weight": good["2.weight"].clone().fill_(float("nan"))}
    cases["bool"] = {**good, "0.weight": torch.ones(4, 4, dtype=torch.bool)}
    cases["inf"] = {**good, "3.running_var": good["3.running_var"],
                    "3.weight": torch.tensor([1.0, float("inf"), 1.0, 1.0])}
    for case, state in cases.items():
        _save_safetensors(state, root / f"{case}_st")
        torch.save(state, root / f"{case}.pt")
    results = hybridpar.spawn(_load_cases, 2, args=(str(root),), timeout=120)
    return root, results


@pytest.mark.parametrize("kind", ["safetensors", "pt"])
def test_integer_buffers_still_load(loaded, kind):
    _, results = loaded
    stage0 = results[0][f"good {kind}"]                    # layers 0 and 1
    assert isinstance(stage0, dict) and int(stage0["1.num_batches_tracked"]) == 7


@pytest.mark.parametrize("kind", ["safetensors", "pt"])
@pytest.mark.parametrize("case, name, says", [
    ("nan", "2.weight", "holds 16 NaN of its 16 values"),      # stage 1's tensor
    ("inf", "3.weight", "holds 1 inf of its 4 values"),
    ("bool", "0.weight", "never cast into float weights"),     # stage 0's tensor
])
def test_a_bad_weight_is_named_with_its_file_on_every_rank(loaded, kind, case, name, says):
    root, results = loaded
    file = root / f"{case}_st" / "model.safetensors" if kind == "safetensors" \
        else "the state dict"
    for rank, r in enumerate(results):
        message = r[f"{case} {kind}"]
        assert isinstance(message, str), f"rank {rank} loaded {case} silently"
        assert message.startswith(f"{name} in {file} "), message
        assert says in message, message


def test_the_checks_alone(monkeypatch):
    weight = torch.zeros(2, 2)
    check_kind("w", "f", "BF16", weight)                   # floats of any width convert
    check_kind("w", "f", torch.float16, weight)
    check_kind("n", "f", torch.int64, torch.zeros((), dtype=torch.int64))   # an int buffer
    with pytest.raises(ValueError, match=r"^w in f is int32, but the model's tensor is float32"):
        check_kind("w", "f", torch.int32, weight)
    with pytest.raises(ValueError, match=r"^w in f is BOOL"):
        check_kind("w", "f", "BOOL", weight)
    check_finite("w", "f", weight)
    with pytest.raises(ValueError, match="holds 1 NaN, 1 inf of its 4 values"):
        check_finite("w", "f", torch.tensor([0.0, float("nan"), float("-inf"), 1.0]))
    monkeypatch.setattr("hybridpar.io.weight_checks._CHUNK", 10)   # checked in slices
    wide = torch.zeros(3, 40)
    check_finite("w", "f", wide[:, 20:])
    wide[2, 39] = float("inf")
    with pytest.raises(ValueError, match="holds 1 inf of its 60 values"):
        check_finite("w", "f", wide[:, 20:])
