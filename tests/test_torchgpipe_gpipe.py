"""torchgpipe's GPipe tests (tests/test_gpipe.py of kakaobrain/torchgpipe v0.0.7, BSD-3-Clause,
Copyright 2019-2020 Kakao Brain), run on `HybridPipe` across processes against the plain model.

Adapted: `GPipe(model, balance, devices=..., chunks=...)` -> `HybridPipe(model, balance,
chunks=..., topology=hybridpar.init(pp=len(balance)))` in spawned ranks, one stage per rank;
`model(x)` with grad + `.backward()` -> `pipe.train_step(x, y)` with the same mean loss, compared
with the plain model (`pipe(x)` is inference); every case of a world size runs in one spawned
job (the `one`, `two` fixtures) and each test asserts its part; `CheckpointBackward` nodes are
counted as recomputations (`is_recomputing()`); the pipe is sequence-like over its own stage's
layers; `model.partitions[0]` -> `pipe.partition` with the model's own names (layout-free,
not `partitions.0.0.weight`); moving to the pipe's own device is allowed; the error messages
are hybridpar's own (same types, each says how to fix it); `too_few_devices` is more stages
than processes (ValueError, not IndexError).
Not ported: `test_devices` (no device list: each process has one stage on `topology.device`);
`test_empty_module` (an empty model has no stage to run: refused, tests/test_pipe_errors.py);
`test_verify_module_duplicate_children` (ported in tests/test_torchgpipe_forms.py);
`test_verify_module_duplicate_parameters_in_distinct_children` (hybridpar trains a parameter
shared by layers as one, tied weights: tests/test_tied.py); `test_recommend_auto_balance`'s
missing balance (a required argument: Python's TypeError) and empty model (refused).
"""

from __future__ import annotations

import time
import warnings
from collections import OrderedDict

import pytest
import torch
from torch import nn

import hybridpar


class ExpectedException(Exception):
    pass


class MyString:
    def __init__(self, value):
        self.value = value

    def __str__(self):
        return self.value


def _mean(output, target):
    return output.mean()


def _try(fn):
    """[exception type name, message] of fn(), or ["ok", fn()'s value]."""
    try:
        return ["ok", fn()]
    except Exception as e:  # recorded for the test to assert
        return [type(e).__name__, str(e)]


def _grads(module):
    return {k: p.grad.clone() for k, p in module.named_parameters() if p.grad is not None}


