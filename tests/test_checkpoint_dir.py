"""The single-process pieces of a run: checkpoint folders, the LR schedule, metrics.jsonl, keys.

No process group: folders are made by hand (a complete checkpoint is a ``step-N`` folder
holding ``.metadata``), so every case of `checkpoint_steps` / `prune_checkpoints` is cheap.
"""

import itertools
import json
import logging
import math

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)

from hybridpar.tensor_parallel.random import get_rng_state_all
from hybridpar.train.checkpoints.checkpoint import (
    CheckpointError,
    allocate_like,
    check_compatible,
    checkpoint_steps,
    latest_checkpoint,
    prune_checkpoints,
    read_metadata,
    saved_entries,
)
from hybridpar.train.checkpoints.shards import (
    ShardChunk,
    check_unique,
    flatten,
    model_entries,
    optimizer_entries,
    unflatten,
)
from hybridpar.train.lr import lr_at
from hybridpar.train.metrics import MetricsLog, read_metrics

LOGGER = "hybridpar.train.checkpoints.checkpoint"


def complete(root, step):
    path = root / f"step-{step}"
    path.mkdir(parents=True)
    (path / ".metadata").write_bytes(b"")
    (path / "__0_0.distcp").write_bytes(b"data")
    return path


def names(root):
    return sorted(p.name for p in root.iterdir())


# the LR schedule -----------------------------------------------------------------------------

def test_lr_warms_up_linearly_to_the_peak_at_step_warmup():
    lrs = [lr_at(s, lr=1.0, steps=20, warmup_steps=4, min_lr=0.1) for s in range(5)]
    assert lrs == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0])
    assert lrs[0] == pytest.approx(1.0 / 4)                      # lr / warmup: step 0 trains
    steps = [b - a for a, b in itertools.pairwise(lrs[:4])]
    assert steps == pytest.approx([0.25] * 3)                   # linear
    assert lr_at(4, lr=1.0, steps=20, warmup_steps=4, min_lr=0.1) == 1.0   # peak at warmup


@pytest.mark.parametrize("steps,warmup", [(20, 4), (10, 0), (7, 1), (3, 0), (1, 0)])
def test_lr_decays_monotonically_towards_min_lr_and_the_last_step_still_trains(steps, warmup):
    # the cosine reaches min_lr one step after the last (issue 39): with the default
    # min_lr = 0 a last step at exactly 0 would update nothing
    lrs = [lr_at(s, lr=3e-3, steps=steps, warmup_steps=warmup, min_lr=3e-4)
           for s in range(steps)]
    assert lrs[warmup] == 3e-3
    last = 3e-4 + (3e-3 - 3e-4) * (1 - math.cos(math.pi / (steps - warmup))) / 2
    assert lrs[-1] == pytest.approx(last) and (lrs[-1] > 3e-4 or steps - warmup == 1)
    decay = lrs[warmup:]
    assert all(b < a for a, b in itertools.pairwise(decay))
    assert all(3e-4 < v <= 3e-3 for v in lrs)
    # the step after the last is the floor, and past it (a longer resumed run's config
    # aside) it stays there
    assert lr_at(steps, lr=3e-3, steps=steps, warmup_steps=warmup, min_lr=3e-4) == 3e-4
    assert lr_at(steps + 5, lr=3e-3, steps=steps, warmup_steps=warmup, min_lr=3e-4) == 3e-4


def test_the_last_step_of_a_short_run_at_the_default_min_lr_updates():
    assert lr_at(3, lr=1e-3, steps=4) == pytest.approx(1e-3 * (1 - math.cos(math.pi / 4)) / 2)
    assert lr_at(3, lr=1e-3, steps=4) > 0


def test_lr_cosine_midpoint_and_no_warmup():
    # 10 steps, no warm-up: t = step / 10, the midpoint (step 5) is halfway between
    assert lr_at(0, lr=2.0, steps=10) == 2.0
    assert lr_at(5, lr=2.0, steps=10, min_lr=1.0) == pytest.approx(1.5)
    assert lr_at(10, lr=2.0, steps=10) == 0.0
    assert lr_at(3, lr=2.0, steps=10) == pytest.approx(1.0 + math.cos(math.pi * 0.3))


