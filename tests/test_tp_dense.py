"""TPDense, the ring collectives and ModelParallelismWrapper give the plain-torch numbers.

One spawned run per tp size (2, 3, 4) performs every multi-rank check and reports each by
name (empty: passed; else the error), so the tests below read the shared runs. Parity is in
float64 against ``nn.Linear`` built under the same seed: outputs, input, weight and bias
gradients (to 1e-12).
"""

import re
import subprocess
import sys
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import hybridpar
from hybridpar import topology
from hybridpar.nn import ModelParallelismWrapper, TPDense
from hybridpar.nn.init import scale_init, shard_init_helper_
from hybridpar.sharded.attrs import get_parallel_dim
from hybridpar.sharded.mappings import shard_range
from hybridpar.tensor_parallel import (
    async_gather,
    async_gather_bidirectional,
    async_gather_split,
    async_scatter,
    async_scatter_split,
)
from hybridpar.tensor_parallel.feature.ring import gather_order, ring_pass
from hybridpar.tensor_parallel.state import collect_state_dict

F64 = torch.float64
IN, OUT = 12, 24  # divisible by 2, 3 and 4
ROOT = Path(__file__).resolve().parents[1]


def _close(actual, expected, what):
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-12, msg=lambda m: f"{what}: {m}")


def _all_gather(t, group):
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return parts


def _block(t, tp, rank, dim=-1):
    start, stop = shard_range(t.shape[dim], tp, rank)
    return t.narrow(dim, start, stop - start)


# TPDense against nn.Linear ------------------------------------------------------------------

DENSE_CASES = [  # (mode, options); each with bias=True and bias=False
    ("none", {}),
    ("none", {"async_comm": True}),
    ("gather", {}),
    ("gather", {"init_scale": 0.5}),
    ("gather", {"skip_communication": True}),
    ("gather", {"async_comm": True}),
    ("gather", {"async_comm": True, "bidirectional": False}),
    ("scatter", {}),
    ("scatter", {"init_scale": 0.5}),
    ("scatter", {"skip_communication": True}),
    ("scatter", {"async_comm": True}),
    ("scatter", {"async_comm": True, "bidirectional": False}),
]


def _dense_name(mode, opts, bias):
    words = [f"{k}={v}" for k, v in sorted(opts.items())] + [f"bias={bias}"]
    return f"dense {mode} " + " ".join(words)


def _check_dense(mode, opts, bias, group, sync_outputs):
    tp, rank = dist.get_world_size(group), dist.get_rank(group)
    torch.manual_seed(0)
    ref = nn.Linear(IN, OUT, bias, dtype=F64)
    after_ref = torch.rand(1)
    torch.manual_seed(0)
    layer = TPDense(IN, OUT, mode=mode, bias=bias, group=group, dtype=F64, **opts)
    assert torch.equal(torch.rand(1), after_ref), "the RNG stream after construction"
    with torch.no_grad():
        ref.weight.mul_(opts.get("init_scale", 1.0))

    skip = opts.get("skip_communication", False)
    w_dim = {"none": None, "gather": 0, "scatter": 1}[mode]
    w_expected = ref.weight if w_dim is None else _block(ref.weight, tp, rank, w_dim)
    assert torch.equal(layer.weight, w_expected), "weight is the slice of nn.Linear's"
    if bias:
        b_expected = ref.bias if mode == "none" else _block(ref.bias, tp, rank)
        assert torch.equal(layer.bias, b_expected), "bias is the slice of nn.Linear's"
        full = collect_state_dict(layer, layer.state_dict())
        _close(full["bias"], ref.bias, "collected bias")
    else:
        assert layer.bias is None
    if mode != "none":
        _close(collect_state_dict(layer, layer.state_dict())["weight"], ref.weight,
               "collected weight")

    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3, 5, IN, dtype=F64, generator=gen)
    g = torch.randn(3, 5, OUT, dtype=F64, generator=gen)
    x_ref = x.clone().requires_grad_()
    ref(x_ref).backward(g)

    full_input = mode == "none" or (mode == "gather" and skip)
    x_in = (x if full_input else _block(x, tp, rank)).clone().requires_grad_()
    y = layer(x_in)
    partial_output = mode == "scatter" and skip
    if mode == "none":
        _close(y, ref(x), "output")
        y.backward(g)
    elif partial_output:  # the caller sums the partials: their sum is the output
        total = y.detach().clone()
        dist.all_reduce(total, group=group)
        _close(total, ref(x).detach(), "sum of the partial outputs")
        y.backward(g)  # the backward of a sum hands every rank the full gradient
    else:
        assert get_parallel_dim(y) == -1, "the sharded output is tagged -1"
        _close(y, _block(ref(x), tp, rank), "output is the slice of nn.Linear's")
        y.backward(_block(g, tp, rank))

    if mode == "gather" and skip:  # the input gradient is a partial sum for the caller
        dist.all_reduce(x_in.grad, group=group)
    _close(x_in.grad, x_ref.grad if full_input else _block(x_ref.grad, tp, rank),
           "input gradient")
    _close(layer.weight.grad, ref.weight.grad if w_dim is None else
           _block(ref.weight.grad, tp, rank, w_dim), "weight gradient")
    if bias:
        _close(layer.bias.grad, ref.bias.grad if mode == "none" else
               _block(ref.bias.grad, tp, rank), "bias gradient")

    key = (mode, bias, skip)
    if opts.get("async_comm"):  # the overlapped layer gives the synchronous layer's numbers
        _close(y, sync_outputs[key], "async output equals the sync output")
    elif "init_scale" not in opts:
        sync_outputs[key] = y.detach()


