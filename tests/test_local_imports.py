"""No function re-imports a module-level name inside a branch (read statically).

`import torch._dynamo` (or `import torch`) anywhere in a function makes `torch` a local of the whole
function; placed under an `if`, the other branch then reads an unbound local. That is how graph mode's
start-up failed on the first GPU it met (the CUDA-graph branch of `StepGraphs.warm_up`), while every
CPU test passed. A function-level import at the top of the function body binds before any use and is
left alone.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _bound(node: ast.Import | ast.ImportFrom) -> set[str]:
    if isinstance(node, ast.Import):
        return {a.asname or a.name.split(".")[0] for a in node.names}
    return {a.asname or a.name for a in node.names}


def shadowing_imports(source: str) -> list[tuple[int, str]]:
    """(line, name) of each import nested in a function's branch that rebinds a module-level import."""
    tree = ast.parse(source)
    module_names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            module_names |= _bound(node)
    found = []
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        top = {id(n) for n in fn.body}
        for node in ast.walk(fn):
            if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in top:
                found += [(node.lineno, name) for name in sorted(_bound(node) & module_names)]
    return found


def test_the_rule_catches_the_warm_up_bug():
    bug = ("import torch\n\ndef warm_up(gpu):\n    if not gpu:\n        import torch._dynamo\n"
           "    return torch.cuda.mem_get_info()\n")
    assert shadowing_imports(bug) == [(5, "torch")]
    fixed = bug.replace("import torch._dynamo", "from torch import _dynamo")
    assert shadowing_imports(fixed) == []


def test_no_function_shadows_a_module_import_in_a_branch():
    offenders = []
    for pkg in ("namazu", "server", "bench"):
        for f in sorted((ROOT / pkg).rglob("*.py")):
            offenders += [f"{f.relative_to(ROOT)}:{line} rebinds {name!r}"
                          for line, name in shadowing_imports(f.read_text())]
    assert not offenders, "\n".join(offenders)
