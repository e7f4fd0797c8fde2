"""Which library code a result was made with: the mmcse modules a stage runs, found from the imports
(static, as the layout test and dvc.yaml's deps see them), and their files' SHA-256.

A checkpoint, an ablation job's result and a sweep's study record the digest of the code that made
them, so a rerun after a loss or the loop was edited trains again instead of taking yesterday's
weights for today's code (DVC reruns the stage; without this the stage would find its sealed output
and stop there).
"""

from __future__ import annotations

import ast
import functools
import hashlib
import json
import os
import subprocess
from collections.abc import Iterable, Mapping, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

from mmcse.io import sha256_json

PACKAGE = Path(__file__).resolve().parents[1]  # src/mmcse
TRAINING_CODE = ("mmcse.pipeline.train",)  # what the train stage, an ablation job and a sweep trial run to train
EVALUATION_CODE = ("mmcse.pipeline.evaluate",)  # what scores a checkpoint


def module_name(path: Path, root: Path = PACKAGE.parent) -> str:
    """``root/mmcse/a/b.py`` → ``mmcse.a.b``; a package's ``__init__.py`` is the package."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _executed(tree: ast.Module) -> Iterable[ast.AST]:
    """Every node of ``tree`` that can run: the bodies of ``if TYPE_CHECKING:`` are left out."""
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            node.body = []
    return ast.walk(tree)


def behaviour_digest(tree: ast.Module) -> str:
    """SHA-256 of what a parsed module does: its syntax tree without docstrings (removed from ``tree``; comments are
    no part of it), so editing prose in a module changes no result's identity."""
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and body
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            node.body = body[1:] or [ast.Pass()]
    return sha256_json({"ast": ast.dump(tree, include_attributes=False)})


FACTS_VERSION = 1  # bump when `_facts` reads a module differently: every cached entry is then parsed again


def _facts(source: str) -> dict[str, Any]:
    """What the code identity reads from one module's text: its `behaviour_digest`, the import statements that
    can run (``[level, module, names]``; ``import a.b`` is ``[0, None, ["a.b"]]``) and whether it imports every
    module of its package."""
    tree = ast.parse(source)
    digest = behaviour_digest(tree)  # before `_executed` empties the TYPE_CHECKING blocks: they are part of the text
    statements = []
    for node in _executed(tree):
        if isinstance(node, ast.Import):
            statements.append([0, None, [a.name for a in node.names]])
        elif isinstance(node, ast.ImportFrom):
            statements.append([node.level, node.module, [a.name for a in node.names]])
    return {"digest": digest, "imports": statements,
            "imports_its_package": "pkgutil.iter_modules(__path__)" in source}


class _FactsCache:
    """`_facts` of a package's modules, kept by the SHA-256 of each module's text in the package's
    ``__pycache__/`` (ignored by git, DVC and this hash, like Python's bytecode beside it): every process that
    trains, resumes or checks a job needs the code identity, and parsing every module took ~2 s of each one's start
    (2 cores). Keyed by content, an edit is always parsed again; an unreadable or foreign cache is parsed afresh and
    replaced; a folder that cannot be written (a read-only install) only costs the parse."""

    def __init__(self, package: Path) -> None:
        self.path = package / "__pycache__" / "mmcse-code-facts.json"
        try:
            stored = json.loads(self.path.read_text())
            self.stored = stored["facts"] if stored.get("version") == FACTS_VERSION else {}
        except (OSError, ValueError, TypeError, KeyError, AttributeError):
            self.stored = {}
        if not isinstance(self.stored, dict):
            self.stored = {}
        self.used: dict[str, dict[str, Any]] = {}

    def get(self, path: Path) -> dict[str, Any]:
        data = path.read_bytes()
        key = hashlib.sha256(data).hexdigest()
        facts = self.stored.get(key)
        if not (isinstance(facts, dict) and set(facts) == {"digest", "imports", "imports_its_package"}
                and isinstance(facts["digest"], str) and isinstance(facts["imports"], list)
                and all(isinstance(i, list) and len(i) == 3 for i in facts["imports"])):
            facts = _facts(data.decode())
        self.used[key] = facts
        return facts

    def save(self) -> None:
        """Keeps the entries this process read (a file's older texts drop out) when any was parsed."""
        if self.used.keys() <= self.stored.keys():
            return
        tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
        try:
            self.path.parent.mkdir(exist_ok=True)
            tmp.write_text(json.dumps({"version": FACTS_VERSION, "facts": self.used}))
            os.replace(tmp, self.path)
        except OSError:
            tmp.unlink(missing_ok=True)


def _resolve(this: str, facts: Mapping[str, Any], modules: set[str], is_package: bool) -> set[str]:
    """The mmcse modules that module ``this`` imports, from its `_facts`."""
    package = this if is_package else this.rpartition(".")[0]
    found: set[str] = set()
    if is_package and facts["imports_its_package"]:
        found |= {m for m in modules if m.rpartition(".")[0] == this}
    for level, module, names in facts["imports"]:
        if level == 0 and module is None:  # import a.b, c
            targets = list(names)
        else:
            base = module or ""
            if level:
                parent = package.split(".")[: len(package.split(".")) - level + 1]
                base = ".".join(parent + ([base] if base else []))
            targets = [f"{base}.{name}" if f"{base}.{name}" in modules else base for name in names]
        for name in targets:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name and name != this:
                found.add(name)
    return found


