"""Nothing in the package unpickles data from disk or the network (DCP's own index excepted).

A source scan: no ``*_object`` collective (each pickles its payload), no `pickle` loads, and
every `torch.load` passes ``weights_only=True``. Then what replaced the object collectives
(tensors with shape headers) is checked on ranks.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from torch import nn

import hybridpar
from hybridpar.comm.broadcast import broadcast_tensors

PACKAGE = Path(hybridpar.__file__).resolve().parent
SOURCES = sorted(PACKAGE.rglob("*.py"))

PICKLING_CALLS = {"broadcast_object_list", "all_gather_object", "gather_object",
                  "scatter_object_list", "send_object_list", "recv_object_list"}


def _calls(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else \
                func.id if isinstance(func, ast.Name) else ""
            base = func.value.id if isinstance(func, ast.Attribute) and isinstance(
                func.value, ast.Name) else ""
            yield node, base, name


def test_the_package_has_sources_to_scan():
    assert len(SOURCES) > 40 and PACKAGE / "pipe" / "hybrid.py" in SOURCES


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_module_unpickles_or_uses_an_object_collective(path):
    text = path.read_text(encoding="utf-8")
    tree = ast.parse(text)
    for node, base, name in _calls(tree):
        where = f"{path.relative_to(PACKAGE)}:{node.lineno}"
        assert name not in PICKLING_CALLS, f"{where}: {name} pickles over the network"
        assert not (base in ("pickle", "cPickle", "dill", "marshal") and name in (
            "load", "loads", "Unpickler")), f"{where}: {base}.{name} reads a pickle"
        if name == "load" and base == "torch":
            flags = {k.arg: k.value for k in node.keywords}
            assert "weights_only" in flags and isinstance(flags["weights_only"], ast.Constant) \
                and flags["weights_only"].value is True, f"{where}: torch.load without " \
                "weights_only=True"
    imports = [n for n in ast.walk(tree) if isinstance(n, ast.Import | ast.ImportFrom)]
    for node in imports:
        names = [a.name for a in node.names]
        module = getattr(node, "module", None) or ""
        assert "pickle" not in names and module != "pickle", \
            f"{path.relative_to(PACKAGE)}:{node.lineno} imports pickle"
        assert not (module.endswith("distributed_c10d") and set(names) & PICKLING_CALLS)


def test_configs_are_read_as_toml_never_executed():
    config = (PACKAGE / "train" / "configs" / "config.py").read_text(encoding="utf-8")
    assert "tomllib.loads" in config
    for source in SOURCES:
        tree = ast.parse(source.read_text(encoding="utf-8"))
        for node, base, name in _calls(tree):
            assert not (isinstance(node.func, ast.Name) and name in ("eval", "exec")), \
                f"{source.relative_to(PACKAGE)}:{node.lineno} calls {name}"
            assert not (base == "runpy" or (base == "importlib" and name == "import_module"
                                            and "config" in ast.unparse(node))), source


def test_single_node_runs_rendezvous_on_localhost():
    # What actually listens where is checked on live runs in test_loopback.py.
    from hybridpar.train.launcher import _rendezvous

    backend, endpoint, local_addr = _rendezvous(None, single=True)
    assert backend == "hybridpar-loopback" and endpoint.startswith("127.0.0.1:")
    assert local_addr == "127.0.0.1"
    launch = (PACKAGE / "launch.py").read_text(encoding="utf-8")
    assert '"MASTER_ADDR": "127.0.0.1"' in launch


# the tensor broadcasts that replaced the object collectives ---------------------------------

def _broadcasts():
    hybridpar.init()
    rank = torch.distributed.get_rank()
    tensors = (torch.arange(6.0).view(2, 3), torch.tensor([True, False]),
               torch.arange(4, dtype=torch.int64), torch.zeros(0, 5, dtype=torch.bfloat16))
    got = broadcast_tensors(tensors if rank == 1 else None, 1)
    same = all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(got, tensors))
    try:
        broadcast_tensors(ValueError("bad on the source") if rank == 1 else None, 1)
    except ValueError as e:
        error = str(e)
    try:
        broadcast_tensors((torch.zeros(2, dtype=torch.complex64),) if rank == 1 else None, 1)
    except TypeError as e:
        dtype_error = str(e)
    return {"same": same and len(got) == 4, "error": error, "dtype_error": dtype_error}


def test_broadcast_tensors_sends_shapes_and_dtypes_and_errors_without_pickles():
    for result in hybridpar.spawn(_broadcasts, 3, timeout=60):
        assert result["same"]
        assert result["error"] == "bad on the source"
        assert "cannot broadcast a tensor of dtype torch.complex64" in result["dtype_error"]


class TwoOutputs(nn.Module):
    def forward(self, x):
        return x * 2, x.sum(-1)


def _pipe_outputs_and_state():
    topo = hybridpar.init(pp=2)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 4), TwoOutputs())
    pipe = hybridpar.HybridPipe(model, [2, 2], chunks=2, topology=topo)
    pipe.eval()
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(1))
    return {"out": pipe(x), "state": pipe.consolidated_state_dict(),
            "balance": hybridpar.HybridPipe(model, "params", topology=topo).balance}


def test_pipe_outputs_state_dicts_and_balances_reach_every_rank_as_tensors():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 4), TwoOutputs())
    model.eval()
    with torch.no_grad():
        expected = model(torch.randn(6, 4, generator=torch.Generator().manual_seed(1)))
    results = hybridpar.spawn(_pipe_outputs_and_state, 2, timeout=60)
    for result in results:
        assert isinstance(result["out"], tuple) and len(result["out"]) == 2
        torch.testing.assert_close(result["out"], expected, rtol=0, atol=1e-6)
        assert list(result["state"]) == list(model.state_dict())
        for key, value in model.state_dict().items():
            assert torch.equal(result["state"][key], value), key
            assert result["state"][key].dtype == value.dtype, key
        assert result["balance"] == results[0]["balance"] and sum(result["balance"]) == 4
