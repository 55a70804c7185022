"""Regional compilation (hybridpar/compile.py): compiled blocks match eager, compile once.

One test compiles with inductor (C++ kernels; a cold cache costs most of this file's time);
the rest use ``aot_eager`` (dynamo and AOT autograd, no C++ compiler): what they check —
frames, graph breaks, recomputation, split backward, tp — is decided before the backend.
"""

import warnings

import pytest
import torch
from torch import nn
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.utils import counters

import hybridpar
from hybridpar.compile import BlockCompileWarning, block_classes, compile_blocks
from hybridpar.models import example_batch, gpt, gpt_loss, mlp, unet
from hybridpar.models.gpt_layers import Block
from hybridpar.models.mlp import MLPBlock
from hybridpar.models.unet import Down, Up
from hybridpar.pipeline.activations.split_backward import SplitLinear, WeightGrads, deferring

pytestmark = [
    pytest.mark.filterwarnings("error::hybridpar.compile.BlockCompileWarning"),  # no fallback
    # torch's own, from its compile stack (the suite makes torch's deprecations errors):
    # dynamo tracing an autograd.Function, inductor importing torch.utils.mkldnn
    pytest.mark.filterwarnings("ignore:.* should not be instantiated:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:"
                               "DeprecationWarning"),
]
TINY = {"vocab_size": 64, "block_size": 8, "n_layer": 2, "n_head": 4, "n_embd": 32}
TOL = {"atol": 2e-5, "rtol": 1e-4}   # float32: a fused kernel sums in another order


def _fresh() -> None:
    """Forget what dynamo compiled and counted (frames are counted per process)."""
    torch._dynamo.reset()
    counters.clear()


def _frames() -> int:
    return counters["frames"]["total"]


def _grads(model: nn.Module) -> dict:
    return {n: p.grad.clone() for n, p in model.named_parameters()}


# the rule --------------------------------------------------------------------------------------

def test_blocks_are_the_repeated_layer_classes_that_hold_parameters():
    assert block_classes(gpt(**TINY)) == {Block}          # not Embeddings, LayerNorm, Head
    assert block_classes(mlp(n_layer=3)) == {MLPBlock}     # not the last Linear
    assert block_classes(unet()) == {Down, Up}
    assert block_classes(nn.Sequential(nn.ReLU(), nn.ReLU(), nn.Linear(2, 2))) == set()


# single process: inductor parity and the count of compiles ---------------------------------

def test_compiled_gpt_matches_eager_and_compiles_its_blocks_once():
    _fresh()
    torch.manual_seed(0)
    ref = gpt(**TINY)
    torch.manual_seed(0)
    model = gpt(**TINY)
    params = dict(model.named_parameters())
    assert compile_blocks(model) == ["1", "2"]            # the two Blocks, in place
    assert dict(model.named_parameters()) == params       # the same Parameter objects
    assert list(model.state_dict()) == list(ref.state_dict())
    for seed in (0, 1):                                    # two micro-batches of one shape
        x, y = example_batch("gpt", 2, seed=seed, **TINY)
        logits, want = model(x), ref(x)
        loss, want_loss = gpt_loss(logits, y), gpt_loss(want, y)
        loss.backward()
        want_loss.backward()
        torch.testing.assert_close(logits, want, **TOL)
        torch.testing.assert_close(loss, want_loss, **TOL)
        # both Blocks, forward and backward, both micro-batches: one frame compiled
        assert _frames() == 1, dict(counters["frames"])
    got, expected = _grads(model), _grads(ref)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], **TOL, msg=name)


def test_a_smaller_last_micro_batch_recompiles_once_with_a_dynamic_batch():
    _fresh()
    torch.manual_seed(0)
    model = gpt(**TINY)
    compile_blocks(model, backend="aot_eager")
    for rows, frames in ((4, 1), (4, 1), (3, 2), (2, 2), (4, 2)):
        x, y = example_batch("gpt", rows, **TINY)
        gpt_loss(model(x), y).backward()
        assert _frames() == frames, f"{rows} rows: {dict(counters['frames'])}"


def test_a_compiled_block_still_defers_its_linears_weight_gradients_to_w():
    _fresh()
    torch.manual_seed(0)
    ref = gpt(**TINY)
    torch.manual_seed(0)
    model = gpt(**TINY)
    compile_blocks(model, backend="aot_eager")
    x, y = example_batch("gpt", 2, **TINY)
    gpt_loss(ref(x), y).backward()
    with SplitLinear():                                    # a zero-bubble forward (F)
        out = model(x)
    with deferring(WeightGrads()) as grads:                # I
        gpt_loss(out, y).backward()
    # each Block's 6 linears (q, k, v, proj, fc, proj) and the Head's wait for W
    assert len(grads) == 2 * 6 + 1
    linears = {f".{m}.{p}" for m in ("q", "k", "v", "proj", "fc") for p in ("weight", "bias")}
    waiting = {n for n, p in model.named_parameters() if p.grad is None}
    assert waiting == {n for n, _ in model.named_parameters() if n.endswith(tuple(linears))}
    grads.run()                                            # W
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, **TOL, msg=name)


# fallback: a block that cannot compile runs eager ----------------------------------------

