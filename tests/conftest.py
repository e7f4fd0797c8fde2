"""Shared fixtures: the repo's real params.yaml shrunk to seconds, a prepared tiny project."""

from __future__ import annotations

import copy
import os
import shutil
import sqlite3
from pathlib import Path

import pytest
import sqlalchemy
import torch
import yaml
from mlflow.store.db import utils as mlflow_db

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


# Every device this machine has: the loss, objective and step tests run once per entry.
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(scope="session", autouse=True)
def mlflow_schema_built_once(tmp_path_factory):
    """A fresh SQLite tracking store gets its schema from MLflow's migrations (about 2 s each); the tests
    create a fresh store in most projects, so MLflow builds the schema once here and each new store gets
    a copy of it (SQLite's backup API). MLflow still creates the default experiment in each store itself;
    stores in subprocesses (stage runs) build their own."""
    original = mlflow_db._initialize_tables
    template = tmp_path_factory.mktemp("mlflow-schema") / "mlflow.db"
    engine = sqlalchemy.create_engine(f"sqlite:///{template}")
    original(engine)
    engine.dispose()

    def initialize(engine) -> None:
        database = engine.url.database
        if engine.url.get_backend_name() != "sqlite" or not database or database == ":memory:":
            original(engine)
            return
        source, target = sqlite3.connect(template), sqlite3.connect(database)
        try:
            source.backup(target)
        finally:
            source.close()
            target.close()

    mlflow_db._initialize_tables = initialize
    yield
    mlflow_db._initialize_tables = original


@pytest.fixture(params=DEVICES, ids=DEVICES)
def device(request) -> torch.device:
    """The device a test's inputs live on: ``cpu`` always, ``cuda`` when one is present."""
    return torch.device(request.param)


def shrink(raw: dict) -> dict:
    """The repo's params with data, model and training sizes cut to a few seconds."""
    raw = copy.deepcopy(raw)
    raw["data"]["demo"].update(
        num_images=24, captions_per_image=2, corpus_sentences=160, sts_dev_pairs=30, sts_test_pairs=40,
        retrieval_images=20, retrieval_val_images=10,
    )
    raw["model"] = copy.deepcopy(TINY_MODEL)
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
