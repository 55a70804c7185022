"""Parameters tied across stages (GPT-2's embedding and head) train as on one device.

The multi-rank runs are cases of one spawn per world size (the `runs` module fixture: 2 and
4 ranks, a case calling `hybridpar.init` with its own layout); each test asserts on its own
cases.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from spawn_cases import spawn_cases
from torch import nn

import hybridpar
from hybridpar.pipeline.parameters.tied import Tie, check_kept, find_ties, names_by_id

from pipe_harness import checked_step

VOCAB, WIDTH, SEQ = 24, 8, 6


class Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, WIDTH)
        self.pos = nn.Parameter(torch.randn(SEQ, WIDTH) * 0.1)

    def reset_parameters(self) -> None:   # for a meta build (the Embedding resets itself)
        nn.init.normal_(self.pos, std=0.1)

    def forward(self, idx):
        return self.tok(idx) + self.pos[: idx.shape[1]]


class Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(),
                                 nn.Linear(4 * WIDTH, WIDTH))

    def forward(self, x):
        return x + self.mlp(self.norm(x))


def tied_lm(seed: int = 0, blocks: int = 4) -> nn.Sequential:
    """embedding, blocks, norm, head: the head's weight is the embedding's (as GPT-2's)."""
    torch.manual_seed(seed)
    model = nn.Sequential(Embed(), *[Residual() for _ in range(blocks)], nn.LayerNorm(WIDTH),
                          nn.Linear(WIDTH, VOCAB, bias=False))
    model[-1].weight = model[0].tok.weight
    return model.double()


def lm_loss(logits, target):
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def batches(steps: int, batch: int):
    g = torch.Generator().manual_seed(3)
    xs = [torch.randint(0, VOCAB, (batch, SEQ), generator=g) for _ in range(steps)]
    return xs, [torch.roll(x, -1, dims=1) for x in xs]


def one_device(steps: int, batch: int, *, clip: float | None = None):
    model = tied_lm()
    opt = torch.optim.AdamW(model.parameters(), lr=0.02)
    losses, norms = [], []
    for x, y in zip(*batches(steps, batch)):
        opt.zero_grad()
        loss = lm_loss(model(x), y)
        loss.backward()
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        losses.append(loss.item())
    return losses, norms, model.state_dict()


def train_worker(layout, balance, schedule, steps, batch, tp_plan, clip):
    pp, tp = layout
    topo = hybridpar.init(pp=pp, tp=tp, timeout=60)
    pipe = hybridpar.HybridPipe(tied_lm(), balance, chunks=2, topology=topo, schedule=schedule,
                                loss_fn=lm_loss, tp_plan=tp_plan)
    opt = torch.optim.AdamW(pipe.parameters(), lr=0.02)
    losses, norms = [], []
    for x, y in zip(*batches(steps, batch)):
        opt.zero_grad()
        losses.append(checked_step(pipe, x, y))
        if clip is not None:
            norms.append(float(pipe.clip_grad_norm_(clip)))
        opt.step()
    local = {k: v.detach().clone() for k, v in pipe.state_dict().items()}
    return {"losses": losses, "norms": norms, "state": pipe.consolidated_state_dict(),
            "local": local, "aliases": sorted(pipe.tied_aliases.items())}


LAYOUTS = [
    ((2, 1), [3, 4], "gpipe", None),
    ((2, 1), [3, 4], "1f1b", None),
    ((4, 1), [2, 2, 2, 1], "gpipe", None),
    ((4, 1), [2, 2, 2, 1], "1f1b", None),
    ((2, 2), [3, 4], "gpipe", "auto"),
    ((2, 2), [3, 4], "1f1b", "auto"),
    ((2, 1), [3, 4], "zb-h1", None),      # the head's weight gradient waits for W
    ((2, 2), [3, 4], "zb-h1", "auto"),
]


def _case(worker, *args):
    return WORKERS[worker](*args)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Each test's run by name; "checkpoint save" saved into the folder "checkpoint folder"."""
    folder = str(tmp_path_factory.mktemp("tied"))
    canonical = tied_lm().state_dict()
    del canonical["6.weight"]                 # as Hugging Face files omit lm_head.weight
    differ = tied_lm().state_dict()
    differ["6.weight"] = differ["6.weight"] + 1
    cases = {}   # name -> (world size, worker, its arguments)
    for layout, balance, schedule, tp_plan in LAYOUTS:
        cases[f"train {layout} {balance} {schedule} {tp_plan}"] = (
            layout[0] * layout[1], "train", layout, balance, schedule, 3, 4, tp_plan, None)
    cases["clip"] = (2, "train", (2, 1), [3, 4], "1f1b", 2, 4, None, 0.5)
    cases["meta"] = (2, "meta")
    cases["load canonical"] = (2, "load", canonical, 2)
    cases["load differ"] = (2, "load", differ, 2)
    cases["checkpoint save"] = (2, "checkpoint", folder, 2)
    cases["untie"] = (2, "untie")
    out = {"checkpoint folder": folder, "canonical": canonical}
    for world in (2, 4):
        out.update(spawn_cases(_case, world, {
            name: c[1:] for name, c in cases.items() if c[0] == world}, timeout=240))
    return out


@pytest.mark.parametrize("layout,balance,schedule,tp_plan", LAYOUTS)
def test_tied_embedding_and_head_on_two_stages_train_as_on_one_device(
        layout, balance, schedule, tp_plan, runs):
    steps, batch = 3, 4
    ref_losses, _, ref_state = one_device(steps, batch)
    results = runs[f"train {layout} {balance} {schedule} {tp_plan}"]
    for r in results:
        assert r["losses"] == pytest.approx(ref_losses, rel=1e-6)   # reported in fp32
        assert list(r["state"]) == list(ref_state)   # both names, as the model's state_dict
        for key, value in ref_state.items():
            torch.testing.assert_close(r["state"][key], value, atol=1e-12, rtol=0)
        assert r["aliases"] == [("6.weight", "0.tok.weight")]
        worst = max(float((r["state"][k] - v).abs().max()) for k, v in ref_state.items())
        print(f"tied lm {layout} {schedule}: max |diff| {worst:.1e}")
    # every copy of the tie is the trained value, on the first and on the last stage
    first, last = results[0]["local"], results[-1]["local"]
    torch.testing.assert_close(first["0.tok.weight"], ref_state["0.tok.weight"],
                               atol=1e-12, rtol=0)
    torch.testing.assert_close(last["6.weight"], ref_state["6.weight"], atol=1e-12, rtol=0)


def test_clip_grad_norm_counts_a_tie_once(runs):
    steps, batch = 2, 4
    _, ref_norms, ref_state = one_device(steps, batch, clip=0.5)
    results = runs["clip"]
    for r in results:
        assert r["norms"] == pytest.approx(ref_norms, rel=1e-6)    # reported in fp32
        torch.testing.assert_close(r["state"]["6.weight"], ref_state["6.weight"],
                                   atol=1e-12, rtol=0)


def test_find_ties_names_the_stages_holding_a_parameter():
    model = tied_lm()
    assert find_ties(model, [3, 4]) == [Tie(names=("0.tok.weight", "6.weight"), stages=(0, 1))]
    assert find_ties(model, [7]) == [Tie(names=("0.tok.weight", "6.weight"), stages=(0,))]


def meta_worker():
    topo = hybridpar.init(pp=2, timeout=60)
    with torch.device("meta"):
        model = tied_lm()
    pipe = hybridpar.HybridPipe(model, [3, 4], topology=topo, loss_fn=lm_loss)
    weight = pipe.state_dict()["0.tok.weight" if topo.pp_rank == 0 else "6.weight"]
    return {"weight": weight.clone()}


def test_a_meta_build_starts_every_copy_from_the_first_stage(runs):
    first, last = runs["meta"]
    assert not torch.isnan(first["weight"]).any()
    torch.testing.assert_close(first["weight"], last["weight"], atol=0, rtol=0)


def load_worker(state, pp):
    topo = hybridpar.init(pp=pp, timeout=60)
    pipe = hybridpar.HybridPipe(tied_lm(seed=5), [3, 4] if pp == 2 else [7], topology=topo,
                                loss_fn=lm_loss)
    try:
        pipe.load_consolidated_state_dict(state)
    except ValueError as e:
        return {"error": str(e)}
    return {"state": pipe.consolidated_state_dict()}


def test_a_state_dict_with_the_canonical_name_only_loads_into_both_copies(runs):
    state = runs["canonical"]             # without "6.weight", as Hugging Face files
    for r in runs["load canonical"]:
        torch.testing.assert_close(r["state"]["6.weight"], state["0.tok.weight"])


def test_a_state_dict_whose_tied_names_differ_is_refused_on_every_rank(runs):
    for r in runs["load differ"]:              # "6.weight" = "0.tok.weight" + 1
        assert "different values for '0.tok.weight' and '6.weight'" in r["error"]


def checkpoint_worker(folder, pp):
    from hybridpar.train.checkpoints.checkpoint import (
        load_checkpoint,
        read_metadata,
        save_checkpoint,
    )
    from hybridpar.train.checkpoints.shards import model_entries, tie_entries

    topo = hybridpar.init(pp=pp, timeout=60)
    balance = [3, 4] if pp == 2 else [7]
    if pp == 2:   # save from two stages
        pipe = hybridpar.HybridPipe(tied_lm(seed=0), balance, topology=topo, loss_fn=lm_loss)
        state = {**model_entries(pipe, None, aliases=pipe.tied_aliases),
                 **tie_entries(pipe.tied_aliases)}
        save_checkpoint(folder, 1, state, keep=1)
        return {}
    pipe = hybridpar.HybridPipe(tied_lm(seed=9), balance, topology=topo, loss_fn=lm_loss)
    path = f"{folder}/step-1"
    saved = sorted(read_metadata(path).state_dict_metadata)
    load_checkpoint(path, model_entries(pipe, None, aliases=pipe.tied_aliases))
    return {"saved": saved, "state": pipe.state_dict()}


def test_a_checkpoint_saves_a_tie_once_and_loads_into_another_layout(runs, tmp_path):
    from hybridpar.train.export import export_checkpoint

    saved = Path(runs["checkpoint folder"])    # "checkpoint save": the 2-stage ranks saved it
    (r,) = hybridpar.spawn(checkpoint_worker, 1, args=(str(saved), 1), timeout=120)
    assert "model/0.tok.weight" in r["saved"] and "model/6.weight" not in r["saved"]
    expected = tied_lm(seed=0).state_dict()
    for key, value in expected.items():
        torch.testing.assert_close(r["state"][key], value, atol=0, rtol=0)
    # the export gives every name of the tie its tensor: the plain model loads it strictly
    exported = export_checkpoint(saved / "step-1", tmp_path / "model.pt")
    assert set(exported) == set(expected)
    model = tied_lm(seed=9)
    model.load_state_dict(torch.load(tmp_path / "model.pt", weights_only=True), strict=True)
    torch.testing.assert_close(model[6].weight, expected["6.weight"], atol=0, rtol=0)


def untie_worker():
    topo = hybridpar.init(pp=1, tp=2, timeout=60)
    plan = {"0.tok": "vocab", "6": "replicate"}
    try:
        hybridpar.HybridPipe(tied_lm(), [7], topology=topo, loss_fn=lm_loss, tp_plan=plan)
    except ValueError as e:
        return str(e)
    return "no error"


def test_a_tp_plan_that_would_shard_one_end_of_a_tie_is_refused_on_every_rank(runs):
    for message in runs["untie"]:
        assert "'0.tok'" in message and "tied to ['6.weight']" in message


def test_a_change_that_unties_parameters_is_caught():
    model = tied_lm()
    before = names_by_id(model)
    model[-1].weight = nn.Parameter(model[-1].weight.detach().clone())
    with pytest.raises(ValueError, match=r"untied the parameters \['0.tok.weight', '6.weight'\]"):
        check_kept(before, model)


WORKERS = {"train": train_worker, "meta": meta_worker, "load": load_worker,
           "checkpoint": checkpoint_worker, "untie": untie_worker}
