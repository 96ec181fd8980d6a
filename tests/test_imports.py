"""The import structure: `import kvserve` stays light (no torch), and kvserve's modules import
each other without cycles, read statically with `ast` (nothing is imported).

An edge is every `import` / `from ... import` of a kvserve module anywhere in a file (module level,
inside functions, and under `if TYPE_CHECKING:`: a type two modules share lives below both). `from kvserve.x import y` is an edge to
kvserve.x.y when that module exists, else to kvserve.x; relative imports likewise.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections import deque
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
FILES = {".".join(p.relative_to(SRC).with_suffix("").parts).removesuffix(".__init__"): p
         for p in sorted((SRC / "kvserve").rglob("*.py"))}
SUBPACKAGES = sorted(m for m, p in FILES.items() if p.name == "__init__.py" and m.count(".") == 1)


def test_import_kvserve_does_not_import_torch():
    code = ("import sys, kvserve, kvserve.sampling_params, kvserve.errors, kvserve.outputs\n"
            "assert 'torch' not in sys.modules, 'import kvserve pulled in torch'")
    proc = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def _resolve(name: str) -> str:
    """The longest prefix of dotted `name` that is a kvserve module."""
    while name not in FILES and "." in name:
        name = name.rpartition(".")[0]
    return name


def _imports(module: str, typing: bool = True) -> set[str]:
    """The kvserve modules `module` imports, anywhere in its file (under `if TYPE_CHECKING:` too
    unless `typing` is False)."""
    package = module if FILES[module].name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if not typing and isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING",
                                                                                 "typing.TYPE_CHECKING"):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:      # relative: one dot is the package itself, each further dot one up
                up = package.rsplit(".", node.level - 1)[0]
                base = f"{up}.{base}" if base else up
            found.update(f"{base}.{a.name}" if f"{base}.{a.name}" in FILES else base for a in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(FILES[module].read_text(), str(FILES[module])))
    return {_resolve(n) for n in found if n.split(".")[0] == "kvserve"} - {module}


GRAPH = {m: _imports(m) for m in FILES}
# Cycles that only typing closes, named with the reason they stay (none under kvserve.server: the
# gateway's modules import down only, issue 62).
TYPING_CYCLES_ALLOWED = {
    # The kernel backend builds the layers' kernels and hands itself to them; they name its type.
    frozenset({"kvserve.model.attention", "kvserve.model.kernels.backend", "kvserve.model.kernels.cpu_ops"}),
    frozenset({"kvserve.model.kernels.backend", "kvserve.model.ops"}),
    frozenset({"kvserve.model.kernels.gguf_linear", "kvserve.model.kernels.backend", "kvserve.model.kernels.cpu_ops"}),
    # The scheduler's Request holds its wire message; the step's ScheduledRequest (messages.py) names it.
    frozenset({"kvserve.engine.messages", "kvserve.engine.request"}),
}


def _unit(module: str) -> str:
    """kvserve (the package root), kvserve.<top-level module>, or kvserve.<subpackage>."""
    return ".".join(module.split(".")[:2])


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One shortest cycle through each node that lies on a cycle (duplicates dropped)."""
    cycles: dict[frozenset[str], list[str]] = {}
    for start in sorted(graph):
        parent: dict[str, str] = {}
        queue = deque([start])
        while queue and start not in parent:
            node = queue.popleft()
            for nxt in sorted(graph.get(node, ())):
                if nxt not in parent:
                    parent[nxt] = node
                    queue.append(nxt)
        if start in parent:
            back = [start]                  # start, then the cycle's nodes walked backwards
            while parent[back[-1]] != start:
                back.append(parent[back[-1]])
            cycle = [start, *reversed(back[1:]), start]
            cycles.setdefault(frozenset(cycle), cycle)
    return list(cycles.values())


def _report(cycles: list[list[str]]) -> str:
    return "import cycles:\n" + "\n".join("  " + " -> ".join(c) for c in cycles)


@pytest.mark.parametrize("subpackage", SUBPACKAGES)
def test_no_import_cycle_inside_a_subpackage(subpackage):
    inside = {m: {n for n in deps if _unit(n) == subpackage} for m, deps in GRAPH.items() if _unit(m) == subpackage}
    cycles = [c for c in _cycles(inside) if frozenset(c) not in TYPING_CYCLES_ALLOWED]
    assert not cycles, _report(cycles)


def test_allowed_cycles_are_typing_only():
    """Each named cycle is closed by a typing-only import: at run time the modules import one way."""
    runtime = {m: _imports(m, typing=False) for m in FILES}
    closed_at_run_time = {frozenset(c) for c in _cycles(runtime)}
    assert not TYPING_CYCLES_ALLOWED & closed_at_run_time


def test_the_gateway_imports_down():
    """Nothing under gates/, generation/, routing/, stages/ or stores/ imports api/ or app, and the
    state the routes share (`ServerState`) lives below api/ (server/state.py), not in app.py."""
    low = ("gates", "generation", "routing", "stages", "stores")
    bad = [f"{m} -> {n}" for m, deps in GRAPH.items() if m.split(".")[2:3] and m.split(".")[2] in low
           and m.startswith("kvserve.server.")
           for n in deps if n.startswith(("kvserve.server.api", "kvserve.server.app"))]
    assert not bad, "imports that point up:\n" + "\n".join(bad)
    assert not any(n == "kvserve.server.app" for m, deps in GRAPH.items() for n in deps if m != "kvserve.server.cli"
                   and m != "kvserve.server.serving" and m != "kvserve.server.__main__"), \
        [m for m, deps in GRAPH.items() if "kvserve.server.app" in deps]


def test_no_import_cycle_between_top_level_units():
    units: dict[str, set[str]] = {}
    for m, deps in GRAPH.items():
        units.setdefault(_unit(m), set()).update(_unit(n) for n in deps if _unit(n) != _unit(m))
    cycles = _cycles(units)
    assert not cycles, _report(cycles)
