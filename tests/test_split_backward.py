"""Split backward (pipeline/activations/split_backward.py): I then W gives a plain backward's
gradients."""

import pytest
import torch
from torch import nn

from hybridpar.pipeline.activations.split_backward import SplitLinear, WeightGrads, deferring


def _model(dtype=torch.float64):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 16),
                         nn.Tanh(), nn.Linear(16, 4, bias=False)).to(dtype)


def _grads(model):
    return {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}


def _plain(x):
    model = _model()
    x = x.clone().requires_grad_()
    model(x).pow(2).sum().backward()
    return _grads(model), x.grad


def test_input_gradient_first_weight_gradients_later_equal_a_plain_backward():
    x = torch.randn(3, 5, 8, dtype=torch.float64)
    want, want_dx = _plain(x)
    model = _model()
    x = x.clone().requires_grad_()
    with SplitLinear():
        out = model(x)
    grads = WeightGrads()
    with deferring(grads):
        out.pow(2).sum().backward()
    # I: the input gradient and the LayerNorm's (the fallback) are there, the linears' wait
    torch.testing.assert_close(x.grad, want_dx, rtol=0, atol=1e-12)
    assert {n for n, g in _grads(model).items() if g is not None} == {"2.weight", "2.bias"}
    assert len(grads) == 3
    grads.run()                                                    # W
    got = _grads(model)
    for name, g in want.items():
        torch.testing.assert_close(got[name], g, rtol=0, atol=1e-12, msg=name)
    assert len(grads) == 0


def test_micro_batches_whose_w_run_in_another_order_accumulate_the_same_sum():
    xs = [torch.randn(4, 8, dtype=torch.float64) for _ in range(3)]
    ref = _model()
    for x in xs:
        ref(x).pow(2).sum().backward()
    model = _model()
    pending = []
    for x in xs:                                   # F0 I0 F1 I1 F2 I2, then W2 W0 W1
        with SplitLinear():
            out = model(x)
        with deferring(WeightGrads()) as grads:
            out.pow(2).sum().backward()
        pending.append(grads)
    for k in (2, 0, 1):
        pending[k].run()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-12, msg=name)


def test_without_deferring_the_split_linear_is_a_plain_backward_and_w_fires_grad_hooks():
    x = torch.randn(6, 8, dtype=torch.float64)
    want, _ = _plain(x)
    model = _model()
    with SplitLinear():
        model(x).pow(2).sum().backward()            # no `deferring`: nothing is deferred
    for name, g in _grads(model).items():
        torch.testing.assert_close(g, want[name], rtol=0, atol=1e-12, msg=name)
    model.zero_grad(set_to_none=True)
    fired = []
    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, name=name: fired.append(name))
    with SplitLinear():
        out = model(x)
    with deferring(WeightGrads()) as grads:
        out.pow(2).sum().backward()
    assert sorted(fired) == ["2.bias", "2.weight"]   # the linears' hooks wait for W
    fired.clear()
    grads.run()
    assert sorted(fired) == sorted(n for n, _ in model.named_parameters()
                                   if not n.startswith("2."))


def test_a_frozen_weight_gets_no_gradient_and_a_frozen_input_none():
    model = _model()
    model[0].weight.requires_grad_(False)
    x = torch.randn(2, 8, dtype=torch.float64)             # no grad wanted for the input
    with SplitLinear():
        out = model(x)
    with deferring(WeightGrads()) as grads:
        out.sum().backward()
    grads.run()
    assert model[0].weight.grad is None and model[0].bias.grad is not None
    assert model[3].weight.grad is not None


@pytest.mark.parametrize("dtype", [torch.bfloat16])
def test_under_autocast_every_parameter_gets_its_gradient_in_its_own_dtype(dtype):
    x = torch.randn(4, 8)
    ref = _model(torch.float32)
    with torch.autocast("cpu", dtype=dtype):
        ref(x).float().pow(2).sum().backward()
    model = _model(torch.float32)
    with torch.autocast("cpu", dtype=dtype):
        with SplitLinear():
            out = model(x)
        with deferring(WeightGrads()) as grads:
            out.float().pow(2).sum().backward()
        grads.run()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert p.grad is not None and p.grad.dtype == torch.float32, name
        assert torch.equal(p.grad, q.grad), name   # the same bf16 GEMMs, the same casts


def test_hybridpar_check_counts_the_output_gradients_kept_for_w():
    """The dry run's saved-activation peak counts what I keeps for W: the linear layer's
    input x (saved by the forward) and its output gradient dy (kept by I)."""
    from hybridpar.pipeline.activations.kept import SavedActivations

    layer = torch.nn.Linear(8, 16)
    x = torch.randn(4, 8, requires_grad=True)
    dy = torch.ones(4, 16)
    saved = SavedActivations(exclude=list(layer.parameters()))
    pending = WeightGrads()
    with saved.track():
        with SplitLinear():
            out = layer(x)
        with deferring(pending):
            out.backward(dy)
    assert saved.peak == x.numel() * 4 + dy.numel() * 4      # 128 + 256 bytes, both alive
    pending.run()
    assert layer.weight.grad is not None
