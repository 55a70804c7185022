"""HybridPipe's torchgpipe promises across processes: dropout replay, deferred BatchNorm,
is_recomputing, current_microbatch, live activations per schedule, exact P2P bytes, meta models,
layout-free names and inference.

Every run is a case of one spawn per world size (the `runs` module fixture: 1, 2, 3 and 4
ranks, a case calling `hybridpar.init` with its own layout); each test asserts on its own
cases.
"""

import math

import pytest
import torch
from spawn_cases import spawn_by_world
from torch import nn

import hybridpar

from pipe_harness import data, mlp, pipe_worker, reference, skipnet

CHECKPOINTS = ("always", "except_last", "never")
SCHEDULES = ("gpipe", "1f1b", "zb-h1")
BN_CASES = [("always", "gpipe"), ("never", "gpipe"), ("always", "zb-h1")]
SAVED_PP, SAVED_M = 3, 6


def _case(worker, *args):
    return WORKERS[worker](*args)


def _cases():
    """name -> (world size, worker, its arguments), for every test of this file."""
    cases = {"dropout one stage": (1, "pipe", "mlp", {"dropout": 0.3}, [4], (1, 1, 1), 3, 8,
                                   {"checkpoint": "always"})}
    for checkpoint in CHECKPOINTS:
        for schedule in SCHEDULES:
            cases[f"dropout {checkpoint} {schedule}"] = (
                2, "pipe", "mlp", {"dropout": 0.3}, [2, 2], (2, 1, 1), 3, 8,
                {"chunks": 4, "checkpoint": checkpoint, "schedule": schedule})
    for checkpoint, schedule in BN_CASES:
        cases[f"bn {checkpoint} {schedule}"] = (
            2, "pipe", "skipnet", {"batch_norm": True}, [2, 5], (2, 1, 1), 3, 12,
            {"chunks": 3, "deferred_batch_norm": True, "checkpoint": checkpoint,
             "schedule": schedule})
    for schedule in ("gpipe", "1f1b"):
        cases[f"live {schedule}"] = (4, "probe", 4, schedule, "never", 6)
    cases["recompute"] = (2, "probe", 2, "1f1b", "always", 3)
    cases["except_last"] = (2, "probe", 2, "gpipe", "except_last", 4)
    for tp in (1, 2):
        cases[f"bytes tp{tp}"] = (2 * tp, "bytes", tp, 4, 8, 6)
    cases["meta"] = (2, "meta")
    for pp in (1, 3):
        cases[f"inference pp{pp}"] = (pp, "inference", pp, 4)
    cases["clip"] = (2, "clip")
    cases["names"] = (1, "names")
    for schedule in ("gpipe", "1f1b"):
        cases[f"saved {schedule} one"] = (SAVED_PP, "saved", SAVED_PP, schedule, "never", 1)
        for mode in ("never", "always"):
            cases[f"saved {schedule} {mode}"] = (SAVED_PP, "saved", SAVED_PP, schedule, mode,
                                                SAVED_M)
    cases["tuples"] = (2, "tuple")
    for schedule in ("1f1b", "zb-h1"):
        cases[f"accumulations {schedule}"] = (2, "accumulations", schedule)
    return cases


@pytest.fixture(scope="module")
def runs():
    return spawn_by_world(_case, {name: (c[0], c[1:]) for name, c in _cases().items()},
                          timeout=240)

# dropout -------------------------------------------------------------------------------------


def test_dropout_on_one_stage_matches_the_plain_model_bit_for_bit(runs):
    steps, batch = 3, 8
    xs, ys = data(steps, batch)
    ref_losses, ref_state = reference(mlp(dropout=0.3), xs, ys)
    (result,) = runs["dropout one stage"]
    assert result["losses"] == ref_losses
    for k, v in ref_state.items():
        assert torch.equal(result["state"][k], v), k


