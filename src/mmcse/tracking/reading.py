"""Runs read back from MLflow for figures and tables: a run's STS predictions, run labels, an
ablation's job runs."""

from __future__ import annotations

from collections.abc import Sequence

import mlflow
import numpy as np
from mlflow.exceptions import MlflowException

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
            raise ValueError(f"run {run_id}: {PREDICTIONS_ARTIFACT} task {task!r} lacks 'cos'/'gold' lists")
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
            raise KeyError(f"--run {run_id}: no such MLflow run in {mlflow.get_tracking_uri()}") from None
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
            raise KeyError(f"--ablation {variant}: not a variant of run {parent_run_id} (has: {', '.join(known)})")
        mine = sorted((j for j in done if j["variant"] == variant), key=lambda j: j["seed"])
        if seed is not None:
            mine = [j for j in mine if j["seed"] == seed]
        if not mine:
            which = f" with seed {seed}" if seed is not None else ""
            raise KeyError(f"--ablation {variant}: no finished job run{which} under run {parent_run_id}")
        out[f"{variant} seed={mine[0]['seed']}"] = mine[0]["run_id"]
    return out
