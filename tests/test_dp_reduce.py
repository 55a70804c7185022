"""GradBuckets: bucketed dp gradient averaging that overlaps the last backward of a step."""

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

import hybridpar
from hybridpar import trace
from hybridpar.pipeline.parameters.reduce import GradBuckets

ROWS, MICRO, STEPS = 7, 3, 3    # rows per dp rank and step, micro-batches (3, 2, 2 rows)


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                         nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))


def _batches(dp: int):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(ROWS * dp, 8, generator=g), torch.randint(0, 3, (ROWS * dp,), generator=g))
            for _ in range(STEPS)]


def _flat_average(params, group, dp: int) -> None:
    """The reference: HybridPipe's one flat all-reduce of every grad that is not None."""
    grads = [p.grad for p in params if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    flat /= dp
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def _microbatch_backwards(model, x, y, buckets=None) -> None:
    """Three forward+backward calls, weighted by their share; `arm` before the last backward."""
    xs, ys = x.tensor_split(MICRO), y.tensor_split(MICRO)
    for i, (xm, ym) in enumerate(zip(xs, ys)):
        loss = nn.functional.cross_entropy(model(xm), ym) * (len(xm) / len(x))
        if buckets is not None and i == MICRO - 1:
            buckets.arm()
        loss.backward()


def _train(dp: int, bucket_bytes: int):
    """Train with GradBuckets and, beside it, a clone averaged by the flat all-reduce."""
    topo = hybridpar.init(dp=dp, timeout=60)
    model = _net()
    clone = copy.deepcopy(model)
    buckets = GradBuckets(list(model.parameters()), topo.dp_group, bucket_bytes=bucket_bytes)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, clone)]
    rows = slice(topo.dp_rank * ROWS, (topo.dp_rank + 1) * ROWS)
    out = {"equal": [], "max_diff": [], "grads": [], "calls": [], "buckets": len(buckets.buckets)}
    for x, y in _batches(dp):
        for opt in opts:
            opt.zero_grad()
        trace.reset_comm_stats()
        _microbatch_backwards(model, x[rows], y[rows], buckets)
        buckets.finish()
        out["calls"].append(trace.comm_stats()["all_reduce"]["calls"])
        _microbatch_backwards(clone, x[rows], y[rows])
        _flat_average(list(clone.parameters()), topo.dp_group, dp)
        pairs = [(p.grad, q.grad) for p, q in zip(model.parameters(), clone.parameters())]
        out["equal"].append(all(torch.equal(a, b) for a, b in pairs))
        out["max_diff"].append(max((a - b).abs().max().item() for a, b in pairs))
        out["grads"].append([p.grad.clone() for p in model.parameters()])
        for opt in opts:
            opt.step()
    out["state"] = {k: v.clone() for k, v in model.state_dict().items()}
    return out


def _one_device(dp: int):
    """The whole batch on one device: grads per step and the final state."""
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    grads = []
    for x, y in _batches(dp):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
    return grads, model.state_dict()


def _assert_matches_one_device(out, dp: int) -> None:
    ref_grads, ref_state = _one_device(dp)
    for got, ref in zip(out["grads"], ref_grads):
        for a, b in zip(got, ref):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    for k, v in ref_state.items():
        torch.testing.assert_close(out["state"][k], v, atol=1e-6, rtol=1e-6)


def test_at_dp2_bucketed_grads_equal_the_flat_all_reduce_bit_for_bit_and_one_device():
    results = hybridpar.spawn(_train, 2, args=(2, 1100), timeout=60)
    for out in results:
        assert out["buckets"] > 2
        assert out["equal"] == [True] * STEPS
        assert out["calls"] == [out["buckets"]] * STEPS     # one all-reduce per bucket
        _assert_matches_one_device(out, 2)
    assert all(torch.equal(results[0]["state"][k], results[1]["state"][k])
               for k in results[0]["state"])


def test_at_dp3_bucketed_grads_match_the_flat_all_reduce_and_one_device():
    results = hybridpar.spawn(_train, 3, args=(3, 1100), timeout=60)
    for out in results:
        assert max(out["max_diff"]) <= 1e-6
        assert out["calls"] == [out["buckets"]] * STEPS
        _assert_matches_one_device(out, 3)


