"""Training runs end to end: metrics, checkpoints, exact resume, reshard, crash, export, init-from.

Every run is a tiny GPT (4 blocks, n_embd 32, block 16) on the embedded corpus, 8 steps of 8
samples, trained on gloo ranks started by `hybridpar.spawn`. Two uninterrupted reference runs
(module fixtures) serve several tests: `ref_run` (pp=2, tp=2, no dropout: eval, sample,
checkpoints kept for reshard / export) and `dropout_run` (dropout 0.1: the RNG streams of a
resume must be restored for its losses to match; it saves no checkpoint, only its losses are
read). A resume under another layout runs the two steps after the step-4 checkpoint: step 5's
loss checks the weights, step 6's the optimizer state, and step 6's save the new layout's.
"""

import json
import os
import re
import shutil
from math import prod
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from safetensors_counting import counting_reads
from spawn_cases import selected_ids, spawn_cases
from torch import nn

import hybridpar
import hybridpar.launch
from hybridpar.models import build_model
from hybridpar.tensor_parallel.layers import ParallelEmbedding
from hybridpar.train import Config, load_config
from hybridpar.train.checkpoints.checkpoint import (
    CheckpointError,
    checkpoint_steps,
    load_checkpoint,
    save_checkpoint,
)
from hybridpar.train.checkpoints.shards import ShardLoadPlanner, check_unique, model_entries
from hybridpar.train.data import decode, make_batches
from hybridpar.train.export import export_checkpoint, export_plain, load_exported
from hybridpar.train.lr import lr_at
from hybridpar.train.metrics import read_metrics
from hybridpar.train.trainer import build_pipe, train

QUICKSTART = Path(__file__).resolve().parent.parent / "configs" / "quickstart.toml"
TIMEOUT = 90
STEPS = 8

BASE = [
    "model.block_size=16", "model.n_embd=32", "model.n_layer=4", "model.n_head=4",
    "model.dropout=0.0", "data.source=corpus",
    "parallel.pp=2", "parallel.tp=2", "parallel.dp=1", "parallel.chunks=2",
    "parallel.timeout=60",
    f"train.steps={STEPS}", "train.batch_size=8", "train.warmup_steps=2", "train.log_every=1",
    "train.eval_every=0", "train.eval_batches=1", "train.sample_tokens=0",
    "checkpoint.every=2", "checkpoint.keep=2",
]


def config(*overrides: str) -> Config:
    return load_config(QUICKSTART, [*BASE, *overrides])


REF = ("train.eval_every=4", "train.sample_tokens=8", "checkpoint.keep=3")
DROPOUT = ("model.dropout=0.1",)


# workers (module level: the children import them by name) -------------------------------------

def _train(cfg, run_dir, init_from=None, stop_at=None):
    return train(cfg, run_dir, init_from=init_from, stop_at=stop_at, progress=False)


def _train_crash(cfg, run_dir, crash_step):
    """Train, but die (os._exit, no cleanup) right before the rename of step `crash_step`."""
    real = os.replace

    def replace(src, dst, *args, **kwargs):
        if Path(src).name == f".step-{crash_step}.partial":
            os._exit(9)
        return real(src, dst, *args, **kwargs)

    os.replace = replace   # the module attribute hybridpar.train.checkpoints.checkpoint.os.replace
    return train(cfg, run_dir, progress=False)


def _checkpoint_errors(cfg, cases):
    """Each (run_dir, init_from) trained in turn; what each raised, as "Type: message"."""
    out = []
    for run_dir, init_from in cases:
        try:
            train(cfg, run_dir, init_from=init_from, progress=False)
        except Exception as e:
            out.append(f"{type(e).__name__}: {e}")
        else:
            out.append(None)
    return out