def test_lr_is_a_pure_function_of_the_step():
    kwargs = dict(lr=1e-3, steps=50, warmup_steps=5, min_lr=1e-5)
    first = [lr_at(s, **kwargs) for s in range(50)]
    assert [lr_at(s, **kwargs) for s in reversed(range(50))][::-1] == first


# metrics.jsonl ---------------------------------------------------------------------------

def write_steps(path, steps, *, after=0):
    log = MetricsLog(path, after=after)
    for s in steps:
        log.write({"step": s, "loss": 1.0 / s})
    log.close()


def test_metrics_appends_one_line_per_record_and_flushes(tmp_path):
    path = tmp_path / "sub" / "metrics.jsonl"
    log = MetricsLog(path)
    log.write({"step": 1, "loss": 2.5, "lr": 0.1})
    assert read_metrics(path) == [{"step": 1, "loss": 2.5, "lr": 0.1}]   # before close
    log.write({"step": 2, "loss": 2.0, "lr": 0.1})
    log.close()
    lines = path.read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2]
    assert read_metrics(tmp_path / "missing.jsonl") == []


def test_metrics_fresh_run_clears_an_old_file(tmp_path):
    path = tmp_path / "metrics.jsonl"
    write_steps(path, [1, 2, 3])
    write_steps(path, [1], after=0)
    assert [r["step"] for r in read_metrics(path)] == [1]


def test_metrics_resume_drops_records_after_the_checkpoint_step(tmp_path):
    path = tmp_path / "metrics.jsonl"
    write_steps(path, range(1, 7))                  # crashed after logging step 6
    write_steps(path, range(5, 9), after=4)         # resumed from the checkpoint of step 4
    records = read_metrics(path)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6, 7, 8]
    assert names(tmp_path) == ["metrics.jsonl"]      # no temporary file left


def test_metrics_tolerate_a_line_cut_by_a_crash(tmp_path):
    path = tmp_path / "metrics.jsonl"
    write_steps(path, [1, 2, 3])
    with open(path, "a") as f:
        f.write('{"step": 4, "lo')                   # cut mid-line, no newline
    assert [r["step"] for r in read_metrics(path)] == [1, 2, 3]
    write_steps(path, [4, 5], after=3)
    lines = path.read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3, 4, 5]   # all valid


# checkpoint folders ------------------------------------------------------------------------

def test_checkpoint_steps_lists_complete_folders_numerically(tmp_path, caplog):
    root = tmp_path / "checkpoints"
    assert checkpoint_steps(root) == [] and latest_checkpoint(root) is None
    for step in (2, 10, 9):
        complete(root, step)
    (root / "step-12").mkdir()                        # cut short: no .metadata
    (root / ".step-14.partial").mkdir()               # a save in progress
    (root / ".step-14.partial" / ".metadata").write_bytes(b"")
    (root / "step-16").write_bytes(b"")               # a file, not a folder
    (root / "step-x").mkdir()
    (root / "notes.txt").write_text("hi")
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert checkpoint_steps(root) == [2, 9, 10]   # 10 after 9: numbers, not strings
        assert latest_checkpoint(root) == root / "step-10"
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings and all("step-12" in r.getMessage() for r in warnings)
    assert ".metadata" in warnings[0].getMessage()


def test_latest_checkpoint_ignores_a_newer_folder_without_metadata(tmp_path, caplog):
    root = tmp_path / "checkpoints"
    complete(root, 4)
    (root / "step-6").mkdir()
    (root / "step-6" / "__0_0.distcp").write_bytes(b"half")
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert latest_checkpoint(root) == root / "step-4"
    assert any("step-6" in r.getMessage() and r.levelno == logging.WARNING
               for r in caplog.records)


def test_a_step_folder_with_leading_zeros_is_ignored_with_a_warning(tmp_path, caplog):
    root = tmp_path / "checkpoints"
    newest = complete(root, 3)
    complete(root, "007")                             # e.g. copied in by hand
    assert latest_checkpoint(root) == newest and newest.is_dir()
    assert "rename it to step-7" in caplog.text
    assert checkpoint_steps(root) == [3]


