"""CausalLMLoss: one next-token loss for full and class-sharded logits, never gathering them;
ParallelCrossEntropyLoss on (B, T, C) logits at tp=1."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hybridpar
from hybridpar.nn import CausalLMLoss, ParallelCrossEntropyLoss, ParallelLinear

B, T, D, V = 4, 6, 12, 10


def _data(seed=0, ignore=True):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, D, dtype=torch.float64, generator=g)
    labels = torch.randint(0, V, (B, T), generator=g)
    if ignore:                      # uneven: row 0 scores 2 tokens, row 3 none after position 0
        labels[0, 3:] = -100
        labels[3, 1:] = -100
    return hidden, labels


def _shifted_reference(logits, labels):
    """What the loss means: F.cross_entropy on the shifted full logits."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, V), labels[:, 1:].reshape(-1),
                           ignore_index=-100)


def test_full_logits_equal_shifted_cross_entropy_and_gradients():
    hidden, labels = _data()
    logits = hidden[..., :V].clone().requires_grad_(True)
    ref_in = logits.detach().clone().requires_grad_(True)
    loss = CausalLMLoss()(logits, labels)
    ref = _shifted_reference(ref_in, labels)
    loss.backward()
    ref.backward()
    torch.testing.assert_close(loss, ref, atol=1e-14, rtol=0)
    torch.testing.assert_close(logits.grad, ref_in.grad, atol=1e-14, rtol=0)


def test_all_ignored_is_zero_not_nan_and_half_precision_scores_in_float32():
    logits = torch.randn(2, 3, V, requires_grad=True)
    loss = CausalLMLoss()(logits, torch.full((2, 3), -100))
    loss.backward()
    assert loss.item() == 0.0 and torch.count_nonzero(logits.grad) == 0
    half = torch.randn(2, 3, V).bfloat16()
    assert CausalLMLoss()(half, torch.randint(0, V, (2, 3))).dtype == torch.float32
    with pytest.raises(ValueError, match=r"labels \(B, T\) aligned with the input ids"):
        CausalLMLoss()(torch.randn(2, 3, V), torch.zeros(2, 2, dtype=torch.long))


def test_token_mean_over_gives_the_batch_token_mean_under_row_weights():
    hidden, labels = _data()
    logits = hidden[..., :V]
    exact = _shifted_reference(logits, labels)
    loss_fn = CausalLMLoss()

    def pipe_like(chunks):
        """The pipe's weighting: each micro-batch's loss times its share of the rows."""
        return sum(loss_fn(x, y) * (x.shape[0] / B)
                   for x, y in zip(logits.chunk(chunks), labels.chunk(chunks)))

    # micro-batches with different token counts: the default is a mean of means, not exact
    assert abs(pipe_like(2).item() - exact.item()) > 1e-3
    with loss_fn.token_mean_over(labels):
        torch.testing.assert_close(pipe_like(2), exact, atol=1e-14, rtol=0)
        torch.testing.assert_close(pipe_like(4), exact, atol=1e-14, rtol=0)
    torch.testing.assert_close(pipe_like(1), exact, atol=1e-14, rtol=0)     # context left


def test_parallel_cross_entropy_loss_takes_classes_last_at_tp1():
    hidden, labels = _data()
    logits = hidden[..., :V]                                     # (B, T, V), untagged
    for kwargs in ({}, {"reduction": "sum", "label_smoothing": 0.1}, {"reduction": "none"}):
        got = ParallelCrossEntropyLoss(**kwargs)(logits, labels)
        want = F.cross_entropy(logits.reshape(-1, V), labels.reshape(-1), **kwargs)
        torch.testing.assert_close(got, want.reshape(got.shape), atol=1e-14, rtol=0)
        assert got.shape == ((B, T) if kwargs.get("reduction") == "none" else ())
    square = torch.randn(2, 5, 5)                                # fits torch's reading: it wins
    target = torch.randint(0, 5, (2, 5))
    assert torch.equal(ParallelCrossEntropyLoss()(square, target), F.cross_entropy(square, target))


def _sharded_worker(tp):
    """Loss and gradients through a column-parallel head (tagged logits) at this tp size."""
    hybridpar.init(tp=tp)
    hidden, labels = _data()
    torch.manual_seed(0)
    full = nn.Linear(D, V, bias=False).double()
    head = ParallelLinear.convert_parallel_linear(copy.deepcopy(full), dim=-1)
    out = {}
    for mode in ("mean", "token_mean_over"):
        x = hidden.clone().requires_grad_(True)
        loss_fn = CausalLMLoss()
        if mode == "mean":
            loss = loss_fn(head(x), labels)
        else:                                   # two micro-batches, weighted by rows
            with loss_fn.token_mean_over(labels):
                loss = sum(loss_fn(head(xm), ym) * 0.5
                           for xm, ym in zip(x.chunk(2), labels.chunk(2)))
        head.zero_grad()
        loss.backward()
        out[mode] = {"loss": loss.detach(), "x_grad": x.grad,
                     "w_grad": head.weight.grad.clone(), "width": head.weight.shape[0]}
    return out


@pytest.mark.parametrize("tp", [1, 2])
def test_sharded_logits_through_a_column_parallel_head_match_full_logits(tp):
    hidden, labels = _data()
    torch.manual_seed(0)
    full = nn.Linear(D, V, bias=False).double()
    x = hidden.clone().requires_grad_(True)
    ref = _shifted_reference(full(x), labels)
    ref.backward()
    results = hybridpar.spawn(_sharded_worker, tp, args=(tp,), timeout=60)
    for rank, got in enumerate(results):
        start = rank * (V // tp)
        for mode, r in got.items():
            assert r["width"] == V // tp
            torch.testing.assert_close(r["loss"], ref.detach(), atol=1e-13, rtol=0)
            torch.testing.assert_close(r["x_grad"], x.grad, atol=1e-13, rtol=0)
            torch.testing.assert_close(r["w_grad"], full.weight.grad[start:start + V // tp],
                                       atol=1e-13, rtol=0)
