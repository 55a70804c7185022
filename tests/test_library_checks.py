"""The config check's layout, plan and data-shape checks are the library's too (issue 39, 1).

Every check `train/configs/config_check.py` makes about a layout, a plan or a data shape is
raised by the library API with the same message (`HybridPipe`, the plan, `pack_documents`):
the table `CONFIG_CHECKS` names, for each raise site of the config check (found in its
source), the library function that makes the same refusal, or why the check is the config's
alone (a key of the file, a folder on disk). A new raise site without a row fails
`test_every_config_check_is_classified`. The refusals through the API run on 2 real ranks.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from config_errors import error_of

import hybridpar
from hybridpar.packing import SEQUENCE_PARALLEL_PACKED
from hybridpar.tensor_parallel.embedding import sequence_length_problem
from hybridpar.tensor_parallel.plans.plan_read import pack_plan_problem

ROOT = Path(__file__).resolve().parents[1]
CHECK = ROOT / "hybridpar/train/configs/config_check.py"

LIBRARY = "library"   # the same refusal is raised through the API (the function named)
CONFIG = "config"     # about the file itself or the run's data on disk: the config's alone

# (function of config_check, first words of the message or the problem function called):
# (kind, where the library raises it / why it is the config's alone)
CONFIG_CHECKS = {
    ("_count_layers", "str(e)"): (LIBRARY, "builder_check.build_checked"),
    ("_count_layers", "model {model.name!r}:"): (LIBRARY, "the model's builder"),
    ("_check_tp", "parallel.tp={tp} does not fit"): (LIBRARY, "models.gpt.check_gpt_config"),
    ("_check_tp", "ValueError"): (LIBRARY, "models.mlp(tp=...)"),
    ("_check_sequence_parallel", "{key} = true shards"): (CONFIG, "tp = 1: HybridPipe has "
                                                          "nothing to shard, sp is a no-op"),
    ("_check_sequence_parallel", "{key} is implemented"): (LIBRARY, "hf.sequence."
                                                            "sequence_parallel"),
    ("_check_sequence_parallel", "SEQUENCE_PARALLEL_PACKED"): (LIBRARY, "HybridPipe"),
    ("_check_sequence_parallel", "sequence_length_problem"): (
        LIBRARY, "tensor_parallel.embedding.check_sequence_length"),
    ("check_layout", "parallel.tp={par.tp} but model"): (CONFIG, "the builder's tp option"),
    ("check_layout", "parallel.tp_plan = 'hf' is"): (LIBRARY, "pipe.build.hf_plan"),
    ("check_layout", "parallel.tp_plan[{glob!r}] = {style}"): (LIBRARY,
                                                              "plans.strategy.strategy_problem"),
    ("check_layout", "parallel.tp_plan[{glob!r}] must be"): (LIBRARY,
                                                            "plans.plan_styles.resolve_dict"),
    ("check_layout", "str(e)"): (LIBRARY, "Layout.of"),
    ("check_layout", "{count} is more stages"): (LIBRARY, "pipeline.parameters.check_balance"),
    ("check_layout", "balance_problem"): (LIBRARY, "pipeline.parameters.balance_problem"),
    ("check_layout", "train.batch_size={train.batch_size}"): (CONFIG, "train.batch_size"),
    ("check_layout", "train.min_lr={train.min_lr}"): (CONFIG, "the schedule's keys"),
    ("check_layout", "parallel.{e}"): (LIBRARY, "check_checkpoint"),
    ("check_layout", "parallel.zero must be"): (LIBRARY, "optim.zero"),
    ("check_layout", "train.param_dtype={train.param_dtype!r}"): (CONFIG, "the trainer's "
                                                                  "autocast keys"),
    ("_check_pack", "data.pack = {data.pack!r} packs"): (CONFIG, "data.source"),
    ("_check_pack", "pack_problem"): (LIBRARY, "models.packing.pack_documents"),
    ("_check_pack", "pack_plan_problem"): (LIBRARY, "pipe.build.apply_plan"),
    ("_check_experts", "str(e)"): (LIBRARY, "models.gpt.check_gpt_config"),
    ("_check_experts", "parallel.sequence_parallel does not take"): (LIBRARY, "models.gpt"),
    ("_check_experts", "parallel.ep={par.ep} shards experts: the"): (
        CONFIG, "ep of a model without experts: the library's topology is plain dp then"),
    ("_check_experts", "parallel.ep={par.ep} does not divide {co"): (LIBRARY,
                                                                      "models.gpt(ep=...)"),
    ("_check_experts", "parallel.ep={par.ep} does not divide par"): (LIBRARY,
                                                                      "topology.ParallelDims"),
}
# the data checks (a token folder, a text file, a validation split): the config's alone
DATA_FUNCTIONS = ("_check_tokens", "_check_data", "_model_vocab")


def _message_head(call: ast.Call) -> str:
    """The first words of a `where.error(message, ...)` call's message, or the name of the
    problem function / constant whose text it raises."""
    arg = call.args[0] if call.args else None
    if isinstance(arg, ast.JoinedStr):
        return ast.unparse(arg)[2:-1][:40]
    if isinstance(arg, ast.Constant):
        return str(arg.value)[:40]
    if isinstance(arg, ast.Name):
        return arg.id
    if isinstance(arg, ast.Call):
        return ast.unparse(arg)
    return ast.unparse(arg) if arg is not None else ""


def _raise_sites() -> list[tuple[str, str]]:
    """(function, message head) of every ``raise`` in config_check.py."""
    tree = ast.parse(CHECK.read_text())
    sites = []
    for fn in [n for n in tree.body if isinstance(n, ast.FunctionDef)]:
        if fn.name in DATA_FUNCTIONS:
            continue
        # a problem variable raised is named by the call that last made it before the raise
        made = sorted((n.lineno, t.id, ast.unparse(n.value.func)) for n in ast.walk(fn)
                      if isinstance(n, ast.Assign) and isinstance(n.value, ast.Call)
                      for t in n.targets if isinstance(t, ast.Name))
        for node in ast.walk(fn):
            if not isinstance(node, ast.Raise) or node.exc is None:
                continue
            exc = node.exc
            if isinstance(exc, ast.Call) and ast.unparse(exc.func) == "where.error":
                head = _message_head(exc)
                calls = [f for line, name, f in made if name == head and line < node.lineno]
                sites.append((fn.name, calls[-1] if calls else head))
            elif isinstance(exc, ast.Name):      # raise where.error(...) from e
                sites.append((fn.name, exc.id))
            elif isinstance(exc, ast.Call):
                sites.append((fn.name, ast.unparse(exc.func)))
    return sites


def _matches(site: tuple[str, str], row: tuple[str, str]) -> bool:
    return site[0] == row[0] and (site[1].startswith(row[1]) or row[1] in site[1])


def test_every_config_check_is_classified():
    """A raise site of the config check without a row (library counterpart or the reason it
    is the config's alone) fails here: add the library check first, then its row."""
    sites = _raise_sites()
    missing = [s for s in sites if not any(_matches(s, row) for row in CONFIG_CHECKS)]
    assert not missing, f"config checks with no row in CONFIG_CHECKS: {missing}"
    stale = [row for row in CONFIG_CHECKS if not any(_matches(s, row) for s in sites)]
    assert not stale, f"rows of CONFIG_CHECKS with no raise site: {stale}"


def test_the_shared_messages_are_the_config_s(tmp_path):
    """The config check raises the library's text (same function, same words)."""
    path = tmp_path / "sp.toml"
    path.write_text('[model]\nname = "gpt"\nn_layer = 2\nn_head = 4\nn_embd = 16\n'
                    'block_size = 16\n[parallel]\ntp = 2\nsequence_parallel = true\n')
    problem = sequence_length_problem(15, 2)
    assert problem is not None and problem in error_of(path, "data.seq_len=15")
    assert sequence_length_problem(16, 2) is None and sequence_length_problem(11, 1) is None
    plan_problem = pack_plan_problem({"0": "vocab"}, "parallel.tp_plan")
    assert plan_problem is not None and plan_problem.startswith("parallel.tp_plan['0'] shards")
    assert pack_plan_problem({"0": "replicate", "1.*": "column"}) is None
    assert "does not take packed documents yet" in SEQUENCE_PARALLEL_PACKED


def _api_worker():
    """The refusals through `HybridPipe` on each of 2 tp ranks, before any collective."""
    from hf_models import tiny

    from hybridpar.hf import to_sequential, tp_plan
    from hybridpar.models.packing import pack_documents

    topo = hybridpar.init(tp=2, timeout=60)
    errors = {}
    try:
        hybridpar.HybridPipe(pack_documents(to_sequential(tiny("qwen3"))), [5], topology=topo,
                             tp_plan="hf", sequence_parallel=True)
    except ValueError as e:
        errors["packed sp"] = str(e)
    try:
        hybridpar.HybridPipe(pack_documents(to_sequential(tiny("llama"))), [5], topology=topo,
                             tp_plan={"0": "vocab"})
    except ValueError as e:
        errors["packed plan"] = str(e)
    # last: a failed step leaves the process groups unusable (`process.generation`)
    pipe = hybridpar.HybridPipe(to_sequential(tiny("llama")), [5], topology=topo,
                                tp_plan="auto", sequence_parallel=True,
                                loss_fn=lambda out, y: out.sum())
    ids = torch.randint(0, 64, (4, 11))
    try:
        pipe.train_step(ids, ids)
    except ValueError as e:
        errors["length"] = str(e)
    model = tiny("qwen3")
    errors["one plan"] = tp_plan(model) == tp_plan(to_sequential(model))
    return errors


def test_the_library_refuses_what_the_config_refuses():
    pytest.importorskip("transformers", reason="hybridpar.hf needs hybridpar[hf]")
    for errors in hybridpar.spawn(_api_worker, 2, timeout=120):
        assert errors["length"] == sequence_length_problem(11, 2)
        assert errors["packed sp"] == SEQUENCE_PARALLEL_PACKED
        assert errors["packed plan"] == pack_plan_problem({"0": "vocab"})
        assert errors["one plan"] is True