def test_prune_keeps_the_newest_and_deletes_debris(tmp_path):
    root = tmp_path / "checkpoints"
    for step in (2, 4, 6, 8):
        complete(root, step)
    (root / "step-10").mkdir()                        # newer number, but incomplete
    (root / ".step-12.partial").mkdir()
    (root / "notes.txt").write_text("kept")
    deleted = prune_checkpoints(root, keep=2)
    assert sorted(p.name for p in deleted) == [".step-12.partial", "step-10", "step-2",
                                               "step-4"]
    assert names(root) == ["notes.txt", "step-6", "step-8"]
    assert prune_checkpoints(root, keep=5) == []
    prune_checkpoints(root, keep=1)
    assert names(root) == ["notes.txt", "step-8"]
    prune_checkpoints(root, keep=1)                   # the newest is never deleted
    assert names(root) == ["notes.txt", "step-8"]
    assert prune_checkpoints(tmp_path / "missing", keep=1) == []


@pytest.mark.parametrize("keep", [0, -1])
def test_prune_rejects_keep_below_one(tmp_path, keep):
    complete(tmp_path, 1)
    with pytest.raises(ValueError, match="keep must be >= 1"):
        prune_checkpoints(tmp_path, keep=keep)
    assert names(tmp_path) == ["step-1"]


def test_read_metadata_errors(tmp_path):
    with pytest.raises(CheckpointError, match="no such checkpoint folder"):
        read_metadata(tmp_path / "step-1")
    (tmp_path / "step-2").mkdir()
    with pytest.raises(CheckpointError, match=r"incomplete checkpoint \(no \.metadata\)"):
        read_metadata(tmp_path / "step-2")
    complete(tmp_path, 3)
    (tmp_path / "step-3" / ".metadata").write_bytes(b"not a pickle")
    with pytest.raises(CheckpointError, match="unreadable checkpoint index"):
        read_metadata(tmp_path / "step-3")
    (tmp_path / "file").write_text("")
    with pytest.raises(CheckpointError, match="no such checkpoint folder"):
        read_metadata(tmp_path / "file")


def _meta(**tensors):
    entries = {k.replace("__", "/").replace("_", "."): TensorStorageMetadata(
        properties=TensorProperties(dtype=dtype), size=torch.Size(size), chunks=[])
        for k, (size, dtype) in tensors.items()}
    return Metadata(state_dict_metadata=entries)


def test_check_compatible_names_missing_and_reshaped_tensors():
    metadata = _meta(model__0_w=((4, 3), torch.float32), optim__0_w__step=((), torch.float32))
    metadata.state_dict_metadata["data/blob"] = BytesStorageMetadata()
    check_compatible("ck", metadata, {"model/0.w": torch.zeros(4, 3), "other/x": torch.zeros(1)})
    check_compatible("ck", metadata, {"model/0.w": ShardChunk(
        torch.zeros(2, 3), torch.Size([4, 3]), torch.Size([2, 0]))})      # the full size counts
    with pytest.raises(CheckpointError, match=r"ck does not match this model: 0\.w has shape "
                       r"\(4, 3\) there and \(4, 5\) here"):
        check_compatible("ck", metadata, {"model/0.w": torch.zeros(4, 5)})
    with pytest.raises(CheckpointError, match=r"1 of its tensors are missing \(first: 1\.b\)"):
        check_compatible("ck", metadata, {"model/0.w": torch.zeros(4, 3),
                                          "model/1.b": torch.zeros(2)})
    with pytest.raises(CheckpointError, match=r"0\.w/step has shape"):
        check_compatible("ck", metadata, {"optim/0.w/step": torch.zeros(1)}, prefix="optim/")
    assert set(saved_entries(metadata, "model/")) == {"model/0.w"}
    assert set(saved_entries(metadata, "data/")) == set()


def test_allocate_like_makes_tensors_of_the_saved_shape_and_dtype():
    metadata = _meta(layout=((5,), torch.int64), model__0_w=((2, 3), torch.float16))
    out = allocate_like(metadata, ["layout", "model/0.w"])
    assert out["layout"].shape == (5,) and out["layout"].dtype == torch.int64
    assert out["model/0.w"].shape == (2, 3) and out["model/0.w"].dtype == torch.float16


# flat keys -----------------------------------------------------------------------------------

