"""The GPU path, second pass, proven on CPU: control traffic on the CPU side of a mixed group,
the gradient clip in a few kernels whatever the number of parameters, and the RNG of the
rank's own GPU only for each checkpointed micro-batch."""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable, Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import hybridpar
from hybridpar.comm.agreement import _device_type, fail_together
from hybridpar.pipeline.activations.checkpoint import RNGReplay
from hybridpar.pipeline.parameters.clip import clip_grad_norm_, local_square_sum
from hybridpar.sharded.attrs import get_parallel_dim, register_parallel_dim
from hybridpar.tensor_parallel.random import get_rng_state_all, set_rng_state_all
from hybridpar.topology import ParallelDims, Topology

# agreement: which device the flags of `fail_together` live on ----------------------------------


@pytest.mark.parametrize("backend,device", [
    ("gloo", "cpu"),
    ("nccl", "cuda"),
    ("cpu:gloo,cuda:nccl", "cpu"),     # what hybridpar.init makes of backend="nccl"
    ("cuda:nccl,cpu:gloo", "cpu"),
    ("CPU:GLOO,CUDA:NCCL", "cpu"),
    ("cuda:nccl", "cuda"),
    ("cpu:gloo", "cpu"),
    ("fake", "cpu"),                   # `hybridpar check`'s dry run
    ("mpi", "cpu"),
])
def test_agreement_uses_the_cpu_side_of_any_group_that_has_one(backend, device):
    assert _device_type(dist.Backend(backend)) == device


def test_a_mixed_backend_is_named_by_its_whole_string_which_is_not_nccl():
    # dist.get_backend(group) returns Backend(the string given to init_process_group): the
    # mixed one is its own lower-cased string, so a comparison with "nccl" never matched it
    assert dist.Backend("cpu:gloo,cuda:nccl") == "cpu:gloo,cuda:nccl" != "nccl"


def _fail_on_a_mixed_group():
    hybridpar.init(backend="cpu:gloo", timeout=30)   # a mixed-form name with one device
    out = {"backend": str(dist.get_backend())}
    try:
        with fail_together(ValueError):
            raise ValueError("rank 0's own check")
    except ValueError as e:
        out["error"] = str(e)
    return out


def test_fail_together_runs_on_a_group_named_in_the_mixed_form():
    out = hybridpar.spawn(_fail_on_a_mixed_group, 1, timeout=60)[0]
    assert out == {"backend": "cpu:gloo", "error": "rank 0's own check"}


# the gradient clip: float64 norms grouped by device and dtype ----------------------------------

def _reference_square_sum(params, tp, not_counted=()):
    """The clip's local sum before `_foreach_norm`: one float64 norm per parameter."""
    total = torch.zeros((), dtype=torch.float64)
    for p in params:
        if p.grad is None or id(p) in not_counted:
            continue
        square = p.grad.detach().double().pow(2).sum()
        sharded = get_parallel_dim(p) is not None
        total += square if sharded or tp == 1 else square / tp
    return total


def _params(fill: Callable[[torch.Size, torch.dtype], torch.Tensor]):
    """Mixed shapes and dtypes, tp-sharded and replicated, a tie copy and a parameter without a
    gradient; `fill(shape, dtype)` gives each gradient. Returns (params, ids of tie copies)."""
    specs = [((3, 3), torch.float32, 0), ((4,), torch.float32, None), ((16, 4), torch.float32, 1),
             ((5, 5), torch.float64, None), ((2, 8), torch.float64, 0), ((1,), torch.float32, None),
             ((4, 4), torch.bfloat16, 1), ((9,), torch.bfloat16, None)]
    params = []
    for shape, dtype, dim in specs:
        p = nn.Parameter(torch.zeros(shape, dtype=dtype))
        p.grad = fill(p.shape, dtype)
        if dim is not None:
            register_parallel_dim(p, dim)
        params.append(p)
    tie = nn.Parameter(torch.zeros(4, 4))          # a tie's copy: another stage counts it
    tie.grad = fill(tie.shape, tie.dtype)
    no_grad = nn.Parameter(torch.zeros(3))
    return [*params, tie, no_grad], {id(tie)}


