"""The MLflow runs table's headline view: which columns an experiment's runs table opens with.

MLflow 3.17's runs table shows no score by default; `mmcse.tracking.ui_url` opens the shared view
`mmcse.tracking.HEADLINE_VIEW` that `write_headline_views` writes into each experiment (the
experiment tag ``mlflow.sharedViewState.mmcse-headline``, the view's state as JSON) from what its
runs log: method and seed, the ablation row and seed, the best dev score and the headline test
scores (`mmcse.evaluation.names.is_headline`).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import mlflow

from mmcse.config import Config
from mmcse.evaluation.names import is_headline
from mmcse.io import at_home, ensure_sqlite_parent
from mmcse.tracking import (
    HEADLINE_VIEW,
    SEED_TAG,
    SHARED_VIEW_TAG,
    VARIANT_TAG,
    configure,
    experiment_urls,
    latest_ablation_url,
    ui_url,
)

# Which columns, in this order, where the experiment's runs have them: the method and seed, the
# ablation row and seed (job runs), the best dev score, then the test scores a table compares.
HEADLINE_PARAMS = ("train.method", "base.seed")
HEADLINE_DEV = ("best_dev_sts", "best_dev_rsum")


MAX_VARYING = 8  # params whose values differ between an experiment's runs, shown after the method and seed


def varying_params(runs_params: Sequence[Mapping[str, str]]) -> list[str]:
    """The params that hold more than one value over the runs that log them (a sweep's drawn values, an
    ablation's row settings), at most `MAX_VARYING`, by name: what the runs table compares them by."""
    values: dict[str, set[str]] = {}
    for params in runs_params:
        for key, value in params.items():
            values.setdefault(key, set()).add(value)
    return sorted(k for k, v in values.items() if len(v) > 1 and k not in HEADLINE_PARAMS)[:MAX_VARYING]


def headline_columns(params: set[str], metrics: set[str], tags: set[str], varying: Sequence[str] = ()) -> list[str]:
    """The runs-table columns (the UI's ``<type>.`<key>`` names) of `HEADLINE_VIEW` for runs that
    log ``params``, ``metrics`` and ``tags``: method and seed, the ``varying`` params (`varying_params`),
    `VARIANT_TAG` / `SEED_TAG`, the best dev score, the test STS / transfer / MTEB averages, every test set's
    rsum and its NDCG means."""
    columns = [f"params.`{p}`" for p in HEADLINE_PARAMS if p in params]
    columns += [f"params.`{p}`" for p in varying if p in params and p not in HEADLINE_PARAMS]
    columns += [f"tags.`{t}`" for t in (VARIANT_TAG, SEED_TAG) if t in tags]
    columns += [f"metrics.`{m}`" for m in HEADLINE_DEV if m in metrics]
    columns += [f"metrics.`{m}`" for m in sorted(metrics, key=_test_order) if m.startswith("test_") and is_headline(m)]
    return columns


def _test_order(metric: str) -> tuple[int, str]:
    return ({"test_avg": 0, "test_transfer_avg": 1, "test_mteb_avg": 2}.get(metric, 3), metric)


def set_headline_view(experiment_id: str, max_runs: int = 1000) -> list[str]:
    """Write `HEADLINE_VIEW` into experiment ``experiment_id`` from what its (last ``max_runs``) runs
    log, sorted by the best dev score where there is one; returns its columns."""

    client = mlflow.MlflowClient()
    runs = client.search_runs([experiment_id], max_results=max_runs)
    params = {k for r in runs for k in r.data.params}
    metrics = {k for r in runs for k in r.data.metrics}
    tags = {k for r in runs for k in r.data.tags}
    columns = headline_columns(params, metrics, tags, varying_params([r.data.params for r in runs]))
    dev = next((f"metrics.`{m}`" for m in HEADLINE_DEV if m in metrics), None)
    view: dict[str, Any] = {"selectedColumns": columns, "runsHiddenMode": "SHOW_ALL"}
    if dev:
        view |= {"orderByKey": dev, "orderByAsc": False}
    client.set_experiment_tag(experiment_id, SHARED_VIEW_TAG + HEADLINE_VIEW, json.dumps(view))
    return columns


def write_headline_views(cfg: Config) -> dict[str, list[str]]:
    """`set_headline_view` for every experiment ``<prefix>-*`` of the configured store:
    ``{experiment name: its columns}``."""

    configure(cfg)
    found = mlflow.search_experiments(filter_string=f"name LIKE '{cfg.base.experiment_prefix}-%'")
    return {exp.name: set_headline_view(exp.experiment_id) for exp in found}


UI_HOST = "127.0.0.1"  # the UIs have no login: this machine only (an SSH tunnel reaches them from elsewhere)
# The MLflow server's background job runner (GenAI scorers, trace archival: 7 extra processes) is
# off for `mmcse ui`: nothing of mmcse uses it, and the server starts in about half the time.
# Its import of a deprecated Starlette module warns on every start; a user can do nothing about it.
UI_MLFLOW_ENV = {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
                 "PYTHONWARNINGS": "ignore:starlette.middleware.wsgi is deprecated"}


def ui_commands(cfg: Config, port: int = 5000, dashboard_port: int = 8080,
                dashboard: str | None = None) -> dict[str, list[str]]:
    """The argument lists `mmcse ui` starts: ``mlflow`` (``mlflow server`` on the project's store,
    ``base.mlflow_tracking_uri``, with artifacts under ``mlruns/artifacts`` where `tracking.experiment`
    puts them) and, given the ``dashboard`` executable, ``optuna`` (optuna-dashboard on
    ``sweep.storage``); both bound to `UI_HOST`. Relative SQLite paths are made absolute here.
    The MLflow server is started with `UI_MLFLOW_ENV` added to the environment."""
    tracking_uri = ensure_sqlite_parent(cfg.base.mlflow_tracking_uri)
    # one worker process: one user's browser; 4 (MLflow's default) take twice as long to start
    # the registry in the same store, named: MLflow otherwise says so on every start
    mlflow_cmd = [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", tracking_uri,
                  "--registry-store-uri", tracking_uri, "--host", UI_HOST, "--port", str(port), "--workers", "1"]
    if cfg.base.mlflow_tracking_uri.startswith("sqlite:///mlruns/"):
        # runs logged by mmcse name their artifact folder themselves; an experiment made in the UI
        # gets its artifacts next to them
        artifacts = at_home("mlruns/artifacts").resolve()
        artifacts.mkdir(parents=True, exist_ok=True)
        mlflow_cmd += ["--artifacts-destination", artifacts.as_uri()]
    commands = {"mlflow": mlflow_cmd}
    if dashboard is not None:
        commands["optuna"] = [dashboard, ensure_sqlite_parent(cfg.sweep.storage), "--host", UI_HOST,
                              "--port", str(dashboard_port)]
    return commands


UI_SERVER_NAMES = {"mlflow": "MLflow", "optuna": "optuna-dashboard"}  # as `mmcse ui` names them when it stops


def optuna_dashboard_executable() -> str | None:
    """The ``optuna-dashboard`` script of this environment (the optional extra ``dashboard``), or None."""
    if importlib.util.find_spec("optuna_dashboard") is None:
        return None
    beside = Path(sys.executable).parent / "optuna-dashboard"
    return str(beside) if beside.is_file() else shutil.which("optuna-dashboard")


def start_server(cmd: list[str], env: dict[str, str] | None) -> subprocess.Popen[bytes]:
    """A server of `mmcse ui` in a process group of its own: the terminal's Ctrl-C reaches `mmcse ui` alone,
    which stops the servers (SIGTERM, their clean shutdown) instead of each server tearing itself down mid-
    request (uvicorn's CancelledError traceback) and racing the parent into calling that a crash."""
    return subprocess.Popen(cmd, env=env, process_group=0)


def _stop_on_sigterm(_signum: int, _frame: object) -> None:
    raise KeyboardInterrupt  # `kill <pid>` stops both servers as Ctrl-C does


def serve_ui(cfg: Config, port: int = 5000, dashboard_port: int = 8080, dashboard: bool = True) -> None:
    """`mmcse ui`: the MLflow UI and, when installed and ``dashboard``, optuna-dashboard on `UI_HOST`, their
    addresses printed, until Ctrl-C or SIGTERM stops both (or one ends: the other is stopped, exit 1)."""
    executable = optuna_dashboard_executable() if dashboard else None
    commands = ui_commands(cfg, port, dashboard_port, executable)
    procs: dict[str, subprocess.Popen[bytes]] = {}
    previous = signal.signal(signal.SIGTERM, _stop_on_sigterm)
    try:
        for name, cmd in commands.items():
            procs[name] = start_server(cmd, {**os.environ, **UI_MLFLOW_ENV} if name == "mlflow" else None)
        base = f"http://{UI_HOST}:{port}"
        print(f"MLflow:           {ui_url(base)}", flush=True)
        print("                  (?workflowType=machine_learning: the runs view, not GenAI traces; the list links "
              "without it:\n                  open an experiment below, or switch the sidebar to 'Model training' "
              "once, which the browser keeps)")
        write_headline_views(cfg)  # the runs tables' headline columns, from what the runs log now
        for name, url in experiment_urls(cfg, base).items():
            print(f"  {name}: {url}", flush=True)
        ablation = latest_ablation_url(cfg, base)
        if ablation:
            print(f"  latest ablation table: {ablation}", flush=True)
        if "optuna" in commands:
            print(f"Optuna dashboard: http://{UI_HOST}:{dashboard_port}/  (study {cfg.sweep.study_name})",
                  flush=True)
        elif dashboard:
            print("Optuna dashboard: not installed; `pip install -e '.[dashboard]'` (or `pip install "
                  "optuna-dashboard`) and run `mmcse ui` again", flush=True)
        print("Ctrl-C stops them.", flush=True)
        while all(p.poll() is None for p in procs.values()):
            time.sleep(0.5)
        ended = [f"{name} (exit {p.returncode})" for name, p in procs.items() if p.returncode is not None]
        print(f"error: {', '.join(ended)} stopped (its output is above); stopping the rest", file=sys.stderr)
        raise SystemExit(1)
    except KeyboardInterrupt:
        stopping = True
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.terminate()
        for p in procs.values():
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        signal.signal(signal.SIGTERM, previous)
    if stopping:
        print(f"\nstopped {' and '.join(UI_SERVER_NAMES.get(name, name) for name in procs)}", flush=True)
