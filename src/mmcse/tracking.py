"""MLflow helpers: one experiment per method, the resolved config as params."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from mmcse.config import Config, to_dict
from mmcse.io import ensure_sqlite_parent


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, dict) and value and key not in ("variants", "space"):
            out.update(flatten(value, name))
        else:
            out[name] = value
    return out


def configure(cfg: Config) -> None:
    """Point MLflow at the configured store (a relative SQLite path is under the cwd)."""
    import mlflow

    mlflow.set_tracking_uri(ensure_sqlite_parent(cfg.base.mlflow_tracking_uri))
    # Quiet MLflow's own console chatter in stage logs.
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")


def experiment(cfg: Config, name: str) -> str:
    """Create (or find) experiment ``<prefix>-<name>`` with artifacts under ``mlruns/artifacts``."""
    import mlflow

    configure(cfg)
    full = f"{cfg.base.experiment_prefix}-{name}"
    found = mlflow.get_experiment_by_name(full)
    if found is not None:
        return found.experiment_id
    artifacts = Path("mlruns") / "artifacts"
    if cfg.base.mlflow_tracking_uri.startswith("sqlite:///mlruns/"):
        artifacts.mkdir(parents=True, exist_ok=True)
        try:
            return mlflow.create_experiment(full, artifact_location=artifacts.resolve().as_uri())
        except Exception:  # created concurrently by another worker
            found = mlflow.get_experiment_by_name(full)
            if found is None:
                raise
            return found.experiment_id
    return mlflow.create_experiment(full)


def log_config(cfg: Config) -> None:
    import mlflow

    params = {k: str(v)[:500] for k, v in flatten(to_dict(cfg)).items()}
    items = list(params.items())
    for start in range(0, len(items), 90):  # MLflow caps params per batch
        mlflow.log_params(dict(items[start : start + 90]))


@contextlib.contextmanager
def run(
    cfg: Config,
    experiment_name: str,
    run_name: str | None = None,
    run_id: str | None = None,
    parent_run_id: str | None = None,
    tags: dict[str, str] | None = None,
) -> Iterator[Any]:
    import mlflow

    exp_id = experiment(cfg, experiment_name)
    with mlflow.start_run(
        run_id=run_id,
        experiment_id=None if run_id else exp_id,
        run_name=run_name,
        parent_run_id=parent_run_id,
        nested=parent_run_id is not None or mlflow.active_run() is not None,
        tags=tags,
    ) as active:
        yield active


def log_metrics(metrics: dict[str, float], step: int | None = None) -> None:
    import mlflow

    mlflow.log_metrics({k: float(v) for k, v in metrics.items()}, step=step)
