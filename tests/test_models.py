"""The model zoo: shapes, tensor-parallel parity with the plain model, skips, sampling, configs.

The parity workers build the plain model and the sharded one under the same seed on every
rank, run both in train mode from the same RNG state, and return the largest differences
(gathered logits, loss, parameter gradients against the slices of the plain gradients).
"""

import itertools

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torchgpipe import GPipe
from torchgpipe.skip import verify_skippables
from torchgpipe.skip.layout import inspect_skip_layout

import hybridpar
from hybridpar.models import (
    MODEL_LOSS,
    MODELS,
    build_model,
    example_batch,
    generate,
    gpt,
    gpt_loss,
    loss_fn,
    mlp,
    unet,
)
from hybridpar.models.gpt_layers import Block, Embeddings, Head
from hybridpar.sharded.attrs import get_parallel_dim
from hybridpar.sharded.mappings import all_gather_along
from hybridpar.tensor_parallel.state import shard_of

SMALL_GPT = {"vocab_size": 64, "block_size": 8, "n_layer": 2, "n_head": 4, "n_embd": 32}
TOL = 1e-5


# workers (module level: spawn pickles them by name) ----------------------------------------

def _compare(ref: nn.Module, par: nn.Module, x, y, loss, group) -> dict:
    """Run both from the same RNG state; the largest differences, by what was compared."""
    torch.manual_seed(1)
    ref_out = ref(x)
    ref_loss = loss(ref_out, y)
    ref_loss.backward()
    ref_next = torch.rand(4)
    torch.manual_seed(1)
    out = par(x)
    par_loss = loss(out, y)
    par_loss.backward()
    par_next = torch.rand(4)
    if get_parallel_dim(out) == -1:
        out = all_gather_along(out.detach(), -1, group)
    diffs = {
        "output": (out - ref_out).abs().max().item(),
        "loss": abs(par_loss.item() - ref_loss.item()),
        "rng after": (par_next - ref_next).abs().max().item(),
    }
    ref_params = dict(ref.named_parameters())
    assert list(ref_params) == [name for name, _ in par.named_parameters()]
    for name, p in par.named_parameters():
        full = ref_params[name]
        diffs[f"{name} value"] = (p - shard_of(full, p, group)).abs().max().item()
        diffs[f"{name} grad"] = (p.grad - shard_of(full.grad, p, group)).abs().max().item()
    diffs["sharded params"] = sum(p.shape != ref_params[n].shape
                                  for n, p in par.named_parameters())
    return diffs


def _gpt_parity_worker(tp: int) -> dict:
    topo = hybridpar.init(tp=tp, timeout=60)
    results = {}
    for dropout in (0.0, 0.1):
        cfg = {**SMALL_GPT, "dropout": dropout}
        torch.manual_seed(0)
        ref = gpt(**cfg)
        torch.manual_seed(0)
        par = gpt(**cfg, tp=tp)
        x, y = example_batch("gpt", 3, seed=2, **cfg)
        results[dropout] = _compare(ref.train(), par.train(), x, y, gpt_loss, topo.tp_group)
    return results


def _mlp_parity_worker(tp: int) -> dict:
    topo = hybridpar.init(tp=tp, timeout=60)
    cfg = {"in_features": 12, "hidden": 16, "out_features": 5, "n_layer": 3, "dropout": 0.2}
    torch.manual_seed(0)
    ref = mlp(**cfg)
    torch.manual_seed(0)
    par = mlp(**cfg, tp=tp)
    x, y = example_batch("mlp", 6, **cfg)
    return _compare(ref.train(), par.train(), x, y, loss_fn("mlp"), topo.tp_group)


def _gpt_pipe_worker() -> dict:
    topo = hybridpar.init(pp=2, tp=2, timeout=60)
    torch.manual_seed(0)
    pipe = hybridpar.HybridPipe(gpt(**SMALL_GPT, tp=2), [2, 3], chunks=2, topology=topo,
                                loss_fn=gpt_loss)
    x, y = example_batch("gpt", 4, **SMALL_GPT)
    loss = pipe.train_step(x, y).item()
    torch.optim.SGD(pipe.parameters(), lr=0.1).step()
    return {"loss": loss, "state": pipe.consolidated_state_dict()}


