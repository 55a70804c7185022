"""train.param_dtype = "bf16": bf16 weights, float32 gradients and master weights, zero 0 / 1.

The mechanism is checked against its definition on one rank, bit for bit: a plain bf16 model
whose micro-batch gradients are summed in float32 by hand and whose float32 copies AdamW
steps. The trainer's bf16 runs (the tiny GPT of test_zero, and a tied GPT-2) then train at
pp2 x dp2 (1F1B, and ZBV, whose W passes accumulate too), tp2 x dp2 and pp2 x tp2 x dp2 as on
one rank (float32 sums in another order: a bf16 weight may round the other way), zero = 1
exactly as zero = 0, near the float32 run (and fp32 weights at zero = 1 over 8 ranks as on
one); each rank holds 2 + 4 bytes per parameter plus 12 per parameter it owns; a checkpoint
holds the float32 masters and resumes at another dp, zero and param_dtype.
"""

from __future__ import annotations

import copy
import shutil

import pytest
import torch
import torch.nn.functional as F
from spawn_cases import selected_ids, spawn_by_world, spawn_cases
from test_zero import config, gpt2

import hybridpar
from hybridpar import HybridPipe
from hybridpar.optim import MasterWeights, deal, optimizer_state_tensors, owned_parameters
from hybridpar.precision import check_dtype_runs, grad_of, set_grad
from hybridpar.train import ConfigError
from hybridpar.train.build import build_optimizer
from hybridpar.train.export import read_state
from hybridpar.train.trainer import build_pipe, train

TIMEOUT = 120
BF16 = ["train.precision=bf16", "train.param_dtype=bf16"]


def _layout(pp: int, tp: int, dp: int, zero: int) -> list[str]:
    return [f"parallel.pp={pp}", f"parallel.tp={tp}", f"parallel.dp={dp}",
            f"parallel.zero={zero}"]


def _train(cfg, run_dir):
    summary = train(cfg, run_dir, progress=False)
    return summary["losses"], summary["start"]