def test_flatten_unflatten_round_trip():
    tree = {"cpu": torch.arange(3), "tracker": {"a": torch.ones(2), "b": torch.zeros(1)},
            "cuda": [torch.tensor(1), torch.tensor(2)]}
    flat = flatten("rng/0.1.2", tree)
    assert set(flat) == {"rng/0.1.2/cpu", "rng/0.1.2/tracker/a", "rng/0.1.2/tracker/b",
                         "rng/0.1.2/cuda/0", "rng/0.1.2/cuda/1"}
    back = unflatten("rng/0.1.2", flat, tree)
    assert back.keys() == tree.keys() and isinstance(back["cuda"], list)
    assert torch.equal(back["cpu"], tree["cpu"]) and torch.equal(back["cuda"][1], tree["cuda"][1])
    assert torch.equal(back["tracker"]["b"], tree["tracker"]["b"])
    # values come from `flat`, the structure from `like`
    other = {k: v + 1 for k, v in flat.items()}
    assert torch.equal(unflatten("rng/0.1.2", other, tree)["tracker"]["a"], torch.full((2,), 2.))
    assert flatten("x", torch.ones(1)).keys() == {"x"}
    assert flatten("x", {}) == {} and unflatten("x", {}, {}) == {}


def test_flatten_unflatten_the_real_rng_state():
    state = get_rng_state_all()
    back = unflatten("rng/0.0.0", flatten("rng/0.0.0", state), state)
    assert torch.equal(back["cpu"], state["cpu"])
    assert back["tracker"].keys() == state["tracker"].keys()


def test_check_unique_accepts_this_stages_layers_only():
    ok = ["model/2.attn.q.weight", "model/4.weight", "optim/3.fc.bias/exp_avg", "train/step",
          "layout", "data/epoch", "rng/0.1.0/cpu"]
    check_unique(ok, range(2, 5))
    for key in ["model/5.weight", "model/1.weight", "optim/7.w/step", "model/tok.weight",
                "model/-1.weight"]:
        with pytest.raises(RuntimeError, match="does not name a layer of this stage") as info:
            check_unique([*ok, key], range(2, 5))
        assert repr(key) in str(info.value) and "layers 2..4" in str(info.value)


# model and optimizer entries (no tp group: plain tensors) --------------------------------

def _tiny():
    return nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4), nn.Linear(4, 2, bias=False))


def test_model_entries_are_the_sequential_state_dict_names():
    model = _tiny()
    entries = model_entries(model, None)
    assert list(entries) == [f"model/{k}" for k in model.state_dict()]
    assert all(entries[f"model/{k}"] is v for k, v in model.state_dict(keep_vars=True).items())
    check_unique(entries, range(3))


def test_optimizer_entries_before_a_step_look_like_after_one():
    model = _tiny()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    before = optimizer_entries(model, optimizer, None)
    assert all(float(v.abs().sum()) == 0 for v in before.values())        # step 0, zeros
    model(torch.randn(5, 3)).sum().backward()
    optimizer.step()
    after = optimizer_entries(model, optimizer, None)
    assert list(after) == list(before)
    for key, value in after.items():
        assert value.shape == before[key].shape and value.dtype == before[key].dtype, key
    assert float(after["optim/0.weight/step"]) == 1.0
    assert {k.rsplit("/", 1)[1] for k in after} == {"step", "exp_avg", "exp_avg_sq"}


def test_optimizer_entries_of_any_optimizer_are_its_first_steps_tensor_state():
    model = _tiny()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    entries = optimizer_entries(model, sgd, None)            # before any step: made as the
    names = [n for n, _ in model.named_parameters()]         # first step would make them
    assert sorted(entries) == sorted(f"optim/{n}/momentum_buffer" for n in names)
    assert all(not e.any() for e in entries.values())
    plain = torch.optim.SGD(model.parameters(), lr=0.1)      # momentum 0: no state at all
    assert optimizer_entries(model, plain, None) == {}


def test_optimizer_entries_reject_state_a_checkpoint_cannot_hold():
    model = _tiny()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    sgd.state[next(model.parameters())]["calls"] = 3
    with pytest.raises(TypeError, match="only tensor state can be checkpointed"):
        optimizer_entries(model, sgd, None)
    with pytest.raises(ValueError, match="amsgrad"):
        optimizer_entries(model, torch.optim.Adam(model.parameters(), amsgrad=True), None)


def test_shard_chunk_reports_the_full_size():
    chunk = ShardChunk(torch.zeros(5, 4), torch.Size([11, 4]), torch.Size([6, 0]))
    assert chunk.size() == torch.Size([11, 4])
    assert "offsets=[(6, 0)]" in repr(chunk) and "global=(11, 4)" in repr(chunk)
