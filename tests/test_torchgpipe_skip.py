"""torchgpipe's skip tests (tests/skip/ of kakaobrain/torchgpipe v0.0.7, BSD-3-Clause,
Copyright 2019-2020 Kakao Brain): the skip API through `HybridPipe` across processes.

Adapted: `verify_skippables(model)` -> `HybridPipe(model, balance, topology=...)` on two ranks,
which verifies the model (a one-layer model gets an `nn.Identity` second stage), with the same
TypeErrors on every rank; `inspect_skip_layout(partitions).copy_policy(j)` ->
`pipeline.runtime.skip.skip_routes(model, balance)` (the skips stage j receives, and from which
stage),
and the namespace model runs on three ranks: each skip goes straight from its stash stage to
its pop stage, and the outputs and gradients equal the plain model's; `Namespace` difference and
copy are shown by isolated skips of one name routed right across processes (each process makes
its own UUIDs); `test_skippable_repr` reads the layer back from the pipe; the stash / pop
errors of `test_stash_pop.py` are raised by a one-stage pipe's forward (a pop or stash the
declarations cannot match is refused earlier, at construction, with a TypeError);
`test_delete_portal_tensor` (portals' tensor_life) -> no stashed or popped tensor outlives its
step, in training and in evaluation, under every checkpoint mode. torchgpipe's `PopFoo` in
test_inspect_skip_layout.py yields `stash('foo')` (a typo): it pops here.
Not ported: `test_no_portal_without_gpipe` (portals: internals; a plain model with skippable
layers runs in every parity test here); `test_stash` (the count of tensors in a
`SkipTracker`: internals; the stashed value reaching its pop is `test_pop`); `test_stash_none`
(ported as `test_none_skip` in tests/test_torchgpipe_ports.py); test_tracker.py (torchgpipe's
thread-local default tracker, `SkipTrackerThroughPotals` and portals, and a CUDA DataParallel
case: internals hybridpar replaces with its `StageSkipTracker`); test_portal.py (portals,
phonies and copy streams: internals).
"""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
from torch import nn
from torchgpipe.skip import Namespace, pop, skippable, stash

import hybridpar
from hybridpar.pipeline.runtime.skip import skip_routes

from pipe_harness import attempt


def _mean(output, target):
    return output.mean()


# test_verify_skippables.py: the models, verified by HybridPipe on every rank ----------------


def _declared(stash=(), pop=()):
    """A skippable layer that only declares (torchgpipe's `class LayerN(nn.Module): pass`)."""

    @skippable(stash=list(stash), pop=list(pop))
    class Layer(nn.Module):
        pass

    return Layer()


def _verify_cases():
    ns1, ns2 = Namespace(), Namespace()
    foo = ["foo"]
    return {
        "matching": [_declared(stash=foo), _declared(pop=foo)],
        "stash_not_pop": [_declared(stash=foo), nn.Identity()],
        "pop_unknown": [_declared(pop=foo), nn.Identity()],
        "stash_again": [_declared(stash=foo), _declared(stash=foo), _declared(pop=foo)],
        "pop_again": [_declared(stash=foo), _declared(pop=foo), _declared(pop=foo)],
        "stash_pop_together_different_names": [
            _declared(stash=foo), _declared(pop=foo, stash=["bar"]), _declared(pop=["bar"])],
        "stash_pop_together_same_name": [_declared(stash=foo, pop=foo), nn.Identity()],
        "double_stash_pop": [_declared(stash=foo), _declared(pop=foo), _declared(stash=foo),
                             _declared(pop=foo)],
        "double_stash_pop_but_isolated": [
            _declared(stash=foo).isolate(ns1), _declared(pop=foo).isolate(ns1),
            _declared(stash=foo).isolate(ns2), _declared(pop=foo).isolate(ns2)],
    }


@skippable(stash=["hello"])
class Hello(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 1, 1)

    def forward(self, x):
        yield stash("hello", x)
        return self.conv(x)


@skippable(pop=["hello"])
class PopHello(nn.Module):
    def forward(self, x):
        hello = yield pop("hello")
        return x + hello