# the mechanism, bit for bit ----------------------------------------------------------------
def _mechanism():
    """Three steps of a 2-layer MLP in 4 micro-batches: the pipe with bf16 weights and
    `MasterWeights`, and the definition written out; both models' weights and masters."""
    topo = hybridpar.init(timeout=60)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    ref = copy.deepcopy(model).to(torch.bfloat16)
    pipe = HybridPipe(model, [3], chunks=4, topology=topo, loss_fn=F.mse_loss,
                      param_dtype=torch.bfloat16)
    optimizer = MasterWeights(pipe.parameters(), torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
    masters = [torch.nn.Parameter(p.detach().float()) for p in ref.parameters()]
    ref_optimizer = torch.optim.AdamW(masters, lr=1e-2, weight_decay=0.1)
    dtypes = {p.dtype for p in pipe.parameters()}
    for _ in range(3):
        x, y = torch.randn(16, 8), torch.randn(16, 4)
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            pipe.train_step(x, y)
        grads = [torch.zeros_like(m) for m in masters]     # float32 sums over micro-batches
        for xs, ys in zip(x.chunk(4), y.chunk(4)):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = F.mse_loss(ref(xs), ys) * (len(xs) / len(x))
            loss.backward()
            for g, p in zip(grads, ref.parameters()):
                g.add_(p.grad)
                p.grad = None
        main = [grad_of(p).clone() for p in pipe.parameters()]
        optimizer.step()
        for m, g in zip(masters, grads):
            m.grad = g
        ref_optimizer.step()
        with torch.no_grad():
            for p, m in zip(ref.parameters(), masters):
                p.copy_(m)
    pipe.close()
    return {"dtypes": dtypes, "grads": (main, grads),
            "weights": ([p.detach() for p in pipe.parameters()],
                        [p.detach() for p in ref.parameters()]),
            "masters": ([optimizer.master_of(p).detach() for p in pipe.parameters()],
                        [m.detach() for m in masters])}


def test_bf16_weights_step_as_their_definition_bit_for_bit():
    out = hybridpar.spawn(_mechanism, 1, timeout=TIMEOUT)[0]
    assert out["dtypes"] == {torch.bfloat16}
    for what in ("grads", "weights", "masters"):
        mine, theirs = out[what]
        assert all(torch.equal(a, b) for a, b in zip(mine, theirs, strict=True)), what
    assert {t.dtype for t in out["masters"][0]} == {torch.float32}
    assert {t.dtype for t in out["grads"][0]} == {torch.float32}


# layouts ------------------------------------------------------------------------------------
UNSAVED = "checkpoint.every=0"   # the layouts' runs: their losses alone are checked


def _cases():
    tied = {"precision": "bf16", "param_dtype": "bf16", "every": 0}
    cases = {"1x1": (1, (config(*BF16, *_layout(1, 1, 1, 0), UNSAVED),)),
             "1x1 fp32": (1, (config(*_layout(1, 1, 1, 0), UNSAVED),)),
             "tied 1x1": (1, (gpt2(1, 1, 0, **tied),)),
             "tied pp2 x dp2 zero1": (4, (gpt2(2, 2, 1, **tied),)),
             "pp2 x tp2 x dp2 zero1": (8, (config(*BF16, *_layout(2, 2, 2, 1), UNSAVED),)),
             "fp32 pp2 x tp2 x dp2 zero1": (8, (config(*_layout(2, 2, 2, 1), UNSAVED),)),
             "zbv pp2 x dp2 zero1": (4, (config(*BF16, *_layout(2, 1, 2, 1),
                                               "parallel.schedule=zbv", UNSAVED),))}
    for name, (pp, tp, dp) in {"pp2 x dp2": (2, 1, 2), "tp2 x dp2": (1, 2, 2)}.items():
        for zero in (0, 1):
            cases[f"{name} zero{zero}"] = (4, (config(*BF16, *_layout(pp, tp, dp, zero),
                                                      UNSAVED),))
    return cases


def _needed(request) -> set[str]:
    """The `_cases` the selected tests read (tests/tiers.py holds the 8-rank ones for the
    campaign)."""
    layouts = selected_ids(request, "test_bf16_layouts_train_as_one_rank")
    needed = set(layouts) | {"tied 1x1" if n.startswith("tied") else "1x1" for n in layouts}
    for name in selected_ids(request, "test_zero_1_steps_exactly_as_zero_0"):
        needed |= {f"{name} zero0", f"{name} zero1"}
    if selected_ids(request, "test_fp32_zero_1_at_pp2_x_tp2_x_dp2_trains_as_one_rank"):
        needed |= {"fp32 pp2 x tp2 x dp2 zero1", "1x1 fp32"}
    if selected_ids(request, "test_bf16_weights_train_close_to_fp32"):
        needed |= {"1x1", "1x1 fp32"}
    return needed


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
    needed = _needed(request)
    cases = {name: (world, (*args, str(tmp_path_factory.mktemp(name.replace(" ", "")))))
             for name, (world, args) in _cases().items() if name in needed}
    return spawn_by_world(_train, cases, timeout=TIMEOUT * 3)


@pytest.mark.parametrize("name", ["pp2 x dp2 zero0", "pp2 x dp2 zero1", "tp2 x dp2 zero0",
                                  "tp2 x dp2 zero1", "pp2 x tp2 x dp2 zero1",
                                  "zbv pp2 x dp2 zero1", "tied pp2 x dp2 zero1"])
def test_bf16_layouts_train_as_one_rank(runs, name):
    one = runs["tied 1x1" if name.startswith("tied") else "1x1"][0][0]
    losses = [r[0] for r in runs[name]]
    assert all(loss == losses[0] for loss in losses)       # every rank reports the same
    assert len(losses[0]) == 4
    # bf16 weights: float32 gradients summed in another order may round a weight the other
    # way (measured: at most 9e-5; the tie's copies not summed over stages: 3e-3)
    assert losses[0] == pytest.approx(one, rel=5e-4, abs=0)


def test_fp32_zero_1_at_pp2_x_tp2_x_dp2_trains_as_one_rank(runs):
    losses = runs["fp32 pp2 x tp2 x dp2 zero1"][0][0]
    assert losses == pytest.approx(runs["1x1 fp32"][0][0], rel=1e-5, abs=0)


@pytest.mark.parametrize("name", ["pp2 x dp2", "tp2 x dp2"])
def test_zero_1_steps_exactly_as_zero_0(runs, name):
    assert runs[f"{name} zero1"][0][0] == runs[f"{name} zero0"][0][0]


def test_bf16_weights_train_close_to_fp32(runs):
    bf16, fp32 = runs["1x1"][0][0], runs["1x1 fp32"][0][0]
    assert bf16 == pytest.approx(fp32, rel=5e-3)            # measured: 1.2e-3 at most
    assert bf16 != fp32


# bytes ----------------------------------------------------------------------------------------
def _state_bytes(overrides):
    """This rank's bytes after one step of the trainer's optimizer: weights, the gradient
    buffers, the optimizer (masters and moments), the parameters it owns (elements)."""
    cfg = config(*overrides)
    par = cfg.parallel
    topo = hybridpar.init(pp=par.pp, tp=par.tp, dp=par.dp, timeout=60)
    pipe = build_pipe(cfg, topo)
    optimizer = build_optimizer(pipe, cfg)
    for p in pipe.parameters():
        set_grad(p, torch.zeros(p.shape))
    optimizer.step()
    nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)   # noqa: E731
    out = {"weights": nbytes(pipe.parameters()),
           "elements": sum(p.numel() for p in pipe.parameters()),
           "optimizer": nbytes(t for t in optimizer_state_tensors(optimizer) if t.dim() > 0),
           "owned": sum(p.numel() for p in pipe.parameters()
                        if id(p) in owned_parameters(optimizer)),
           "type": type(optimizer).__name__}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        pipe.train_step(*pipe_batch(cfg))              # the float32 gradient buffers exist
    out["buffers"] = nbytes(pipe._dp_buckets.buffers())
    pipe.close()
    return out