def _gpt_pipe_generate_worker() -> torch.Tensor:
    topo = hybridpar.init(pp=2, tp=2, timeout=60)
    torch.manual_seed(0)
    pipe = hybridpar.HybridPipe(gpt(**SMALL_GPT, tp=2), [2, 3], chunks=2, topology=topo)
    x, _ = example_batch("gpt", 2, **SMALL_GPT)
    return generate(pipe.eval(), x[:, :3], 6, generator=torch.Generator().manual_seed(3),
                    block_size=SMALL_GPT["block_size"])


def _unet_pipe_worker() -> float:
    topo = hybridpar.init(pp=3, timeout=60)
    torch.manual_seed(0)
    pipe = hybridpar.HybridPipe(unet(), [2, 2, 3], chunks=1, topology=topo,
                                loss_fn=loss_fn("unet"))
    x, y = example_batch("unet", 4)
    return pipe.train_step(x, y).item()


def _assert_small(diffs: dict, what: str) -> None:
    bad = {k: v for k, v in diffs.items() if k != "sharded params" and v > TOL}
    assert not bad, f"{what}: differences above {TOL}: {bad}"
    assert diffs["sharded params"] > 0, f"{what}: nothing was sharded"


# gpt -----------------------------------------------------------------------------------------

def test_gpt_is_a_sequential_of_embeddings_blocks_norm_and_head():
    model = gpt(**SMALL_GPT)
    assert isinstance(model, nn.Sequential) and len(model) == SMALL_GPT["n_layer"] + 3
    assert isinstance(model[0], Embeddings) and isinstance(model[-1], Head)
    assert all(isinstance(b, Block) for b in model[1:-2])
    assert isinstance(model[-2], nn.LayerNorm)
    x, y = example_batch("gpt", 2, **SMALL_GPT)
    assert x.shape == y.shape == (2, 8) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the next tokens
    logits = model(x)
    assert logits.shape == (2, 8, 64) and get_parallel_dim(logits) is None
    loss = gpt_loss(logits, y)
    assert loss.item() == pytest.approx(F.cross_entropy(logits.reshape(-1, 64),
                                                        y.reshape(-1)).item())
    # it splits anywhere: the layers chained one by one give the same logits
    h = x
    for layer in model:
        h = layer(h)
    torch.testing.assert_close(h, logits)


def test_gpt_rejects_a_sequence_longer_than_block_size():
    with pytest.raises(ValueError, match="longer than block_size 8"):
        gpt(**SMALL_GPT)(torch.zeros(1, 9, dtype=torch.int64))


@pytest.mark.parametrize("tp", [2, 4])
def test_gpt_tp_matches_one_device_with_and_without_dropout(tp):
    results = hybridpar.spawn(_gpt_parity_worker, tp, args=(tp,), timeout=90)
    for rank, by_dropout in enumerate(results):
        for dropout, diffs in by_dropout.items():
            _assert_small(diffs, f"gpt tp={tp} rank {rank} dropout={dropout}")


def test_gpt_in_a_two_stage_two_way_tp_pipe_matches_one_device():
    torch.manual_seed(0)
    ref = gpt(**SMALL_GPT)
    x, y = example_batch("gpt", 4, **SMALL_GPT)
    ref_loss = gpt_loss(ref(x), y)
    ref_loss.backward()
    torch.optim.SGD(ref.parameters(), lr=0.1).step()
    results = hybridpar.spawn(_gpt_pipe_worker, 4, timeout=120)
    for r in results:
        assert r["loss"] == pytest.approx(ref_loss.item(), abs=TOL)
        assert list(r["state"]) == list(ref.state_dict())
        for k, v in ref.state_dict().items():
            torch.testing.assert_close(r["state"][k], v, atol=TOL, rtol=0)


def test_generate_from_a_pipe_forward_matches_one_device():
    torch.manual_seed(0)
    ref = gpt(**SMALL_GPT).eval()
    x, _ = example_batch("gpt", 2, **SMALL_GPT)
    tokens = generate(ref, x[:, :3], 6, generator=torch.Generator().manual_seed(3))
    for r in hybridpar.spawn(_gpt_pipe_generate_worker, 4, timeout=120):
        assert torch.equal(r, tokens)