# test_stash_pop.py's layers ---------------------------------------------------------------


@skippable(stash=["foo"])
class StashDouble(nn.Module):
    def forward(self, input):
        yield stash("foo", input)
        return input * 2


@skippable(pop=["foo"])
class PopFooOnly(nn.Module):
    def forward(self, input):
        foo = yield pop("foo")
        return foo


@skippable(stash=["foo"])
class StashDeclaredNotUsed(nn.Module):
    def forward(self, input):
        return input * 2


@skippable(pop=["foo"])
class PopDeclaredNotUsed(nn.Module):
    def forward(self, input):
        return input * 3


@skippable()
class StashNotDeclared(nn.Module):
    def forward(self, input):
        yield stash("foo", input)
        return input * 2


@skippable()
class PopNotDeclared(nn.Module):
    def forward(self, input):
        foo = yield pop("foo")
        return foo


# test_leak.py's layers: every stashed and popped tensor, watched -----------------------------

WATCHED = []


@skippable(stash=["skip"])
class Stash(nn.Module):
    def forward(self, input):
        WATCHED.append(weakref.ref(input))
        yield stash("skip", input)
        return input


@skippable(pop=["skip"])
class Pop(nn.Module):
    def forward(self, input):
        skip = yield pop("skip")
        WATCHED.append(weakref.ref(skip))
        return input + skip


def _alive():
    gc.collect()
    return sum(ref() is not None for ref in WATCHED)