# ring collectives -----------------------------------------------------------------------------

def _rank_input(rank):
    return torch.arange(12, dtype=F64).reshape(2, 6) + 100 * rank  # (2, C=6), h = 3


def _piece(label):
    rank, part = re.fullmatch(r"x(\d+)(\[:h\]|\[h:\])?", label).groups()
    x = _rank_input(int(rank))
    return x if part is None else (x[..., :3] if part == "[:h]" else x[..., 3:]), int(rank), part


def _weights(rank, count):
    gen = torch.Generator().manual_seed(1000 + rank)
    return [torch.randn(2, 6, dtype=F64, generator=gen) for _ in range(count)]


def _check_gather(fn, variant, shift_up, group):
    tp, rank = dist.get_world_size(group), dist.get_rank(group)
    x = _rank_input(rank).requires_grad_()
    out = fn(x)
    labels = gather_order(tp, rank, variant=variant, shift_up=shift_up)
    assert len(out) == len(labels), f"{len(out)} pieces, expected {len(labels)}"
    for i, (t, label) in enumerate(zip(out, labels)):
        assert torch.equal(t, _piece(label)[0]), f"element {i} is {label}"
    # backward: a weighted sum of the pieces sends each weight back to the piece's owner
    loss = sum((t * w[..., :t.shape[-1]]).sum() for t, w in zip(out, _weights(rank, len(out))))
    loss.backward()
    expected = torch.zeros(2, 6, dtype=F64)
    for s in range(tp):
        for label, w in zip(gather_order(tp, s, variant=variant, shift_up=shift_up),
                            _weights(s, len(labels))):
            _, owner, part = _piece(label)
            if owner == rank:
                cols = slice(0, 6) if part is None else slice(0, 3) if part == "[:h]" else \
                    slice(3, 6)
                expected[..., cols] += w[..., :cols.stop - cols.start]
    _close(x.grad, expected, "gradient of the gathered input")


def _check_scatter(fn, group):
    tp, rank = dist.get_world_size(group), dist.get_rank(group)
    xs = [(torch.full((2, 6), 100.0 * rank + j, dtype=F64) + torch.arange(6)).requires_grad_()
          for j in range(tp)]
    y = fn(xs)
    expected = sum(torch.full((2, 6), 100.0 * s + rank, dtype=F64) + torch.arange(6)
                   for s in range(tp))
    _close(y, expected, "rank r holds the sum over ranks of their xs[r]")
    (y * _weights(rank, 1)[0]).sum().backward()
    for j in range(tp):  # xs[j] fed rank j's sum: its gradient is rank j's weight
        _close(xs[j].grad, _weights(j, 1)[0], f"gradient of xs[{j}]")


