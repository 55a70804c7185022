"""`hybridpar check`: the first steps of every rank on fake GPUs (hybridpar.train.check).

Every dry run here goes through the real pipeline (build_pipe, HybridPipe.train_step, the
executor, comm). The fake GPU's registration lasts for the process that runs a dry run, so
they run in child processes: `dry_run` isolates itself by default, and the `children` fixture
runs the dry runs of `JOBS` one after another in two children (torch's imports cost about 3 s
per process): "large" (8 fake ranks) with the virtual-stage jobs in one, the rest in the
other, while the CLI test's `hybridpar check` of the quick start runs in a third, whose JSON
is also the report the quick-start tests read (one dry run of it, not two): a dry run keeps
one core busy, so the three run side by side. A fake step's time goes with the number of
ops it runs (layers x micro-batches x ranks), not with their sizes. Models with a planted
fault are built by functions of this file.
"""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from spawn_cases import selected_ids
from torch import nn
from torch.testing._internal.distributed.fake_pg import FakeStore

from hybridpar.device import BRANCHES
from hybridpar.models import gpt, mlp
from hybridpar.train.check import CheckError, CheckReport, dry_run
from hybridpar.train.configs.config import Config, load_config

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "configs" / "quickstart.toml"
LARGE = ROOT / "configs" / "gpt_large_gpu.toml"


def small_mlp(*, model=(), train=(), **parallel):
    """A 2-stage x 2-shard MLP: 16 rows of 16 features in 4 micro-batches, 4 classes."""
    return Config.from_dict({
        "name": "small_mlp",
        "model": {"name": "mlp", "in_features": 16, "hidden": 32, "out_features": 4,
                  "n_layer": 3, **dict(model)},
        "parallel": {"pp": 2, "tp": 2, "chunks": 4, "schedule": "1f1b", **parallel},
        "train": {"batch_size": 16, **dict(train)}})


# faulty layers ---------------------------------------------------------------------------------
class ZerosOnTheCPU(nn.Module):
    def forward(self, x):
        return x + torch.zeros(x.shape)        # no device=: the CPU


class ReadsAValue(nn.Module):
    def forward(self, x):
        if x.abs().max().item() > 1e3:          # waits for the GPU
            x = x / 1e3
        return x


class CountsAsInt16(nn.Module):
    def forward(self, x):
        return x, (x > 0).sum(-1).to(torch.int16)   # (N, C), (N,) int16: NCCL has no int16


class DropsCounts(nn.Module):
    def forward(self, inputs):
        x, counts = inputs
        return x + 0 * counts[:, None]


def mlp_with_int16_counts(**options):
    """Stage 0 (layers 0-2) ends with CountsAsInt16: an int16 crosses the boundary."""
    layers = list(mlp(**options))
    return nn.Sequential(*layers[:2], CountsAsInt16(), DropsCounts(), *layers[2:])


def traced_dry_run(config, **options):
    """`dry_run` with every rank's pipe tracing its steps (as `hybridpar run --trace` does)."""
    from hybridpar.train import trainer

    built = trainer.build_pipe

    def build_traced(*args, **kwargs):
        pipe = built(*args, **kwargs)
        pipe.trace = True
        return pipe

    trainer.build_pipe = build_traced
    try:
        return dry_run(config, isolate=False, **options)
    finally:
        trainer.build_pipe = built


def mlp_with_zeros_on_the_cpu(**options):
    layers = list(mlp(**options))
    return nn.Sequential(*layers[:3], ZerosOnTheCPU(), *layers[3:])


def mlp_that_reads_a_value(**options):
    layers = list(mlp(**options))
    return nn.Sequential(*layers[:1], ReadsAValue(), *layers[1:])


def receive_before_sending(config):
    """A dry run whose stage 0 posts its first gradient receive in a group of its own before
    sending its second activation: stage 1 waits for that activation (with its first
    gradient's send after it), so under NCCL's rendezvous both ranks wait for each other (a
    planted fault in the P2P order; 1F1B's stage 0 posts that receive with the send)."""
    from hybridpar.pipe import HybridPipe
    from hybridpar.pipeline.schedules.schedule import GROUP, RECV_B, SEND_F, Action

    lowered = HybridPipe._program

    def program(pipe, microbatches, *, train):
        actions = list(lowered(pipe, microbatches, train=train))
        if pipe.stage == 0 and train:
            receive = actions.pop(next(k for k, a in enumerate(actions) if a.kind == RECV_B))
            second = next(k for k, a in enumerate(actions) if a.kind == SEND_F and
                          a.microbatch == 1)
            actions[second:second] = [receive, Action(GROUP, -1)]   # F1 RECV_B0 | SEND_F1
        return actions

    HybridPipe._program = program
    try:
        return dry_run(config, isolate=False)
    finally:
        HybridPipe._program = lowered