def _from_export(cfg, exported, x, paths, run_root):
    """The pipeline with the exported weights: its eval outputs, its consolidated state dict
    and the bytes of this rank's tensors (its stage, its tp slices); then a one-step run
    --init-from each of `paths` (in RUN_ROOT/run<i>): its summary and the bytes this rank
    read from safetensors files."""
    topo = hybridpar.init(pp=cfg.parallel.pp, tp=cfg.parallel.tp)
    pipe = build_pipe(cfg, topo)
    tensors = pipe.state_dict(keep_vars=True)
    own = sum(t.numel() * t.element_size() for t in {id(t): t for t in tensors.values()}.values())
    pipe.load_consolidated_state_dict(load_exported(exported))
    pipe.eval()
    out = pipe(x)
    state = pipe.consolidated_state_dict()
    runs = []
    for i, path in enumerate(paths):
        with counting_reads() as counter:
            result = train(cfg, Path(run_root) / f"run{i}", init_from=path, stop_at=1,
                           progress=False)
        runs.append((result, counter[0]))
    return {"out": out, "state": state, "own": own, "runs": runs}


W_ROWS = torch.arange(11 * 4, dtype=torch.float32).view(11, 4)    # 11 rows: uneven over 2, 3
W_COLS = torch.arange(3 * 7, dtype=torch.float32).view(3, 7)      # 7 columns: uneven too


def _embeddings(tables, group):
    rows, cols = tables
    return nn.Sequential(ParallelEmbedding(11, 4, _weight=rows, dim=0, group=group),
                         ParallelEmbedding(3, 7, _weight=cols, dim=-1, group=group))


def _save_embeddings(root):
    topo = hybridpar.init(tp=int(os.environ["WORLD_SIZE"]))
    model = _embeddings((W_ROWS, W_COLS), topo.tp_group)
    state = model_entries(model, topo.tp_group)
    check_unique(state, range(2))
    save_checkpoint(root, 1, state, keep=1)
    return [tuple(model[0].weight.shape), tuple(model[1].weight.shape)]


def _load_embeddings(path):
    topo = hybridpar.init(tp=int(os.environ["WORLD_SIZE"]))
    model = _embeddings((torch.zeros(11, 4), torch.zeros(3, 7)), topo.tp_group)
    load_checkpoint(path, model_entries(model, topo.tp_group))
    return [model[0].weight.detach().clone(), model[1].weight.detach().clone()]


# helpers -------------------------------------------------------------------------------------

def run(cfg, run_dir, *, init_from=None, stop_at=None):
    """`train` on the config's pp * tp * dp ranks; each rank's summary."""
    par = cfg.parallel
    return hybridpar.spawn(_train, par.pp * par.tp * (par.dp or 1),
                           args=(cfg, str(run_dir), init_from, stop_at), timeout=TIMEOUT)


def same_on_every_rank(results, key):
    values = [r[key] for r in results]
    assert all(v == values[0] for v in values), f"{key} differs between ranks: {values}"
    return values[0]


def folders(root):
    return sorted(p.name for p in Path(root).iterdir())


def copy_checkpoint(src, run_dir):
    dst = Path(run_dir) / "checkpoints" / src.name
    shutil.copytree(src, dst)
    return dst


def plain_model(cfg, state):
    model = build_model("gpt", **cfg.model.args)   # tp=None: the unsharded model
    model.load_state_dict(state, strict=True)
    return model.eval()


def gpt_loss_of(model, x, y):
    with torch.no_grad():
        logits = model(x)
    return float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)))


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """The two uninterrupted pp=2 x tp=2 runs, one after the other on the same 4 ranks (each
    `train` seeds its own streams): name -> (run folder, each rank's summary)."""
    configs = {"dropout": config(*DROPOUT, "checkpoint.every=0"), "ref": config(*REF)}
    dirs = {name: tmp_path_factory.mktemp(name) for name in configs}
    results = spawn_cases(_train, 4, {name: (configs[name], str(dirs[name]))
                                      for name in configs}, timeout=TIMEOUT * 2)
    return {name: (dirs[name], results[name]) for name in configs}


@pytest.fixture(scope="module")
def ref_run(references):
    """pp=2 x tp=2, no dropout, uninterrupted: eval at 4 and 8, a sample, keep=3."""
    return (config(*REF), *references["ref"])


@pytest.fixture(scope="module")
def dropout_run(references):
    """pp=2 x tp=2 with dropout 0.1, uninterrupted (the reference of resume and crash): the
    config those tests run (checkpoints every 2 steps) and the losses of the same run without
    saves (a save draws no random number: the resumes match it exactly)."""
    return (config(*DROPOUT), *references["dropout"])