class _Breaks(nn.Module):
    """A block dynamo cannot capture whole: ``fullgraph=True`` makes its graph break fatal."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.lin(x)
        torch._dynamo.graph_break()
        return x.tanh()


def _fails(gm, example_inputs):
    raise RuntimeError("this backend compiles no backward")


# dynamo refuses the graph break; or the backend fails on the backward graph (compiled with
# the forward, inside the block's call, so it falls back too)
CANNOT_COMPILE = {
    "forward": {"backend": "eager", "fullgraph": True},
    "backward": {"backend": aot_autograd(fw_compiler=lambda gm, _: gm, bw_compiler=_fails)},
}


@pytest.mark.parametrize("how", list(CANNOT_COMPILE))
def test_a_block_that_cannot_compile_runs_eager_after_a_warning(how):
    _fresh()
    torch.manual_seed(0)
    ref = nn.Sequential(_Breaks(), _Breaks())
    torch.manual_seed(0)
    model = nn.Sequential(_Breaks(), _Breaks())
    assert compile_blocks(model, **CANNOT_COMPILE[how]) == ["0", "1"]
    x = torch.randn(3, 4)
    with pytest.warns(BlockCompileWarning, match=r"layer '0' \(_Breaks\) could not be "
                      r"compiled .*; it and every _Breaks run eager"):
        model(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")                    # warned once, for the class
        out = model(x)
    want = ref(x)
    torch.testing.assert_close(out, want)
    out.sum().backward()
    want.sum().backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


def test_an_error_of_the_block_itself_is_raised_as_it_is():
    _fresh()
    model = gpt(**TINY)
    compile_blocks(model, classes={type(model[0])}, backend="eager")   # Embeddings
    with pytest.raises(ValueError, match="longer than block_size 8"):
        model(torch.zeros(1, 9, dtype=torch.int64))


def test_mode_and_options_together_are_rejected():
    with pytest.raises(ValueError, match="takes one of them"):
        compile_blocks(gpt(**TINY), mode="max-autotune", options={"fallback_random": True})


# multi-process: HybridPipe(compile=...) against eager -------------------------------------

def _pipe_worker(pp: int, tp: int, schedules: tuple[str, ...], checkpoint: str,
                 dropout: float) -> dict:
    """Per schedule, 2 steps eager then 2 compiled (``aot_eager``): the losses, the largest
    difference of the stage's state after them, the frames compiled after each step."""
    from torch._dynamo.utils import counters

    warnings.simplefilter("error", BlockCompileWarning)    # as pytestmark, in the ranks
    warnings.filterwarnings("ignore", ".* should not be instantiated", DeprecationWarning)
    topo = hybridpar.init(pp=pp, tp=tp, timeout=200)
    cfg = {**TINY, "dropout": dropout}
    balances = {"1f1b": [2, 3] if pp == 2 else [5], "zbv": [2, 1, 1, 1]}
    out: dict = {}
    for schedule in schedules:
        runs = {}
        for compile in (False, "aot_eager"):
            torch._dynamo.reset()
            counters.clear()
            torch.manual_seed(0)
            pipe = hybridpar.HybridPipe(gpt(**cfg, tp=tp if tp > 1 else None),
                                        balances[schedule], chunks=2, topology=topo,
                                        schedule=schedule, checkpoint=checkpoint,
                                        loss_fn=gpt_loss, compile=compile)
            opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
            losses, frames = [], []
            for step in range(2):
                x, y = example_batch("gpt", 4, seed=step, **TINY)
                torch.manual_seed(10 + step)              # the dropout masks of the step
                losses.append(pipe.train_step(x, y).item())
                opt.step()
                opt.zero_grad()
                frames.append(counters["frames"]["total"])
            runs[compile] = (losses, {k: v.clone() for k, v in pipe.state_dict().items()},
                             frames, pipe.compiled_blocks)
            pipe.close()
        (eager, state, _, _), (losses, compiled_state, frames, blocks) = runs.values()
        out[schedule] = {"eager": eager, "compiled": losses, "frames": frames,
                         "blocks": blocks,
                         "state": max((compiled_state[k] - v).abs().max().item()
                                      for k, v in state.items())}
    return out


def _assert_matches_eager(what: str, r: dict) -> None:
    assert r["blocks"], f"{what}: nothing compiled"
    assert r["compiled"] == pytest.approx(r["eager"], abs=1e-5), what
    assert r["state"] < 1e-5, what
    # no recompilation per micro-batch or step: what step 1 compiled serves step 2
    assert r["frames"][0] == r["frames"][1] > 0, \
        f"{what}: frames after each step {r['frames']}"


# the limits catch a hang: the whole file runs in ~45 s alone, and compiling is what slows
# most when the suite's other files load the two cores (68 s seen, once past 80 s)
@pytest.mark.timeout(250)
def test_pipe_pp2_compiled_matches_eager_with_recompute_and_dropout_under_1f1b_and_zbv():
    results = hybridpar.spawn(_pipe_worker, 2, args=(2, 1, ("1f1b", "zbv"), "always", 0.1),
                              timeout=240)
    for rank, by_schedule in enumerate(results):
        for schedule, r in by_schedule.items():
            _assert_matches_eager(f"rank {rank} {schedule}", r)
        # 1f1b: one Block a stage, checkpointed: its no_grad forward and its recomputation
        assert by_schedule["1f1b"]["frames"] == [2, 2]
        # zbv (stages E,1 | 2 | LN | H on ranks 0 1 1 0): each linear of a Block runs eager
        # (its weight gradient deferred to W), the code between them compiled
        assert by_schedule["zbv"]["blocks"] == (["1"] if rank == 0 else ["2"])


@pytest.mark.timeout(250)
def test_tp2_compiled_matches_eager_with_graph_breaks_at_the_collectives():
    results = hybridpar.spawn(_pipe_worker, 2, args=(1, 2, ("1f1b",), "never", 0.0),
                              timeout=240)
    for rank, by_schedule in enumerate(results):
        _assert_matches_eager(f"tp rank {rank}", by_schedule["1f1b"])
