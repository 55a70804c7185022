"""torch 2.11, the oldest release hybridpar supports, proven on the one torch these machines
install (the pinned 2.13.0): every rank removes each torch name that came after 2.11 (`NEWER`)
before it builds anything, then trains pp2 x tp2, pp2 x dp2 and ZBV virtual stages (every P2P
matched by order alone, tag 0) against the plain model, as the parity tests do. A name that
hybridpar uses without a fallback fails here as it would fail on a GPU machine's torch 2.11.

Why 2.11 and not lower: the GPU machines run 2.11 and 2.12, and the H200 ran
`scripts/gpu_check.py` on 2.11 (README). Below it, what hybridpar relies on is more than names,
which removing a name cannot reproduce (the newest of them, each within the floor):

    what hybridpar uses                                               came in
    torch.get_autocast_dtype(device) / is_autocast_enabled(device)   2.4
    F.scaled_dot_product_attention(enable_gqa=)   (an argument)       2.5
    DCP saving a non-DTensor through `__create_write_items__` (train/checkpoints/shards.py:
      DCP's checkpointable protocol; older DCP tests for DTensor)     2.5
    torch.utils.backend_registration._setup_privateuseone_for_python_backend and
      torch._C._acc.PrivateUse1Hooks (`hybridpar check`'s fake GPU;
      private, "experimental and might change without notice")        2025 (2.9 / 2.10)
    torch.distributed.pipelining / torch.distributed.tensor (scripts/bench only)  2.4 / 2.5

and no torch but the pinned one installs here to try them.

Names are removed from the namespace hybridpar calls them through (``torch.distributed``), not
from ``torch.distributed.distributed_c10d``, where torch 2.13's old names call the new ones.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from spawn_cases import spawn_cases
from test_p2p_order import _reference as order_reference
from test_p2p_order import _worker as order_worker
from test_p2p_order import assert_plan_matches
from test_pipe_parity import _assert_same
from test_pipe_tp import _gpt_worker
from test_pipe_tp import _reference as tp_reference

import hybridpar
from hybridpar.pipeline.schedules import replay as nccl
from hybridpar.process.compat import is_fake_device_mismatch
from hybridpar.sharded.mappings import all_gather_along, reduce_scatter_along

from pipe_harness import data, mlp, pipe_worker, reference

FLOOR = "2.11"

# Every torch name newer than the floor that hybridpar could reach: (module, name, release it
# came in). The last two are newer than the torch we know (2.10), but their release could not
# be established from the installed sources; they are removed to be safe (removing a name that
# 2.11 has only makes the test stricter). Of the names hybridpar uses (its `torch.`, `dist.`,
# `torch._` names, audited), none outside this table came after 2.10.
NEWER = [
    ("torch.distributed", "all_gather_single", "2.13"),       # was all_gather_into_tensor
    ("torch.distributed", "reduce_scatter_single", "2.13"),   # was reduce_scatter_tensor
    ("torch.distributed", "record_comm", "2.10 or later, unsure"),
    ("torch.distributed", "shrink_group", "2.10 or later, unsure"),
]
PINNED = "2.13"   # this suite's torch (constraints.txt): it has every NEWER name
# The fallbacks `hybridpar.process.compat` takes without the new names; torch 2.13 deprecates them
# (a FutureWarning, an error in this suite), torch 2.11 does not.
FALLBACKS = ["all_gather_into_tensor", "reduce_scatter_tensor"]

LAYOUT_TP = ((2, 2, 1), [3, 2], {"chunks": 4, "schedule": "1f1b", "checkpoint": "except_last"})
LAYOUT_DP = ((2, 1, 2), [2, 2], {"chunks": 4, "schedule": "1f1b"})
ORDER = ("gpt", (2, 2), [1, 1, 2, 1], "zbv")   # virtual stages, tp scatter-gather, new shapes


def _names_case():
    """What a rank sees: the NEWER names (absent), tags, and both collectives on the
    fallbacks (called, and right)."""
    topo = hybridpar.init(pp=2, tp=2, timeout=60)
    calls = dict.fromkeys(FALLBACKS, 0)
    with pytest.MonkeyPatch.context() as mp:
        for name in FALLBACKS:
            def counted(*args, _name=name, _original=getattr(dist, name), **kwargs):
                calls[_name] += 1
                return _original(*args, **kwargs)
            mp.setattr(dist, name, counted)
        r = topo.tp_rank
        gathered = all_gather_along(torch.arange(3.0) + 10 * r, 0, topo.tp_group)
        scattered = reduce_scatter_along(torch.arange(5.0) * (r + 1), 0, topo.tp_group)
    return {"present": [hasattr(importlib.import_module(m), n) for m, n, _ in NEWER],
            "tags": topo.p2p_tags, "calls": calls,
            "gathered": gathered, "scattered": scattered}


def _warning_case():
    """Whether a FutureWarning from a torch module fails this rank (pyproject's filters)."""
    try:
        warnings.warn_explicit("deprecated", FutureWarning, "torch/x.py", 1, module="torch.x")
    except FutureWarning:
        return "raised"
    return "passed"


CASES = {"names": _names_case, "warning": _warning_case, "tp": _gpt_worker,
         "dp": pipe_worker, "order": order_worker}


def _on_the_floor(what, *args):
    """Case `what` in a rank whose torch lacks every NEWER name (back after the case)."""
    with pytest.MonkeyPatch.context() as mp, warnings.catch_warnings():
        for module, name, _ in NEWER:   # raising=False: an older torch lacks them already
            mp.delattr(importlib.import_module(module), name, raising=False)
        for old in FALLBACKS:
            warnings.filterwarnings("ignore", f".*{old}` is deprecated", FutureWarning)
        return CASES[what](*args)


@pytest.fixture(scope="module")
def runs():
    (layout, balance, options), (dp_layout, dp_balance, dp_options) = LAYOUT_TP, LAYOUT_DP
    return spawn_cases(_on_the_floor, 4, {
        "names": ("names",),
        "warning": ("warning",),
        "tp": ("tp", layout, balance, options, 0.0),
        "dp": ("dp", "mlp", {}, dp_balance, dp_layout, 3, 8, dp_options, "adamw"),
        "order": ("order", *ORDER),
    }, timeout=240)


def test_setup_cfg_and_the_readme_state_the_floor():
    root = Path(__file__).resolve().parents[1]
    assert f"torch>={FLOOR}\n" in (root / "setup.cfg").read_text(encoding="utf-8")
    assert f"torch ≥ {FLOOR}" in (root / "README.md").read_text(encoding="utf-8")
    assert "torch==2.13.0\n" in (root / "constraints.txt").read_text(encoding="utf-8")


@pytest.mark.skipif(not torch.__version__.startswith(PINNED),
                    reason="the names are the pinned torch's; an older one lacks them (the "
                           "other tests here then run on that torch itself)")
def test_the_pinned_torch_has_every_name_the_floor_test_removes():
    # else removing them proves nothing
    for module, name, _ in NEWER:
        assert hasattr(importlib.import_module(module), name), (module, name)
    for old in FALLBACKS:
        assert hasattr(dist, old), old


def test_a_fake_device_mismatch_is_told_by_its_class_and_by_torch_2_11s_message():
    # torch 2.11 has no FakeTensorDeviceMismatchError (found by this suite on a GPU machine's
    # 2.11, docs/gpu.md): it raises a RuntimeError that `hybridpar check` tells by its text.
    # The class cannot be removed as NEWER's names are: torch's own fake tensors raise it.
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(), pytest.raises(RuntimeError) as raised:
        torch.ones(2, device="meta") + torch.ones(2)
    assert is_fake_device_mismatch(raised.value)
    torch_2_11 = RuntimeError("Unhandled FakeTensor Device Propagation for aten.add.Tensor, "
                              "found two different devices cuda:0, cpu")
    assert is_fake_device_mismatch(torch_2_11)
    assert not is_fake_device_mismatch(RuntimeError("shapes cannot be multiplied"))


def test_the_ranks_lack_the_newer_names_and_gather_through_the_old_ones(runs):
    for r in runs["names"]:
        assert r["present"] == [False] * len(NEWER)
        assert r["tags"] is False   # P2P matched by order alone
        assert r["calls"] == {"all_gather_into_tensor": 1, "reduce_scatter_tensor": 1}
        assert r["gathered"].tolist() == [0, 1, 2, 10, 11, 12]
    # 0..4 summed over ranks 1x and 2x is 3x; split 3 + 2 (`shard_sizes`)
    assert [r["scattered"].tolist() for r in runs["names"]] == \
        [[0, 3, 6], [9, 12], [0, 3, 6], [9, 12]]


def test_pipeline_and_tensor_parallel_match_one_device_on_the_floor(runs):
    ref_losses, ref_norms, ref_state = tp_reference(0.0)
    for r in runs["tp"]:
        assert r["losses"] == pytest.approx(ref_losses, abs=1e-5)
        assert r["norms"] == pytest.approx(ref_norms, rel=1e-5)
        for k, v in ref_state.items():
            torch.testing.assert_close(r["state"][k], v, atol=1e-5, rtol=0)


def test_data_parallel_pipeline_matches_one_device_on_the_floor(runs):
    xs, ys = data(3, 8 * LAYOUT_DP[0][2])
    ref_losses, ref_state = reference(mlp(), xs, ys, optimizer="adamw")
    _assert_same(runs["dp"], ref_losses, ref_state)


def test_virtual_stages_matched_by_order_alone_match_one_device_on_the_floor(runs):
    ref_values, ref_state = order_reference(ORDER[0])
    assert_plan_matches(runs["order"], ref_values, ref_state)
    logs = {rank: [[nccl.P2POp(*op) for op in group] for group in r["log"]]
            for rank, r in enumerate(runs["order"])}
    assert nccl.replay(logs, check_labels=True).pairs > 0   # the order NCCL would match


def test_a_torch_deprecation_fails_the_tests_and_every_rank(runs):
    with pytest.raises(FutureWarning):
        warnings.warn_explicit("deprecated", FutureWarning, "torch/x.py", 1, module="torch.x")
    with pytest.raises(DeprecationWarning):
        warnings.warn_explicit("deprecated", DeprecationWarning, "h.py", 1, module="hybridpar.h")
    assert runs["warning"] == ["raised"] * 4


def test_a_session_whose_first_spawn_is_from_another_folder_has_the_filters_in_its_ranks():
    # CI's red twice: a test that moved to its tmp_path spawned first in a pytest worker, its
    # forkserver started there and could not import `tests.torch_warnings` (conftest.py)
    root = Path(__file__).resolve().parents[1]
    session = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "-p", "no:cacheprovider",
         "tests/first_spawn_elsewhere.py"], cwd=root, capture_output=True, text=True,
        timeout=240)
    assert session.returncode == 0, session.stdout[-3000:]
    assert "1 passed" in session.stdout
