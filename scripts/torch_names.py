"""Every torch name hybridpar's source uses, looked up in the torch that runs this script.

    python scripts/torch_names.py [--root hybridpar] [--json OUT]

Reads each module of the package (ast, nothing imported from it) and collects the torch names
it reaches: ``from torch.x import y``, and attribute chains rooted at a name bound to torch
(``import torch.distributed as dist`` makes ``dist.all_gather_single`` the name
``torch.distributed.all_gather_single``). Each is then looked up in this torch (import the
longest module prefix, getattr the rest). Prints the names this torch lacks, with the files
that use them; exit code 1 when there are any. A name used only behind a fallback (a
``getattr(dist, "name", None)`` in `hybridpar/process/compat.py`) is a string, not a chain, so it is
not counted. On a GPU machine's torch this finds what the CPU suite (one pinned torch) cannot:
``tests/test_torch_floor.py`` removes the names known to be newer; this finds the unknown ones.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import json
import sys
import warnings
from collections import defaultdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def _bindings(tree: ast.Module) -> dict[str, str]:
    """Local name -> the torch path it is bound to, from the module's imports (any depth)."""
    bound: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "torch" or a.name.startswith("torch."):
                    bound[a.asname or a.name.split(".")[0]] = a.name if a.asname else "torch"
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 \
                and (node.module == "torch" or node.module.startswith("torch.")):
            for a in node.names:
                if a.name != "*":
                    bound[a.asname or a.name] = f"{node.module}.{a.name}"
    return bound


def _chain(node: ast.expr) -> list[str] | None:
    """``a.b.c`` as ["a", "b", "c"]; None for anything else (a call, a subscript)."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return [node.id, *reversed(parts)]


def used_names(root: Path) -> dict[str, set[str]]:
    """Torch path -> the files (relative to `root`'s parent) that use it."""
    used: dict[str, set[str]] = defaultdict(set)
    for file in sorted(root.rglob("*.py")):
        tree = ast.parse(file.read_text(encoding="utf-8"), filename=str(file))
        bound = _bindings(tree)
        where = str(file.relative_to(root.parent))
        for path in bound.values():
            used[path].add(where)
        for node in ast.walk(tree):
            chain = _chain(node) if isinstance(node, ast.Attribute) else None
            if chain and chain[0] in bound:
                used[".".join([bound[chain[0]], *chain[1:]])].add(where)
    # a chain's prefixes are looked up on the way to it: keep the longest only
    return {p: f for p, f in used.items() if not any(q.startswith(p + ".") for q in used)}


def resolves(path: str) -> bool:
    """Whether ``torch.a.b.c`` exists in this torch (longest importable module, then getattr)."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            with warnings.catch_warnings():   # a module that warns on import still exists
                warnings.simplefilter("ignore")   # (torch.distributed.optim: torch.jit)
                obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default=str(ROOT / "hybridpar"))
    parser.add_argument("--json", help="write {torch, checked, missing} here")
    args = parser.parse_args(argv)
    used = used_names(Path(args.root))
    missing = {p: sorted(f) for p, f in sorted(used.items()) if not resolves(p)}
    print(f"torch {torch.__version__}: {len(used)} names used by {args.root}, "
          f"{len(missing)} missing")
    for path, files in missing.items():
        print(f"  MISSING {path}  ({', '.join(files)})")
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"torch": torch.__version__, "checked": len(used), "missing": missing}, indent=1))
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
