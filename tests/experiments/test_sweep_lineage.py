"""A sweep's lineage, read as the MLflow UI reads it (its REST API on `mmcse ui`'s server): the trials'
runs under the study's parent run, each trial's checkpoint a logged model with the trial's params and
dev score, and study → run → model linked from both ends (Optuna user attrs, MLflow tags)."""

import json
import os
import socket
import time
import urllib.request
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from mmcse.analysis import views
from mmcse.experiments import sweep
from mmcse.experiments.params import load_config
from mmcse.integrity.files import SEAL, file_sha256, read_seal
from mmcse.pipeline.paths import Paths
from tests.experiments.test_sweep import write_params


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class _Rest:
    """MLflow's REST API at ``base`` (GET with a query, POST with a JSON body)."""

    def __init__(self, base: str) -> None:
        self.base = base

    def get(self, path: str) -> dict:
        with urllib.request.urlopen(f"{self.base}/api/2.0/mlflow/{path}", timeout=30) as answer:
            return json.loads(answer.read())

    def post(self, path: str, body: dict) -> dict:
        request = urllib.request.Request(f"{self.base}/api/2.0/mlflow/{path}", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as answer:
            return json.loads(answer.read())


def _serve(cfg) -> tuple:
    port = _free_port()
    proc = views.start_server(views.ui_commands(cfg, port=port)["mlflow"], {**os.environ, **views.UI_MLFLOW_ENV})
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while True:
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=5):
                return proc, _Rest(base)
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.terminate()
                raise AssertionError(f"mlflow server did not answer on {base}") from None
            time.sleep(0.5)


def _tags(entity: dict) -> dict[str, str]:
    """The tags of a run (under ``data``) or of a logged model's ``info``."""
    return {t["key"]: t["value"] for t in entity.get("data", entity).get("tags", [])}


@pytest.mark.slow  # a 3-trial sweep, then an MLflow server read over REST
def test_a_sweeps_trials_show_as_runs_under_one_parent_with_their_models(project):
    write_params(project, "lineage", 3)
    cfg = load_config("params.yaml")
    summary = sweep.run_sweep(cfg, Paths.of(cfg), progress=False)
    assert summary["trials"] == 3
    study = optuna.load_study(study_name="lineage", storage=f"sqlite:///{project}/mlruns/optuna.db")
    trials = [t for t in study.trials if t.state in (TrialState.COMPLETE, TrialState.PRUNED)]
    assert len(trials) == 3
    # issue 67.4: the sweep's last line names where the best trial's model is
    best = study.best_trial
    assert (summary["best_trial"], summary["best_run_id"], summary["best_model_id"]) == (
        best.number, best.user_attrs[sweep.RUN_ATTR], best.user_attrs[sweep.MODEL_ATTR])
    assert (Path(summary["best_checkpoint"]) / "model.safetensors").is_file()
    line = sweep.best_line(summary)
    assert f"best trial {best.number} (" in line and summary["best_checkpoint"] in line
    assert f"MLflow run {best.user_attrs[sweep.RUN_ATTR]}, model {best.user_attrs[sweep.MODEL_ATTR]}" in line

    proc, rest = _serve(cfg)
    try:
        experiment = rest.get("experiments/get-by-name?experiment_name=mmcse-sweep")["experiment"]
        assert study.user_attrs[sweep.EXPERIMENT_ATTR] == experiment["experiment_id"]
        runs = rest.post("runs/search", {"experiment_ids": [experiment["experiment_id"]], "max_results": 100})["runs"]
        parents = [r for r in runs if r["info"]["run_name"] == "sweep lineage"]
        assert len(parents) == 1
        parent = parents[0]
        assert _tags(parent)["optuna.study"] == "lineage"
        children = {r["info"]["run_id"]: r for r in runs
                    if _tags(r).get("mlflow.parentRunId") == parent["info"]["run_id"]}
        assert sorted(r["info"]["run_name"] for r in children.values()) == ["trial 0", "trial 1", "trial 2"]
        models = {m["info"]["model_id"]: m for m in rest.post(
            "logged-models/search", {"experiment_ids": [experiment["experiment_id"]]})["models"]}
        assert len(models) == 3

        for trial in trials:
            # Optuna -> MLflow: the trial names its run, its model and its checkpoint
            run = children[trial.user_attrs[sweep.RUN_ATTR]]
            model = models[trial.user_attrs[sweep.MODEL_ATTR]]
            checkpoint = Path(trial.user_attrs[sweep.CHECKPOINT_ATTR])
            # MLflow -> Optuna: the run and the model name the study and the trial
            for tags in (_tags(run), _tags(model["info"])):
                assert (tags["optuna.study"], tags["optuna.trial_number"]) == ("lineage", str(trial.number))
                assert tags["mmcse.checkpoint"] == str(checkpoint)
            assert _tags(run)["mmcse.model_id"] == model["info"]["model_id"]
            assert run["info"]["run_name"] == f"trial {trial.number}"
            assert model["info"]["source_run_id"] == run["info"]["run_id"]
            assert model["info"]["name"] == f"trial-{trial.number}"
            assert _tags(model["info"])["optuna.state"] == trial.state.name
            # the model is this checkpoint: its seal's hash
            assert _tags(model["info"])["mmcse.checkpoint_seal_sha256"] == file_sha256(checkpoint / SEAL)
            assert checkpoint == (project / "sweeps" / "lineage" / f"trial-{trial.number}" / "best").resolve()
            # the model's params are the trial's draws, its metrics the trial's best dev score and step
            params = {p["key"]: p["value"] for p in model["data"]["params"]}
            assert params == {key: str(value) for key, value in trial.params.items()}
            metrics = {m["key"]: m["value"] for m in model["data"]["metrics"]}
            if trial.state == TrialState.COMPLETE:
                assert metrics["best_dev_sts"] == pytest.approx(trial.value)
            else:  # the best so far, the initial evaluation's (step 0, not reported to Optuna) included
                assert metrics["best_dev_sts"] >= max(trial.intermediate_values.values())
            assert metrics["best_step"] == read_seal(checkpoint, "")["step"]
            if metrics["best_step"] > 0:
                assert trial.intermediate_values[int(metrics["best_step"])] == pytest.approx(metrics["best_dev_sts"])
    finally:
        proc.terminate()
        proc.wait(timeout=60)