def _launch_during_backward():
    topo = hybridpar.init(dp=2, timeout=60)
    model = _net()
    buckets = GradBuckets(list(model.parameters()), topo.dp_group, bucket_bytes=600)
    x, y = _batches(2)[0]
    x = x[topo.dp_rank * ROWS:(topo.dp_rank + 1) * ROWS]
    y = y[topo.dp_rank * ROWS:(topo.dp_rank + 1) * ROWS]
    seen: list[int] = []
    trace.reset_comm_stats()
    calls = []
    xs, ys = x.tensor_split(MICRO), y.tensor_split(MICRO)
    for i, (xm, ym) in enumerate(zip(xs, ys)):
        h = model[1](model[0](xm))      # the first layer's output: its grad comes late
        if i == MICRO - 1:
            h.register_hook(lambda g: seen.append(buckets.launched))
            buckets.arm()
        loss = nn.functional.cross_entropy(model[2:](h), ym) * (len(xm) / len(x))
        loss.backward()
        calls.append(trace.comm_stats().get("all_reduce", {"calls": 0})["calls"])
    launched_before_finish = buckets.launched
    buckets.finish()
    stats = trace.comm_stats()["all_reduce"]
    return {"seen": seen, "calls": calls, "launched": launched_before_finish,
            "after": stats, "layout": buckets.buckets,
            "bytes": sum(p.numel() * 4 for p in model.parameters())}


def test_buckets_are_launched_while_the_armed_backward_still_runs():
    for out in hybridpar.spawn(_launch_during_backward, 2, timeout=60):
        n = len(out["layout"])
        # reversed: [l4.b l4.w l3.b] [l3.w] [l2.b] [l2.w] [l1.b l1.w] for 600 bytes
        assert out["layout"] == [[7, 6, 5], [4], [3], [2], [1, 0]]
        assert out["calls"] == [0, 0, n]       # unarmed backwards launch nothing
        assert 1 <= out["seen"][0] < n         # some launched, the first layer's not yet
        assert out["launched"] == n            # all of them before finish()
        assert out["after"] == {"calls": n, "bytes": out["bytes"]}


def test_the_layout_is_reverse_order_per_dtype_up_to_the_limit_and_big_params_alone():
    f32 = [nn.Parameter(torch.zeros(n)) for n in (4, 10, 100, 4)]     # 16, 40, 400, 16 B
    f64 = [nn.Parameter(torch.zeros(n, dtype=torch.float64)) for n in (4, 2)]  # 32, 16 B
    frozen = nn.Parameter(torch.zeros(3), requires_grad=False)
    params = [f32[0], f32[1], f64[0], f32[2], f64[1], frozen, f32[3], f32[0]]  # f32[0] twice
    buckets = GradBuckets(params, None, bucket_bytes=64)
    # reversed: 7 is a repeat of 0; 6 (f32) | 4 (f64) | 3 (400 B > 64: alone) | 2 joins 4's
    # open f64 bucket | 1 opens a new f32 bucket and 0 fits in it (56 B); 5 is frozen
    assert buckets.buckets == [[6], [4, 2], [3], [1, 0]]
    assert GradBuckets(params, None, bucket_bytes=1 << 20).buckets == [[6, 3, 1, 0], [4, 2]]
    with pytest.raises(ValueError, match="bucket_bytes"):
        GradBuckets(params, None, bucket_bytes=0)


