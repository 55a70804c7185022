"""Vocab-parallel cross-entropy equals F.cross_entropy on the full logits, without gathering."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import hybridpar
from hybridpar.sharded import attrs, mappings
from hybridpar.tensor_parallel.loss import ParallelCrossEntropyLoss, parallel_cross_entropy

TOL = 1e-6


def _cases(classes):
    """(name, shape of the logits without the class dim, options) of every checked case."""
    weight = torch.rand(classes, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    opts = {
        "plain": {},
        "ignore": {"ignore_index": -100},
        "ignore_a_class": {"ignore_index": 1},
        "weight": {"weight": weight},
        "smooth": {"label_smoothing": 0.1},
        "weight_smooth": {"weight": weight, "label_smoothing": 0.2},
        "weight_smooth_ignore": {"weight": weight, "label_smoothing": 0.3, "ignore_index": -100},
    }
    for shape in [(6,), (3, 4)]:
        for name, opt in opts.items():
            if len(shape) > 1 and name not in ("plain", "weight_smooth_ignore"):
                continue  # (N, T, C) is the same computation on N * T rows
            for reduction in ("none", "mean", "sum"):
                yield f"{name}-{reduction}-{'x'.join(map(str, shape))}", shape, {
                    **opt, "reduction": reduction}


def _targets(shape, classes, opt, gen, every):
    target = torch.randint(classes, shape, generator=gen)
    if "ignore_index" in opt:
        target.view(-1)[::every] = opt["ignore_index"]  # every `every`-th row is ignored
    return target


def _diff(a, b):
    """max |a - b|, where nan equals nan (0 / 0 of an all-ignored mean, as in torch)."""
    if a.numel() == 0:
        return 0.0
    both_nan = torch.isnan(a) & torch.isnan(b)
    return torch.where(both_nan, 0.0, (a - b).abs()).max().item()


def _compare(sharded, full, group, classes, shape, opt, gen, counts, *, every=3):
    """Max |difference| of loss and gradient slice between the sharded loss and torch's."""
    n, rank = mappings.group_size(group), mappings.group_rank(group)
    start, stop = mappings.shard_range(classes, n, rank)
    logits = torch.randn(*shape, classes, dtype=torch.float64, generator=gen)   # (*, C)
    target = _targets(shape, classes, opt, gen, every)                        # (*)
    local = logits[..., start:stop].clone().requires_grad_(True)              # (*, C/tp)
    attrs.register_parallel_dim(local, -1)
    ref_in = logits.reshape(-1, classes).clone().requires_grad_(True)         # (R, C)

    before = dict(counts)
    loss = sharded(local, target, opt)
    forward_calls = counts["all_reduce"] - before["all_reduce"]
    ref = full(ref_in, target.reshape(-1), opt)
    if opt["reduction"] == "none":
        ref = ref.reshape(shape)
        upstream = torch.randn(shape, dtype=torch.float64, generator=gen)
        loss.backward(upstream)
        ref.backward(upstream)
    else:
        loss.backward()
        ref.backward()
    backward_calls = counts["all_reduce"] - before["all_reduce"] - forward_calls
    ref_grad = ref_in.grad.reshape(*shape, classes)[..., start:stop]
    return {
        "loss": _diff(loss.detach(), ref.detach()),
        "grad": _diff(local.grad, ref_grad),
        "forward_all_reduces": forward_calls,
        "backward_all_reduces": backward_calls,
        "shape_ok": loss.shape == ref.shape,
    }


def _functional(group):
    def sharded(x, target, opt):
        return parallel_cross_entropy(x, target, group=group, **opt)
    return sharded


def _module(x, target, opt):  # reads the default tp group of hybridpar.init
    return ParallelCrossEntropyLoss(**opt)(x, target)


def _torch(x, target, opt):
    return F.cross_entropy(x, target, **opt)