# the spawned run ------------------------------------------------------------------------------

def _checks(group):
    tp = dist.get_world_size(group)
    sync_outputs = {}
    for mode, opts in DENSE_CASES:
        for bias in (True, False):
            yield _dense_name(mode, opts, bias), lambda m=mode, o=opts, b=bias: _check_dense(
                m, o, b, group, sync_outputs)
    for name, fn, variant, up in [
        ("async_gather up", lambda x: async_gather(x, group), "unidirectional", True),
        ("async_gather down", lambda x: async_gather(x, group, shift_up=False),
         "unidirectional", False),
        ("async_gather_bidirectional up", lambda x: async_gather_bidirectional(x, group),
         "bidirectional", True),
        ("async_gather_bidirectional down",
         lambda x: async_gather_bidirectional(x, group, shift_up=False), "bidirectional", False),
        ("async_gather_split", lambda x: async_gather_split(x, group), "split", True),
    ]:
        yield f"ring {name}", lambda f=fn, v=variant, u=up: _check_gather(f, v, u, group)
    for name, fn in [
        ("async_scatter up", lambda xs: async_scatter(xs, group)),
        ("async_scatter down", lambda xs: async_scatter(xs, group, shift_up=False)),
        ("async_scatter_split", lambda xs: async_scatter_split(xs, group)),
    ]:
        yield f"ring {name}", lambda f=fn: _check_scatter(f, group)
    yield "wrapper split_rngs", lambda: _check_wrapper_split(group)
    yield "wrapper mask", lambda: _check_wrapper_mask(group)
    yield "errors", lambda: _check_errors(group, tp)


def _check_wrapper_split(group):
    torch.manual_seed(0)
    wrapped = ModelParallelismWrapper(lambda: nn.Linear(4, 3), group=group)
    after = torch.rand(1)
    weights = _all_gather(wrapped.module.weight.detach(), group)
    assert all(not torch.equal(weights[0], w) for w in weights[1:]), "distinct per rank"
    assert all(torch.equal(after, a) for a in _all_gather(after, group)), \
        "the default RNG stream stays the same on every rank"
    torch.manual_seed(0)
    again = ModelParallelismWrapper(lambda: nn.Linear(4, 3), group=group)
    assert torch.equal(again.module.weight, wrapped.module.weight), "reproducible under a seed"
    x = torch.randn(2, 4)
    _close(wrapped(x), wrapped.module(x), "the wrapper forwards to its module")

    torch.manual_seed(0)
    same = ModelParallelismWrapper(lambda: nn.Linear(4, 3), split_rngs=False, group=group)
    torch.manual_seed(0)
    plain = nn.Linear(4, 3)
    assert torch.equal(same.module.weight, plain.weight), "split_rngs=False: the plain draw"
    assert all(torch.equal(w, plain.weight) for w in _all_gather(same.module.weight, group))


def _check_wrapper_mask(group):
    rank = dist.get_rank(group)
    torch.manual_seed(0)
    masked = ModelParallelismWrapper(lambda: nn.Linear(4, 3), mask_except_model_idx=1,
                                     group=group)
    nonzero = [bool(p.abs().sum() > 0) for p in masked.parameters()]
    assert nonzero == [rank == 1] * 2, f"rank {rank}: only rank 1 keeps non-zero parameters"


def _raises(exc, pattern, fn):
    with pytest.raises(exc, match=pattern):
        fn()