def _dyadic(shape, dtype):
    # every numel above is a square n = k * k: the norm of a constant c is k * |c|, exact, so
    # sqrt-then-square and any order of summation give the same float64 bits
    return torch.full(shape, 0.75, dtype=dtype)


def _random(seed: int):
    g = torch.Generator().manual_seed(seed)
    return lambda shape, dtype: (torch.randn(shape, generator=g) * 3).to(dtype)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_local_square_sum_weights_shards_replicas_and_ties_as_before(tp):
    params, ties = _params(_dyadic)
    new = local_square_sum(params, tp, torch.device("cpu"), not_counted=ties)
    old = _reference_square_sum(params, tp, ties)
    assert new.dtype == torch.float64 and torch.equal(new, old), (new, old)


@pytest.mark.parametrize("tp", [1, 2])
def test_local_square_sum_of_random_gradients_is_the_float64_sum_to_the_last_bits(tp):
    # not bit for bit: _foreach_norm returns the root of each sum, squared back here (a
    # rounding), and sums in its own order; both errors are of float64's epsilon (2.2e-16)
    for seed in range(20):
        params, ties = _params(_random(seed))
        new = local_square_sum(params, tp, torch.device("cpu"), not_counted=ties)
        old = _reference_square_sum(params, tp, ties)
        torch.testing.assert_close(new, old, rtol=1e-14, atol=0)


def _one_rank() -> Topology:
    return Topology(ParallelDims(), 0, None)   # tp = pp = 1: no collective


def _no_guard(what, group):
    raise AssertionError(f"no collective expected on one rank, got {what}")


def test_clip_returns_the_reference_norm_and_scales_every_gradient_by_the_same_factor():
    params, ties = _params(_dyadic)
    grads = [None if p.grad is None else p.grad.clone() for p in params]
    # squares: 9 + 4 + 64 + 25 + 16 + 1 + 16 + 9 (the tie left out) times 0.75 ** 2
    old = _reference_square_sum(params, 1, ties).sqrt()
    assert float(old) == 0.75 * 12
    norm = clip_grad_norm_(params, 2.0, _one_rank(), guard=_no_guard, not_counted=ties)
    assert norm.dtype == torch.float32 and torch.equal(norm, old.float())
    scale = (2.0 / (old + 1e-6)).clamp(max=1.0)
    for p, g in zip(params, grads):
        if g is None:
            assert p.grad is None
            continue
        assert p.grad.dtype == g.dtype   # the tie copy is scaled too
        assert torch.equal(p.grad, g.mul(scale.to(g.dtype))), p.shape


