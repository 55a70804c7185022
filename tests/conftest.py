"""Set-up shared by every test file.

`hybridpar.spawn` forks its ranks from a forkserver that has imported torch and hybridpar
once (`hybridpar.launch.preload` adds to those). The ranks of the Hugging Face tests then import
transformers' model families on their own, 1-2 s of CPU a rank (4 ranks: 2-3 s a spawn on 2
cores). When the collected tests import transformers (they are being run), the forkserver
imports those modules too, once, before the first spawn starts it: what each rank runs is
unchanged, it only finds them imported. Last, it imports `torch_warnings`, which sets the
suite's warning filters (torch's deprecations are errors) in the forkserver, so in every rank.
Python 3.11's forkserver imports its preloads with its own path (its current directory first,
not tests/), hence the module by both names, its own (where the forkserver's path has tests/)
and the one from the checkout (``tests.torch_warnings``); a name that does not import is
skipped. So the server starts here, once the tests are collected, from the checkout, not at
the first spawn, which may run in whatever folder a test moved to; test_torch_floor.py
checks that a rank has the filters.
"""

from __future__ import annotations

import contextlib
import multiprocessing.forkserver
import sys
from pathlib import Path

import pytest
from tiers import COLLECTED, TIERS, campaign_keys, in_campaign

import hybridpar.launch

HF_PRELOAD = ["transformers", "transformers.models.auto.modeling_auto",
              "transformers.models.gpt2.modeling_gpt2", "transformers.models.llama.modeling_llama",
              "hybridpar.hf"]


def pytest_collection_finish(session):
    if "transformers" in sys.modules:
        hybridpar.launch.preload(*HF_PRELOAD)
    # ZeRO-1's ZeroRedundancyOptimizer: its package scripts every functional optimizer on
    # import, 0.5 s of CPU in each rank of the ZeRO tests (a few dozen spawns)
    hybridpar.launch.preload("torch.distributed.optim")
    # last: the imports above run unfiltered
    root = session.config.rootpath
    hybridpar.launch.preload("torch_warnings", _name_from(root, "torch_warnings"))
    if session.items and not session.config.option.collectonly:
        # Started now, from the checkout: it imports `tests.torch_warnings` from its current
        # directory, and the first test to spawn may have moved this process elsewhere
        # (monkeypatch.chdir), where the server would start without the filters.
        multiprocessing.get_context("forkserver").set_forkserver_preload(
            hybridpar.launch.preloaded())
        with contextlib.chdir(root):
            multiprocessing.forkserver.ensure_running()


def _name_from(root: Path, module: str) -> str:
    """The dotted name of tests/`module` as imported from directory `root`."""
    path = Path(__file__).resolve().parent / module
    try:
        return ".".join(path.relative_to(root.resolve()).parts)
    except ValueError:   # tests/ is outside `root`: the forkserver cannot import it
        return module


# The slowest modules first (seconds of a worker on 2 cores, `make test`): pytest-xdist hands
# each worker whole files in collection order (`--no-loadscope-reorder`: by default it puts the
# files with the most tests first), and a worker that draws one of these last runs alone while
# the others wait at the end.
SLOW_FIRST = ("test_run_cli.py", "test_check_memory.py", "test_zero.py", "test_check.py",
              "test_check_hf.py", "test_examples.py", "test_train_run.py", "test_hf_families.py",
              "test_compile.py", "test_launcher_faults.py", "test_finetune.py",
              "test_run_memory_limit.py",
              "test_master_weights.py", "test_run_any_model.py", "test_memory_bound.py",
              "test_run_stops.py", "test_trace.py", "test_hf_layouts.py",
              "test_virtual_parity.py", "test_nccl_order_plans.py",
              "test_bench_build_memory_smoke.py", "test_bad_inputs.py", "test_imports.py",
              "test_gpu_microbatch_smoke.py", "test_gpu_check_smoke.py",
              "test_sequence_parallel.py", "test_p2p_order.py", "test_bench_zero_smoke.py",
              "test_pipe_errors.py", "test_loopback.py", "test_weight_checks.py",
              "test_wakeup_latency_smoke.py", "test_tp_dense.py", "test_tp_shard.py",
              "test_watchdog.py", "test_layer_checkpoint.py", "test_zero_parity.py")


def pytest_addoption(parser):
    parser.addoption("--tier", choices=TIERS, default="suite",
                     help="suite: `make test`'s tests (the default); campaign: the long runs "
                          "of tests/tiers.py (`make campaign`); all: both")


def pytest_configure(config):
    config.addinivalue_line("markers", "campaign: a long run of tests/tiers.py's campaign "
                                       "(run with --tier campaign or --tier all)")


@pytest.hookimpl(tryfirst=True)   # before -k deselects: COLLECTED sees every test
def pytest_collection_modifyitems(session, config, items):
    config.stash[COLLECTED] = ({item.nodeid.partition("::")[0] for item in items},
                               {key for item in items for key in campaign_keys(item.nodeid)})

    def rank(item):
        name = Path(str(item.fspath)).name
        return SLOW_FIRST.index(name) if name in SLOW_FIRST else len(SLOW_FIRST)

    tier = config.getoption("--tier")
    kept, dropped = [], []
    for item in items:
        campaign = in_campaign(item.nodeid)
        if campaign:
            item.add_marker(pytest.mark.campaign)
        wanted = tier == "all" or (tier == "campaign") == campaign
        (kept if wanted else dropped).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
    items[:] = sorted(kept, key=rank)   # stable: the rest keep their order


def pytest_report_header(config):
    return (f"tier: {config.getoption('--tier')} (tests/tiers.py; `make test` runs the "
            "suite, `make campaign` the campaign)")
