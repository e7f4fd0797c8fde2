"""Shared fixtures: the repo's real params.yaml shrunk to seconds, a prepared tiny project."""

from __future__ import annotations

import atexit
import copy
import importlib.abc
import importlib.util
import os
import runpy
import shutil
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from mmcse import stopping

# Nothing heavy at collection: torch, MLflow's database utilities and SQLAlchemy load where a test or fixture uses
# them (a unit test file runs in seconds; the suite imports them once per worker anyway).

# tests.durations: every run's per-test seconds (.pytest-durations.json) and a summary at the end; pytester: the
# plugin's own test
pytest_plugins = ["tests.durations", "pytester"]

REPO = Path(__file__).resolve().parents[1]
SENTEVAL = Path(os.environ.get("MMCSE_SENTEVAL_DIR", REPO.parent / "shared" / "data" / "senteval"))

# A 2-layer, 64-wide BERT with fresh weights and the packaged MiniLM tokenizer.
TINY_MODEL = {
    "name_or_path": "packaged:all-MiniLM-L6-v2",
    "init": "random",
    "config_overrides": {
        "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 128,
    },
    "max_seq_len": 32,
    "proj_dim": 32,
}


def pytest_addoption(parser) -> None:
    parser.addoption("--real-data-full", action="store_true",
                     help="score the whole SentEval sets in tests/evaluation/test_real_eval.py against the reference "
                          "numbers (about 6 min on 2 cores) instead of every 10th item against a direct computation")