def pipe_batch(cfg):
    from hybridpar.train.data import make_batches

    return make_batches(cfg, split="train", dp_rank=0, dp=cfg.parallel.dp).next_batch()


def test_each_rank_holds_6_bytes_per_parameter_and_12_per_parameter_it_owns():
    cases = {"zero0": (BF16 + _layout(1, 1, 2, 0),), "zero1": (BF16 + _layout(1, 1, 2, 1),)}
    out = spawn_cases(_state_bytes, 2, cases, timeout=TIMEOUT)
    for rank in range(2):
        whole, part = out["zero0"][rank], out["zero1"][rank]
        for r in (whole, part):
            assert r["type"] == "MasterWeights"
            assert r["weights"] == 2 * r["elements"]      # bf16
            assert r["buffers"] == 4 * r["elements"]      # float32 gradients, no copy
        assert whole["optimizer"] == 12 * whole["elements"]
        assert part["optimizer"] == 12 * part["owned"]
    owned = [r["owned"] for r in out["zero1"]]
    assert sum(owned) == out["zero0"][0]["elements"] and max(owned) < 0.6 * sum(owned)


# checkpoints ----------------------------------------------------------------------------------
def test_a_bf16_zero_1_checkpoint_resumes_at_another_dp_zero_and_param_dtype(tmp_path):
    ref = tmp_path / "ref"
    (ref_losses, _), _ = spawn_cases(_train, 2, {"ref": (config(*BF16, *_layout(1, 1, 2, 1)),
                                                         str(ref))}, timeout=TIMEOUT)["ref"]
    step2 = ref / "checkpoints" / "step-2"
    cases = {"same": (2, BF16 + _layout(1, 1, 2, 1), 0.0),
             "dp1 zero0": (1, BF16 + _layout(1, 1, 1, 0), 5e-4),
             "pp2 dp2 zero1": (4, BF16 + _layout(2, 1, 2, 1), 5e-4),
             "fp32 weights": (2, _layout(1, 1, 2, 0), 5e-3)}
    for name, (ranks, overrides, rel) in cases.items():
        folder = tmp_path / name.replace(" ", "-")
        shutil.copytree(step2, folder / "checkpoints" / "step-2")
        losses, start = hybridpar.spawn(_train, ranks, args=(config(*overrides), str(folder)),
                                        timeout=TIMEOUT)[0]
        assert start == 2, name
        if rel == 0:
            assert losses == ref_losses[2:], name     # the masters resume exactly
        else:
            assert losses == pytest.approx(ref_losses[2:], rel=rel, abs=0), name
    # what `hybridpar export` reads: every tensor of the model, float32 (the masters), with
    # the names of a checkpoint of fp32 weights
    bf16_state = read_state(step2)
    fp32_state = read_state(tmp_path / "fp32-weights" / "checkpoints" / "step-4")
    assert bf16_state.keys() == fp32_state.keys()
    assert {v.dtype for v in bf16_state.values() if v.is_floating_point()} == {torch.float32}


