"""Optuna sweep: two worker processes on one storage, every trial recorded once."""

import sqlite3
import subprocess
import sys

import optuna
import yaml


def test_two_workers_share_one_study(project):
    raw = yaml.safe_load((project / "params.yaml").read_text())
    raw["sweep"].update(n_trials=4, study_name="t", pruner_startup_trials=1)
    raw["train"].update(max_steps=4, eval_steps=2)
    (project / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    cmd = [sys.executable, "-m", "mmcse.cli", "sweep", "--params", "params.yaml"]
    workers = [subprocess.Popen(cmd, cwd=project, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
               for _ in range(2)]
    outs = [w.communicate(timeout=600) for w in workers]
    for w, (_, err) in zip(workers, outs, strict=True):
        assert w.returncode == 0, err[-2000:]

    study = optuna.load_study(study_name="t", storage=f"sqlite:///{project}/mlruns/optuna.db")
    finished = [t for t in study.trials if t.state.is_finished()]
    assert 4 <= len(finished) <= 5  # both workers may start the last trial together
    assert all(t.state in (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED) for t in finished)
    for t in finished:
        assert 0.001 <= t.params["loss.lambda_img"] <= 1.0 and 0.02 <= t.params["loss.temperature"] <= 0.1

    with sqlite3.connect(project / "mlruns/mlflow.db") as db:
        names = [r[0] for r in db.execute(
            "select r.name from runs r join tags t on t.run_uuid = r.run_uuid where t.key='mlflow.parentRunId'")]
        parents = db.execute("select count(*) from runs where name = 'sweep t'").fetchone()[0]
        logged = db.execute(
            "select count(distinct p.run_uuid) from params p where p.key='loss.lambda_img'").fetchone()[0]
    assert sorted(names) == sorted(f"t trial {t.number}" for t in finished)  # once each
    assert parents == 2 and logged >= len(finished)
    complete = [t for t in finished if t.state == optuna.trial.TrialState.COMPLETE]
    assert all(t.user_attrs["mlflow_run_id"] for t in complete)