def pytest_configure(config) -> None:
    """Under pytest-xdist (``-n N``) each worker gets an equal share of the cores for torch, and so do the stages
    its tests start (OMP_NUM_THREADS): N workers of 2 threads each on 2 cores spin against each other and took
    twice the CPU time (measured: the fast tier 5.4 min with 2 threads a worker, 2.7 with 1, 4.2 serial)."""
    # Bytecode is cached even where PYTHONDONTWRITEBYTECODE is set (this machine's containers set it): without the
    # cache every xdist worker recompiles src/ and re-rewrites each test module's asserts while collecting (the fast
    # tier: 21 s a worker, 9 s cached), and so does every stage, worker and flow run a test starts. __pycache__/ is
    # ignored by git, DVC (.dvcignore) and the code hash (*.py only).
    sys.dont_write_bytecode = False
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)  # the processes the tests start
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
    if workers > 1:
        threads = max(1, (os.cpu_count() or 1) // workers)
        os.environ.setdefault("OMP_NUM_THREADS", str(threads))  # torch reads it when first imported
        if "torch" in sys.modules:
            sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    sys.meta_path.insert(0, _MlflowSchemaOnce())


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook; a machine without the plugin runs with -o addopts=
def pytest_xdist_auto_num_workers(config) -> int:
    """``-n auto``: one worker per core, at most 4 (each holds torch, MLflow and a prepared project; the
    end-to-end tests start processes of their own), and one more where the slow tier runs: its tests wait on
    servers, locks and the processes they start, and the cores stood idle 6 % of a whole-suite run with one worker
    per core (the fast tier is all computation: a worker more only slows its collection)."""
    cores = os.cpu_count() or 1
    markexpr = " ".join((config.option.markexpr or "").split())
    with_slow = "not slow" not in markexpr
    return max(1, min(cores + (1 if with_slow else 0), 4))


def _devices() -> list[str]:
    """Every device this machine has: the loss, objective and step tests run once per entry."""
    import torch

    return ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def pytest_generate_tests(metafunc) -> None:
    if "device" in metafunc.fixturenames:
        devices = _devices()
        metafunc.parametrize("device", devices, ids=devices, indirect=True)


class _MlflowSchemaOnce(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """A fresh SQLite tracking store gets its schema from MLflow's migrations (about 2 s each); the tests create a
    fresh store in most projects, so MLflow builds the schema once, in a template, and each new store gets a copy of
    it (SQLite's backup API). Installed as an import hook: MLflow's database utilities are patched when something
    first imports them, and a test that never opens a store never pays for them. MLflow still creates the default
    experiment in each store itself; stores in subprocesses (stage runs) build their own."""

    NAME = "mlflow.store.db.utils"

    def find_spec(self, fullname, path, target=None):
        if fullname != self.NAME:
            return None
        sys.meta_path.remove(self)  # the real module, found by the others
        spec = importlib.util.find_spec(fullname)
        sys.meta_path.insert(0, self)
        if spec is None:
            return None
        self._real = spec.loader
        spec.loader = self
        return spec

    def create_module(self, spec):
        return self._real.create_module(spec)

    def exec_module(self, module) -> None:
        self._real.exec_module(module)
        original = module._initialize_tables
        template: list[Path] = []

        def initialize(engine) -> None:
            database = engine.url.database
            if engine.url.get_backend_name() != "sqlite" or not database or database == ":memory:":
                original(engine)
                return
            if not template:  # built on the first store: the migrations run once per process
                import tempfile

                import sqlalchemy

                folder = Path(tempfile.mkdtemp(prefix="mlflow-schema-"))
                atexit.register(shutil.rmtree, folder, ignore_errors=True)
                path = folder / "mlflow.db"
                made = sqlalchemy.create_engine(f"sqlite:///{path}")
                original(made)
                made.dispose()
                template.append(path)
            source, target = sqlite3.connect(template[0]), sqlite3.connect(database)
            try:
                source.backup(target)
            finally:
                source.close()
                target.close()

        module._initialize_tables = initialize


REGISTRIES = ("mmcse.methods.terms.base", "mmcse.evaluation.evaluators.base")  # modules holding a REGISTRY


@pytest.fixture(autouse=True)
def registries_restored():
    """A test that adds a loss term or an evaluator to a registry leaves the registry as it found it, so a name a
    test used stays free for the next test and for a contributor (a registry a test imports for the first time is
    left as its import filled it)."""
    saved = [(module.REGISTRY, dict(module.REGISTRY)) for name in REGISTRIES if (module := sys.modules.get(name))]
    yield
    for registry, before in saved:
        registry.clear()
        registry.update(before)


@pytest.fixture(autouse=True)
def mlflow_active_experiment_cleared():
    """Each test has its own MLflow store: an experiment a test made active (``mlflow.set_experiment``) names
    nothing in the next test's store, and MLflow refuses to continue a run of another experiment while one is
    active (xdist runs many tests in one process)."""
    yield
    if fluent := sys.modules.get("mlflow.tracking.fluent"):
        fluent._active_experiment_id = None


@pytest.fixture(autouse=True)
def figures_closed():
    """A figure a test drew and left open (pyplot keeps each until closed) is closed after it: past 20 open figures
    pyplot warns, and a later test that turns warnings into errors (xdist runs many tests in one process) failed on
    another test's figures. Library code closes its own (tests/experiments/test_ablation_record.py checks one)."""
    yield
    if pyplot := sys.modules.get("matplotlib.pyplot"):
        pyplot.close("all")


@pytest.fixture
def device(request):
    """The device a test's inputs live on: ``cpu`` always, ``cuda`` when one is present."""
    import torch

    return torch.device(request.param)


def shrink(raw: dict) -> dict:
    """The repo's params with data, model and training sizes cut to a few seconds."""
    raw = copy.deepcopy(raw)
    raw["data"]["demo"].update(
        num_images=24, captions_per_image=2, corpus_sentences=160, sts_dev_pairs=30, sts_test_pairs=40,
        retrieval_images=20, retrieval_val_images=10,
    )
    raw["model"] = copy.deepcopy(TINY_MODEL)
    raw["base"]["threads"] = 1  # one torch thread a pytest-xdist worker (pytest_configure)
    raw["train"].update(batch_size=8, max_steps=8, eval_steps=4, checkpoint_steps=4, learning_rate=1e-3)
    raw["teachers"]["batch_size"] = 64
    raw["ablate"]["seeds"] = [1, 2]
    return raw


# DUET at test size: 2 visual + 1 shared layer, 32 wide (the text stream is TINY_MODEL).
TINY_DUET = {"visual_layers": 2, "shared_layers": 1, "joint_dim": 32, "heads": 2, "ff_dim": 64}


def repo_params() -> dict:
    return yaml.safe_load((REPO / "params.yaml").read_text())


@pytest.fixture(scope="session")
def senteval_dir() -> Path:
    if not (SENTEVAL / "downstream" / "STS").is_dir():
        pytest.skip(f"SentEval data not found at {SENTEVAL} (set MMCSE_SENTEVAL_DIR)")
    return SENTEVAL


@pytest.fixture(scope="session")
def transfer_dir(senteval_dir):
    from mmcse.data.senteval import TRANSFER_TASKS, available_transfer_tasks

    if available_transfer_tasks(senteval_dir) != list(TRANSFER_TASKS):
        pytest.skip(f"SentEval transfer-task data not complete under {senteval_dir}")
    return senteval_dir


def params_copy(root: Path) -> Path:
    """``root`` with a copy of the repo's params.yaml and the presets, profiles and recipes beside it."""
    shutil.copy(REPO / "params.yaml", root / "params.yaml")
    for folder in ("ablations", "profiles", "recipes"):
        shutil.copytree(REPO / folder, root / folder)
    return root


def stage_here(name: str, cwd: Path, capsys=None) -> subprocess.CompletedProcess:
    """``stages/<name>.py`` run in this process in ``cwd`` as its own process would run it (``__main__``, through
    `mmcse.entry.run_entry`: an expected error is one line on stderr and exit status 2), for the tests that need
    one process's behaviour only: a stage process pays ~8 s of imports (torch, transformers, MLflow) before its
    first line. With ``capsys`` the result carries what it printed."""
    if capsys is not None:
        capsys.readouterr()
    before, handlers = os.getcwd(), {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    os.chdir(cwd)
    try:
        runpy.run_path(str(REPO / "stages" / f"{name}.py"), run_name="__main__")
        code = 0
    except SystemExit as stopped:
        code = stopped.code if isinstance(stopped.code, int) else 1
    finally:
        os.chdir(before)
        for number, handler in handlers.items():  # the stage installed its own (`mmcse.stopping`)
            signal.signal(number, handler)
        stopping.reset()
    out = capsys.readouterr() if capsys is not None else None
    return subprocess.CompletedProcess([name], code, out.out if out else "", out.err if out else "")


def prepare_project(root: Path, raw: dict) -> Path:
    """Write ``raw`` as ``root/params.yaml`` and run download, detect_objects, cache_teachers."""
    from mmcse.experiments.params import load_config
    from mmcse.pipeline.cache_teachers import run_cache_teachers
    from mmcse.pipeline.detect import run_detect
    from mmcse.pipeline.download import run_download
    from mmcse.pipeline.paths import Paths

    (root / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    cwd = os.getcwd()
    os.chdir(root)
    try:
        cfg = load_config("params.yaml")
        paths = Paths.of(cfg)
        run_download(cfg, paths)
        run_detect(cfg, paths)
        run_cache_teachers(cfg, paths)
    finally:
        os.chdir(cwd)
    return root


@pytest.fixture(scope="session")
def prepared_project(tmp_path_factory) -> Path:
    """A folder with shrunk params.yaml after download, detect_objects and cache_teachers."""
    return prepare_project(tmp_path_factory.mktemp("project"), shrink(repo_params()))


@pytest.fixture
def project(prepared_project: Path, tmp_path: Path, monkeypatch) -> Path:
    """A private copy of the prepared project as the cwd (tests may write into it)."""
    root = tmp_path / "project"
    shutil.copytree(prepared_project, root, ignore=shutil.ignore_patterns("models", "mlruns", "ablation"))
    monkeypatch.chdir(root)
    return root