def _two_stages():
    topo = hybridpar.init(pp=2, timeout=30)
    r = {}
    r["verify"] = {name: attempt(lambda: hybridpar.HybridPipe(
        nn.Sequential(*layers), [len(layers) // 2, len(layers) - len(layers) // 2],
        topology=topo)) for name, layers in _verify_cases().items()}

    pipe = hybridpar.HybridPipe(nn.Sequential(Hello(), PopHello()), [1, 1], topology=topo)
    r["repr"] = repr(pipe[0])

    x = torch.tensor([[42.0]])
    pipe = hybridpar.HybridPipe(nn.Sequential(StashDouble(), PopFooOnly()), [1, 1],
                                topology=topo)
    r["pop"] = pipe(x)

    # no stashed or popped tensor outlives its step (stash on stage 0, pop on stage 1)
    r["leak"] = {}
    for mode in ("always", "except_last", "never"):
        torch.manual_seed(0)
        pipe = hybridpar.HybridPipe(nn.Sequential(nn.Linear(4, 4), Stash(), nn.Linear(4, 4),
                                                  Pop()), [2, 2], chunks=2, checkpoint=mode,
                                    topology=topo, loss_fn=_mean)
        for train in (True, False):
            WATCHED.clear()
            x = torch.rand(10, 4)
            if train:
                pipe.train()
                pipe.train_step(x, torch.zeros(10))
            else:
                pipe.eval()
                pipe(x)
            r["leak"][mode, train] = [len(WATCHED), _alive()]
    r["leak"] = [[mode, train, *counts] for (mode, train), counts in r["leak"].items()]
    return r


@pytest.fixture(scope="module")
def two():
    return hybridpar.spawn(_two_stages, 2, timeout=60)


@pytest.mark.parametrize("name", ["matching", "stash_pop_together_different_names",
                                  "double_stash_pop_but_isolated"])
def test_verify_skippables_accepted(two, name):
    # test_matching, test_stash_pop_together_different_names, test_double_stash_pop_but_isolated
    for r in two:
        assert r["verify"][name] == ["ok", ""]


@pytest.mark.parametrize("name,messages", [
    ("stash_not_pop", ["no module declared 'foo' as poppable but stashed"]),
    ("pop_unknown", ["'0' declared 'foo' as poppable but it was not stashed"]),
    ("stash_again", ["'1' redeclared 'foo' as stashable"]),
    ("pop_again", ["'2' redeclared 'foo' as poppable"]),
    ("stash_pop_together_same_name", ["'0' declared 'foo' both as stashable and as poppable"]),
    ("double_stash_pop", ["'2' redeclared 'foo' as stashable",
                          "'3' redeclared 'foo' as poppable"]),
])
def test_verify_skippables_refused(two, name, messages):
    # test_stash_not_pop, test_pop_unknown, test_stash_again, test_pop_again,
    # test_stash_pop_together_same_name, test_double_stash_pop
    for r in two:
        kind, message = r["verify"][name]
        assert kind == "TypeError"
        for expected in messages:
            assert expected in message


def test_skippable_repr(two):
    assert two[0]["repr"] == '''
@skippable(Hello(
  (conv): Conv2d(1, 1, kernel_size=(1, 1), stride=(1, 1))
))
'''.strip()


def test_pop(two):
    for r in two:   # the stashed input crossed to stage 1, not the doubled output
        assert r["pop"].tolist() == [[42.0]]


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_delete_portal_tensor(two, train, checkpoint):
    for r in two:
        (watched, alive), = [row[2:] for row in r["leak"] if row[:2] == [checkpoint, train]]
        assert watched >= 2 and alive == 0


# test_stash_pop.py: the errors, raised by a one-stage pipe's forward -------------------------


def _one_stage():
    topo = hybridpar.init(pp=1, timeout=30)
    x = torch.tensor([42.0])
    cases = {
        "declare_but_not_use_stash": [StashDeclaredNotUsed(), PopDeclaredNotUsed()],
        "declare_but_not_use_pop": [StashDouble(), PopDeclaredNotUsed()],
        "stash_not_declared": [StashNotDeclared()],
        "pop_not_declared": [StashDouble(), PopNotDeclared()],
        "pop_not_stashed": [PopFooOnly()],
    }
    r = {name: attempt(lambda: hybridpar.HybridPipe(nn.Sequential(*layers), [len(layers)],
                                                 topology=topo)(x))
         for name, layers in cases.items()}
    r["pop"] = hybridpar.HybridPipe(nn.Sequential(StashDouble(), PopFooOnly()), [2],
                                    topology=topo)(x)
    return r


@pytest.fixture(scope="module")
def one():
    (result,) = hybridpar.spawn(_one_stage, 1, timeout=60)
    return result


def test_pop_one_stage(one):
    assert one["pop"].tolist() == [42.0]


def test_declare_but_not_use(one):
    kind, message = one["declare_but_not_use_stash"]
    assert kind == "RuntimeError" and "'foo'" in message and "stashed" in message
    kind, message = one["declare_but_not_use_pop"]
    assert kind == "RuntimeError" and "'foo'" in message and "popped" in message


def test_stash_not_declared(one):
    kind, message = one["stash_not_declared"]
    assert kind == "RuntimeError" and "'foo'" in message


def test_pop_not_declared(one):
    # torchgpipe raises when the layer runs; the pipe refuses the model when it is built
    kind, message = one["pop_not_declared"]
    assert kind == "TypeError" and "no module declared 'foo' as poppable but stashed" in message


def test_pop_not_stashed(one):
    kind, message = one["pop_not_stashed"]
    assert kind == "TypeError" and "'0' declared 'foo' as poppable but it was not stashed" \
        in message


# test_inspect_skip_layout.py: which skips each stage receives, from which stage -------------


class Pass(nn.Module):
    def forward(self, input):
        return input


@skippable(stash=["foo"])
class StashFoo(nn.Module):
    def forward(self, input):
        yield stash("foo", input)
        return input


@skippable(pop=["foo"])
class PopFoo(nn.Module):
    def forward(self, input):
        foo = yield pop("foo")
        return input + foo


@skippable(stash=["bar"])
class StashBar(nn.Module):
    def forward(self, input):
        yield stash("bar", input)
        return input


@skippable(pop=["bar"])
class PopBar(nn.Module):
    def forward(self, input):
        bar = yield pop("bar")
        return input + bar


def _policy(*partitions):
    """torchgpipe's copy policy: per stage, the (source stage, namespace, name) of every skip
    it receives from an earlier stage, in the order the routes give."""
    balance = [len(p) for p in partitions]
    routes = skip_routes(nn.Sequential(*[layer for p in partitions for layer in p]), balance)
    return [[(r.src, r.ns, r.name) for r in routes if r.dst == j and r.src != j]
            for j in range(len(partitions))]


def test_no_skippables():
    assert _policy([Pass()], [Pass()]) == [[], []]


def test_inner_partition():
    assert _policy([StashFoo(), PopFoo()], [Pass()]) == [[], []]


def test_adjoining_partitions():
    assert _policy([StashFoo()], [PopFoo()]) == [[], [(0, None, "foo")]]


def test_far_partitions():
    assert _policy([StashFoo()], [Pass()], [PopFoo()]) == [[], [], [(0, None, "foo")]]


def test_pop_2_from_different_partitions():
    # p3 pops 'bar' before 'foo', but the plan is sorted by source partition index.
    assert _policy([StashFoo()], [StashBar()], [PopBar(), PopFoo()]) == \
        [[], [], [(0, None, "foo"), (1, None, "bar")]]


def test_namespace():
    ns1, ns2 = Namespace(), Namespace()
    assert _policy([StashFoo().isolate(ns1)], [StashFoo().isolate(ns2)],
                   [PopFoo().isolate(ns2), PopFoo().isolate(ns1)]) == \
        [[], [], [(0, ns1, "foo"), (1, ns2, "foo")]]


# the namespace model on three ranks: direct routes, the plain model's numbers -----------------


def _namespaced(pop_ns=lambda ns: ns):
    """Two skips named 'foo' in two namespaces, popped in the other order, linears between so
    that a mix-up changes the numbers; `pop_ns` gives the namespace the pop is isolated in."""
    torch.manual_seed(0)
    ns1, ns2 = Namespace(), Namespace()
    return nn.Sequential(StashFoo().isolate(ns1), nn.Linear(4, 4),
                         StashFoo().isolate(ns2), nn.Linear(4, 4),
                         PopFoo().isolate(pop_ns(ns2)), nn.Linear(4, 4),
                         PopFoo().isolate(pop_ns(ns1)))


def _three_stages():
    topo = hybridpar.init(pp=3, timeout=30)
    r = {}
    for name, pop_ns in (("difference", lambda ns: ns), ("copy", copy.copy)):
        pipe = hybridpar.HybridPipe(_namespaced(pop_ns), [2, 2, 3], chunks=2, topology=topo,
                                    loss_fn=_mean)
        pipe.p2p_log = []
        x = torch.rand(6, 4, generator=torch.Generator().manual_seed(1), requires_grad=True)
        pipe.train_step(x, torch.zeros(6))
        peers = sorted({op.peer for group in pipe.p2p_log for op in group})
        r[name] = [{k: p.grad for k, p in pipe.named_parameters()}, x.grad, peers, pipe(x)]
    return r


@pytest.fixture(scope="module")
def three():
    return hybridpar.spawn(_three_stages, 3, timeout=60)


@pytest.mark.parametrize("name", ["difference", "copy"])
def test_namespace_difference_and_copy(three, name):
    # test_namespace_difference: two namespaces keep two skips of one name apart;
    # test_namespace_copy: a copy of a namespace is the same namespace (pop isolated in it)
    model = _namespaced()
    x = torch.rand(6, 4, generator=torch.Generator().manual_seed(1), requires_grad=True)
    output = model(x)
    output.mean().backward()
    got = {k: g for r in three for k, g in r[name][0].items()}
    for k, p in model.named_parameters():
        assert torch.allclose(got[k], p.grad, atol=1e-6), k
    assert torch.allclose(three[0][name][1], x.grad, atol=1e-6)
    for r in three:
        assert torch.allclose(r[name][3], output, atol=1e-6)
    # the skips go straight to stage 2: stage 0 exchanges messages with stage 2 itself
    assert [r[name][2] for r in three] == [[1, 2], [0, 2], [0, 1]]