# 1. a whole run ----------------------------------------------------------------------------

def test_run_trains_and_writes_metrics_checkpoints_config_and_sample(ref_run):
    cfg, run_dir, results = ref_run
    assert len(results) == 4
    losses = same_on_every_rank(results, "losses")
    assert same_on_every_rank(results, "start") == 0
    assert same_on_every_rank(results, "steps") == STEPS
    assert len(losses) == STEPS and all(torch.isfinite(torch.tensor(losses)))
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.1, losses

    records = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    for r, loss in zip(records, losses):
        assert {"step", "loss", "lr", "tokens_per_s", "step_time"} <= set(r)
        assert r["loss"] == loss
        assert r["lr"] == pytest.approx(lr_at(r["step"] - 1, lr=cfg.train.lr, steps=STEPS,
                                              warmup_steps=2, min_lr=cfg.train.min_lr))
        assert r["tokens_per_s"] > 0 and r["step_time"] > 0
        assert r["tokens_per_s"] == pytest.approx(8 * 16 / r["step_time"])
    evals = same_on_every_rank(results, "eval")
    assert sorted(evals) == [4, 8]
    assert {r["step"]: r["eval_loss"] for r in records if "eval_loss" in r} == evals

    saved = json.loads((run_dir / "config.json").read_text())
    assert saved == json.loads(json.dumps(cfg.to_dict()))
    assert Config.from_dict(saved) == cfg

    root = run_dir / "checkpoints"
    assert folders(root) == ["step-4", "step-6", "step-8"]   # keep=3 of 2, 4, 6, 8
    assert all((root / name / ".metadata").is_file() for name in folders(root))
    assert checkpoint_steps(root) == [4, 6, 8]

    sample = same_on_every_rank(results, "sample")
    text = (run_dir / "sample.txt").read_text(encoding="utf-8")
    assert text == sample and len(text) > 0
    prompt = make_batches(cfg, split="val").tokens[:8]
    assert text.startswith(decode(prompt))
    assert len(text.encode("utf-8")) >= 8 + 8        # prompt + sample_tokens (U+FFFD: 3 bytes)


LAST_STEP = [(3, 2, [2, 3]), (2, 0, None)]   # steps, checkpoint.every, the steps saved


def last_step_config(steps, every):
    return config("parallel.pp=2", "parallel.tp=1", f"train.steps={steps}", "train.log_every=2",
                  f"checkpoint.every={every}", "checkpoint.keep=5", "train.sample_tokens=0")


@pytest.mark.parametrize("steps,every,saved", LAST_STEP)
def test_last_step_is_saved_and_logged_and_every_zero_saves_nothing(two_ranks, steps, every,
                                                                     saved):
    tmp_path, results = two_ranks[f"last {steps} every {every}"]
    assert results[0]["sample"] is None and results[0]["steps"] == steps
    assert not (tmp_path / "sample.txt").exists()                     # sample_tokens = 0
    if saved is None:
        assert not (tmp_path / "checkpoints").exists()
    else:
        assert checkpoint_steps(tmp_path / "checkpoints") == saved
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [s for s in range(1, steps + 1)
                                            if s % 2 == 0 or s == steps]
    assert [r["loss"] for r in records] == [results[0]["losses"][r["step"] - 1]
                                            for r in records]


# 2. resume ---------------------------------------------------------------------------------

def test_resume_continues_exactly_with_dropout(dropout_run, tmp_path):
    cfg, _, full = dropout_run
    reference = full[0]["losses"]
    first = run(cfg, tmp_path, stop_at=5)
    assert same_on_every_rank(first, "steps") == 5
    assert same_on_every_rank(first, "losses") == reference[:5]
    assert folders(tmp_path / "checkpoints") == ["step-2", "step-4"]
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4, 5]

    second = run(cfg, tmp_path)
    assert same_on_every_rank(second, "start") == 4
    assert same_on_every_rank(second, "steps") == STEPS
    assert same_on_every_rank(second, "losses") == reference[4:]     # exactly, not approx

    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))  # step 5 once, re-logged
    assert [r["loss"] for r in records] == reference
    assert folders(tmp_path / "checkpoints") == ["step-6", "step-8"]


