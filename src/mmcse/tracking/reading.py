"""Runs read back from MLflow for figures and tables: a run's STS predictions, run labels, an
ablation's job runs."""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import mlflow
import numpy as np
from mlflow.exceptions import MlflowException

from mmcse.errors import InputError, MissingEntry
from mmcse.runstore import SqliteRuns

PREDICTIONS_ARTIFACT = "evaluation/sts_predictions.json"  # logged by pipeline.run_evaluate


def load_sts_predictions(run_id: str) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """``{task: (cos, gold)}`` of a run's ``evaluation/sts_predictions.json`` (current tracking URI)."""
    try:
        raw = mlflow.artifacts.load_dict(f"runs:/{run_id}/{PREDICTIONS_ARTIFACT}")
    except (MlflowException, OSError) as err:
        raise FileNotFoundError(f"run {run_id}: no artifact {PREDICTIONS_ARTIFACT} (is it an evaluated run?): "
                                f"{str(err).splitlines()[0][:200]}") from None
    out: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for task, entry in raw.items():
        if not isinstance(entry, dict) or not {"cos", "gold"} <= set(entry):
            raise InputError(f"run {run_id}: {PREDICTIONS_ARTIFACT} task {task!r} lacks 'cos'/'gold' lists")
        out[task] = (np.asarray(entry["cos"], dtype=np.float64), np.asarray(entry["gold"], dtype=np.float64))
    return out


def run_labels(run_ids: Sequence[str]) -> dict[str, str]:
    """``{"<run name> [<id[:8]>]": run_id}`` in the given order; an unknown id is a clear error."""
    client = mlflow.MlflowClient()
    labels: dict[str, str] = {}
    for run_id in run_ids:
        try:
            name = client.get_run(run_id).info.run_name or "run"
        except MlflowException:
            raise MissingEntry(f"--run {run_id}: no such MLflow run in {mlflow.get_tracking_uri()}") from None
        labels[f"{name} [{run_id[:8]}]"] = run_id
    return labels


def ablation_job_runs(parent_run_id: str, variants: Sequence[str], seed: int | None = None) -> dict[str, str]:
    """``{"<variant> seed=<s>": run_id}``: for each variant, its job run under the ablation parent
    run (``jobs.json``, logged by `mmcse.experiments.ablation_record.log_ablation`) with ``seed``, or its lowest
    seed that has a finished run."""
    try:
        jobs = mlflow.artifacts.load_dict(f"runs:/{parent_run_id}/jobs.json")["jobs"]
    except (MlflowException, OSError, KeyError):
        raise FileNotFoundError(f"ablation parent run {parent_run_id}: no jobs.json artifact "
                                "(has the ablation finished its table?)") from None
    done = [j for j in jobs if j.get("run_id") and j.get("status", "ok") == "ok"]
    known = sorted({j["variant"] for j in jobs})
    out: dict[str, str] = {}
    for variant in variants:
        if variant not in known:
            raise MissingEntry(f"--ablation {variant}: not a variant of run {parent_run_id} (has: {', '.join(known)})")
        mine = sorted((j for j in done if j["variant"] == variant), key=lambda j: j["seed"])
        if seed is not None:
            mine = [j for j in mine if j["seed"] == seed]
        if not mine:
            which = f" with seed {seed}" if seed is not None else ""
            raise MissingEntry(f"--ablation {variant}: no finished job run{which} under run {parent_run_id}")
        out[f"{variant} seed={mine[0]['seed']}"] = mine[0]["run_id"]
    return out


class MlflowRuns:
    """A `mmcse.runstore.RunReader` through MLflow's client: the stores `mmcse.runstore.SqliteRuns` does not read
    directly (PostgreSQL, a tracking server). The tracking URI is the current one (`mmcse.tracking.configure`)."""

    def __init__(self) -> None:
        self.client = mlflow.MlflowClient()

    def experiment_id(self, name: str) -> str | None:
        experiment = self.client.get_experiment_by_name(name)
        return None if experiment is None else experiment.experiment_id

    def runs(self, experiment_id: str, param: tuple[str, str] | None = None,
             tag: tuple[str, str] | None = None) -> list[Any]:
        where = [f"{kind}.`{match[0]}` = '{match[1]}'" for kind, match in (("params", param), ("tags", tag)) if match]
        return list(self.client.search_runs([experiment_id], " and ".join(where),
                                            order_by=["attributes.start_time DESC"], max_results=5000))

    def artifact(self, run: Any, path: str) -> bytes | None:
        with tempfile.TemporaryDirectory(prefix="mmcse-read-") as tmp:
            try:
                return Path(self.client.download_artifacts(run.info.run_id, path, tmp)).read_bytes()
            except Exception:  # not logged (a running or failed run), or unreadable: no artifact
                return None

    def artifact_paths(self, run: Any, folder: str) -> list[str]:
        return [a.path for a in self.client.list_artifacts(run.info.run_id, folder) if not a.is_dir]


def run_reader(tracking_uri: str) -> SqliteRuns | MlflowRuns:
    """The store's reader: its SQLite file read directly, another store through MLflow's client (the current
    tracking URI: `mmcse.tracking.configure`)."""
    return SqliteRuns.open(tracking_uri) or MlflowRuns()


def log_report(files: dict[str, Path], runs: Sequence[str], verdicts: dict[str, dict[str, float]]) -> None:
    """A report's files under ``report/`` in every ablation run it read, with the run's ``verdicts`` (of its block's
    independent cells, how many reproduced the paper, differ or are inconclusive)."""
    client = mlflow.MlflowClient()
    for run_id in runs:
        for path in files.values():
            client.log_artifact(run_id, str(path), "report")
        for name, value in verdicts.get(run_id, {}).items():
            client.log_metric(run_id, name, value)
