"""The package's layers: every module imports alone, and imports point one way.

    layer                         may import
    tensor_parallel, nn           torch, hybridpar's leaves (topology, trace, comm, ...)
    pipeline, pipe                tensor_parallel (parallel-dim tags, shards), not train / cli
    balance                       pipeline, tensor_parallel; not train / cli
    train (run, check, balance    everything
    commands), cli
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "hybridpar"
MODULES = sorted(".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts)
                 .removesuffix(".__init__") for p in PACKAGE.rglob("*.py")
                 if p.name != "__main__.py")


def _imports(module: str) -> set[str]:
    """The hybridpar modules `module` imports (at any depth of its code)."""
    path = PACKAGE.parent / (module.replace(".", "/") + ".py")
    if not path.exists():
        path = PACKAGE.parent / module.replace(".", "/") / "__init__.py"
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return {name for name in found if name.startswith("hybridpar")}


_ALONE = """
import importlib, os, sys, traceback
import torch  # imported once, before the fork: each child starts without any hybridpar module
# and the heavy torch and third-party modules hybridpar's modules import, once (not hybridpar's)
import numpy, safetensors, torch.distributed.checkpoint, torch.distributed.tensor, tqdm
import torchgpipe
failed, running = [], {}   # two children at a time (the machines have two cores)

def reap():
    pid, status = os.wait()
    if status != 0:
        failed.append(running[pid])
    del running[pid]

def spawn(module):
    if len(running) == 2:
        reap()
    pid = os.fork()
    if pid == 0:
        try:
            importlib.import_module(module)
        except BaseException:
            traceback.print_exc()
            os._exit(1)
        os._exit(0)
    running[pid] = module

# Python imports a module's packages first, so importing any module runs `import hybridpar`
# first, whole: the modules that import loads come in its fixed order whichever is asked for,
# and one child checks them all. The others are checked each in a child forked after
# `import hybridpar` (what their own import would have run first anyway).
spawn("hybridpar")
while running:
    reap()
if failed:
    print("hybridpar")
    sys.exit(1)
import hybridpar
loaded = {name for name in sys.modules if name.startswith("hybridpar")}
for module in sys.argv[1:]:
    if module not in loaded:
        spawn(module)
while running:
    reap()
print(" ".join(sorted(failed)))
sys.exit(1 if failed else 0)
"""


def test_every_module_imports_alone():
    """Each module imported in a process that has imported no hybridpar module before (a
    child forked after torch's import): an import cycle or a hidden order shows up here."""
    done = subprocess.run([sys.executable, "-c", _ALONE, *MODULES], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, f"failed alone: {done.stdout} {done.stderr[-3000:]}"


@pytest.mark.parametrize("layer,forbidden", [
    ("hybridpar.tensor_parallel", ("hybridpar.pipeline", "hybridpar.pipe", "hybridpar.train",
                                   "hybridpar.cli")),
    ("hybridpar.pipeline", ("hybridpar.train", "hybridpar.cli")),
    ("hybridpar.pipe", ("hybridpar.train", "hybridpar.cli")),
    ("hybridpar.balance", ("hybridpar.train", "hybridpar.cli")),
])
def test_imports_point_one_way(layer, forbidden):
    wrong = {m: sorted(i for i in _imports(m) if i.startswith(forbidden))
             for m in MODULES if m == layer or m.startswith(layer + ".")}
    assert not {m: w for m, w in wrong.items() if w}, wrong