def imports_of(path: Path, modules: set[str], root: Path = PACKAGE.parent) -> set[str]:
    """The mmcse modules ``path`` imports, at its top or inside a function (``from mmcse.x import y``
    names module ``mmcse.x.y`` when that is a module, else ``mmcse.x``); a package ``__init__`` that
    imports every module it holds (``pkgutil.iter_modules(__path__)``, as `mmcse.methods.terms`) imports
    them all."""
    this = module_name(path, root) if path.is_relative_to(root) else ""
    return _resolve(this, _facts(path.read_text()), modules, path.name == "__init__.py")


def module_files(package: Path = PACKAGE) -> dict[str, Path]:
    """Every module of the package folder ``package`` by name."""
    return {module_name(p, package.parent): p for p in sorted(package.rglob("*.py"))}


def _graph_and_facts(package: Path, files: Mapping[str, Path]) -> tuple[dict[str, set[str]], dict[str, dict[str, Any]]]:
    """`import_graph` and each module's `_facts` (``files``: `module_files` of ``package``)."""
    cache = _FactsCache(package)
    facts = {name: cache.get(path) for name, path in files.items()}
    cache.save()
    modules = set(files)
    graph = {name: _resolve(name, facts[name], modules, path.name == "__init__.py")
             for name, path in files.items()}
    return graph, facts


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """Module → the package's modules it imports."""
    return _graph_and_facts(package, module_files(package))[0]


def modules_run(roots: Iterable[str], graph: Mapping[str, set[str]]) -> set[str]:
    """Every module importing ``roots`` runs: their imports, transitively, and the packages above each
    (importing ``mmcse.a.b`` runs ``mmcse/__init__.py`` and ``mmcse/a/__init__.py`` first)."""
    todo, seen = list(roots), set()
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        todo += graph.get(module, ())
        parts = module.split(".")
        todo += [p for i in range(1, len(parts)) if (p := ".".join(parts[:i])) in graph]
    return seen


# Packages that cannot change a number a run computes: they log, show progress or take commands. A result's code
# identity leaves them out, so editing them keeps resume points, finished jobs and sweep studies.
NO_NUMBERS = ("mmcse.tracking", "mmcse.progress", "mmcse.cli", "mmcse.entry")


def _numberless(module: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in NO_NUMBERS)


@functools.lru_cache(maxsize=8)
def code_files(roots: Sequence[str] = TRAINING_CODE, package: Path = PACKAGE) -> dict[str, str]:
    """``{path under src/: digest}`` of every module importing ``roots`` runs (`modules_run`) that can change a
    number (`NO_NUMBERS` left out), each its `behaviour_digest` (docstrings and comments left out), read once per
    process (a process runs the code it imported, not later edits)."""
    files = module_files(package)
    unknown = [r for r in roots if r not in files]
    if unknown:
        raise ValueError(f"no module {unknown} in {package}")
    graph, facts = _graph_and_facts(package, files)
    return {str(files[m].relative_to(package.parent)): facts[m]["digest"]
            for m in sorted(modules_run(roots, graph)) if not _numberless(m)}


def code_digest(files: Mapping[str, str]) -> str:
    """One hash for a `code_files` map."""
    return sha256_json(dict(sorted(files.items())))


def changed_code(recorded: Mapping[str, str] | None, current: Mapping[str, str], shown: int = 4) -> str:
    """The files that differ between two `code_files` maps, for a message (``"mmcse/methods/losses.py,
    mmcse/training/loop.py"``, at most ``shown`` named); ``"unknown files"`` when nothing was recorded."""
    if not recorded:
        return "unknown files (not recorded)"
    differ = sorted(p for p in set(recorded) | set(current) if recorded.get(p) != current.get(p))
    more = f" and {len(differ) - shown} more" if len(differ) > shown else ""
    return ", ".join(differ[:shown]) + more


REPO = PACKAGE.parents[1]  # the checkout mmcse runs from (src/mmcse -> the repository)
# what a run's code is made of beyond params.yaml and the data: the library, the stages and flows, the install
CODE_PATHS = ("src", "stages", "flows", "pyproject.toml", "requirements.lock")


def source_state(root: Path = REPO) -> dict[str, Any]:
    """The checkout's code as git sees it: ``{"commit": HEAD or "unknown", "dirty": True | False | None,
    "changed": [paths under `CODE_PATHS` that differ from HEAD, untracked ones included]}`` (None and no
    commit outside a git checkout). A run made from a dirty tree is not its commit's run."""
    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.SubprocessError):
            return None
        return out.stdout if out.returncode == 0 else None

    head = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=all", "--", *CODE_PATHS)
    if head is None or status is None:
        return {"commit": "unknown", "dirty": None, "changed": []}
    changed = sorted({line[3:].split(" -> ")[-1].strip('"') for line in status.splitlines() if line.strip()})
    return {"commit": head.strip(), "dirty": bool(changed), "changed": changed}


def version_line() -> str:
    """What `mmcse --version` says: the installed package's version and the commit its code is, with the
    files that differ from it (`source_state`)."""
    try:
        version = metadata.version("mmcse")
    except metadata.PackageNotFoundError:
        version = "(not installed)"
    state = source_state()
    if state["dirty"] is None:
        return f"mmcse {version} (not a git checkout: {REPO})"
    changed = state["changed"]
    dirty = f", uncommitted changes in {', '.join(changed[:5])}{' …' if len(changed) > 5 else ''}" if changed else ""
    return f"mmcse {version} (commit {state['commit'][:12]}{dirty})"
