"""The GPU path, proven on CPU: the device is chosen once, no host synchronisation inside a
step, autocast's cast cache off where recomputation would reuse a stale cast."""

from __future__ import annotations

import os

import pytest
import torch
from host_reads import watching_reads
from torch import nn

import hybridpar
from hybridpar.models import example_batch, gpt, gpt_loss

SMALL = {"vocab_size": 32, "block_size": 8, "n_layer": 2, "n_head": 2, "n_embd": 16,
         "dropout": 0.1}   # sharded dropout too


def _nccl_on_a_cpu_machine():
    try:
        hybridpar.init(backend="nccl", timeout=10)
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_a_gpu_job_that_lands_on_a_cpu_raises_instead_of_training_on_the_cpu():
    for message in hybridpar.spawn(_nccl_on_a_cpu_machine, 2, timeout=60):
        assert "backend nccl needs GPU" in message and "(LOCAL_RANK)" in message, message
        assert "HYBRIDPAR_BACKEND=gloo" in message


# host synchronisation --------------------------------------------------------------------

# Allowed on CPU tensors only, by design: the target bounds check of the vocab-parallel loss
# raises a clear IndexError on CPU and becomes a device-side assert on a GPU.
_CPU_ONLY = (os.path.join("tensor_parallel", "loss.py"), "_check_targets")


def _refuse(name: str, caller) -> None:
    if not (caller.co_filename.endswith(_CPU_ONLY[0]) and caller.co_name == _CPU_ONLY[1]):
        raise AssertionError(f"host synchronisation: Tensor.{name} in "
                             f"{caller.co_filename}:{caller.co_name}")


def _no_host_sync():
    """Make every host read of a tensor's values raise (what would synchronise a GPU)."""
    return watching_reads(_refuse)


def _step_without_host_sync(layout, schedule):
    pp, tp, dp = layout
    topo = hybridpar.init(pp=pp, tp=tp, dp=dp, timeout=60)
    torch.manual_seed(0)
    balance = [5] if pp == 1 else [1, 1, 2, 1] if schedule in ("zbv", "interleaved") else [2, 3]
    pipe = hybridpar.HybridPipe(gpt(**SMALL, tp=tp), balance, chunks=2,
                                topology=topo, schedule=schedule, loss_fn=gpt_loss)
    x, y = example_batch("gpt", 4, seed=topo.dp_rank, **SMALL)
    pipe.train_step(x, y)            # shapes are new: the headers are read on the host
    pipe.clip_grad_norm_(1.0)
    try:
        with _no_host_sync():
            loss = pipe.train_step(x, y)
            norm = pipe.clip_grad_norm_(0.01)
    except AssertionError as e:
        return str(e)
    return [float(loss), float(norm)]


@pytest.mark.parametrize("layout,schedule", [((2, 2, 1), "1f1b"), ((2, 1, 2), "gpipe"),
                                             ((1, 2, 1), "1f1b"), ((2, 2, 1), "zbv"),
                                             ((2, 1, 1), "interleaved")])
def test_a_steady_train_step_and_clip_never_read_a_tensor_on_the_host(layout, schedule):
    results = hybridpar.spawn(_step_without_host_sync, layout[0] * layout[1] * layout[2],
                              args=(layout, schedule), timeout=120)
    for r in results:
        assert isinstance(r, list), r
        assert r[0] > 0 and r[1] > 0


def test_the_host_sync_detector_catches_a_read():
    with pytest.raises(AssertionError, match=r"host synchronisation: Tensor\.item"):
        with _no_host_sync():
            torch.ones(()).item()
    assert torch.ones(()).item() == 1.0


# autocast and recomputation --------------------------------------------------------------