# config validation -----------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,message", [
    ({"n_embd": 30, "n_head": 4}, r"n_embd=30 is not divisible by n_head=4"),
    ({"n_head": 4, "tp": 3}, r"n_head=4 is not divisible by tp=3.*valid tp sizes .* \[1, 2, 4\]"),
    ({"vocab_size": 10, "n_head": 4, "tp": 4},
     r"vocab_size=10 is not divisible by tp=4.*\[1, 2\]"),
    ({"tp": 0}, r"tp must be a positive integer"),
    ({"dropout": 1.0}, r"dropout must be in \[0, 1\)"),
    ({"n_layer": 0}, r"n_layer must be a positive integer"),
])
def test_gpt_config_errors_name_the_numbers(kwargs, message):
    with pytest.raises(ValueError, match=message):
        gpt(**kwargs)


def test_gpt_with_tp_needs_hybridpar_init_or_a_group():
    assert isinstance(gpt(**SMALL_GPT, tp=1), nn.Sequential)  # tp=1: plain, no init needed
    with pytest.raises(RuntimeError, match=r"hybridpar\.init"):
        gpt(**SMALL_GPT, tp=2)
    with pytest.raises(ValueError, match="group= is given without tp="):
        gpt(**SMALL_GPT, group=object())


def test_mlp_config_errors_name_the_numbers():
    with pytest.raises(ValueError, match=r"hidden=10 is not divisible by tp=4.*\[1, 2, 5, 10\]"):
        mlp(hidden=10, tp=4)
    with pytest.raises(ValueError, match="n_layer must be a positive integer"):
        mlp(n_layer=0)


def test_unknown_model_names_and_options_are_rejected():
    with pytest.raises(ValueError, match="unknown model 'resnet'; choose one of gpt, mlp, unet"):
        build_model("resnet")
    with pytest.raises(ValueError, match="choose one of gpt, mlp, unet"):
        example_batch("resnet", 2)
    with pytest.raises(TypeError, match=r"unexpected options \['width'\]"):
        example_batch("mlp", 2, width=3)


# generate --------------------------------------------------------------------------------------

class _Bigram:
    """A callable (B, T) ids -> (B, T, V) logits from a table; records each context length."""

    def __init__(self, vocab: int = 7, seed: int = 0):
        self.table = torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(seed))
        self.lengths = []

    def __call__(self, ids):
        self.lengths.append(ids.shape[1])
        return self.table[ids]


def test_generate_is_deterministic_given_a_generator_and_uses_only_the_callable():
    idx = torch.tensor([[1, 2], [3, 4]])
    runs = [generate(_Bigram(), idx, 10, generator=torch.Generator().manual_seed(7))
            for _ in range(2)]
    assert runs[0].shape == (2, 12) and torch.equal(runs[0][:, :2], idx)
    assert torch.equal(runs[0], runs[1])
    other = generate(_Bigram(), idx, 10, generator=torch.Generator().manual_seed(8))
    assert not torch.equal(other, runs[0])


def test_generate_crops_to_block_size_and_greedy_follows_the_argmax():
    model = _Bigram()
    out = generate(model, torch.tensor([[0]]), 6, temperature=0.0, block_size=3)
    assert model.lengths == [1, 2, 3, 3, 3, 3]
    expected = [0]
    for _ in range(6):
        expected.append(int(model.table[expected[-1]].argmax()))
    assert out.tolist() == [expected]
    top1 = generate(_Bigram(), torch.tensor([[0]]), 6, top_k=1,
                    generator=torch.Generator().manual_seed(0))
    assert torch.equal(top1, out)