def _worker(tp):
    """Every case on one tp size; returns {case: errors}, collective counts, error messages."""
    topo = hybridpar.init(tp=tp)
    group = topo.tp_group
    counts = {"all_reduce": 0, "all_gather": 0}
    for name in ("all_gather", "all_gather_single", "all_gather_into_tensor", "all_gather_object",
                 "all_reduce"):   # all_gather_single: hybridpar.process.compat's, on torch >= 2.13
        original = getattr(dist, name, None)
        if original is None:   # a torch before 2.13 (GPU machines): compat takes the old name
            continue

        def counted(*args, _original=original, _key=name, **kwargs):
            key = "all_reduce" if _key == "all_reduce" else "all_gather"
            counts[key] += 1
            return _original(*args, **kwargs)

        setattr(dist, name, counted)

    results = {}
    class_counts = [10, 7] + ([3] if tp == 4 else [])  # 3 over 4 ranks: one rank holds none
    for classes in class_counts:
        gen = torch.Generator().manual_seed(classes)  # same numbers on every rank
        for i, (name, shape, opt) in enumerate(_cases(classes)):
            sharded = _module if i % 2 else _functional(group)
            results[f"C{classes}-{name}"] = _compare(sharded, _torch, group, classes, shape,
                                                     opt, gen, counts)
        legacy = {"size_average": False, "reduction": "mean"}  # legacy flags say 'sum'
        results[f"C{classes}-legacy"] = _compare(
            _functional(group), lambda x, t, o: F.cross_entropy(x, t, reduction="sum"),
            group, classes, (5,), legacy, gen, counts)
        ignored = {"reduction": "mean", "ignore_index": 4}
        results[f"C{classes}-all-ignored"] = _compare(
            _functional(group), _torch, group, classes, (4,), ignored, gen, counts, every=1)
        results[f"C{classes}-empty-batch"] = _compare(
            _functional(group), _torch, group, classes, (0,), {"reduction": "mean"}, gen, counts)

    # float32 logits agree to float32 precision
    gen = torch.Generator().manual_seed(0)
    start, stop = mappings.shard_range(10, tp, topo.tp_rank)
    logits = torch.randn(8, 10, generator=gen)
    target = torch.randint(10, (8,), generator=gen)
    local = logits[:, start:stop].clone().requires_grad_(True)
    attrs.register_parallel_dim(local, 1)  # 1 and -1 both mean "classes sharded"
    f32 = (parallel_cross_entropy(local, target) - F.cross_entropy(logits, target)).abs().item()

    errors = {}
    try:
        parallel_cross_entropy(local, torch.full((8,), 10))
    except IndexError as e:
        errors["out_of_range"] = str(e)
    try:
        parallel_cross_entropy(local, target, weight=torch.ones(9))
    except ValueError as e:
        errors["weight"] = str(e)
    return {"results": results, "all_gathers": counts["all_gather"], "float32": f32,
            "errors": errors}


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_sharded_loss_and_gradient_match_torch_on_full_logits(tp):
    out = hybridpar.spawn(_worker, tp, args=(tp,), timeout=60)
    for rank, got in enumerate(out):
        assert got["all_gathers"] == 0, "the sharded loss must not gather logits"
        assert got["float32"] < 1e-5
        assert "out of bounds for 10 classes" in got["errors"]["out_of_range"]
        assert "full (10,) class weight" in got["errors"]["weight"]
        for case, r in got["results"].items():
            where = f"rank {rank}, case {case}"
            assert r["loss"] < TOL, f"{where}: loss differs by {r['loss']}"
            assert r["grad"] < TOL, f"{where}: gradient differs by {r['grad']}"
            assert r["shape_ok"], where
            assert r["forward_all_reduces"] == (2 if tp > 1 else 0), where
            assert r["backward_all_reduces"] == 0, where


def test_untagged_logits_are_exactly_f_cross_entropy_without_init():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 5, 3, generator=gen)                     # (N, C, d1): classes on dim 1
    t = torch.randint(5, (4, 3), generator=gen)
    w = torch.rand(5, generator=gen)
    for kwargs in ({}, {"weight": w, "label_smoothing": 0.1, "reduction": "sum"},
                   {"ignore_index": 2, "reduction": "none"}):
        assert torch.equal(ParallelCrossEntropyLoss(**kwargs)(x, t),
                           nn.CrossEntropyLoss(**kwargs)(x, t))
        assert torch.equal(parallel_cross_entropy(x, t, **kwargs), F.cross_entropy(x, t, **kwargs))
    probs = torch.softmax(torch.randn(4, 5, generator=gen), dim=1)  # probability targets
    x2 = torch.randn(4, 5, generator=gen)
    assert torch.equal(parallel_cross_entropy(x2, probs, label_smoothing=0.1),
                       F.cross_entropy(x2, probs, label_smoothing=0.1))
    with pytest.warns(UserWarning):
        legacy = parallel_cross_entropy(x2, t[:, 0], size_average=False)
    assert torch.equal(legacy, F.cross_entropy(x2, t[:, 0], reduction="sum"))


def test_tagged_logits_before_init_tell_to_call_init():
    x = torch.randn(4, 5)
    attrs.register_parallel_dim(x, -1)
    with pytest.raises(RuntimeError, match=r"hybridpar\.init"):
        parallel_cross_entropy(x, torch.zeros(4, dtype=torch.long))
    with pytest.raises(RuntimeError, match=r"hybridpar\.init"):
        ParallelCrossEntropyLoss()(x, torch.zeros(4, dtype=torch.long))


def test_wrong_target_shape_for_sharded_logits_is_a_clear_error():
    x = torch.randn(2, 3, 5)                                   # (N, T, C/tp)
    attrs.register_parallel_dim(x, -1)
    with pytest.raises(ValueError, match=r"need a target of shape \(2, 3\), got \(2,\)"):
        parallel_cross_entropy(x, torch.zeros(2, dtype=torch.long))
    with pytest.raises(TypeError, match="class-index targets"):
        parallel_cross_entropy(x, torch.rand(2, 3))


def test_module_is_a_cross_entropy_loss_with_a_group():
    loss = ParallelCrossEntropyLoss(weight=torch.ones(3), label_smoothing=0.1, group=None)
    assert isinstance(loss, nn.CrossEntropyLoss)
    assert loss.group is None and loss.label_smoothing == 0.1
    assert "weight" in dict(loss.named_buffers())