class _Ops(TorchDispatchMode):
    """Counts the aten operators called that launch a kernel on a GPU (views launch none)."""

    def __init__(self):
        super().__init__()
        self.calls: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket is not torch.ops.aten.detach:
            self.calls[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def _clip_ops(copies: int) -> Counter[str]:
    params = [p for _ in range(copies) for p in _params(_random(0))[0]]
    with _Ops() as ops:
        clip_grad_norm_(params, 1.0, _one_rank(), guard=_no_guard)
    return ops.calls


def test_clip_calls_as_many_operators_for_200_parameters_as_for_10():
    few, many = _clip_ops(1), _clip_ops(20)
    assert few == many, (few, many)
    assert few["aten._foreach_norm"] == 3   # one per dtype (tp = 1: every group counts whole)
    assert few["aten._foreach_mul_"] == 3   # one per dtype
    assert sum(few.values()) < 30


# the RNG of one checkpointed micro-batch ------------------------------------------------------

class _FakeCuda:
    """`torch.cuda`'s RNG calls, recorded; each device's generator a counter."""

    def __init__(self, current: int = 1, count: int = 4):
        self.current, self.count = current, count
        self.calls: list[tuple[str, int | None]] = []
        self.states = {i: torch.tensor([i, 0], dtype=torch.uint8) for i in range(count)}

    def install(self, monkeypatch) -> None:
        for name in ("is_available", "is_initialized", "current_device", "device_count",
                     "get_rng_state", "set_rng_state", "get_rng_state_all",
                     "set_rng_state_all"):
            monkeypatch.setattr(torch.cuda, name, getattr(self, name))

    def is_available(self) -> bool:
        return True

    def is_initialized(self) -> bool:
        return True

    def current_device(self) -> int:
        return self.current

    def device_count(self) -> int:
        return self.count

    @staticmethod
    def _index(device) -> int | None:
        if device is None or device == "cuda":
            return None
        return device if isinstance(device, int) else torch.device(device).index

    def get_rng_state(self, device="cuda"):
        index = self._index(device)
        self.calls.append(("get", index))
        return self.states[self.current if index is None else index].clone()

    def set_rng_state(self, state, device="cuda"):
        index = self._index(device)
        self.calls.append(("set", index))
        self.states[self.current if index is None else index] = state.clone()

    def get_rng_state_all(self):
        self.calls.append(("get_all", None))
        return [s.clone() for s in self.states.values()]

    def set_rng_state_all(self, states):
        self.calls.append(("set_all", None))


@pytest.fixture
def fake_cuda(monkeypatch) -> Iterator[_FakeCuda]:
    cuda = _FakeCuda(current=1)
    cuda.install(monkeypatch)
    yield cuda


def test_the_rng_state_holds_the_cpu_and_the_given_gpu_only(fake_cuda):
    state = get_rng_state_all(torch.device("cuda", 2))
    assert set(state) == {"cpu", "cuda", "tracker"} and list(state["cuda"]) == ["2"]
    assert fake_cuda.calls == [("get", 2)]
    fake_cuda.states[2] = torch.tensor([9, 9], dtype=torch.uint8)
    set_rng_state_all(state)
    assert fake_cuda.calls == [("get", 2), ("set", 2)]
    assert torch.equal(fake_cuda.states[2], torch.tensor([2, 0], dtype=torch.uint8))
    # a CPU rank keeps no CUDA state; no device given: the current one (hybridpar.init's)
    assert "cuda" not in get_rng_state_all(torch.device("cpu"))
    assert list(get_rng_state_all()["cuda"]) == ["1"]


def _dropout_twice(replay: RNGReplay) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.ones(64)
    with replay.first_forward() as state:
        first = nn.functional.dropout(x, 0.5)
    torch.rand(5)          # other micro-batches draw in between
    with replay.recompute(state):
        again = nn.functional.dropout(x, 0.5)
    return first, again


@pytest.mark.parametrize("make", [
    lambda: RNGReplay(functools.partial(get_rng_state_all, torch.device("cuda", 1)),
                      set_rng_state_all),   # the pipe's, given its device
    lambda: RNGReplay(get_rng_state_all, set_rng_state_all),   # no device: the current one
    lambda: RNGReplay(device=torch.device("cuda", 1)),         # the default streams
    lambda: RNGReplay(),
])
def test_a_checkpointed_micro_batch_reads_and_restores_the_rank_own_gpu_only(fake_cuda, make):
    first, again = _dropout_twice(make())
    assert torch.equal(first, again)
    # capture at the first forward; at the recomputation: read now, replay, put now back
    assert fake_cuda.calls == [("get", 1), ("get", 1), ("set", 1), ("set", 1)]


def _checkpointed_step_on_a_fake_gpu():
    topo = hybridpar.init(timeout=30)
    torch.manual_seed(0)
    pipe = hybridpar.HybridPipe(nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.Linear(8, 2)),
                                [3], chunks=2, checkpoint="always", topology=topo,
                                loss_fn=nn.functional.cross_entropy)
    x, y = torch.randn(4, 8), torch.randint(0, 2, (4,))
    with pytest.MonkeyPatch.context() as mp:
        cuda = _FakeCuda(current=1)
        cuda.install(mp)
        pipe.train_step(x, y)
    return cuda.calls


def test_a_checkpointed_pipe_step_on_the_cpu_reads_no_gpu_generator():
    # the pipe gives its replay its own device (pipe.py: functools.partial(get_rng_state_all,
    # self.device)): a CPU rank on a machine with GPUs reads none of their generators; a GPU
    # rank reads its own alone (the RNGReplay cases above, with the device given)
    calls = hybridpar.spawn(_checkpointed_step_on_a_fake_gpu, 1, timeout=60)[0]
    assert calls == [], calls
