"""Optuna sweeps over ``sweep.space``: objective = best dev STS, pruned on the way.

The study lives in ``sweep.storage`` (SQLite under ``mlruns/`` by default, PostgreSQL
for many machines) and is resumed by name: any number of worker processes may run
``run_sweep`` on the same storage; together they stop at ``n_trials`` finished trials.
Each trial is an MLflow run nested under its worker's sweep run, with its params; both
carry the device ``base.device`` resolved to in the worker (`mmcse.device.device_tags`), so
with one worker per GPU (``CUDA_VISIBLE_DEVICES=<i>``) every trial says which GPU ran it.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mmcse.config import Config, with_overrides
from mmcse.io import ensure_sqlite_parent


def suggest(trial: Any, space: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """Dotted-key overrides drawn by ``trial`` from a params.yaml search space."""
    values: dict[str, Any] = {}
    for key, spec in space.items():
        kind = spec["type"]
        if kind == "float":
            values[key] = trial.suggest_float(
                key, float(spec["low"]), float(spec["high"]), log=bool(spec.get("log", False)),
                step=spec.get("step"),
            )
        elif kind == "int":
            values[key] = trial.suggest_int(
                key, int(spec["low"]), int(spec["high"]), log=bool(spec.get("log", False)),
                step=int(spec.get("step", 1)),
            )
        else:
            values[key] = trial.suggest_categorical(key, list(spec["choices"]))
    return values


def run_sweep(
    cfg: Config,
    paths: Any,
    n_trials: int | None = None,
    study_name: str | None = None,
    storage: str | None = None,
    tags: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Run trials until the study holds ``n_trials`` finished (complete or pruned) ones; the
    worker's sweep run and its trial runs are tagged with the device and ``tags``."""
    import mlflow
    import optuna
    from filelock import FileLock
    from optuna.study import MaxTrialsCallback
    from optuna.trial import TrialState

    from mmcse import tracking
    from mmcse.device import device_tags
    from mmcse.pipeline import run_train

    n_trials = n_trials or cfg.sweep.n_trials
    study_name = study_name or cfg.sweep.study_name
    storage_url = ensure_sqlite_parent(storage or cfg.sweep.storage)
    # Workers started together would race to create the SQLite schemas: serialise the setup.
    Path("mlruns").mkdir(exist_ok=True)
    with FileLock(str(Path("mlruns") / ".sweep-setup.lock")):
        rdb = optuna.storages.RDBStorage(storage_url, engine_kwargs={"pool_pre_ping": True})
        study = optuna.create_study(
            study_name=study_name,
            storage=rdb,
            load_if_exists=True,
            direction=cfg.sweep.direction,
            pruner=optuna.pruners.MedianPruner(
                n_startup_trials=cfg.sweep.pruner_startup_trials, n_warmup_steps=cfg.sweep.pruner_warmup_steps
            ),
        )
        tracking.experiment(cfg, "sweep")
    out_root = Path("sweeps") / study_name

    with (
        tracking.tagged({**device_tags(cfg.base.device), **(tags or {})}),
        tracking.run(cfg, "sweep", run_name=f"sweep {study_name}", tags={"study": study_name}) as parent,
    ):

        def objective(trial: optuna.Trial) -> float:
            overrides = suggest(trial, cfg.sweep.space)
            trial_cfg = with_overrides(cfg, overrides, where=f"sweep trial {trial.number}")

            def report(step: int, score: float) -> None:
                trial.report(score, step)
                if trial.should_prune():
                    mlflow.set_tags({"optuna.pruned": f"step {step}", "optuna.state": "PRUNED"})
                    pruned = optuna.TrialPruned(f"pruned at step {step} (dev {score:.2f})")
                    pruned.mlflow_status = "FINISHED"  # stopped as planned: not a failure (tracking.run)
                    raise pruned

            summary = run_train(
                trial_cfg, paths, out_dir=out_root / f"trial-{trial.number}", experiment_name="sweep",
                run_name=f"{study_name} trial {trial.number}", parent_run_id=parent.info.run_id,
                on_eval=report, progress=False,
            )
            trial.set_user_attr("mlflow_run_id", summary["run_id"])
            return summary["best_dev_sts"]

        study.optimize(
            objective,
            n_trials=n_trials,
            callbacks=[MaxTrialsCallback(n_trials, states=(TrialState.COMPLETE, TrialState.PRUNED))],
            catch=(),
        )
    finished = [t for t in study.trials if t.state in (TrialState.COMPLETE, TrialState.PRUNED)]
    complete = [t for t in finished if t.state == TrialState.COMPLETE]
    best = study.best_trial if complete else None
    return {
        "study": study_name,
        "trials": len(finished),
        "complete": len(complete),
        "pruned": len(finished) - len(complete),
        "best_value": best.value if best else None,
        "best_params": best.params if best else None,
    }