# the dry runs, in one child process -------------------------------------------------------------
JOBS = {   # the quick start's own dry run is the CLI's (`children`)
    # 2 micro-batches instead of 8 and 8 of its 24 layers (each 1024 wide) keep the test short
    "large": lambda: dry_run(LARGE, overrides=["parallel.chunks=2", "model.n_layer=8"],
                             isolate=False),
    "gpipe": lambda: dry_run(small_mlp(schedule="gpipe", checkpoint="never"), isolate=False),
    "1f1b": lambda: dry_run(small_mlp(schedule="1f1b", checkpoint="never"), isolate=False),
    "zeros": lambda: dry_run(small_mlp(), model=f"{__file__}:mlp_with_zeros_on_the_cpu",
                             isolate=False),
    "item": lambda: dry_run(small_mlp(), model=f"{__file__}:mlp_that_reads_a_value",
                            isolate=False),
    "deadlock": lambda: receive_before_sending(small_mlp(schedule="1f1b", checkpoint="never")),
    "interleaved": lambda: dry_run(small_mlp(schedule="interleaved", balance=[1, 1, 1, 1]),
                                   isolate=False),
    "zbv": lambda: dry_run(small_mlp(schedule="zbv", balance=[1, 1, 1, 1]), isolate=False),
    # bf16, sharded dropout, checkpointed micro-batches, a traced step: every CUDA branch
    "branches": lambda: traced_dry_run(small_mlp(model={"dropout": 0.1},
                                                 train={"precision": "bf16"},
                                                 checkpoint="except_last")),
    # 1 KiB per device: every rank's peak is over it
    "too little memory": lambda: dry_run(small_mlp(), memory_gib=2**-20, isolate=False),
    "int16": lambda: dry_run(small_mlp(balance="uniform"),
                             model=f"{__file__}:mlp_with_int16_counts", isolate=False),
    "int16 on cpu": lambda: dry_run(small_mlp(balance="uniform"), device="cpu",
                                    model=f"{__file__}:mlp_with_int16_counts", isolate=False),
    # pp2 x tp2 on fake CPU ranks: the vocab-parallel loss's target check skips fake tensors
    # (2 of its 4 blocks and 2 micro-batches: the same code, half the ops)
    "quickstart on cpu": lambda: dry_run(QUICKSTART, device="cpu",
                                         overrides=["parallel.chunks=2", "model.n_layer=2"],
                                         isolate=False),
}
# the jobs of the child beside "jobs": the 8 ranks of "large" and the virtual stages
LARGE_JOBS = ("large", "interleaved", "zbv")
TIMEOUT = 300   # seconds, each child: generous (66 s was too short beside the suite)


def run_jobs(out: str, *names: str) -> None:
    """In the child: the report or error (with the report of the failed check, if any) of
    each job of `names`, as JSON in `out`."""
    results = {}
    for name in names:
        try:
            results[name] = {"report": JOBS[name]().to_dict()}
        except CheckError as e:
            results[name] = {"error": str(e), "rank": e.rank,
                             "failed": e.report.to_dict() if e.report is not None else None}
    Path(out).write_text(json.dumps(results))


def _jobs(folder: Path, name: str, *names: str) -> list[str]:
    """The command of a child that runs JOBS `names` into <folder>/<name>.json."""
    code = f"import sys; sys.path.insert(0, {str(ROOT / 'tests')!r}); import test_check; " \
           f"test_check.run_jobs({str(folder / (name + '.json'))!r}, *{names!r})"
    return [sys.executable, "-c", code]


def _side_by_side(folder: Path, commands: dict[str, list[str]]) -> dict[str, int]:
    """Run `commands` (name -> command) as child processes at once, their output in
    <folder>/<name>.out and .err; {name: exit status}."""
    procs = {}
    for name, command in commands.items():
        with open(folder / f"{name}.out", "w") as out, open(folder / f"{name}.err", "w") as err:
            procs[name] = subprocess.Popen(command, stdout=out, stderr=err, cwd=ROOT)
    start = time.monotonic()
    try:
        for name, proc in procs.items():
            proc.wait(timeout=max(TIMEOUT - (time.monotonic() - start), 0.1))
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return {name: proc.returncode for name, proc in procs.items()}


