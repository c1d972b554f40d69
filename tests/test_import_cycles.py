"""No import cycles among the modules of `namazu/` and `server/`, read statically (nothing is imported).

What counts as an edge A -> B: any `import B...` or `from B import x` in A's source, at module level or
inside a function or class (a function-local import is still a dependency; hiding a cycle inside a
function is exactly what this test exists to catch). Relative imports are resolved against A's package.
`from P import x` is an edge to the module `P.x` when that file exists, else to `P` itself; `import P.x`
is an edge to `P.x` only (a compiled extension such as `namazu._nvfp4_cpu` is no node).
Not edges: imports under `if TYPE_CHECKING:` (never run), and the implicit import of a parent package's
`__init__` (namazu's package inits import nothing eagerly; an `__init__` that does is its own module with
its own edges). Only modules of this repository are nodes; third-party imports are ignored.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("namazu", "server")


def module_files(root: Path = ROOT) -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for f in sorted((root / pkg).rglob("*.py")):
            parts = list(f.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = f
    return out


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or \
        (isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST):
    """Every Import/ImportFrom node outside `if TYPE_CHECKING:` blocks."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    files = module_files(root)
    known = set(files)
    graph: dict[str, set[str]] = {m: set() for m in files}


    for mod, path in files.items():
        is_pkg = path.name == "__init__.py"
        package = mod if is_pkg else mod.rpartition(".")[0]
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in _imports(tree):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                if node.level:
                    base_parts = package.split(".")
                    base_parts = base_parts[:len(base_parts) - (node.level - 1)]
                    base = ".".join(base_parts + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
            # A name that is no module file here (third party, a compiled extension) is no edge.
            graph[mod].update(t for t in targets if t in known and t != mod)
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[tuple[list[str], list[str]]]:
    """Per strongly connected component with more than one module: one concrete cycle (a -> ... -> a)
    through it, and all its modules."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    sccs: list[list[str]] = []
    counter = 0

    def strongconnect(v: str) -> None:  # Tarjan; the graph is small, recursion depth is fine
        nonlocal counter
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                sccs.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strongconnect(v)
    cycles = []
    for comp in sccs:
        members = set(comp)
        start = comp[0]
        # Breadth-first from start back to start inside the component: the shortest cycle through it.
        prev: dict[str, str] = {}
        frontier = [start]
        found = None
        while frontier and found is None:
            nxt = []
            for v in frontier:
                for w in sorted(graph[v] & members):
                    if w == start:
                        found = v
                        break
                    if w not in prev:
                        prev[w] = v
                        nxt.append(w)
                if found is not None:
                    break
            frontier = nxt
        path = [found]
        while path[-1] != start:
            path.append(prev[path[-1]])
        cycle = list(reversed(path)) + [start]
        cycles.append((cycle, comp))
    return cycles


def test_no_import_cycles():
    cycles = find_cycles(import_graph())
    assert not cycles, "import cycles:\n" + "\n".join(
        f"{' -> '.join(c)}  (all modules in this knot: {', '.join(comp)})" for c, comp in cycles)


def test_cycle_finder_sees_function_local_and_relative_imports(tmp_path):
    pkg = tmp_path / "namazu"
    (pkg / "sub").mkdir(parents=True)
    (tmp_path / "server").mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "a.py").write_text("from . import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from namazu.sub.c import g\n")
    (pkg / "sub" / "c.py").write_text("import namazu.sub.a\n")
    (pkg / "sub" / "d.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                      "    from namazu.sub import e\n")
    (pkg / "sub" / "e.py").write_text("from .d import x\n")
    cycles = find_cycles(import_graph(tmp_path))
    assert cycles == [(["namazu.sub.a", "namazu.sub.b", "namazu.sub.c", "namazu.sub.a"],
                       ["namazu.sub.a", "namazu.sub.b", "namazu.sub.c"])]
