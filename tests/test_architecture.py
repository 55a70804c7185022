"""The library's rooms and the one-way arrows between them, as docs/architecture.md draws them.

A room is a package of `hybridpar` (``pipeline/runtime/`` is ``pipeline.runtime``); the modules
directly in ``hybridpar/`` form two rooms: the assembly (`ASSEMBLY`: what launches ranks,
compiles blocks, counts a model's FLOPs) and the leaves (everything else there: devices,
topology, tracing counters, files), plus the command line (``cli``) on top. An arrow A -> B
means a module of A imports one of B (at module level or inside a function; imports under
``TYPE_CHECKING`` and a package's ``__init__``, its front door, are not arrows). The doc's
table must list exactly the arrows the code has, the arrows must not close a cycle, and every
room says what it owns in its ``__init__`` docstring. ``python tests/test_architecture.py``
prints the table's arrows.
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "hybridpar"
DOC = ROOT / "docs" / "architecture.md"
ASSEMBLY = {"hybridpar.launch", "hybridpar.compile", "hybridpar.flops"}
MAX_MODULES = 12          # modules a room holds, its __init__ not counted
MAX_LINES = 400           # lines a module holds
# what is still over (docs/architecture.md, "Open"): a ratchet, each may only shrink
OVER_MODULES: dict[str, int] = {}
OVER_LINES: dict[str, int] = {}


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module(p): p for p in PACKAGE.rglob("*.py")}


def room_of(module: str) -> str:
    """The room of a module, as the doc names it (without the ``hybridpar.`` prefix)."""
    if module in ASSEMBLY:
        return "(assembly)"
    if module == "hybridpar.cli":
        return "cli"
    parts, folder, room = module.split("."), PACKAGE, []
    for part in parts[1:]:
        if not (folder / part).is_dir():
            break
        folder = folder / part
        room.append(part)
    return ".".join(room) or "(leaves)"


def _imported(name: str) -> str | None:
    """The module an import names (``a.b.c`` may be module ``a.b``'s attribute ``c``)."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in MODULES:
            return ".".join(parts[:end])
    return None


def arrows() -> dict[str, set[str]]:
    """``{room: rooms it imports}`` from the source."""
    out: dict[str, set[str]] = defaultdict(set)
    for module, path in MODULES.items():
        if path.name == "__init__.py":
            continue
        tree = ast.parse(path.read_text())
        typing_only = {id(node) for top in ast.walk(tree) if isinstance(top, ast.If) and
                       getattr(top.test, "id", "") == "TYPE_CHECKING"
                       for stmt in top.body for node in ast.walk(stmt)}
        source = room_of(module)
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            for name in names:
                target = _imported(name) if name.startswith("hybridpar") else None
                if target is not None and room_of(target) != source:
                    out[source].add(room_of(target))
    return out


def documented() -> dict[str, set[str]]:
    """``{room: rooms it imports}`` from the doc's table (| `room` | owns | imports |)."""
    out: dict[str, set[str]] = {}
    for line in DOC.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and re.fullmatch(r"`[\w.()]+`", cells[0]):
            out[cells[0].strip("`")] = set(re.findall(r"`([\w.()]+)`", cells[2]))
    return out


def rooms() -> set[str]:
    return {room_of(m) for m in MODULES}


def test_the_doc_draws_every_room_and_exactly_the_arrows_the_code_has():
    drawn, actual = documented(), arrows()
    assert set(drawn) == rooms()
    for room in sorted(rooms()):
        assert drawn[room] == actual.get(room, set()), room


def test_the_arrows_go_one_way():
    graph = arrows()

    def reach(start: str) -> set[str]:
        seen, stack = set(), [start]
        while stack:
            for nxt in graph.get(stack.pop(), ()):
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append(nxt)
        return seen

    assert [room for room in sorted(graph) if room in reach(room)] == []


def test_pipeline_and_tensor_parallel_share_only_leaves():
    graph = arrows()
    assert not any(room.startswith("pipeline") for room in graph["tensor_parallel"] |
                   graph["tensor_parallel.plans"] | graph["tensor_parallel.feature"])
    assert not any(room.startswith(("tensor_parallel", "hf")) for pipeline in graph
                   if pipeline.startswith("pipeline") for room in graph[pipeline])
    # schedules are data: no torch, nothing of hybridpar outside the room
    for module, path in MODULES.items():
        if room_of(module) == "pipeline.schedules":
            assert not re.search(r"^\s*(import|from) torch", path.read_text(), re.M), module
    assert graph.get("pipeline.schedules", set()) == set()


def test_every_room_says_what_it_owns():
    for module, path in MODULES.items():
        if path.name == "__init__.py":
            docstring = ast.get_docstring(ast.parse(path.read_text()))
            assert docstring and len(docstring) > 40, module


def test_rooms_and_modules_stay_small():
    counts: dict[str, int] = defaultdict(int)
    for module, path in MODULES.items():
        if path.name not in ("__init__.py", "__main__.py"):
            counts[room_of(module) if room_of(module) not in ("(assembly)", "cli")
                   else "(leaves)"] += 1
    over = {room: n for room, n in counts.items() if n > MAX_MODULES}
    assert set(over) <= set(OVER_MODULES)
    assert all(n <= OVER_MODULES[room] for room, n in over.items()), over
    long = {str(p.relative_to(ROOT)): len(p.read_text().splitlines())
            for p in MODULES.values()}
    long = {p: n for p, n in long.items() if n > MAX_LINES}
    assert set(long) <= set(OVER_LINES) and all(n <= OVER_LINES[p] for p, n in long.items()), long


if __name__ == "__main__":
    for room in sorted(rooms()):
        print(f"| `{room}` | | {', '.join(f'`{r}`' for r in sorted(arrows().get(room, ())))} |")
