"""Optuna sweep: two worker processes on one storage, every trial recorded once."""

import os
import sqlite3
import subprocess
import sys

import optuna
import yaml


def run_sweep_workers(project, study_name: str, storage: str | None = None, tracking: str | None = None,
                      workers: int = 2) -> list:
    """Start ``workers`` `mmcse sweep` processes on one study (as on separate machines or GPUs:
    worker i with CUDA_VISIBLE_DEVICES=i), wait
    for them, and return the study's finished trials, checked: 4 trials asked, every one
    complete or pruned (both workers may start the last one together)."""
    raw = yaml.safe_load((project / "params.yaml").read_text())
    raw["sweep"].update(n_trials=4, study_name=study_name, pruner_startup_trials=1)
    if storage:
        raw["sweep"]["storage"] = storage
    if tracking:
        raw["base"]["mlflow_tracking_uri"] = tracking
    raw["train"].update(max_steps=4, eval_steps=2)
    (project / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    cmd = [sys.executable, "-m", "mmcse.cli", "sweep", "--params", "params.yaml"]
    # one GPU per worker, as `CUDA_VISIBLE_DEVICES=<i> prefect worker start` gives each (CPU here)
    procs = [subprocess.Popen(cmd, cwd=project, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "CUDA_VISIBLE_DEVICES": str(i)})
             for i in range(workers)]
    outs = [p.communicate(timeout=900) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-3000:]
    study = optuna.load_study(study_name=study_name, storage=storage or f"sqlite:///{project}/mlruns/optuna.db")
    finished = [t for t in study.trials if t.state.is_finished()]
    assert 4 <= len(finished) <= 5
    assert all(t.state in (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED) for t in finished)
    return finished


def test_two_workers_share_one_study(project):
    finished = run_sweep_workers(project, "t")
    for t in finished:
        assert 0.001 <= t.params["loss.lambda_img"] <= 1.0 and 0.02 <= t.params["loss.temperature"] <= 0.1

    with sqlite3.connect(project / "mlruns/mlflow.db") as db:
        names = [r[0] for r in db.execute(
            "select r.name from runs r join tags t on t.run_uuid = r.run_uuid where t.key='mlflow.parentRunId'")]
        parents = db.execute("select count(*) from runs where name = 'sweep t'").fetchone()[0]
        logged = db.execute(
            "select count(distinct p.run_uuid) from params p where p.key='loss.lambda_img'").fetchone()[0]
        visible = dict(db.execute(  # run -> the CUDA_VISIBLE_DEVICES of the worker that started it
            "select run_uuid, value from tags where key = 'cuda_visible_devices'").fetchall())
        parent_of = dict(db.execute("select run_uuid, value from tags where key = 'mlflow.parentRunId'").fetchall())
        devices = {r[0] for r in db.execute("select value from tags where key = 'device'")}
    assert sorted(names) == sorted(f"t trial {t.number}" for t in finished)  # once each
    assert parents == 2 and logged >= len(finished)
    assert sorted(visible[p] for p in set(parent_of.values())) == ["0", "1"]  # each worker's sweep run
    assert parent_of and all(visible[run] == visible[p] for run, p in parent_of.items())  # trials: their worker's
    assert devices == {"cpu"}  # base.device cpu, resolved in each worker
    with sqlite3.connect(project / "mlruns/mlflow.db") as db:
        status = dict(db.execute("select name, status from runs").fetchall())
        pruned_runs = {r[0] for r in db.execute(
            "select r.name from runs r join tags t on t.run_uuid = r.run_uuid where t.key = 'optuna.state'")}
    pruned = {f"t trial {t.number}" for t in finished if t.state == optuna.trial.TrialState.PRUNED}
    assert pruned_runs == pruned  # tagged PRUNED, and ended as planned, not as a failure
    assert set(status.values()) == {"FINISHED"}, status
    complete = [t for t in finished if t.state == optuna.trial.TrialState.COMPLETE]
    assert all(t.user_attrs["mlflow_run_id"] for t in complete)