def test_dropout_masks_replay_exactly_under_every_checkpoint_mode_and_schedule(runs):
    runs = {(checkpoint, schedule): runs[f"dropout {checkpoint} {schedule}"][0]
            for checkpoint in CHECKPOINTS for schedule in SCHEDULES}
    # Within a schedule the checkpoint modes agree bit for bit; across schedules the
    # gradients accumulate in another micro-batch order, so they agree to rounding.
    for (checkpoint, schedule), run in runs.items():
        same = runs["never", schedule]
        assert run["losses"] == same["losses"], (checkpoint, schedule)
        for k, v in same["state"].items():
            assert torch.equal(run["state"][k], v), (checkpoint, schedule, k)
    gpipe, one_f_one_b = runs["never", "gpipe"], runs["never", "1f1b"]
    assert gpipe["losses"] == pytest.approx(one_f_one_b["losses"], abs=1e-6)
    assert runs["never", "zb-h1"]["losses"] == pytest.approx(one_f_one_b["losses"], abs=1e-6)


# deferred BatchNorm ----------------------------------------------------------------------------


def _bn_reference(model, xs, ys, chunks):
    """Per-micro-batch normalization, running statistics of the whole mini-batch."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for x, y in zip(xs, ys):
        buffers = {k: v.clone() for k, v in model.named_buffers()}
        opt.zero_grad()
        loss = sum(nn.functional.cross_entropy(model(xc), yc) * len(xc) / len(x)
                   for xc, yc in zip(x.chunk(chunks), y.chunk(chunks)))
        loss.backward()
        with torch.no_grad():
            for k, v in model.named_buffers():
                v.copy_(buffers[k])
            model(x)  # one update of the running statistics by the whole mini-batch
        opt.step()
        losses.append(loss.item())
    return losses, model.state_dict()


@pytest.mark.parametrize("checkpoint,schedule", BN_CASES)
def test_deferred_batch_norm_tracks_the_whole_mini_batch(checkpoint, schedule, runs):
    steps, batch, chunks = 3, 12, 3
    xs, ys = data(steps, batch)
    ref_losses, ref_state = _bn_reference(skipnet(batch_norm=True), xs, ys, chunks)
    results = runs[f"bn {checkpoint} {schedule}"]
    for r in results:
        assert r["losses"] == pytest.approx(ref_losses, abs=1e-5)
        assert list(r["state"]) == list(ref_state)  # no extra buffers in the state dict
        for k, v in ref_state.items():
            torch.testing.assert_close(r["state"][k], v, atol=1e-5, rtol=0)
    assert results[0]["state"]["1.1.num_batches_tracked"].item() == steps


# is_recomputing, current_microbatch, live activations ------------------------------------------


class Probe(nn.Module):
    """Counts forwards, records the flags it sees and the micro-batches alive on its stage."""

    def __init__(self):
        super().__init__()
        self.forwards = 0
        self.flags = []
        self.keys = {}
        self.live = 0
        self.max_live = 0

    def forward(self, x):
        import torchgpipe

        self.flags.append((hybridpar.is_recomputing(), torchgpipe.is_recomputing(),
                           hybridpar.is_checkpointing(), torchgpipe.is_checkpointing()))
        key = hybridpar.current_microbatch()
        self.keys.setdefault(id(key), 0)
        self.keys[id(key)] += 1
        if not hybridpar.is_recomputing():
            self.forwards += 1
        return _Live.apply(x, self) if torch.is_grad_enabled() else x


class _Live(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, probe):
        ctx.probe = probe
        probe.live += 1
        probe.max_live = max(probe.max_live, probe.live)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.probe.live -= 1
        return grad, None


def _probe_worker(pp, schedule, checkpoint, chunks):
    topo = hybridpar.init(pp=pp, timeout=60)
    torch.manual_seed(0)
    layers = []
    for _ in range(pp):
        layers += [nn.Linear(4, 4), Probe()]
    pipe = hybridpar.HybridPipe(nn.Sequential(*layers), [2] * pp, chunks=chunks, topology=topo,
                                schedule=schedule, checkpoint=checkpoint,
                                loss_fn=lambda out, y: (out - y).pow(2).mean())
    probe = pipe.partition[1]
    pipe.train_step(torch.randn(2 * chunks, 4), torch.randn(2 * chunks, 4))
    return {"forwards": probe.forwards, "max_live": probe.max_live, "live": probe.live,
            "flags": [list(f) for f in probe.flags], "keys": sorted(probe.keys.values())}


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_live_microbatches_per_stage_follow_the_schedule(schedule, runs):
    pp, m = 4, 6
    results = runs[f"live {schedule}"]
    expected = [m] * pp if schedule == "gpipe" else [min(pp - s, m) for s in range(pp)]
    assert [r["max_live"] for r in results] == expected
    assert all(r["live"] == 0 for r in results)


def test_recomputation_is_detected_and_counts_each_microbatch_once(runs):
    m = 3
    results = runs["recompute"]
    for r in results:
        assert r["forwards"] == m
        # first forwards are checkpointing, the recomputations are recomputing
        assert r["flags"].count([False, False, True, True]) == m
        assert r["flags"].count([True, True, False, False]) == m
        assert r["keys"] == [2] * m  # current_microbatch: one object per micro-batch, seen twice
        assert r["max_live"] == 1  # checkpointing keeps no micro-batch's activations alive


def test_except_last_recomputes_all_but_the_last_microbatch(runs):
    m = 4
    r0, _ = runs["except_last"]
    assert r0["forwards"] == m
    assert sum(f[0] for f in r0["flags"]) == m - 1


# exact communication ---------------------------------------------------------------------------


def _bytes_worker(tp, chunks, batch, width):
    topo = hybridpar.init(pp=2, tp=tp, timeout=60)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(width, width), nn.Linear(width, width))
    pipe = hybridpar.HybridPipe(model, [1, 1], chunks=chunks, topology=topo,
                                loss_fn=lambda out, y: (out - y).pow(2).mean())
    x, y = torch.randn(batch, width), torch.randn(batch, width)
    pipe.train_step(x, y)  # warm-up: the counters count one whole step after it
    hybridpar.reset_comm_stats()
    pipe.train_step(x, y)
    return hybridpar.comm_stats()


@pytest.mark.parametrize("tp", [1, 2])
def test_p2p_bytes_per_step_are_b_h_per_microbatch_divided_by_tp(tp, runs):
    chunks, batch, width = 4, 8, 6
    results = runs[f"bytes tp{tp}"]
    payload = batch * width * 4 // tp  # fp32: b*h per boundary per step, 1/tp with scatter-gather
    for rank, stats in enumerate(results):
        assert stats["p2p_send"]["bytes"] == payload, rank  # activations out, or gradients back
        assert stats["p2p_send"]["calls"] == chunks
        assert stats["p2p_recv"]["bytes"] == payload
        if tp > 1:  # the receiver re-assembles each micro-batch inside its tp group
            assert stats["all_gather"]["calls"] == chunks


# construction, names, inference ------------------------------------------------------------------


def _meta_worker():
    topo = hybridpar.init(pp=2, timeout=60)
    with torch.device("meta"):
        model = mlp()
    pipe = hybridpar.HybridPipe(model, [2, 2], chunks=2, topology=topo,
                                loss_fn=nn.functional.cross_entropy)
    others = [p.is_meta for i, layer in enumerate(model) if i // 2 != topo.pp_rank
              for p in layer.parameters()]
    loss = pipe.train_step(torch.randn(4, 8), torch.tensor([0, 1, 2, 0]))
    return {"names": [n for n, _ in pipe.named_parameters()], "others_freed": all(others),
            "local_on_cpu": all(p.device.type == "cpu" for p in pipe.parameters()),
            "loss": loss.item()}


def test_a_meta_built_model_is_materialized_only_for_the_local_stage(runs):
    r0, r1 = runs["meta"]
    assert r0["names"] == ["0.0.weight", "0.0.bias", "1.0.weight", "1.0.bias"]
    assert r1["names"] == ["2.0.weight", "2.0.bias", "3.weight", "3.bias"]
    assert r0["others_freed"] and r1["others_freed"]
    assert r0["local_on_cpu"] and r1["local_on_cpu"]
    assert r0["loss"] == r1["loss"] and math.isfinite(r0["loss"])


def _inference_worker(pp, chunks):
    topo = hybridpar.init(pp=pp, timeout=60)
    pipe = hybridpar.HybridPipe(skipnet(), [7 // pp + (1 if s < 7 % pp else 0) for s in range(pp)],
                                chunks=chunks, topology=topo)
    return pipe(data(1, 10)[0][0])


@pytest.mark.parametrize("pp", [1, 3])
def test_inference_returns_the_full_output_on_every_rank(pp, runs):
    expected = skipnet()(data(1, 10)[0][0])
    for out in runs[f"inference pp{pp}"]:
        torch.testing.assert_close(out, expected, atol=1e-6, rtol=0)


def _clip_worker():
    topo = hybridpar.init(pp=2, timeout=60)
    pipe = hybridpar.HybridPipe(mlp(), [2, 2], chunks=2, topology=topo,
                                loss_fn=nn.functional.cross_entropy)
    x, y = data(1, 8)
    pipe.train_step(x[0], y[0])
    norm = pipe.clip_grad_norm_(0.1)
    return {"norm": norm.item(), "state": {n: p.grad for n, p in pipe.named_parameters()}}


def test_clip_grad_norm_uses_the_global_norm_over_all_stages(runs):
    model = mlp()
    x, y = data(1, 8)
    nn.functional.cross_entropy(model(x[0]), y[0]).backward()
    norm = nn.utils.clip_grad_norm_(model.parameters(), 0.1)
    grads = {n: p.grad for n, p in model.named_parameters()}
    for r in runs["clip"]:
        assert r["norm"] == pytest.approx(norm.item(), rel=1e-5)
        for n, g in r["state"].items():
            torch.testing.assert_close(g, grads[n], atol=1e-6, rtol=0)


def test_a_one_stage_pipe_keeps_the_models_state_dict_keys(runs):
    (names,) = runs["names"]
    assert names == list(mlp().state_dict())


def _names_worker():
    topo = hybridpar.init(timeout=60)
    pipe = hybridpar.HybridPipe(mlp(), [4], topology=topo)
    return list(pipe.state_dict())


# saved activations, measured with saved-tensor hooks ----------------------------------------


def _saved_bytes_worker(pp, schedule, checkpoint, chunks):
    import weakref

    topo = hybridpar.init(pp=pp, timeout=60)
    torch.manual_seed(0)
    layers = [nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(pp)]
    pipe = hybridpar.HybridPipe(nn.Sequential(*layers), [1] * pp, chunks=chunks, topology=topo,
                                schedule=schedule, checkpoint=checkpoint,
                                loss_fn=lambda out, y: (out - y).pow(2).mean())
    params = {id(p) for p in pipe.parameters()}
    live, peak = [0], [0]

    class Saved:
        def __init__(self, t):
            self.t = t

    def pack(t):
        handle = Saved(t)
        if id(t) not in params:  # activations only
            nbytes = t.numel() * t.element_size()
            live[0] += nbytes
            peak[0] = max(peak[0], live[0])
            weakref.finalize(handle, lambda: live.__setitem__(0, live[0] - nbytes))
        return handle

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda h: h.t):
        pipe.train_step(torch.randn(4 * chunks, 16), torch.randn(4 * chunks, 16))
    return {"peak": peak[0], "after": live[0]}


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_saved_activation_bytes_follow_the_live_microbatch_formulas(schedule, runs):
    pp, m = SAVED_PP, SAVED_M
    one = [r["peak"] for r in runs[f"saved {schedule} one"]]
    runs = {mode: runs[f"saved {schedule} {mode}"] for mode in ("never", "always")}
    live = [m] * pp if schedule == "gpipe" else [min(pp - s, m) for s in range(pp)]
    assert [r["peak"] for r in runs["never"]] == [n * b for n, b in zip(live, one)]
    # checkpointing keeps one micro-batch's activations at a time (during its recomputation)
    assert [r["peak"] for r in runs["always"]] == one
    assert all(r["after"] == 0 for mode in runs for r in runs[mode])


# tuples between stages -----------------------------------------------------------------------


class SplitPair(nn.Module):
    def forward(self, x):
        return x * 2, (x > 0).long()  # a float and an integer tensor cross the boundary


class JoinPair(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, pair):
        x, mask = pair
        return self.fc(x * mask)


def _tuple_worker():
    topo = hybridpar.init(pp=2, timeout=60)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), SplitPair(), JoinPair())
    pipe = hybridpar.HybridPipe(model, [2, 1], chunks=2, topology=topo,
                                loss_fn=nn.functional.cross_entropy)
    x, y = torch.randn(6, 4, generator=torch.Generator().manual_seed(1)), torch.arange(6) % 3
    loss = pipe.train_step(x, y)
    return {"loss": loss.item(), "grads": {n: p.grad for n, p in pipe.named_parameters()}}


def test_tuples_of_float_and_integer_tensors_cross_stages(runs):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), SplitPair(), JoinPair())
    x, y = torch.randn(6, 4, generator=torch.Generator().manual_seed(1)), torch.arange(6) % 3
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    for r in runs["tuples"]:
        assert r["loss"] == pytest.approx(loss.item(), abs=1e-6)
        for n, g in r["grads"].items():
            torch.testing.assert_close(g, grads[n], atol=1e-6, rtol=0)


# zero bubble: where weight gradients are computed ----------------------------------------------


def _accumulations_worker(schedule):
    topo = hybridpar.init(pp=2, timeout=60)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 4), nn.Linear(4, 4))
    pipe = hybridpar.HybridPipe(model, [2, 2], chunks=3, topology=topo, schedule=schedule,
                                loss_fn=lambda out, y: (out - y).pow(2).mean())
    seen = []
    executor = pipe._executor
    for name, p in pipe.named_parameters():
        def hook(p, name=name):   # the action running when the gradient accumulates
            seen.append((name, executor.step.actions[executor.step.at].kind))
        p.register_post_accumulate_grad_hook(hook)
    pipe.train_step(torch.randn(6, 4), torch.randn(6, 4))
    return sorted(set(seen)), len(seen)


def test_zero_bubble_defers_the_linear_layers_weight_gradients_to_w(runs):
    # 1F1B accumulates every gradient in B; ZB-H1 accumulates the Linear weights and biases in
    # W (the split), the LayerNorm's in I (the fallback), once per micro-batch each
    one_f_one_b = runs["accumulations 1f1b"]
    zb = runs["accumulations zb-h1"]
    assert one_f_one_b[0] == ([(n, "B") for n in ("0.bias", "0.weight", "1.bias", "1.weight")],
                              12)
    assert zb[0] == ([("0.bias", "W"), ("0.weight", "W"), ("1.bias", "I"), ("1.weight", "I")],
                     12)
    assert zb[1] == ([(n, "W") for n in ("2.bias", "2.weight", "3.bias", "3.weight")], 12)


WORKERS = {"pipe": pipe_worker, "probe": _probe_worker, "bytes": _bytes_worker,
           "meta": _meta_worker, "inference": _inference_worker, "clip": _clip_worker,
           "names": _names_worker, "saved": _saved_bytes_worker, "tuple": _tuple_worker,
           "accumulations": _accumulations_worker}