def test_dropout_makes_the_resume_test_meaningful(dropout_run, ref_run):
    # with dropout, the losses depend on the random streams a resume must restore
    assert dropout_run[2][0]["losses"] != ref_run[2][0]["losses"]


def test_finished_run_trains_no_more_steps_and_resume_wins_over_init_from(two_ranks):
    # the step-8 checkpoint copied, --init-from a missing file: not read, a checkpoint is there
    tmp_path, again = two_ranks["finished"]
    assert again[0]["start"] == STEPS and again[0]["losses"] == []
    assert again[0]["sample"] is None
    assert checkpoint_steps(tmp_path / "checkpoints") == [8]


# 3. reshard (and virtual stages) ------------------------------------------------------------

RESHARD = [(1, 1, 1), (4, 1, 1), (1, 4, 1), (2, 1, 2)]
VIRTUAL = ["interleaved", "zbv"]
RESUMED_TO = 6      # steps 5 and 6 after the step-4 checkpoint, and the save of step 6


def _resharded(layout):
    pp, tp, dp = layout
    return config(*REF, f"parallel.pp={pp}", f"parallel.tp={tp}", f"parallel.dp={dp}",
                  "train.eval_every=0", "train.sample_tokens=0")


def _virtual(schedule):
    return config(*REF, f"parallel.schedule={schedule}", "train.eval_every=0",
                  "train.sample_tokens=0")


@pytest.fixture(scope="module")
def reshards(request, ref_run, tmp_path_factory):
    """The step-4 checkpoint resumed to step RESUMED_TO under each layout of RESHARD and
    with 2 stages per rank under each schedule of VIRTUAL, each in a run folder of its own:
    the 4-rank runs one after another on the same ranks (`train` inits each layout), the
    1-rank one apart (the campaign's layouts and schedules left out: tests/tiers.py).
    layout or schedule -> (run folder, each rank's summary)."""
    wanted = selected_ids(request, "test_resume_under_virtual_stages_matches_the_uninterrupted_"
                                   "run")
    layouts = selected_ids(request, "test_resume_under_another_layout_matches_the_uninterrupted_"
                                    "run")
    configs = {**{layout: _resharded(layout) for layout in RESHARD
                  if "pp{}-tp{}-dp{}".format(*layout) in layouts},
               **{schedule: _virtual(schedule) for schedule in VIRTUAL if schedule in wanted}}
    out = {}
    for key in configs:
        folder = tmp_path_factory.mktemp(key if isinstance(key, str) else
                                         "pp{}-tp{}-dp{}".format(*key))
        copy_checkpoint(ref_run[1] / "checkpoints" / "step-4", folder)
        out[key] = folder
    fours = {key: (configs[key], str(folder), None, RESUMED_TO) for key, folder in out.items()
             if isinstance(key, str) or prod(key) == 4}
    four = spawn_cases(_train, 4, fours, timeout=TIMEOUT * 3) if fours else {}
    return {key: (folder, four[key] if key in four else
                  run(configs[key], folder, stop_at=RESUMED_TO))
            for key, folder in out.items()}


def assert_resumed_as_uninterrupted(ref_run, run_dir, resumed):
    _, _, results = ref_run
    assert same_on_every_rank(resumed, "start") == 4
    assert same_on_every_rank(resumed, "steps") == RESUMED_TO
    losses = same_on_every_rank(resumed, "losses")
    assert losses == pytest.approx(results[0]["losses"][4:RESUMED_TO], abs=1e-5, rel=0)
    assert checkpoint_steps(run_dir / "checkpoints") == [4, 6]    # saved under this layout


@pytest.mark.parametrize("schedule", VIRTUAL)
def test_resume_under_virtual_stages_matches_the_uninterrupted_run(ref_run, reshards, schedule):
    """A pp 2 x tp 2 checkpoint resumed with 2 stages per rank (looped or V): the same
    layout-free names, the same losses."""
    run_dir, resumed = reshards[schedule]
    assert len(resumed) == 4
    assert_resumed_as_uninterrupted(ref_run, run_dir, resumed)