def _reports(folder: Path, status: dict[str, int], names: tuple[str, ...]) -> dict:
    """The reports (or errors) of the children `names` by job name."""
    results = {}
    for name in names:
        assert status[name] == 0, (folder / f"{name}.err").read_text()[-3000:]
        results.update(json.loads((folder / f"{name}.json").read_text()))
    return {name: CheckReport.from_dict(r["report"]) if "report" in r else r
            for name, r in results.items()}


# the quick start's CLI dry run in the suite: 2 of its 4 blocks and 2 of its 8 micro-batches
# (what it moves per micro-batch and the table are the same; the campaign's check of every
# layer's parameter bytes runs it whole)
QUICK_CUT = ("parallel.chunks=2", "model.n_layer=2")


@pytest.fixture(scope="module")
def quick_overrides(request):
    """The overrides of the quick start's CLI dry run this session (none for the campaign's
    whole-model test)."""
    whole = selected_ids(request, "test_the_quick_start_passes_with_the_real_models_"
                                  "parameter_bytes")
    return () if whole else QUICK_CUT


@pytest.fixture(scope="module")
def children(tmp_path_factory, quick_overrides):
    """Two child processes side by side: the JOBS but LARGE_JOBS in turn, and `hybridpar
    check` of the quick start with --json (the CLI test's and the quick-start tests' report).
    Returns the folder of their files (<name>.out, <name>.err, <name>.json) and {name: exit
    status}."""
    folder = tmp_path_factory.mktemp("check")
    sets = [a for o in quick_overrides for a in ("--set", o)]
    return folder, _side_by_side(folder, {
        "jobs": _jobs(folder, "jobs", *(name for name in JOBS if name not in LARGE_JOBS)),
        "cli": [sys.executable, "-m", "hybridpar.cli", "check", str(QUICKSTART), *sets,
                "--json", str(folder / "cli.json")],
    })


@pytest.fixture(scope="module")
def runs(children):
    folder, status = children
    results = _reports(folder, status, ("jobs",))
    # `hybridpar check configs/quickstart.toml --json`: the dry run's report as is
    assert status["cli"] == 0, (folder / "cli.err").read_text()[-3000:]
    results["quickstart"] = CheckReport.from_dict(json.loads((folder / "cli.json").read_text()))
    return results


@pytest.fixture(scope="module")
def large_runs(tmp_path_factory):
    """The LARGE_JOBS in one child (the campaign's: 8 fake ranks, virtual stages)."""
    folder = tmp_path_factory.mktemp("check-large")
    return _reports(folder, _side_by_side(folder, {"large": _jobs(folder, "large",
                                                                 *LARGE_JOBS)}), ("large",))


# the quick start -------------------------------------------------------------------------------
def _layer_bytes(config, tp_rank):
    """Parameter bytes of each layer of the real model on one tp rank (built on meta)."""
    dist.init_process_group("fake", store=FakeStore(), rank=tp_rank,
                            world_size=config.parallel.tp)
    try:
        with torch.device("meta"):
            model = gpt(**config.model.args, tp=config.parallel.tp, group=dist.group.WORLD)
        return [sum(p.numel() * p.element_size() for p in layer.parameters())
                for layer in model]
    finally:
        dist.destroy_process_group()


def test_the_quick_start_passes_with_the_real_models_parameter_bytes(runs, quick_overrides):
    assert quick_overrides == ()                      # the whole model
    report, config = runs["quickstart"], load_config(QUICKSTART)
    assert report.dims == (1, 2, 2) and len(report.ranks) == 4
    assert report.device == "cuda" and sum(report.balance) == 7
    shards = [_layer_bytes(config, tp_rank) for tp_rank in range(config.parallel.tp)]
    for r in report.ranks:
        layers = shards[r.tp]
        start, stop = sum(report.balance[:r.stage]), sum(report.balance[:r.stage + 1])
        assert r.layers == tuple(range(start, stop))
        assert r.params == sum(layers[i] for i in r.layers)   # the gpt has no buffers
        assert r.grads == r.params                        # every parameter gets a gradient
        assert r.optimizer == 2 * r.params                # AdamW: exp_avg and exp_avg_sq
        assert r.buckets == 0                             # dp = 1
        # the peak is counted tensor by tensor from the steady state: the optimizer's state
        # and the saved activations are alive together in the step, and so are the gradients
        # and the foreach AdamW's temporaries (a copy of the parameters) in its update
        assert r.activations > 0
        assert r.peak >= r.params + r.optimizer + r.activations
        assert r.peak >= r.params + r.grads + r.optimizer + r.params


