"""The package's shape, read statically: what the `namazu/` root may hold, which layer may import which, and
how long a function on the serving path may be. (Import cycles: test_import_cycles.py.)

The rules (docs/architecture.md, "Layers"):
- the root holds only the public face: at most 12 modules;
- `namazu/layers` and `namazu/models` never import `namazu.quant` (a quantized format registers itself with
  the layer: `layers.moe.register_experts_format`);
- `namazu/kernels` never imports `namazu.layers` or `namazu.models` (an op a layer needs lives in kernels/);
- the engine process's packages never import the worker's model code, and the wire imports neither side;
- no function on the serving path (everything but the offline tools: `namazu/tiny`, `namazu/spec/training`,
  `namazu/eval`, `namazu/quant`'s calibration) is longer than 80 lines.
"""
from __future__ import annotations

import ast
from pathlib import Path

from test_import_cycles import import_graph

ROOT = Path(__file__).resolve().parent.parent
OFFLINE = ("namazu/tiny/", "namazu/spec/training/", "namazu/eval/", "namazu/quant/calibrate.py",
           "namazu/quant/sensitivity.py", "namazu/spec/refresh.py")
MAX_FUNCTION_LINES = 80


def _edges(graph: dict[str, set[str]], src: str, dst: str) -> list[str]:
    def under(m: str, pkg: str) -> bool:
        return m == pkg or m.startswith(pkg + ".")
    return sorted(f"{a} -> {b}" for a, deps in graph.items() if under(a, src) for b in deps if under(b, dst))


def test_the_root_holds_only_the_public_face():
    modules = sorted(p.name for p in (ROOT / "namazu").glob("*.py"))
    assert len(modules) <= 12, modules


def test_layers_and_models_do_not_import_quantization():
    graph = import_graph()
    bad = _edges(graph, "namazu.layers", "namazu.quant") + _edges(graph, "namazu.models", "namazu.quant")
    assert not bad, bad


def test_kernels_do_not_import_layers_or_models():
    graph = import_graph()
    bad = _edges(graph, "namazu.kernels", "namazu.layers") + _edges(graph, "namazu.kernels", "namazu.models")
    assert not bad, bad


def test_process_sides():
    """The engine process plans and folds; it reaches the worker only through the executor. The wire
    (`namazu.step`) is imported by both and imports neither."""
    graph = import_graph()
    bad = [e for e in _edges(graph, "namazu.engine", "namazu.worker") if not e.endswith("namazu.worker.executor")]
    for side in ("namazu.engine", "namazu.worker", "namazu.models", "namazu.layers", "namazu.scheduler"):
        bad += _edges(graph, "namazu.step", side)
    for model_code in ("namazu.models", "namazu.layers", "namazu.kernels"):
        bad += _edges(graph, "namazu.engine", model_code) + _edges(graph, "namazu.scheduler", model_code)
    assert not bad, bad


def test_the_serving_path_imports_no_offline_tool():
    """Trainers, calibration and evaluation stay out of a server's process (and its import time)."""
    offline = tuple(p.removesuffix(".py").removesuffix("/").replace("/", ".") for p in OFFLINE)
    graph = import_graph()
    bad = sorted(f"{a} -> {b}" for a, deps in graph.items() if not a.startswith(offline)
                 for b in deps if b.startswith(offline))
    assert not bad, bad


def long_functions(path: Path, root: Path = ROOT, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return [f"{path.relative_to(root)}:{n.lineno} {n.name} ({n.end_lineno - n.lineno + 1} lines)"
            for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
            and n.end_lineno - n.lineno + 1 > limit]


def test_no_serving_path_function_is_longer_than_80_lines():
    found = []
    for pkg in ("namazu", "server"):
        for f in sorted((ROOT / pkg).rglob("*.py")):
            rel = f.relative_to(ROOT).as_posix()
            if not rel.startswith(OFFLINE):
                found += long_functions(f)
    assert not found, "\n".join(found)


def test_the_length_rule_sees_a_long_function(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    f = tmp_path / "probe.py"
    f.write_text(f"def step():\n{body}\n\n\ndef short():\n    return 1\n")
    assert long_functions(f, tmp_path) == [f"probe.py:1 step ({MAX_FUNCTION_LINES + 1} lines)"]