@pytest.mark.parametrize("layout", RESHARD, ids=lambda t: "pp{}-tp{}-dp{}".format(*t))
def test_resume_under_another_layout_matches_the_uninterrupted_run(ref_run, reshards, layout):
    pp, tp, dp = layout
    run_dir, resumed = reshards[layout]
    assert len(resumed) == pp * tp * dp
    assert_resumed_as_uninterrupted(ref_run, run_dir, resumed)


def test_uneven_embedding_shards_reshard_through_a_checkpoint(tmp_path):
    """ParallelEmbedding splits unevenly (gpt itself needs vocab % tp == 0): 11 rows and 7
    columns saved at tp=2 load exactly at tp=3 and at tp=1."""
    root = tmp_path / "checkpoints"
    shapes = hybridpar.spawn(_save_embeddings, 2, args=(str(root),), timeout=TIMEOUT)
    assert shapes == [[(6, 4), (3, 4)], [(5, 4), (3, 3)]]
    path = root / "step-1"
    assert checkpoint_steps(root) == [1]

    shards = hybridpar.spawn(_load_embeddings, 3, args=(str(path),), timeout=TIMEOUT)
    rows = [(0, 4), (4, 8), (8, 11)]
    cols = [(0, 3), (3, 5), (5, 7)]
    for rank, (table_rows, table_cols) in enumerate(shards):
        assert torch.equal(table_rows, W_ROWS[slice(*rows[rank])])
        assert torch.equal(table_cols, W_COLS[:, slice(*cols[rank])])

    whole = {"model/0.weight": torch.zeros(11, 4), "model/1.weight": torch.zeros(3, 7)}
    dcp.load(whole, checkpoint_id=str(path), planner=ShardLoadPlanner(), no_dist=True)
    assert torch.equal(whole["model/0.weight"], W_ROWS)
    assert torch.equal(whole["model/1.weight"], W_COLS)
    plain = export_checkpoint(path, tmp_path / "emb.pt")
    assert set(plain) == {"0.weight", "1.weight"}
    assert torch.equal(plain["0.weight"], W_ROWS) and torch.equal(plain["1.weight"], W_COLS)


# 4. export ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def exported(ref_run, tmp_path_factory):
    run_dir = ref_run[1]
    out = tmp_path_factory.mktemp("export") / "not" / "yet" / "model.pt"
    plain = export_checkpoint(run_dir / "checkpoints" / "step-8", out)
    return out, plain


def test_export_writes_the_plain_state_dict_atomically(ref_run, exported):
    cfg = ref_run[0]
    out, plain = exported
    assert os.listdir(out.parent.parent.parent) == ["not"]   # the missing folders made
    assert os.listdir(out.parent) == ["model.pt"]            # and no temporary file left
    state = torch.load(out, weights_only=True)
    model = build_model("gpt", **cfg.model.args)
    assert set(state) == set(model.state_dict())
    for key, value in model.state_dict().items():
        assert state[key].shape == value.shape, key
        assert torch.equal(state[key], plain[key])
    model.load_state_dict(state, strict=True)


def test_export_overwrites_a_file_whole(ref_run, exported, tmp_path):
    out = tmp_path / "model.pt"
    shutil.copy(exported[0], out)
    step4 = export_checkpoint(ref_run[1] / "checkpoints" / "step-4", out)
    assert os.listdir(tmp_path) == ["model.pt"]                        # no temp left
    reloaded = load_exported(out)
    assert reloaded.keys() == step4.keys() == exported[1].keys()
    assert all(torch.equal(reloaded[k], step4[k]) for k in step4)
    assert not all(torch.equal(reloaded[k], exported[1][k]) for k in step4)


def test_exported_weights_give_the_runs_eval_loss(ref_run, exported):
    cfg, _, results = ref_run
    model = plain_model(cfg, load_exported(exported[0]))
    x, y = make_batches(cfg, split="val").next_batch()
    assert gpt_loss_of(model, x, y) == pytest.approx(results[0]["eval"][8], abs=1e-5)