def test_the_quick_start_moves_bsh_floats_per_micro_batch_and_direction(runs, quick_overrides):
    report, config = runs["quickstart"], load_config(QUICKSTART, list(quick_overrides))
    m, tp = config.parallel.chunks, config.parallel.tp
    b = config.train.batch_size // m
    s, h = config.data.seq_len, config.model.args["n_embd"]
    boundary = b * s * h * 4                  # bytes each way per micro-batch (BENCH.md)
    for r in report.ranks:                   # scatter-gather: each tp rank moves 1/tp of it
        assert r.comm["p2p_send"] == {"bytes": m * boundary // tp, "calls": m}
        assert r.comm["p2p_recv"] == {"bytes": m * boundary // tp, "calls": m}
        assert r.comm["p2p_header"] == {"bytes": m * 1024, "calls": m}   # new shapes: 1 KiB
        assert r.collectives > 0              # tp all-reduces, loss broadcast, norm
    assert report.p2p_groups > 0


def test_saved_activations_follow_the_schedule(runs):
    # without checkpointing stage s holds m micro-batches under GPipe, p - s under 1F1B; the
    # batch's inputs (stage 0) and targets (stage 1) are one tensor each whatever the schedule
    m, p, shared = 4, 2, {0: 16 * 16 * 4, 1: 16 * 8}
    for g, f in zip(runs["gpipe"].ranks, runs["1f1b"].ranks):
        batch = shared[g.stage]
        assert (g.activations - batch) * (p - g.stage) == (f.activations - batch) * m


def test_the_large_gpu_config_passes_on_8_fake_ranks(large_runs):
    report = large_runs["large"]
    assert report.dims == (1, 4, 2) and len(report.ranks) == 8
    assert report.precision == "bf16" and len(report.balance) == 4
    assert any("balance='time'" in note for note in report.notes)
    assert all(r.params > 40 * 2**20 for r in report.ranks)   # bf16 autocast: fp32 weights
    assert len({(r.stage, r.params) for r in report.ranks}) == 4   # tp ranks alike


# what fails ------------------------------------------------------------------------------------
def test_a_tensor_made_on_the_cpu_in_forward_names_the_rank_and_layer(runs):
    failed = runs["zeros"]
    assert failed["rank"] == 2
    assert failed["error"].startswith(
        "rank 2 (dp 0, stage 1, tp 0): tensors on the GPU and the CPU meet in layer 3 "
        "(ZerosOnTheCPU) at ")
    assert "`return x + torch.zeros(x.shape)`" in failed["error"]


def test_item_in_a_layer_is_a_host_synchronisation_naming_the_layer(runs):
    failed = runs["item"]
    assert failed["rank"] == 0
    assert failed["error"].startswith(
        "rank 0 (dp 0, stage 0, tp 0): host synchronisation in layer 1 (ReadsAValue) at ")
    assert "`if x.abs().max().item() > 1e3:`" in failed["error"]


def test_a_p2p_order_nccl_cannot_progress_is_named(runs):
    # the fake backend completes every op, so the step itself runs; the replay of the logged
    # groups under NCCL's rules finds both stages waiting for each other
    failed = runs["deadlock"]
    assert failed["error"].startswith("the P2P order NCCL cannot progress: ")
    assert "the gradient of micro-batch 0" in failed["error"]
    assert "the activation of micro-batch 1 header" in failed["error"]   # new shapes


def test_too_little_memory_names_the_rank_and_by_how_much(runs):
    failed = runs["too little memory"]                # 1 KiB per device
    assert failed["failed"] is not None, failed       # the CheckError carries the report
    report = CheckReport.from_dict(failed["failed"])
    worst = max(report.ranks, key=lambda r: r.peak)
    assert failed["rank"] == worst.rank
    assert failed["error"].startswith(f"rank {worst.rank} (dp 0, stage {worst.stage}, tp "
                                      f"{worst.tp}) needs ")
    assert "KiB more than --memory 9.54e-07 GiB" in failed["error"]


@pytest.mark.parametrize("schedule", ["interleaved", "zbv"])
def test_virtual_stages_dry_run_every_stage_with_its_headers(large_runs, schedule):
    """pp 2 x tp 2, 2 stages per rank: the shape passes go round the ranks (under the V,
    rank 0's last stage waits for rank 1's), then every rank's steps exchange their headers,
    and their groups replay under NCCL's rules."""
    report = large_runs[schedule]
    held = {"interleaved": {0: (0, 2), 1: (1, 3)}, "zbv": {0: (0, 3), 1: (1, 2)}}[schedule]
    assert report.p2p_groups > 0
    for r in report.ranks:
        assert r.layers == held[r.stage]     # one layer per stage
        assert r.comm["p2p_send"]["bytes"] > 0 and r.comm["p2p_header"]["calls"] > 0


# the GPU path -----------------------------------------------------------------------------------
def test_every_cuda_branch_runs_in_the_dry_run(runs):
    # the fake GPU counts as CUDA (hybridpar.device.standing_in): every branch that reads the
    # switch takes its GPU side, its CUDA calls going to the dry run's FakeCuda
    report = runs["branches"]
    assert set(report.cuda_branches) == set(BRANCHES), report.cuda_branches
    assert report.cuda_branches["watchdog"] == 4          # on by default: one per rank
    assert report.cuda_branches["pinned batch"] == 4 * 2  # every rank, both steps


def test_fake_cpu_ranks_take_no_cuda_branch(runs):
    assert runs["int16 on cpu"].cuda_branches == {}


def test_the_dry_steps_exchange_headers_for_new_shapes_and_a_short_last_batch(runs):
    # step 1: the first batch; step 2: one row short, so the last micro-batch is smaller:
    # both are new shapes, each forward message goes with its header
    report = runs["1f1b"]
    assert report.microbatches == [[4, 4, 4, 4], [4, 4, 4, 3]]
    for r in report.ranks:   # the numbers are the first step's: one header per message
        assert r.comm["p2p_header"]["calls"] == 4
    assert report.p2p_groups > 0   # both steps' groups, headers included, replayed


def test_an_int16_between_stages_is_rejected_naming_the_layer_and_the_output(runs):
    failed = runs["int16"]
    assert failed["rank"] == 0
    assert failed["error"].startswith(
        "rank 0 (dp 0, stage 0, tp 0): stage 0 sends the activation of micro-batch 0 to stage "
        "1: output 1 of layer 2 (CountsAsInt16) is torch.int16, which NCCL cannot carry "
        "between GPUs"), failed["error"]
    assert "e.g. .to(torch.int32)" in failed["error"]


def test_fake_cpu_ranks_run_the_tensor_parallel_loss(runs):
    report = runs["quickstart on cpu"]
    assert report.device == "cpu" and len(report.ranks) == 4
    assert all(r.activations > 0 for r in report.ranks)


def test_gloo_carries_the_int16_that_nccl_cannot(runs):
    report = runs["int16 on cpu"]   # the same model on fake CPU ranks passes
    assert report.device == "cpu" and len(report.ranks) == 4


# the command line ------------------------------------------------------------------------------
def test_the_cli_prints_the_table_and_exits_0(children):
    folder, status = children          # `hybridpar check quickstart.toml --json cli.json`
    out = folder / "cli.json"
    stdout, stderr = (folder / "cli.out").read_text(), (folder / "cli.err").read_text()
    assert status["cli"] == 0, stderr
    lines = stdout.splitlines()
    assert lines[0].startswith("quickstart: dp=1 x pp=2 x tp=2 on 4 fake cuda devices")
    assert lines[1].split() == ["rank", "dp", "stage", "tp", "layers", "params", "grads",
                                "buckets", "optimizer", "activations", "peak", "p2p",
                                "collectives"]
    assert [line.split()[0] for line in lines[2:7]] == ["0", "1", "2", "3", "total"]
    assert "NCCL replay" in lines[7] and stderr == ""
    data = json.loads(out.read_text())
    assert [r["rank"] for r in data["ranks"]] == [0, 1, 2, 3]
    assert data["total"]["peak"] == sum(r["peak"] for r in data["ranks"])


def test_memory_takes_the_gib_of_a_device_and_says_so_when_given_a_path(capsys):
    from hybridpar.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["check", "--memory", "configs/llama_tiny.toml"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "'configs/llama_tiny.toml' is not a number of GiB" in err
    assert "hybridpar check CONFIG --memory 80" in err
