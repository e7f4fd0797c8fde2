"""Smoke: each method trained for a few epochs through the real `train` stage script; its
loss, read back from MLflow, goes down. Only image–caption batches (a 4-sentence corpus),
so every step carries every term and an epoch's mean loss compares like with like."""

import sqlite3
from pathlib import Path

import numpy as np
import pytest
import yaml

from mmcse import tracking
from tests.conftest import prepare_project, repo_params, shrink, stage_here

EPOCH = 6  # 48 pairs / batch 8


@pytest.fixture(scope="module")
def pairs_only_project(tmp_path_factory):
    raw = shrink(repo_params())
    raw["data"]["demo"]["corpus_sentences"] = 4  # fewer than a batch: no text-only batches
    raw["train"].update(max_steps=4 * EPOCH, epochs=4, eval_steps=4 * EPOCH, checkpoint_steps=4 * EPOCH)
    return prepare_project(tmp_path_factory.mktemp("methods"), raw)


@pytest.mark.parametrize(
    ("method", "extra"),
    # plain KDMCSE is KDMCSE + CML + IML with two terms off: the fast tier runs the combination; SimCSE's
    # term trains inside every other method's run (MCSE = SimCSE + the image term)
    [pytest.param("simcse", {}, marks=pytest.mark.slow), ("mcse", {}),
     pytest.param("kdmcse", {}, marks=pytest.mark.slow), ("dalr", {}), ("mcseo", {}),
     ("kdmcse", {"dalr": {"cml": True, "iml": True}}),
     # the MLM step itself is in the fast tier (tests/training/test_step_devices.py)
     pytest.param("simcse", {"simcse": {"mlm": True}}, marks=pytest.mark.slow)],
    ids=["simcse", "mcse", "kdmcse", "dalr", "mcseo", "kdmcse+cml+iml", "simcse+mlm"],
)
def test_method_loss_goes_down_through_the_train_stage(pairs_only_project, method, extra, monkeypatch):
    monkeypatch.chdir(pairs_only_project)
    raw = yaml.safe_load(Path("params.yaml").read_text())
    raw["train"]["method"] = method
    # the project is shared by the parameters: undo an earlier case's switches first
    raw["loss"]["dalr"].update({"cml": "auto", "iml": "auto"})
    raw["loss"]["simcse"]["mlm"] = False
    for section, values in extra.items():
        raw["loss"][section].update(values)
    raw["base"]["models_dir"] = f"models-{method}{'-' + '-'.join(extra) if extra else ''}"
    Path("params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    assert stage_here("train", pairs_only_project).returncode == 0

    run_id = tracking.folder_run_id(Path(raw["base"]["models_dir"], "student"))
    with sqlite3.connect("mlruns/mlflow.db") as db:
        rows = db.execute("select step, key, value from metrics where run_uuid=? and key like 'loss/%'",
                          (run_id,)).fetchall()
    keys = {k for _, k, _ in rows}
    total = dict(sorted((s, v) for s, k, v in rows if k == "loss/loss"))
    assert len(total) == 4 * EPOCH  # every step is a pair batch and is logged
    losses = np.array(list(total.values()))
    first, last = losses[:EPOCH].mean(), losses[-EPOCH:].mean()
    assert last < first, f"{method}: epoch-mean loss {first:.4f} -> {last:.4f}"
    expected = {"simcse": {"simcse"}, "mcse": {"image"}, "kdmcse": {"kdmcse", "kdmcse_image", "kdmcse_text"},
                "dalr": {"info", "consistency", "cma", "rank", "ima"}, "mcseo": {"image", "object"}}[method]
    if "dalr" in extra:
        expected = expected | {"consistency", "cma", "rank", "ima"}
    if "simcse" in extra:
        expected = expected | {"mlm"}
    # KDMCSE Algorithm 1 and DALR Eq. 14: image–caption batches train without SimCSE's term
    base = {"loss"} if method in ("kdmcse", "dalr") else {"simcse", "loss"}
    assert keys == {f"loss/{t}" for t in expected | base}