def test_export_errors(tmp_path):
    with pytest.raises(CheckpointError, match="no such checkpoint folder"):
        export_checkpoint(tmp_path / "missing", tmp_path / "out.pt")
    (tmp_path / "step-1").mkdir()
    with pytest.raises(CheckpointError, match="incomplete"):
        export_checkpoint(tmp_path / "step-1", tmp_path / "out.pt")
    assert not (tmp_path / "out.pt").exists()
    torch.save({"a": 1}, tmp_path / "obj.pt")
    with pytest.raises(ValueError, match="not a state dict of tensors"):
        load_exported(tmp_path / "obj.pt")


# 5. pipeline outputs and --init-from -------------------------------------------------------

@pytest.fixture(scope="module")
def from_export(ref_run, exported, tmp_path_factory):
    """The step-8 export also as safetensors (3+ shards, and one file), then one 4-rank spawn
    (`_from_export`): the pipeline loaded from the .pt file, and a one-step run --init-from the
    .pt file, the shards' folder, their index and the single file (RUN_ROOT/run0 .. run3)."""
    from hybridpar.io.weight_files import INDEX

    cfg, run_dir, _ = ref_run
    pt, plain = exported
    root = tmp_path_factory.mktemp("from-export")
    total = sum(t.numel() * t.element_size() for t in plain.values())
    written = export_plain(run_dir / "checkpoints" / "step-8", root / "shards",
                           max_shard_size=total // 3)
    export_plain(run_dir / "checkpoints" / "step-8", root / "one")   # model.safetensors
    paths = [str(pt), str(root / "shards"), str(root / "shards" / INDEX),
             str(root / "one" / "model.safetensors")]
    x, _ = make_batches(cfg, split="val").next_batch()                 # (8, 16)
    got = hybridpar.spawn(_from_export, 4, args=(cfg, str(pt), x, paths, str(root / "runs")),
                          timeout=TIMEOUT)
    return {"root": root, "written": written, "total": total, "x": x, "ranks": got}


def test_exported_model_matches_the_pipeline_and_init_from_starts_there(
        ref_run, exported, from_export):
    cfg, _, results = ref_run
    out, plain = exported
    model = plain_model(cfg, load_exported(out))
    x = from_export["x"]
    with torch.no_grad():
        expected = model(x)                                            # (8, 16, 256)
    got = from_export["ranks"]
    for rank in got:
        torch.testing.assert_close(rank["out"], expected, atol=1e-5, rtol=0)
        assert list(rank["state"]) == list(model.state_dict())
        for key, value in rank["state"].items():
            assert torch.equal(value, plain[key]), key

    # --init-from: the first step's loss is that of the exported weights on the first batch
    result = got[0]["runs"][0][0]
    assert result["start"] == 0 and result["steps"] == 1
    x0, y0 = make_batches(cfg, split="train").next_batch()
    assert result["losses"][0] == pytest.approx(gpt_loss_of(model, x0, y0), abs=1e-5)
    assert abs(result["losses"][0] - results[0]["losses"][0]) > 0.1   # not the seed's weights
    run0 = from_export["root"] / "runs" / "run0"
    assert [r["step"] for r in read_metrics(run0 / "metrics.jsonl")] == [1]


def test_a_folder_of_shards_starts_a_run_as_the_pt_file_does(ref_run, exported, from_export):
    """`hybridpar export CHECKPOINT OUT` (no .pt): safetensors files written one tensor at a
    time; --init-from takes the folder, its index or a single file and starts from the same
    weights as the .pt file, each rank reading only its stage's tensors and tp slices."""
    cfg = ref_run[0]
    plain = exported[1]
    total, written = from_export["total"], from_export["written"]
    assert len(written.files) >= 3 and written.total_size == total
    assert written.peak_bytes <= total // 3
    state = load_exported(from_export["root"] / "shards")
    assert state.keys() == plain.keys() and all(torch.equal(state[k], plain[k]) for k in plain)
    model = plain_model(cfg, plain)
    got = from_export["ranks"]
    x0, y0 = make_batches(cfg, split="train").next_batch()
    first = [result["losses"][0] for result, _ in got[0]["runs"]]
    assert first[0] == pytest.approx(gpt_loss_of(model, x0, y0), abs=1e-5)
    assert first[1:] == [first[0]] * 3                     # bit for bit the .pt file's start
    for rank in got:                                       # pp2 x tp2: a quarter, about
        read = [nbytes for _, nbytes in rank["runs"]]
        assert read == [0, rank["own"], rank["own"], rank["own"]], (read, rank["own"])
        assert rank["own"] < total / 2


def _refusal_cases(ref_run, exported, root):
    """Each refusal test's (config, [(run folder, init_from)]), its files written under
    ROOT/<test>: bad --init-from files, an export changed in one stage, safetensors exports
    that do not fit, and the step-8 checkpoint resumed by a model of another width or depth."""
    folders = {name: root / name for name in
               ("bad", "head", "safetensors", "other width", "other depth")}
    for folder in folders.values():
        folder.mkdir()

    tmp = folders["bad"]
    cfg = config("parallel.pp=2", "parallel.tp=1")
    garbage = tmp / "garbage.pt"
    garbage.write_bytes(b"\x00not a torch file" * 10)
    other = tmp / "other.pt"
    torch.save(build_model("gpt", **{**cfg.model.args, "n_embd": 16}).state_dict(), other)
    mlp = tmp / "mlp.pt"
    torch.save(build_model("mlp").state_dict(), mlp)
    objects = tmp / "objects.pt"
    torch.save({"a": 1}, objects)
    cases = {"bad": (cfg, [(str(tmp / f"run{i}"), str(f)) for i, f in enumerate(
        [tmp / "missing.pt", garbage, other, mlp, objects])])}

    tmp = folders["head"]
    state = load_exported(exported[0])
    state["6.proj.weight"] = torch.zeros(255, 32)          # the head only (stage 1)
    torch.save(state, tmp / "head.pt")
    cases["head"] = (config("parallel.pp=2", "parallel.tp=1", "parallel.timeout=20"),
                     [(str(tmp / "r"), str(tmp / "head.pt"))])

    from safetensors.torch import save_file

    tmp = folders["safetensors"]
    state = load_exported(exported[0])
    exports = {"missing": {k: v for k, v in state.items() if k != "3.mlp.fc.weight"},
               "shape": {**state, "4.attn.q.weight": torch.zeros(32, 31)},
               "extra": {**state, "7.weight": torch.zeros(2)}}
    for name, tensors in exports.items():
        (tmp / name).mkdir()
        save_file(tensors, str(tmp / name / "model.safetensors"))
    (tmp / "empty").mkdir()
    cases["safetensors"] = (config("parallel.pp=2", "parallel.tp=1", "parallel.timeout=20"),
                            [(str(tmp / f"run-{name}"), str(tmp / name))
                             for name in [*exports, "empty"]])

    for name, changes in (("other width", ["model.n_embd=16"]),
                          ("other depth", ["model.n_layer=2", "parallel.timeout=20"])):
        copy_checkpoint(ref_run[1] / "checkpoints" / "step-8", folders[name])
        cases[name] = (config("parallel.pp=2", "parallel.tp=1", *changes),
                       [(str(folders[name]), None)])
    return folders, cases


def _two_rank_case(kind, *args):
    """A case of the 2-rank spawn: a run (`_train`) or refusals (`_checkpoint_errors`)."""
    return (_train if kind == "run" else _checkpoint_errors)(*args)


@pytest.fixture(scope="module")
def two_ranks(ref_run, exported, tmp_path_factory):
    """Every pp=2 x tp=1 run of this file, one case after another on the same 2 ranks: the
    runs of LAST_STEP ("last <steps> every <every>"), the step-8 checkpoint resumed with
    --init-from a missing file ("finished"), then every refusal of a checkpoint or an
    --init-from file (each raised on both ranks before any step: "Type: message" of each run,
    None where it trained). case -> (its folder, each rank's result)."""
    root = tmp_path_factory.mktemp("two-ranks")
    cases, folders = {}, {}
    for steps, every, _ in LAST_STEP:
        name = f"last {steps} every {every}"
        folders[name] = root / name
        cases[name] = ("run", last_step_config(steps, every), str(folders[name]))
    folders["finished"] = root / "finished"
    copy_checkpoint(ref_run[1] / "checkpoints" / "step-8", folders["finished"])
    cases["finished"] = ("run", config("parallel.pp=2", "parallel.tp=1", *REF),
                         str(folders["finished"]), str(folders["finished"] / "missing.pt"))
    refused, refusal_cases = _refusal_cases(ref_run, exported, root)
    folders.update(refused)
    cases.update({name: ("refusals", *args) for name, args in refusal_cases.items()})
    results = spawn_cases(_two_rank_case, 2, cases, timeout=TIMEOUT * 3)
    return {name: (folders[name], results[name]) for name in cases}


def test_bad_init_from_raises_checkpoint_error_on_every_rank(two_ranks):
    _, results = two_ranks["bad"]
    for messages in results:
        assert all(m is not None and m.startswith("CheckpointError: --init-from ")
                   for m in messages), messages
        missing, bad_bytes, small, wrong_model, not_tensors = messages
        assert "missing.pt: no such file" in missing
        assert "cannot be read as a state dict" in bad_bytes and "garbage.pt" in bad_bytes
        assert "does not fit model 'gpt'" in small and "other.pt" in small
        assert "does not fit model 'gpt'" in wrong_model and "missing" in wrong_model
        assert "cannot be read as a state dict" in not_tensors


def test_init_from_mismatch_in_one_stage_fails_on_every_rank(two_ranks):
    _, results = two_ranks["head"]
    messages = [m for (m,) in results]
    assert all(m is not None and m.startswith("CheckpointError: ") for m in messages), messages


def test_a_safetensors_export_that_does_not_fit_fails_on_every_rank_naming_the_file(two_ranks):
    """Checked before anything is read, on the rank that holds the key; raised on both."""
    tmp_path, results = two_ranks["safetensors"]
    for messages in results:                                # every rank: the same errors
        assert all(m is not None and m.startswith("CheckpointError: --init-from ")
                   for m in messages), messages
        missing, shape, extra, empty = messages
        assert "3.mlp.fc.weight" in missing and "not in the checkpoint" in missing
        assert str(tmp_path / "missing" / "model.safetensors") in missing
        assert "4.attn.q.weight" in shape and "has shape (32, 31)" in shape
        assert "expects (32, 32)" in shape and str(tmp_path / "shape") in shape
        assert "7.weight" in extra and "does not have" in extra
        assert "holds neither" in empty


# 6. a crash in the middle of a save ----------------------------------------------------------

def test_crash_during_save_resumes_from_the_previous_checkpoint(dropout_run, tmp_path):
    cfg, _, full = dropout_run
    root = tmp_path / "checkpoints"
    with pytest.raises(hybridpar.SpawnError):
        hybridpar.spawn(_train_crash, 4, args=(cfg, str(tmp_path), 4), timeout=TIMEOUT)
    assert folders(root) == [".step-4.partial", "step-2"]
    partial = root / ".step-4.partial"
    assert (partial / ".metadata").is_file() and list(partial.glob("*.distcp"))
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4]
    # debris of other crashes: a partial of a later step, a copy cut short (no .metadata)
    (root / ".step-99.partial").mkdir()
    (root / "step-98").mkdir()

    resumed = run(cfg, tmp_path)
    assert same_on_every_rank(resumed, "start") == 2
    assert same_on_every_rank(resumed, "losses") == full[0]["losses"][2:]
    assert folders(root) == ["step-6", "step-8"]            # debris pruned after a save
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == \
        list(range(1, STEPS + 1))


# 7. a checkpoint of another model (cases of the `two_ranks` spawn) ----------------------------

def test_checkpoint_of_another_model_fails_on_every_rank(two_ranks):
    tmp_path, results = two_ranks["other width"]
    for (message,) in results:
        assert message is not None and message.startswith("CheckpointError: "), message
        assert "step-8 does not match this model" in message
        assert re.search(r"has shape \(.*32.*\) there and \(.*16.*\) here", message), message
    assert not (tmp_path / "checkpoints" / "step-10").exists()


def test_checkpoint_of_a_model_with_other_layers_fails_on_every_rank(two_ranks):
    _, results = two_ranks["other depth"]
    messages = [m for (m,) in results]
    # stage 1 of the 2-block model holds layer 4 as the head: "4.proj.weight" is not saved
    assert any(m is not None and "tensors are missing" in m for m in messages), messages
    assert all(m is not None and m.startswith("CheckpointError: ") for m in messages), messages
