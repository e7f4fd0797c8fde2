"""The package layout: no import circle, imports flow down the layers, DVC stages list what they run.

The import graph counts every ``import`` a module executes, at its top or inside a function (a
lazy import is still an import); only ``if TYPE_CHECKING:`` blocks, which never run, are left out.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO

SRC = REPO / "src"
# Top to bottom: a module may import modules of its own layer's packages (no circle) or of a lower layer.
LAYERS = [
    ["cli", "entry"],
    ["experiments"],
    ["pipeline"],
    ["analysis"],
    ["training"],
    ["evaluation"],
    ["methods", "teachers", "detection"],
    ["models"],
    ["data"],
    ["integrity", "tracking"],
    ["config"],
    ["environment"],
    ["io", "errors", "hub", "stopping"],
]
RANK = {package: rank for rank, packages in enumerate(LAYERS) for package in packages}


def module_name(path: Path, root: Path = SRC) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _executed(tree: ast.Module) -> Iterable[ast.AST]:
    """Every node of ``tree`` that can run: the bodies of ``if TYPE_CHECKING:`` are left out."""
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            node.body = []
    return ast.walk(tree)


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """The mmcse modules ``path`` imports (``from mmcse.x import y`` names module ``mmcse.x.y`` when
    that is a module, else ``mmcse.x``)."""
    this = module_name(path) if path.is_relative_to(SRC) else ""
    package = this if path.name == "__init__.py" else this.rpartition(".")[0]
    found: set[str] = set()
    for node in _executed(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name and name != this:
                found.add(name)
    return found


def import_graph() -> dict[str, set[str]]:
    files = {module_name(p): p for p in (SRC / "mmcse").rglob("*.py")}
    return {name: imports_of(path, set(files)) for name, path in files.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of ``graph`` as ``[a, b, ..., a]``, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def package_of(module: str) -> str:
    return module.split(".")[1] if module.count(".") else "mmcse"


def test_no_import_circle_between_modules():
    cycle = find_cycle(import_graph())
    assert cycle is None, f"import circle: {' -> '.join(cycle)}"


def test_no_import_circle_between_packages():
    graph: dict[str, set[str]] = {}
    for module, targets in import_graph().items():
        graph.setdefault(package_of(module), set()).update(package_of(t) for t in targets)
    for package, targets in graph.items():
        targets.discard(package)
    cycle = find_cycle(graph)
    assert cycle is None, f"package import circle: {' -> '.join(cycle)}"


def test_every_import_goes_down_the_layers():
    graph = import_graph()
    unplaced = sorted({package_of(m) for m in graph} - set(RANK) - {"mmcse"})
    assert not unplaced, f"packages in no layer of LAYERS: {unplaced}"
    upward = [f"{m} -> {t}" for m, targets in sorted(graph.items()) for t in sorted(targets)
              if package_of(m) != "mmcse" and RANK[package_of(t)] < RANK[package_of(m)]]
    assert not upward, f"imports of a higher layer: {upward}"


def test_the_checks_find_a_circle_and_a_lazy_import(tmp_path):
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    pkg = tmp_path / "mmcse"
    pkg.mkdir()
    (pkg / "one.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import mmcse.three\n"
                                "def f():\n    from mmcse import two\n")
    found = imports_of(pkg / "one.py", {"mmcse", "mmcse.one", "mmcse.two", "mmcse.three"})
    assert found == {"mmcse.two"}  # the function's import counts, the type-checking one does not


def stage_modules(script: Path, graph: dict[str, set[str]]) -> set[str]:
    """Every mmcse module a stage script runs: its imports (a ``flows.x`` import: that file's) and
    theirs, transitively."""
    modules = set(graph)
    todo = list(imports_of(script, modules))
    for local in ast.walk(ast.parse(script.read_text())):  # the repo's flows/ (stage ablate)
        if isinstance(local, ast.ImportFrom) and (local.module or "").startswith("flows."):
            todo += imports_of(REPO / (local.module.replace(".", "/") + ".py"), modules)
    seen: set[str] = set()
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo += graph.get(module, ())
    return seen


def module_file(module: str) -> str:
    path = SRC / Path(*module.split("."))
    return str((path / "__init__.py" if path.is_dir() else path.with_suffix(".py")).relative_to(REPO))


STAGES = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]


@pytest.mark.parametrize("stage", sorted(STAGES))
def test_each_stage_lists_the_library_modules_it_runs(stage):
    """Editing any module a stage runs reruns the stage: it is in the stage's deps, itself or by its folder."""
    script = REPO / STAGES[stage]["cmd"].split()[-1]
    deps = [d for d in STAGES[stage]["deps"] if d.startswith("src/")]
    missing = sorted(f for f in (module_file(m) for m in stage_modules(script, import_graph()))
                     if not any(f == d or f.startswith(d.rstrip("/") + "/") for d in deps))
    assert not missing, f"dvc.yaml: stage {stage} runs modules its deps do not list: {missing}"
    stale = [d for d in deps if not (REPO / d).exists()]
    assert not stale, f"dvc.yaml: stage {stage} lists deps that do not exist: {stale}"
