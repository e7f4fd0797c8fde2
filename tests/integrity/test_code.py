"""`mmcse.integrity.code`: which library files a result was made with."""

import json

import yaml

from mmcse.integrity import code
from mmcse.integrity.code import TRAINING_CODE, changed_code, code_digest, code_files, imports_of
from tests.conftest import REPO


def write_package(root):
    files = {
        "mmcse/__init__.py": "",
        "mmcse/a.py": "import mmcse.b\n",
        "mmcse/b.py": "from mmcse.sub import d\n\ndef f():\n    from mmcse import e  # run when called: counts\n",
        "mmcse/c.py": "import mmcse.a\n",  # imports a, is not imported by it
        "mmcse/e.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import mmcse.c\n",
        "mmcse/sub/__init__.py": "",
        "mmcse/sub/d.py": "x = 1\n",
    }
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root / "mmcse"


def test_the_files_a_module_runs_are_its_imports_transitively_and_the_packages_above(tmp_path):
    package = write_package(tmp_path)
    files = code_files(("mmcse.a",), package)
    assert set(files) == {"mmcse/__init__.py", "mmcse/a.py", "mmcse/b.py", "mmcse/e.py", "mmcse/sub/__init__.py",
                          "mmcse/sub/d.py"}
    assert imports_of(package / "e.py", {"mmcse", "mmcse.c", "mmcse.e"}, tmp_path) == set()


def test_an_edit_changes_the_digest_only_when_the_module_is_run_and_is_named(tmp_path):
    package = write_package(tmp_path)
    before = code_files(("mmcse.a",), package)
    (package / "c.py").write_text("import mmcse.a\ny = 2\n")  # not run by mmcse.a
    code_files.cache_clear()
    assert code_digest(code_files(("mmcse.a",), package)) == code_digest(before)
    (package / "sub/d.py").write_text("x = 2\n")
    code_files.cache_clear()
    after = code_files(("mmcse.a",), package)
    assert code_digest(after) != code_digest(before)
    assert changed_code(before, after) == "mmcse/sub/d.py"
    assert changed_code(None, after) == "unknown files (not recorded)"
    many = {f"mmcse/m{i}.py": "0" for i in range(6)}
    assert changed_code(many, {}) == "mmcse/m0.py, mmcse/m1.py, mmcse/m2.py, mmcse/m3.py and 2 more"


def test_the_training_code_is_what_the_train_stage_depends_on():
    """Every file a checkpoint's seal covers is a dep of dvc.yaml's train stage (an edit reruns the
    stage, and the stage then trains again), and it holds every loss term, not the figures."""
    files = code_files(TRAINING_CODE)
    deps = [d for d in yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]["train"]["deps"]
            if d.startswith("src/")]
    uncovered = [f for f in files if not any(f"src/{f}" == d or f"src/{f}".startswith(d + "/") for d in deps)]
    assert not uncovered
    assert {"mmcse/training/loop.py", "mmcse/methods/terms/dalr.py", "mmcse/methods/terms/simcse.py"} <= set(files)
    assert "mmcse/evaluation/figures.py" not in files and "mmcse/cli.py" not in files


def test_mmcse_version_names_the_package_and_the_commit_its_code_is():
    """Issue 56.3: `mmcse --version` answers (argparse said a command was missing), with the commit and, on a
    tree with uncommitted code, the files."""
    import subprocess
    import sys
    from importlib import metadata

    from mmcse.integrity.code import source_state

    out = subprocess.run([sys.executable, "-m", "mmcse.cli", "--version"], capture_output=True, text=True,
                         timeout=60, cwd=REPO)
    state = source_state()
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"mmcse {metadata.version('mmcse')} (commit {state['commit'][:12]}")
    assert ("uncommitted changes in" in out.stdout) == bool(state["changed"])


def test_prose_and_code_that_computes_nothing_leave_a_results_identity(tmp_path):
    """A docstring or comment, or anything in a package that only logs, shows progress or takes commands
    (`NO_NUMBERS`: mmcse.tracking …), is no part of a result's code identity: editing it keeps resume points, finished
    ablation jobs and sweep studies (issue 66.10); a change to what a module computes still counts."""
    package = write_package(tmp_path)
    (package / "tracking").mkdir()
    (package / "tracking/__init__.py").write_text('"""Logs."""\nLEVEL = 1\n')
    (package / "b.py").write_text('"""B."""\nfrom mmcse.sub import d\nimport mmcse.tracking\n\n'
                                  'def f():\n    """F."""\n    from mmcse import e  # run when called: counts\n')
    code_files.cache_clear()
    before = code_files(("mmcse.a",), package)
    assert "mmcse/tracking/__init__.py" not in before and "mmcse/b.py" in before
    (package / "tracking/__init__.py").write_text('"""Logs, now louder."""\nLEVEL = 2\n')
    (package / "b.py").write_text('"""B, reworded."""\nfrom mmcse.sub import d\nimport mmcse.tracking\n\n'
                                  'def f():\n    """F, reworded."""\n    # a new comment\n    from mmcse import e\n')
    code_files.cache_clear()
    assert code_files(("mmcse.a",), package) == before
    (package / "b.py").write_text('"""B."""\nfrom mmcse.sub import d\nimport mmcse.tracking\n\n'
                                  'def f():\n    """F."""\n    from mmcse import e\n    return 1\n')
    code_files.cache_clear()
    assert changed_code(before, code_files(("mmcse.a",), package)) == "mmcse/b.py"
    code_files.cache_clear()


def test_a_modules_facts_are_parsed_once_per_text_and_a_damaged_cache_is_parsed_afresh(tmp_path, monkeypatch):
    """Every process that trains reads the code identity: what it parses is kept by each module's text in the
    package's __pycache__/, so the next process parses only what was edited since, and a cache it cannot read is
    replaced, not trusted and not fatal."""
    package = write_package(tmp_path)
    code_files.cache_clear()
    first = code_files(("mmcse.a",), package)
    cache = package / "__pycache__" / "mmcse-code-facts.json"
    assert cache.is_file()
    parsed = []
    real = code._facts
    monkeypatch.setattr(code, "_facts", lambda source: parsed.append(source) or real(source))
    code_files.cache_clear()
    assert code_files(("mmcse.a",), package) == first and parsed == []  # every text known: nothing parsed
    (package / "sub/d.py").write_text("x = 3\n")
    code_files.cache_clear()
    edited = code_files(("mmcse.a",), package)
    assert parsed == ["x = 3\n"] and changed_code(first, edited) == "mmcse/sub/d.py"
    facts = json.loads(cache.read_text())["facts"]
    wrong_shape = {"version": code.FACTS_VERSION, "facts": {key: {**entry, "imports": [["mmcse.b"]]}
                                                           for key, entry in facts.items()}}
    for damaged in ("{not json", json.dumps(wrong_shape), '{"version": 1, "facts": []}', "[]"):
        cache.write_text(damaged)
        parsed.clear()
        code_files.cache_clear()
        assert code_files(("mmcse.a",), package) == edited and len(parsed) == 7  # all seven modules
        assert json.loads(cache.read_text())["version"] == code.FACTS_VERSION  # replaced
    code_files.cache_clear()