def _check_errors(group, tp):
    x = torch.ones(2, 4)
    _raises(ValueError, rf"got {tp + 1} tensors for a tp group of {tp} ranks; pass exactly one",
            lambda: async_scatter([x] * (tp + 1), group))
    _raises(ValueError, "one shape", lambda: async_scatter([x] + [torch.ones(2, 5)] * (tp - 1),
                                                           group))
    _raises(ValueError, "at least 2", lambda: async_gather_split(torch.ones(2, 1), group))
    _raises(ValueError, "at least 2", lambda: async_scatter_split([torch.ones(2, 1)] * tp,
                                                                  group))
    bad = tp * 3 + 1
    _raises(ValueError, rf"in_features={bad} is not divisible by the tp size {tp}.*multiple",
            lambda: TPDense(bad, OUT, mode="gather", group=group))
    _raises(ValueError, rf"out_features={bad} is not divisible by the tp size {tp}",
            lambda: TPDense(IN, bad, mode="gather", group=group))
    _raises(ValueError, rf"in_features={bad} is not divisible",
            lambda: TPDense(bad, OUT, mode="scatter", group=group))
    _raises(ValueError, rf"out_features={bad} is not divisible",
            lambda: TPDense(IN, bad, mode="scatter", group=group))
    TPDense(bad, OUT, mode="gather", skip_communication=True, group=group)  # input comes full
    TPDense(IN, bad, mode="scatter", skip_communication=True, group=group)  # output partial
    layer = TPDense(IN, OUT, mode="gather", group=group)
    _raises(ValueError, rf"takes inputs with {IN // tp} features .*got shape \(2, {IN}\).*"
            r"x\.chunk\(tp, -1\)\[tp_rank\]", lambda: layer(torch.ones(2, IN)))
    _raises(ValueError, rf"mask_except_model_idx={tp} is not a rank of the tp group of {tp}",
            lambda: ModelParallelismWrapper(lambda: nn.Linear(2, 2), mask_except_model_idx=tp,
                                            group=group))
    _raises(TypeError, "must return an nn.Module",
            lambda: ModelParallelismWrapper(lambda: 3, group=group))


def _worker(tp):
    topo = hybridpar.init(tp=tp, timeout=60)
    results = {}
    for name, check in _checks(topo.tp_group):
        try:
            check()
            results[name] = ""
        except Exception:
            results[name] = traceback.format_exc()
    return results


@pytest.fixture(scope="module", params=[2, 3, 4], ids=lambda tp: f"tp{tp}")
def run(request):
    """{check name: errors on any rank ('' when it passed)} of one spawned run."""
    per_rank = hybridpar.spawn(_worker, request.param, args=(request.param,), timeout=120)
    return {name: "".join(f"rank {r}: {res[name]}" for r, res in enumerate(per_rank)
                          if res[name]) for name in per_rank[0]}


def _assert_passed(run, prefix):
    names = [n for n in run if n.startswith(prefix)]
    assert names, f"no check named {prefix!r}*"
    failed = {n: run[n] for n in names if run[n]}
    assert not failed, "\n".join(f"{n}:\n{e}" for n, e in failed.items())


def test_gather_mode_holds_the_slices_and_matches_nn_linear(run):
    _assert_passed(run, "dense gather")


def test_scatter_mode_holds_the_slices_and_matches_nn_linear(run):
    _assert_passed(run, "dense scatter")


def test_none_mode_is_nn_linear_on_every_rank(run):
    _assert_passed(run, "dense none")


def test_async_layers_equal_the_sync_layers_and_nn_linear(run):
    assert sum("async_comm=True" in n for n in run) == 10
    _assert_passed(run, "dense gather async_comm=True")
    _assert_passed(run, "dense scatter async_comm=True")


def test_ring_gathers_return_the_documented_order_and_scatter_gradients_back(run):
    _assert_passed(run, "ring async_gather")


def test_ring_scatters_sum_each_ranks_share_and_gather_gradients_back(run):
    _assert_passed(run, "ring async_scatter")


def test_wrapper_gives_each_rank_its_own_parameters_or_masks_them(run):
    _assert_passed(run, "wrapper")


def test_misuse_on_a_group_fails_naming_what_is_wrong_and_the_fix(run):
    _assert_passed(run, "errors")


# single-process checks ------------------------------------------------------------------------