class Counted(nn.Module):
    """Counts its first forwards under checkpointing and its recomputations."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(1, 1)
        self.checkpointed = self.recomputed = 0

    def forward(self, x):
        self.checkpointed += hybridpar.is_checkpointing()
        self.recomputed += hybridpar.is_recomputing()
        return self.fc(x)


class Two(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc_a = nn.Linear(1, 1)
        self.fc_b = nn.Linear(1, 1)

    def forward(self, a_and_b):
        a, b = a_and_b
        return (self.fc_a(a), self.fc_b(b))


class One(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(1, 1)

    def forward(self, only_a):
        a, = only_a
        return (self.fc(a),)


class NonTensor(nn.Module):
    def forward(self, _):
        return "hello"


class NonTensorTuple(nn.Module):
    def forward(self, x):
        return (x, "hello")


class Raise(nn.Module):
    def forward(self, *_):
        raise ExpectedException()


def _pair_loss(out, _):
    return (out[0] + out[1]).mean()


def _single_loss(out, _):
    return out[0].mean()


# one rank: the cases of torchgpipe's one-partition tests --------------------------------------


def _one_stage():
    topo = hybridpar.init(pp=1, timeout=30)
    r = {}
    a, b = nn.Linear(1, 1), nn.Linear(1, 1)
    pipe = hybridpar.HybridPipe(nn.Sequential(a, b), [2], topology=topo)
    with pytest.raises(IndexError):
        pipe[2]
    r["sequential_like"] = [len(pipe), list(pipe) == [a, b], pipe[0] is a, pipe[1] is b,
                            pipe[-1] is b, pipe[-2] is a]
    pipe = hybridpar.HybridPipe(nn.Sequential(nn.Linear(1, 1)), (1,), chunks=42.000,
                                checkpoint=MyString("always"), topology=topo)
    r["public_attrs"] = [pipe.balance, pipe.chunks, type(pipe.chunks).__name__, pipe.checkpoint,
                         type(pipe.checkpoint).__name__, str(pipe.device)]
    two = nn.Sequential(nn.Linear(1, 1), nn.Linear(1, 1))
    r["wrong_length"] = [_try(lambda: hybridpar.HybridPipe(two, [1], topology=topo)),
                         _try(lambda: hybridpar.HybridPipe(two, [3], topology=topo))]
    four = nn.Sequential(*[nn.Linear(1, 1) for _ in range(4)])
    r["too_few"] = _try(lambda: hybridpar.HybridPipe(four, [1, 1, 1, 1], topology=topo))
    r["mode_invalid"] = _try(lambda: hybridpar.HybridPipe(
        nn.Sequential(nn.Linear(1, 1)), [1], chunks=2, checkpoint="INVALID_CHECKPOINT",
        topology=topo))
    r["non_sequential"] = _try(lambda: hybridpar.HybridPipe(nn.Module(), [1], topology=topo))
    pipe = hybridpar.HybridPipe(nn.Sequential(Raise()), [1], chunks=1, topology=topo)
    r["exception"] = _try(lambda: pipe(torch.rand(1)))
    pipe = hybridpar.HybridPipe(nn.Sequential(nn.Linear(1, 1)), [1], topology=topo)
    r["varargs"] = _try(lambda: pipe(torch.rand(1), torch.rand(1)))
    for name, layer in {"non_tensor": NonTensor(), "non_tensor_tuple": NonTensorTuple()}.items():
        pipe = hybridpar.HybridPipe(nn.Sequential(layer), [1], topology=topo)
        r[name] = [_try(lambda: pipe(torch.rand(1))),
                   _try(lambda: pipe("hello" if name == "non_tensor"
                                     else (torch.rand(1), "hello")))]
    return r


@pytest.fixture(scope="module")
def one():
    (result,) = hybridpar.spawn(_one_stage, 1, timeout=60)
    return result


def test_sequential_like_one_stage(one):
    # test_sequential_like[2]: the pipe is its one stage's nn.Sequential
    assert one["sequential_like"] == [2, True, True, True, True, True]


def test_public_attrs(one):
    # devices -> the stage's one device (`pipe.device`, `topology.device`)
    assert one["public_attrs"] == [[1], 42, "int", "always", "str", "cpu"]


def test_balance_wrong_length(one):
    for kind, message in one["wrong_length"]:
        assert kind == "ValueError", message
        assert "covers" in message and "'time'" in message   # auto-balance, recommended


def test_too_few_devices(one):
    kind, message = one["too_few"]
    assert kind == "ValueError", message
    assert "balance [1, 1, 1, 1] has 4 stages but the pipeline has pp=1" in message


def test_checkpoint_mode_invalid(one):
    kind, message = one["mode_invalid"]
    assert kind == "ValueError"
    assert "checkpoint must be one of 'always', 'except_last', 'never'" in message


def test_verify_module_non_sequential(one):
    kind, message = one["non_sequential"]
    assert kind == "TypeError" and "needs an nn.Sequential" in message


def test_exception(one):
    assert one["exception"][0] == "ExpectedException"


def test_input_varargs(one):
    assert one["varargs"][0] == "TypeError"


def test_non_tensor(one):
    (out_kind, out), (in_kind, _) = one["non_tensor"]
    assert out_kind == "TypeError" and "returned str" in out
    assert in_kind == "TypeError"


def test_non_tensor_tuple(one):
    (out_kind, _), (in_kind, _) = one["non_tensor_tuple"]
    assert (out_kind, in_kind) == ("TypeError", "TypeError")


# two ranks: every other case, a stage per rank, against the plain model -------------------------


def _two_stages():
    topo = hybridpar.init(pp=2, timeout=30)
    rank, r = topo.pp_rank, {}
    torch.manual_seed(0)
    a, b = nn.Linear(1, 1), nn.Linear(1, 1)
    pipe = hybridpar.HybridPipe(nn.Sequential(a, b), [1, 1], topology=topo)
    mine = a if rank == 0 else b
    r["parameters"] = len(list(pipe.parameters()))
    r["sequential_like"] = [len(pipe), list(pipe) == [mine], pipe[0] is mine, pipe[-1] is mine,
                            _try(lambda: pipe[1])[0]]
    r["partitions"] = [type(pipe.partition).__name__, list(pipe.state_dict())]

    model = nn.Sequential(nn.Linear(1, 1), nn.Linear(1, 1))
    r["less_than_1"] = [_try(lambda: hybridpar.HybridPipe(model, [0, 2], topology=topo)),
                        _try(lambda: hybridpar.HybridPipe(model, [-1, 3], topology=topo))]
    r["chunks_less_than_1"] = [
        _try(lambda: hybridpar.HybridPipe(model, [1, 1], chunks=0, topology=topo)),
        _try(lambda: hybridpar.HybridPipe(model, [1, 1], chunks=-1, topology=topo))]
    r["recommend"] = _try(lambda: hybridpar.HybridPipe(model, [1], topology=topo))

    # batch sizes: indivisible (7 rows, 4 chunks) and smaller than chunks (2 rows)
    torch.manual_seed(1)
    pipe = hybridpar.HybridPipe(nn.Sequential(nn.Linear(1, 1), nn.Linear(1, 1)), [1, 1],
                                chunks=4, topology=topo)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        r["batch_sizes"] = [pipe(x) for x in (torch.arange(7.0)[:, None],
                                              torch.arange(2.0)[:, None])]
    r["warnings"] = [str(w.message) for w in record]

    # checkpoint modes: micro-batches checkpointed and recomputed on each stage, chunks=2;
    # in evaluation mode nothing is checkpointed
    counts = {}
    for mode in ("always", "except_last", "never"):
        pipe = hybridpar.HybridPipe(nn.Sequential(Counted(), Counted()), [1, 1], chunks=2,
                                    checkpoint=mode, topology=topo, loss_fn=_mean)
        pipe.train_step(torch.rand(2, 1), torch.zeros(2))
        counts[mode] = [pipe[0].checkpointed, pipe[0].recomputed]
        if mode == "always":
            pipe.eval()
            pipe.train_step(torch.rand(2, 1), torch.zeros(2))
            pipe.eval_step(torch.rand(2, 1), torch.zeros(2))
            pipe(torch.rand(2, 1))
            counts["eval"] = [pipe[0].checkpointed - 2, pipe[0].recomputed - 2]
    r["checkpoint_mode"] = counts

    # chunks=1: every mode runs and trains as one device
    x = torch.randn(4, 1, generator=torch.Generator().manual_seed(0))
    r["chunks_1"] = {}
    for mode in ("except_last", "always", "never"):
        torch.manual_seed(2)
        pipe = hybridpar.HybridPipe(nn.Sequential(nn.Linear(1, 1), nn.Linear(1, 1)), [1, 1],
                                    chunks=1, checkpoint=mode, topology=topo, loss_fn=_mean)
        r["chunks_1"][mode] = [pipe.train_step(x, torch.zeros(4)), _grads(pipe)]

    # no_grad: the partition's output holds no graph
    latent = []
    pipe = hybridpar.HybridPipe(nn.Sequential(nn.Linear(1, 1), nn.Linear(1, 1)), [1, 1],
                                chunks=2, topology=topo)
    pipe.partition.register_forward_hook(lambda module, input, output: latent.append(output))
    with torch.no_grad():
        pipe(torch.rand(2, 1))
    pipe(torch.rand(2, 1))   # HybridPipe's forward is inference, with or without no_grad
    r["no_grad"] = [t.grad_fn is None for t in latent]

    # tuples in and out, across the stages: gradients reach the inputs of the first stage
    for name, layer, loss in (("pair", Two, _pair_loss), ("singleton", One, _single_loss)):
        torch.manual_seed(3)
        pipe = hybridpar.HybridPipe(nn.Sequential(layer(), layer()), [1, 1], chunks=2,
                                    topology=topo, loss_fn=loss)
        inputs = tuple(torch.rand(10, 1, generator=torch.Generator().manual_seed(i),
                                  requires_grad=True) for i in range(2 if name == "pair" else 1))
        r[name] = [pipe.train_step(inputs, torch.zeros(10)), _grads(pipe),
                   [t.grad for t in inputs]]

    # deferred BatchNorm: running statistics (chunks=2) and parameter gradients (chunks=1)
    x = torch.rand(4, 3, 10, 10, generator=torch.Generator().manual_seed(0))
    r["deferred_batch_norm"] = {}
    for mode in ("never", "always", "except_last"):
        for chunks in (1, 2):
            torch.manual_seed(4)
            pipe = hybridpar.HybridPipe(nn.Sequential(nn.Conv2d(3, 3, 1), nn.BatchNorm2d(3)),
                                        [1, 1], chunks=chunks, checkpoint=mode, topology=topo,
                                        loss_fn=_mean, deferred_batch_norm=True)
            for _ in range(2):
                pipe.train_step(x, torch.zeros(4))
            r["deferred_batch_norm"][f"{mode}-{chunks}"] = [
                {k: v for k, v in pipe.state_dict().items() if "running" in k}, _grads(pipe)]

    # named children keep their names; a name the pipe needs for itself is refused
    a, b = nn.Linear(1, 1), nn.Linear(1, 1)
    pipe = hybridpar.HybridPipe(nn.Sequential(OrderedDict([("a", a), ("b", b)])), [1, 1],
                                topology=topo)
    r["named_children"] = [sorted(n for n, _ in pipe.named_modules()),
                           getattr(pipe, "a" if rank == 0 else "b") is (a if rank == 0 else b),
                           _try(lambda: pipe.b if rank == 0 else pipe.a)[0],
                           _try(lambda: hybridpar.HybridPipe(nn.Sequential(OrderedDict(
                               [("a", nn.Linear(1, 1)), ("checkpoint", nn.Linear(1, 1))])),
                               [1, 1], topology=topo))]

    # moving is denied, casting is allowed: a step in float64 matches one device
    torch.manual_seed(5)
    pipe = hybridpar.HybridPipe(nn.Sequential(nn.Linear(1, 1), nn.Linear(1, 1)), [1, 1],
                                chunks=2, topology=topo, loss_fn=_mean)
    r["moving"] = [_try(lambda: pipe.cuda())[0], _try(lambda: pipe.to(torch.device("cuda")))[0],
                   _try(lambda: pipe.to(0))[0], _try(lambda: pipe.to("cuda"))[0],
                   _try(lambda: pipe.to(device=0))[0], _try(lambda: pipe.to("meta"))[0],
                   _try(lambda: pipe.to(torch.rand(1, device="meta")))[0],
                   _try(lambda: pipe.to(tensor=torch.rand(1, device="meta")))[0],
                   _try(lambda: pipe.cpu())[0], _try(lambda: pipe.to("cpu"))[0]]
    pipe.half()
    pipe.to(torch.double)
    pipe.to(dtype=torch.float)
    pipe.to(torch.double)
    r["cast"] = [pipe.train_step(torch.arange(4.0, dtype=torch.double)[:, None],
                                 torch.zeros(4)), _grads(pipe)]
    return r


@pytest.fixture(scope="module")
def two():
    return hybridpar.spawn(_two_stages, 2, timeout=90)


def _plain_step(model, input, loss=_mean):
    out = model(input)
    loss(out, None).backward()
    return out


def test_parameters(two):
    assert [r["parameters"] for r in two] == [2, 2]


def test_sequential_like(two):
    # test_sequential_like[1:1]: each rank's pipe is sequence-like over its own stage
    for r in two:
        assert r["sequential_like"] == [1, True, True, True, "IndexError"]


def test_balance_less_than_1(two):
    for r in two:
        for kind, message in r["less_than_1"]:
            assert kind == "ValueError" and "has a stage with no layer" in message


def test_chunks_less_than_1(two):
    for r in two:
        for kind, message in r["chunks_less_than_1"]:
            assert kind == "ValueError" and "chunks must be a positive integer" in message


def test_recommend_auto_balance(two):
    for r in two:
        kind, message = r["recommend"]
        assert kind == "ValueError" and "'time'" in message   # balance='time' recommended


def test_batch_size_indivisible(two):
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(1, 1), nn.Linear(1, 1))
    for r in two:
        assert r["warnings"] == []   # indivisible and smaller-than-chunks batches are legal
        with torch.no_grad():
            assert torch.allclose(r["batch_sizes"][0], model(torch.arange(7.0)[:, None]))


def test_batch_size_small(two):
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(1, 1), nn.Linear(1, 1))
    for r in two:
        assert r["warnings"] == []
        with torch.no_grad():
            assert torch.allclose(r["batch_sizes"][1], model(torch.arange(2.0)[:, None]))


def test_checkpoint_mode(two):
    for r in two:   # [checkpointed first forwards, recomputations] of the stage's 2 micro-batches
        counts = r["checkpoint_mode"]
        assert counts["always"] == [2, 2]
        assert counts["except_last"] == [1, 1]
        assert counts["never"] == [0, 0]


def test_checkpoint_eval(two):
    # in eval mode a train_step, an eval_step and a forward checkpoint nothing
    for r in two:
        assert r["checkpoint_mode"]["eval"] == [0, 0]


def test_checkpoint_mode_when_chunks_1(two):
    # every mode is fine with one micro-batch, and trains as one device
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(1, 1), nn.Linear(1, 1))
    loss = model(torch.randn(4, 1, generator=torch.Generator().manual_seed(0))).mean()
    loss.backward()
    for mode in ("except_last", "always", "never"):
        got = {**two[0]["chunks_1"][mode][1], **two[1]["chunks_1"][mode][1]}
        assert two[0]["chunks_1"][mode][0].item() == pytest.approx(loss.item(), abs=1e-6)
        for k, p in model.named_parameters():
            assert torch.allclose(got[k], p.grad, atol=1e-6), (mode, k)


def test_no_grad(two):
    for r in two:
        assert r["no_grad"] == [True] * 4   # 2 micro-batches, 2 forwards


@pytest.mark.parametrize("name", ["pair", "singleton"])
def test_input_pair_and_singleton(two, name):
    # test_input_pair, test_input_singleton: tuples cross the stages; the inputs get gradients
    torch.manual_seed(3)
    layer, loss = (Two, _pair_loss) if name == "pair" else (One, _single_loss)
    model = nn.Sequential(layer(), layer())
    inputs = tuple(torch.rand(10, 1, generator=torch.Generator().manual_seed(i),
                              requires_grad=True) for i in range(2 if name == "pair" else 1))
    expected_loss = loss(model(inputs), None)
    expected_loss.backward()
    expected = _grads(model)
    loss0, grads0, input_grads = two[0][name]
    got = {**grads0, **two[1][name][1]}
    assert set(got) == set(expected)
    for k, g in expected.items():
        assert torch.allclose(got[k], g, atol=1e-6), k
    assert torch.allclose(loss0, expected_loss, atol=1e-6)
    for got_grad, t in zip(input_grads, inputs):
        assert got_grad is not None and torch.allclose(got_grad, t.grad, atol=1e-6)


@pytest.mark.parametrize("checkpoint", ["never", "always", "except_last"])
def test_deferred_batch_norm(two, checkpoint):
    # running statistics of two steps of 2 micro-batches = the plain BatchNorm's
    torch.manual_seed(4)
    model = nn.Sequential(nn.Conv2d(3, 3, 1), nn.BatchNorm2d(3))
    x = torch.rand(4, 3, 10, 10, generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        model(x)
    stats = two[1]["deferred_batch_norm"][f"{checkpoint}-2"][0]
    assert torch.allclose(stats["1.running_mean"], model[1].running_mean, atol=1e-4)
    assert torch.allclose(stats["1.running_var"], model[1].running_var, atol=1e-4)


@pytest.mark.parametrize("checkpoint", ["never", "always"])
def test_deferred_batch_norm_params(two, checkpoint):
    # chunks=1: the BatchNorm's (and the conv's) gradients = the plain model's, over two steps
    torch.manual_seed(4)
    model = nn.Sequential(nn.Conv2d(3, 3, 1), nn.BatchNorm2d(3))
    x = torch.rand(4, 3, 10, 10, generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        model(x).mean().backward()
    got = {**two[0]["deferred_batch_norm"][f"{checkpoint}-1"][1],
           **two[1]["deferred_batch_norm"][f"{checkpoint}-1"][1]}
    assert set(got) == {"0.weight", "0.bias", "1.weight", "1.bias"}
    for k, p in model.named_parameters():
        assert torch.allclose(got[k], p.grad, atol=1e-4), k


def test_partitions(two):
    # pipe.partitions[0] -> pipe.partition; names are the model's, not 'partitions.0.0.weight'
    assert two[0]["partitions"] == ["Sequential", ["0.weight", "0.bias"]]
    assert two[1]["partitions"] == ["Sequential", ["1.weight", "1.bias"]]


def test_deny_moving(two):
    for r in two:
        # cuda(), to(cuda), to(0), to('cuda'), to(device=0), to('meta'), to(a meta tensor) x 2
        assert r["moving"][:8] == ["TypeError"] * 8
        assert r["moving"][8:] == ["ok", "ok"]   # to its own device (cpu): nothing moves
    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(1, 1), nn.Linear(1, 1)).half().double()   # as the pipe
    x = torch.arange(4.0, dtype=torch.double)[:, None]
    loss = model(x).mean()
    loss.backward()
    got = {**two[0]["cast"][1], **two[1]["cast"][1]}
    assert two[0]["cast"][0].item() == pytest.approx(loss.item(), abs=1e-12)
    for k, p in model.named_parameters():
        assert got[k].dtype == torch.double and torch.allclose(got[k], p.grad), k


def test_named_children(two):
    names0, own0, other0, clash0 = two[0]["named_children"]
    names1, own1, other1, clash1 = two[1]["named_children"]
    assert (names0, names1) == (["", "a"], ["", "b"])
    assert own0 and own1   # pipe.a on the rank that holds it
    assert other0 == other1 == "AttributeError"   # a layer of another stage is not here
    for kind, message in (clash0, clash1):   # torchgpipe: no __getattr__ for this reason
        assert kind == "ValueError" and "['checkpoint'] are attributes of HybridPipe" in message


# failures across processes ----------------------------------------------------------------------

TIMEOUT = 2


class Pass(nn.Module):
    def forward(self, x):
        return x


class Counter(nn.Module):
    def __init__(self):
        super().__init__()
        self.count = 0

    def forward(self, x):
        time.sleep(0.1)
        self.count += 1
        return x


def _failing(layers, balance, chunks):
    """A train_step of a pipe whose last layer raises; each rank returns [error type, message,
    seconds, Counter counts]. (In a forward: tests/test_torchgpipe_bugs.py.)"""
    topo = hybridpar.init(pp=len(balance), timeout=TIMEOUT)
    pipe = hybridpar.HybridPipe(nn.Sequential(*[layer() for layer in layers]), balance,
                                chunks=chunks, topology=topo, loss_fn=_mean)
    x = torch.rand(chunks, requires_grad=True)
    start = time.monotonic()
    kind, message = _try(lambda: pipe.train_step(x, torch.zeros(chunks)))
    return [kind, str(message), time.monotonic() - start,
            [m.count for m in pipe.partition if isinstance(m, Counter)]]


def test_exception_across_stages():
    # test_exception over two stages: the failing stage raises its own exception, the other
    # a PipelineError naming it, at once
    (kind0, message0, seconds0, _), (kind1, _, _, _) = hybridpar.spawn(
        _failing, 2, args=([Pass, Raise], [1, 1], 1), timeout=60)
    assert kind1 == "ExpectedException"
    assert kind0 == "PipelineError" and "ExpectedException" in message0
    assert seconds0 < TIMEOUT


def test_exception_early_stop_asap():
    # the stage before the failed one stops as soon as possible: it ran 2 micro-batches, not 3
    # (it learned of the failure at its next wait, after its last forward, until the listener
    # stopped it before its next action: pipeline/failures/listener.py)
    results = hybridpar.spawn(_failing, 4, args=([Pass, Pass, Counter, Raise], [1, 1, 1, 1],
                                                 3), timeout=60)
    assert results[3][0] == "ExpectedException"
    assert results[2][3] == [2]