def test_generate_ends_once_every_row_has_drawn_a_stop_token():
    model = _Bigram()
    greedy = generate(model, torch.tensor([[0]]), 6, temperature=0.0)[0].tolist()  # 0 + 6
    stop = greedy[3]                       # the third token drawn
    first = greedy.index(stop, 1)          # where it is first drawn
    out = generate(_Bigram(), torch.tensor([[0]]), 6, temperature=0.0, stop={stop})
    assert out[0].tolist() == greedy[:first + 1]
    start = torch.tensor([[0], [greedy[1]]])
    full = generate(_Bigram(), start, 6, temperature=0.0)                  # (2, 7)
    drawn = [row[1:].tolist().index(stop) + 1 if stop in row[1:].tolist() else 6
             for row in full]                                              # until both drew it
    rows = generate(_Bigram(), start, 6, temperature=0.0, stop={stop})
    assert drawn[0] != drawn[1] and torch.equal(rows, full[:, :max(drawn) + 1])


def test_generate_reads_block_size_from_a_gpt():
    torch.manual_seed(0)
    model = gpt(**SMALL_GPT).eval()
    out = generate(model, torch.zeros(1, 8, dtype=torch.int64), 3,
                   generator=torch.Generator().manual_seed(0))
    assert out.shape == (1, 11)


# mlp -------------------------------------------------------------------------------------------

def test_mlp_shapes_and_loss():
    model = mlp(in_features=12, hidden=16, out_features=5, n_layer=3)
    assert len(model) == 4
    x, y = example_batch("mlp", 6, in_features=12, out_features=5)
    assert x.shape == (6, 12) and y.shape == (6,) and int(y.max()) < 5
    out = model(x)
    assert out.shape == (6, 5)
    MODEL_LOSS["mlp"](out, y).backward()


def test_mlp_tp2_matches_one_device_with_dropout():
    for rank, diffs in enumerate(hybridpar.spawn(_mlp_parity_worker, 2, args=(2,), timeout=60)):
        _assert_small(diffs, f"mlp tp=2 rank {rank}")


# unet ------------------------------------------------------------------------------------------

def test_unet_forward_backward_with_batch_norm():
    torch.manual_seed(0)
    model = unet(channels=4, depth=2)
    assert len(model) == 7
    assert any(isinstance(m, nn.BatchNorm2d) for m in model.modules())
    x, y = example_batch("unet", 4, channels=4, depth=2)
    assert x.shape == (4, 3, 16, 16)
    out = model(x)
    assert out.shape == (4, 10)
    loss_fn("unet")(out, y).backward()
    assert all(p.grad is not None for p in model.parameters())
    # odd sizes and a deeper net work too (Up resizes to its skip)
    assert unet(depth=3, batch_norm=False)(torch.randn(2, 3, 13, 11)).shape == (2, 10)


def test_unet_long_skips_cross_stages_of_a_three_way_split():
    model = unet()
    verify_skippables(model)
    balance = [2, 2, 3]
    bounds = [sum(balance[:i]) for i in range(len(balance) + 1)]
    partitions = [model[a:b] for a, b in itertools.pairwise(bounds)]
    routes = sorted(inspect_skip_layout(partitions).by_ns_name.values())
    assert routes == [(0, 2), (1, 2)]  # level 0: stage 0 -> 2; level 1: stage 1 -> 2


def test_unet_in_torchgpipe_matches_the_plain_model():
    torch.manual_seed(0)
    model = unet().eval()
    x, _ = example_batch("unet", 4)
    expected = model(x)
    piped = GPipe(model, balance=[2, 2, 3], devices=["cpu"] * 3, chunks=2)
    torch.testing.assert_close(piped(x), expected)


def test_unet_in_a_three_stage_pipe_matches_one_device():
    torch.manual_seed(0)
    ref = unet()
    x, y = example_batch("unet", 4)
    expected = loss_fn("unet")(ref(x), y).item()
    losses = hybridpar.spawn(_unet_pipe_worker, 3, timeout=90)
    assert losses == pytest.approx([expected] * 3, abs=TOL)


# the registry ----------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_model_builds_trains_a_step_from_its_example_batch(name):
    torch.manual_seed(0)
    model = build_model(name)
    x, y = example_batch(name, 2, seed=5)
    x2, y2 = example_batch(name, 2, seed=5)
    assert torch.equal(x, x2) and torch.equal(y, y2)
    assert not torch.equal(x, example_batch(name, 2, seed=6)[0])
    loss = loss_fn(name)(model(x), y)
    assert loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()