def test_gather_order_tables():
    assert [" ".join(gather_order(4, r)) for r in range(4)] == [
        "x0 x3 x2 x1",
        "x1 x0 x3 x2",
        "x2 x1 x0 x3",
        "x3 x2 x1 x0",
    ]
    assert [" ".join(gather_order(4, r, shift_up=False)) for r in range(2)] == [
        "x0 x1 x2 x3",
        "x1 x2 x3 x0",
    ]
    # bidirectional: the same list as the unidirectional gather, delivered both ways
    assert gather_order(4, 1, variant="bidirectional") == gather_order(4, 1)
    assert gather_order(5, 2, variant="bidirectional", shift_up=False) == \
        gather_order(5, 2, shift_up=False)
    assert [" ".join(gather_order(3, r, variant="split")) for r in range(3)] == [
        "x0 x2[:h] x1[:h] x1[h:] x2[h:]",
        "x1 x0[:h] x2[:h] x2[h:] x0[h:]",
        "x2 x1[:h] x0[:h] x0[h:] x1[h:]",
    ]
    assert len(gather_order(4, 0, variant="split")) == 2 * 4 - 1


def test_ring_collectives_without_a_group_are_identities():
    x = torch.randn(2, 4)
    assert async_gather(x, None) == [x]
    assert async_gather_split(x, None) == [x]
    assert async_scatter([x], None) is x
    with pytest.raises(ValueError, match="got 2 tensors for a tp group of 1 ranks"):
        async_scatter([x, x], None)
    with pytest.raises(TypeError, match="takes a Tensor, got list"):
        async_gather([x], None)
    with pytest.raises(ValueError, match=r"hops \[1\] must lie in \[0, 0\]"):
        list(ring_pass([(x, 1, 1)], None))


def test_tpdense_none_mode_is_nn_linear_without_hybridpar_init(monkeypatch):
    monkeypatch.setattr(topology, "_current", None)
    torch.manual_seed(0)
    ref = nn.Linear(6, 5)
    torch.manual_seed(0)
    layer = TPDense(6, 5, mode="none", init_scale=0.25)
    assert torch.equal(layer.weight, ref.weight * 0.25) and torch.equal(layer.bias, ref.bias)
    x = torch.randn(3, 6)
    torch.testing.assert_close(layer(x), x @ (ref.weight * 0.25).t() + ref.bias)
    assert "mode='none'" in repr(layer) and "init_scale=0.25" in repr(layer)


def test_tpdense_misuse_is_rejected_before_any_communication(monkeypatch):
    with pytest.raises(ValueError, match=r"mode must be one of \('gather', 'scatter', 'none'\)"
                                         r", got 'column'"):
        TPDense(4, 4, mode="column")
    with pytest.raises(ValueError, match="nothing to overlap; drop async_comm or "
                                         "skip_communication"):
        TPDense(4, 4, mode="scatter", skip_communication=True, async_comm=True)
    monkeypatch.setattr(topology, "_current", None)
    with pytest.raises(RuntimeError, match=r"call hybridpar\.init"):
        TPDense(4, 4, mode="gather")
    with pytest.raises(RuntimeError, match=r"call hybridpar\.init"):
        ModelParallelismWrapper(lambda: nn.Linear(2, 2))
    with pytest.raises(ValueError, match="takes inputs with 4 features"):
        TPDense(4, 4)(torch.ones(2, 3))


def test_scale_init_scales_what_the_initializer_draws():
    torch.manual_seed(0)
    plain = nn.init.kaiming_uniform_(torch.empty(5, 4), a=5 ** 0.5)
    torch.manual_seed(0)
    init = scale_init(nn.init.kaiming_uniform_, 0.5)
    t = torch.empty(5, 4)
    assert init(t, a=5 ** 0.5) is t
    assert torch.equal(t, plain * 0.5)
    torch.manual_seed(0)
    u = shard_init_helper_(scale_init(nn.init.kaiming_uniform_, 0.5), torch.empty(5, 4),
                           a=5 ** 0.5)
    assert torch.equal(u, plain * 0.5)
    assert torch.equal(scale_init(nn.init.ones_)(torch.empty(2)), torch.ones(2))
    with pytest.raises(TypeError, match="takes an initializer function, got float"):
        scale_init(0.5)


def test_the_tp_dense_example_matches_plain_linear_layers():
    out = subprocess.run([sys.executable, "examples/tp_dense.py"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    diff = float(re.search(r"max difference ([0-9.e+-]+)", out.stdout).group(1))
    assert diff < 1e-5, out.stdout