class _CacheProbe(nn.Module):
    """Records whether autocast's cast cache is on at each call."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[bool] = []

    def forward(self, x):
        self.seen.append(torch.is_autocast_cache_enabled())
        return x


def _bf16_grads(mode, schedule="gpipe"):
    topo = hybridpar.init(timeout=30)
    torch.manual_seed(0)
    probe = _CacheProbe()
    model = nn.Sequential(nn.Linear(8, 8), probe, nn.ReLU(), nn.Linear(8, 3))
    pipe = hybridpar.HybridPipe(model, [4], chunks=2, topology=topo, checkpoint=mode,
                                schedule=schedule, loss_fn=nn.functional.cross_entropy)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(4, 8, generator=g), torch.randint(0, 3, (4,), generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = pipe.train_step(x, y)
    return {"loss_dtype": str(loss.dtype), "seen": probe.seen,
            "grads": {n: None if p.grad is None else p.grad.clone()
                      for n, p in pipe.named_parameters()}}


def test_under_bf16_every_parameter_gets_the_same_gradient_in_every_checkpoint_mode():
    runs = {mode: hybridpar.spawn(_bf16_grads, 1, args=(mode,), timeout=60)[0]
            for mode in ("always", "except_last", "never")}
    for mode, run in runs.items():
        assert run["loss_dtype"] == "torch.float32", mode        # reported in fp32
        assert all(g is not None and g.abs().sum() > 0 for g in run["grads"].values()), mode
        for name, g in run["grads"].items():
            assert torch.equal(g, runs["never"]["grads"][name]), (mode, name)
    # the cache is off in a checkpointed forward and its recomputation, on elsewhere:
    # always: F0 F1 (checkpointed) then the recomputations of both
    assert runs["always"]["seen"] == [False, False, False, False]
    assert runs["except_last"]["seen"] == [False, True, False]  # F0 ckpt, F1 plain, R0
    assert runs["never"]["seen"] == [True, True]


def test_under_bf16_a_split_backward_gives_every_parameter_its_gradient():
    # ZB-H1: the linears' weight gradients computed in W in the autocast dtype, cast to fp32:
    # bit for bit what autograd computes in B
    plain = hybridpar.spawn(_bf16_grads, 1, args=("never",), timeout=60)[0]
    for mode in ("always", "never"):
        split = hybridpar.spawn(_bf16_grads, 1, args=(mode, "zb-h1"), timeout=60)[0]
        assert split["loss_dtype"] == "torch.float32"
        for name, g in split["grads"].items():
            assert g is not None and g.dtype == torch.float32, (mode, name)
            assert torch.equal(g, plain["grads"][name]), (mode, name)


# the GPU switch: hybridpar.device ----------------------------------------------------------

def test_the_switch_is_true_on_cuda_devices_only_outside_a_dry_run():
    from hybridpar.device import has_cuda, is_cuda, pinned

    assert is_cuda(torch.device("cuda", 1), branch="watchdog")
    assert not is_cuda(torch.device("cpu"), branch="watchdog")
    assert not is_cuda(torch.empty(1, device="meta"), branch="dropout scale")
    assert has_cuda(branch="rng streams") == torch.cuda.is_available()
    x = torch.zeros(2)
    assert pinned(torch.device("cpu"), x)[0] is x      # a CPU run pins nothing


def test_a_stand_in_counts_as_cuda_and_its_runtime_takes_the_cuda_calls():
    from hybridpar.device import cuda, has_cuda, is_cuda, pinned, standing_in
    from hybridpar.train.check.fake_gpu import FakeCuda

    fake = FakeCuda()
    with standing_in("meta", fake):
        assert is_cuda(torch.empty(1, device="meta"), branch="dropout scale")
        assert has_cuda(branch="rng streams") and cuda() is fake
        x = torch.zeros(2)
        assert pinned(torch.device("meta"), x)[0] is x
        cuda().manual_seed(7)
        state = cuda().get_rng_state()
        assert state.dtype == torch.uint8 and state.shape == (16,) and state[0] == 7
    assert not is_cuda(torch.device("meta"), branch="watchdog") and cuda() is not fake
    assert fake.hits == {"dropout scale": 1, "rng streams": 1, "pinned batch": 1}


def test_nccl_carries_every_dtype_a_stage_may_send_but_int16():
    from hybridpar.comm.p2p_spec import (
        DTYPES,
        NCCL_DTYPES,
        NCCLDtypeError,
        check_nccl_dtypes,
        spec_of,
    )

    assert set(DTYPES) - NCCL_DTYPES == {torch.int16}
    spec = spec_of([torch.zeros(2), torch.zeros(2, dtype=torch.int16)], 1, grads=True,
                   single=False)
    check_nccl_dtypes(spec._replace(tensors=spec.tensors[:1]), ["output 0"], "a message")
    with pytest.raises(NCCLDtypeError, match=r"^a message: output 1 is torch.int16, which "
                       r"NCCL cannot carry.*\.to\(torch.int32\)"):
        check_nccl_dtypes(spec, ["output 0", "output 1"], "a message")