# bad input ------------------------------------------------------------------------------------
def test_bf16_weights_need_bf16_compute_and_a_known_dtype():
    with pytest.raises(ConfigError, match=r"train\.param_dtype='bf16' needs "
                                          r"train\.precision='bf16'"):
        config("train.param_dtype=bf16")
    with pytest.raises(ConfigError, match=r"train\.param_dtype"):
        config("train.param_dtype=fp16")


def _pipe_with_weights(dtype):
    topo = hybridpar.init(timeout=60)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    try:
        HybridPipe(model, [1], topology=topo, loss_fn=F.mse_loss, param_dtype=dtype)
    except ValueError as e:
        return str(e)
    return None


def test_weights_of_a_dtype_the_device_cannot_run_are_refused(monkeypatch):
    # float16 weights: refused by the pipe, on its rank, before anything is built
    error = hybridpar.spawn(_pipe_with_weights, 1, args=(torch.float16,), timeout=TIMEOUT)[0]
    assert error is not None and "torch.float16 weights are not supported" in error
    assert "use torch.bfloat16" in error
    # bf16 on a GPU without bf16 arithmetic (a V100): what it is, and what to set instead
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation: False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (7, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "Tesla V100-SXM2-32GB")
    with pytest.raises(ValueError, match=r"train\.precision = 'bf16': Tesla V100-SXM2-32GB "
                                         r"\(compute capability 7\.0\) has no bf16 arithmetic "
                                         r".*train in fp32"):
        check_dtype_runs(torch.bfloat16, torch.device("cuda", 0),
                         what="train.precision = 'bf16'")
    check_dtype_runs(torch.bfloat16, torch.device("cpu"), what="cpu")   # CPUs run bf16


def test_master_weights_refuse_what_they_cannot_shard():
    p = torch.nn.Parameter(torch.zeros(2, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="LBFGS cannot be sharded over data parallelism"):
        MasterWeights([p], torch.optim.LBFGS, shard=True)
    with pytest.raises(TypeError, match=r"optimizer_class must be a torch\.optim\.Optimizer"):
        MasterWeights([p], "adamw")
    with pytest.raises(ValueError, match="listed twice"):
        MasterWeights([p, p], torch.optim.AdamW)
    with pytest.raises(ValueError, match="empty parameter list"):
        MasterWeights([], torch.optim.AdamW)


def test_parameters_are_dealt_largest_first_to_the_least_loaded_rank():
    sizes = [torch.empty(n) for n in (5, 1, 7, 3, 3)]
    #   7 -> r0 (7) | 5 -> r1 (5) | 3 -> r1 (8) | 3 -> r0 (10) | 1 -> r1 (9)
    assert deal([sizes], 2) == [1, 1, 0, 1, 0]
    # the load carries over from group to group, as ZeRO's: 5 -> r0, 1 -> r1 | 7 -> r1 (8),
    # 3 -> r0 (8), 3 -> r0 (11)
    assert deal([sizes[:2], sizes[2:]], 2) == [0, 1, 1, 0, 0]