class _Partly(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(8, 16)
        self.unused = nn.Linear(16, 16)
        self.frozen = nn.Linear(16, 16).requires_grad_(False)
        self.b = nn.Linear(16, 3)

    def forward(self, x):
        return self.b(torch.tanh(self.frozen(torch.tanh(self.a(x)))))


def _unused_and_frozen():
    topo = hybridpar.init(dp=2, timeout=60)
    model = _Partly()
    clone = copy.deepcopy(model)
    buckets = GradBuckets(list(model.parameters()), topo.dp_group, bucket_bytes=250)
    x, y = _batches(2)[0]
    x = x[topo.dp_rank * ROWS:(topo.dp_rank + 1) * ROWS]
    y = y[topo.dp_rank * ROWS:(topo.dp_rank + 1) * ROWS]
    trace.reset_comm_stats()
    _microbatch_backwards(model, x, y, buckets)
    launched = buckets.launched
    buckets.finish()
    _microbatch_backwards(clone, x, y)
    _flat_average(list(clone.parameters()), topo.dp_group, 2)
    return {"layout": buckets.buckets, "launched": launched,
            "calls": trace.comm_stats()["all_reduce"]["calls"],
            "grads": {k: p.grad for k, p in model.named_parameters()},
            "flat": {k: p.grad for k, p in clone.named_parameters()}}


def test_an_unused_parameter_keeps_a_none_grad_and_a_frozen_one_is_not_bucketed():
    for out in hybridpar.spawn(_unused_and_frozen, 2, timeout=60):
        # indices: a.w a.b unused.w unused.b frozen.w frozen.b b.w b.b
        assert out["layout"] == [[7, 6], [3], [2], [1], [0]]
        assert out["launched"] == 1        # unused.b holds its bucket and the later ones
        assert out["calls"] == 5           # finish() launched the rest
        for k, g in out["grads"].items():
            if k.startswith(("unused.", "frozen.")):
                assert g is None, k
            else:
                assert torch.equal(g, out["flat"][k]), k


def _size_one_group():
    topo = hybridpar.init(dp=1, timeout=60)
    model = _net()
    clone = copy.deepcopy(model)
    buckets = GradBuckets(list(model.parameters()), topo.dp_group, bucket_bytes=600)
    x, y = _batches(1)[0]
    trace.reset_comm_stats()
    _microbatch_backwards(model, x, y, buckets)
    buckets.finish()
    _microbatch_backwards(clone, x, y)
    return {"stats": trace.comm_stats(),
            "same": all(torch.equal(p.grad, q.grad)
                        for p, q in zip(model.parameters(), clone.parameters()))}


def test_a_group_of_one_or_none_runs_no_collective_and_leaves_the_grads():
    out = hybridpar.spawn(_size_one_group, 1, timeout=60)[0]
    assert out == {"stats": {}, "same": True}
    model, clone = _net(), _net()
    buckets = GradBuckets(list(model.parameters()), None, bucket_bytes=600)
    x, y = _batches(1)[0]
    trace.reset_comm_stats()
    _microbatch_backwards(model, x, y, buckets)
    buckets.finish()
    buckets.remove()
    _microbatch_backwards(clone, x, y)
    assert trace.comm_stats() == {}
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), clone.parameters()))


# the buckets are the gradients: attach() before the first backward ---------------------------

def _storages(tensors) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tensors}


def _attached(set_to_none: bool):
    """Three steps with attach(): backward accumulates into the bucket buffers (no other
    gradient storage, checked at every accumulation), every grad ends a view of them, equal
    bit for bit to the flat all-reduce of plain grads; an unused parameter keeps a None grad;
    zero_grad either way between steps."""
    topo = hybridpar.init(dp=2, timeout=60)
    model = _Partly()
    clone = copy.deepcopy(model)
    accumulated: list[int] = []   # where each accumulation left the grad (before any launch)
    for p in model.parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(
                lambda p: accumulated.append(p.grad.untyped_storage().data_ptr()))
    buckets = GradBuckets(list(model.parameters()), topo.dp_group, bucket_bytes=250)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, clone)]
    rows = slice(topo.dp_rank * ROWS, (topo.dp_rank + 1) * ROWS)
    out = {"equal": [], "views": [], "unused": [], "buffers": []}
    for x, y in _batches(2):
        for opt in opts:
            opt.zero_grad(set_to_none=set_to_none)
        buckets.attach()
        before = _storages(buckets.buffers())
        accumulated.clear()
        _microbatch_backwards(model, x[rows], y[rows], buckets)
        buckets.finish()
        out["buffers"].append(len(before) == len(buckets.buffers())
                              and len(accumulated) == 4 * MICRO and set(accumulated) <= before)
        _microbatch_backwards(clone, x[rows], y[rows])
        _flat_average(list(clone.parameters()), topo.dp_group, 2)
        grads = {k: p.grad for k, p in model.named_parameters()}
        out["equal"].append(all(
            (g is None and q.grad is None) or (g is not None and torch.equal(g, q.grad))
            for g, (_, q) in zip(grads.values(), clone.named_parameters())))
        out["views"].append(_storages(g for g in grads.values() if g is not None) <= before)
        out["unused"].append([k for k, g in grads.items() if g is None])
        for opt in opts:
            opt.step()
    out["state"] = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                           clone.state_dict().values()))
    return out


@pytest.mark.parametrize("set_to_none", [True, False])
def test_attached_grads_are_views_of_the_buckets_and_equal_the_flat_all_reduce(set_to_none):
    for out in hybridpar.spawn(_attached, 2, args=(set_to_none,), timeout=60):
        assert out["equal"] == out["views"] == out["buffers"] == [True] * STEPS
        unused = ["unused.weight", "unused.bias", "frozen.weight", "frozen.bias"]
        # set_to_none=False: the unused grads were None before the first attach and after
        # every finish, so zero_grad leaves them None
        assert out["unused"] == [unused] * STEPS
        assert out["state"]
