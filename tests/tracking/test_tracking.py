"""MLflow runs end with the status of what happened in them."""

import mlflow
import pytest

from mmcse import tracking
from mmcse.experiments.params import load_config
from mmcse.training.engine import Hooks


class Pruned(Exception):
    mlflow_status = "FINISHED"


def _status(run_id: str) -> str:
    return mlflow.get_run(run_id).info.status


def test_run_status_follows_how_the_block_ended(project):
    cfg = load_config("params.yaml")
    ids = {}
    with tracking.run(cfg, "t", run_name="ok") as r:
        ids["ok"] = r.info.run_id
    for name, err in [("failed", ValueError("boom")), ("pruned", Pruned("pruned at step 2")),
                      ("interrupted", KeyboardInterrupt())]:
        with pytest.raises(type(err)):
            with tracking.run(cfg, "t", run_name=name) as r:
                ids[name] = r.info.run_id
                raise err
    assert {name: _status(i) for name, i in ids.items()} == {
        "ok": "FINISHED", "failed": "FAILED", "pruned": "FINISHED", "interrupted": "KILLED"}
    assert mlflow.active_run() is None


def test_a_run_continued_to_finished_no_longer_says_why_an_earlier_attempt_ended(project):
    """Issue 53.7: the end reason of a failed attempt moves to mmcse.end_reason.earlier when the run continues."""
    cfg = load_config("params.yaml")
    run_id = None
    for err in (RuntimeError("Connection reset by peer"), KeyboardInterrupt("stopped on SIGTERM")):
        with pytest.raises(type(err)):
            with tracking.run(cfg, "t", run_name="resumed", run_id=run_id) as r:  # the second continues the first
                run_id = r.info.run_id
                raise err
    tags = mlflow.get_run(run_id).data.tags
    assert tags[tracking.END_REASON_TAG] == "stopped on SIGTERM"
    assert tags[tracking.EARLIER_END_TAG] == "RuntimeError: Connection reset by peer"
    with tracking.run(cfg, "t", run_id=run_id):
        pass
    run = mlflow.get_run(run_id)
    assert run.info.status == "FINISHED" and tracking.END_REASON_TAG not in run.data.tags
    assert run.data.tags[tracking.EARLIER_END_TAG] == ("RuntimeError: Connection reset by peer; stopped on SIGTERM")


def test_a_failed_child_run_leaves_its_parent_running(project):
    cfg = load_config("params.yaml")
    with tracking.run(cfg, "t", run_name="parent") as parent:
        with pytest.raises(ValueError):
            with tracking.run(cfg, "t", run_name="child", parent_run_id=parent.info.run_id) as child:
                raise ValueError("boom")
        assert mlflow.active_run().info.run_id == parent.info.run_id
        assert _status(child.info.run_id) == "FAILED" and _status(parent.info.run_id) == "RUNNING"
    assert _status(parent.info.run_id) == "FINISHED"


KILLED_TRAINING = """
import os, signal, sys
from pathlib import Path
from mmcse.config import with_overrides
from mmcse.experiments.params import load_config
from mmcse.pipeline.paths import Paths
from mmcse.pipeline.train import run_train
from mmcse.training.engine import Hooks

cfg = with_overrides(load_config("params.yaml"), {"train.max_steps": 12, "train.eval_steps": 4,
                                                    "train.checkpoint_steps": 4})
kill_at = int(sys.argv[1])

def die(step, score):
    if step == kill_at:  # after this evaluation is logged, before its resume point is written
        os.kill(os.getpid(), signal.SIGKILL)

run_train(cfg, Paths.of(cfg), out_dir=Path("m"), hooks=Hooks(on_eval=die, progress=False))
"""


@pytest.mark.slow  # trainings in subprocesses, one killed
def test_kill_9_then_resume_is_one_run_and_the_dead_run_is_marked_killed(project):
    import subprocess
    import sys

    from mmcse.config import with_overrides
    from mmcse.pipeline.paths import Paths
    from mmcse.pipeline.train import run_train

    for kill_at in (4, 8):  # 4: before any resume point; 8: the resume point of step 4 exists
        proc = subprocess.run([sys.executable, "-c", KILLED_TRAINING, str(kill_at)], cwd=project,
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == -9, proc.stderr[-2000:]
    cfg = load_config("params.yaml")
    tracking.configure(cfg)
    runs = mlflow.search_runs(experiment_names=["mmcse-mcse"], output_format="list")
    assert [r.info.status for r in runs] == ["RUNNING", "KILLED"]  # newest first: the 2nd start ended the 1st
    killed_first, second = runs[1], runs[0]
    assert "was gone" in killed_first.data.tags["mmcse.ended_by"]

    cfg = with_overrides(cfg, {"train.max_steps": 12, "train.eval_steps": 4, "train.checkpoint_steps": 4})
    summary = run_train(cfg, Paths.of(cfg), out_dir=project / "m", hooks=Hooks(progress=False))
    assert summary["run_id"] == second.info.run_id  # the resumed training continued the killed run
    # ... found through the folder's run record: no file of the output folder (a DVC output) names a run
    assert tracking.folder_run_id(project / "m") == second.info.run_id
    named = [f for f in (project / "m").rglob("*") if f.is_file() and f.suffix in (".json", ".md", ".csv")
             and second.info.run_id in f.read_text()]
    assert named == []
    runs = mlflow.search_runs(experiment_names=["mmcse-mcse"], output_format="list")
    assert len(runs) == 2 and _status(second.info.run_id) == "FINISHED"
    assert mlflow.get_run(second.info.run_id).data.tags["mmcse.resumed_from_step"] == "4"
    history = mlflow.MlflowClient().get_metric_history(second.info.run_id, "dev_sts")
    by_step = {}
    for m in history:
        by_step.setdefault(m.step, set()).add(round(m.value, 6))
    # one history, steps 0..12 with no gap; steps 5-8 were replayed bit-identically after the kill
    assert sorted(by_step) == [0, 4, 8, 12] and all(len(v) == 1 for v in by_step.values())
    losses = {m.step for m in mlflow.MlflowClient().get_metric_history(second.info.run_id, "loss/loss")}
    assert {5, 10} <= losses


@pytest.mark.slow  # end to end: the full suite runs it (fast tier under 5 min)
def test_a_retrain_from_step_0_gets_its_own_run_and_the_old_one_says_why(project):
    """A damaged best/ makes the training restart from step 0: a new run with one history, the old
    (finished) run tagged with the reason and its successor; only a true resume continues a run."""
    from mmcse.config import with_overrides
    from mmcse.pipeline.paths import Paths
    from mmcse.pipeline.train import run_train

    cfg = with_overrides(load_config("params.yaml"), {"train.max_steps": 4, "train.eval_steps": 2,
                                                        "train.checkpoint_steps": 2})
    first = run_train(cfg, Paths.of(cfg), out_dir=project / "m", hooks=Hooks(progress=False))
    weights = project / "m/best/model.safetensors"
    weights.write_bytes(weights.read_bytes()[:200])  # truncated
    second = run_train(cfg, Paths.of(cfg), out_dir=project / "m", hooks=Hooks(progress=False))
    assert second["run_id"] != first["run_id"] and second["best_dev_sts"] == first["best_dev_sts"]
    old, new = mlflow.get_run(first["run_id"]), mlflow.get_run(second["run_id"])
    assert old.info.status == "FINISHED" and old.data.tags["mmcse.superseded_by"] == second["run_id"]
    assert "model.safetensors" in old.data.tags["mmcse.superseded_reason"]
    assert new.data.tags["mmcse.restarted_from_run"] == first["run_id"]
    assert "mmcse.resumed_from_step" not in new.data.tags
    steps = [m.step for m in mlflow.MlflowClient().get_metric_history(second["run_id"], "dev_sts")]
    assert steps == [0, 2, 4]  # logged once each, in its own run
    third = run_train(cfg, Paths.of(cfg), out_dir=project / "m", hooks=Hooks(progress=False))  # finished: a true resume
    assert third["run_id"] == second["run_id"]
    assert mlflow.get_run(second["run_id"]).data.tags["mmcse.resumed_from_step"] == "4"


def test_a_killed_run_that_restarts_from_step_0_ends_killed(project):
    """A resume point whose weights are damaged: the remembered run, left RUNNING by a killed
    process, ends KILLED with the reason when the restart opens its own run."""
    from mmcse.config import with_overrides
    from mmcse.pipeline.paths import Paths
    from mmcse.pipeline.train import run_train

    cfg = with_overrides(load_config("params.yaml"), {"train.max_steps": 4, "train.eval_steps": 2,
                                                        "train.checkpoint_steps": 2})

    def stop(step: int, score: float) -> None:
        if step == 4:
            raise SystemExit("killed")

    with pytest.raises(SystemExit):
        run_train(cfg, Paths.of(cfg), out_dir=project / "m", hooks=Hooks(progress=False, on_eval=stop))
    dead = tracking.remembered_run(project / "m")["run_id"]
    mlflow.MlflowClient().update_run(dead, status="RUNNING")  # as a SIGKILL leaves it
    trainer = project / "m/last/trainer.pt"
    trainer.write_bytes(trainer.read_bytes()[:-50])
    summary = run_train(cfg, Paths.of(cfg), out_dir=project / "m", hooks=Hooks(progress=False))
    assert summary["run_id"] != dead and _status(dead) == "KILLED"
    assert "trainer.pt" in mlflow.get_run(dead).data.tags["mmcse.superseded_reason"]


# --- how the runs read in the MLflow UI: the model-training view, run names, parent runs ---


def test_experiments_are_tagged_model_training_on_create_and_when_found(project):
    cfg = load_config("params.yaml")
    created = tracking.experiment(cfg, "fresh")
    client = mlflow.MlflowClient()  # after tracking.experiment pointed MLflow at the project's store
    assert client.get_experiment(created).tags[tracking.EXPERIMENT_KIND_TAG] == "custom_model_development"
    # made before mmcse tagged experiments, and one the MLflow UI had inferred as GenAI
    old = mlflow.create_experiment("mmcse-old")
    genai = mlflow.create_experiment("mmcse-genai", tags={"mlflow.experimentKind": "genai_development"})
    assert "mlflow.experimentKind" not in client.get_experiment(old).tags
    assert tracking.experiment(cfg, "old") == old and tracking.experiment(cfg, "genai") == genai
    for found in (old, genai):
        assert client.get_experiment(found).tags["mlflow.experimentKind"] == "custom_model_development"


def test_every_experiment_says_what_its_runs_are(project):
    cfg = load_config("params.yaml")
    tracking.configure(cfg)
    client = mlflow.MlflowClient()  # after configure: the project's store
    for name, phrase in (("mcse", "Trainings of train.method mcse"), ("ablate", "One parent run per ablation"),
                         ("sweep", "One run per worker")):
        created = tracking.experiment(cfg, name)
        assert phrase in client.get_experiment(created).tags[tracking.DESCRIPTION_TAG]
    old = mlflow.create_experiment("mmcse-dalr")  # made before mmcse described experiments
    assert tracking.experiment(cfg, "dalr") == old
    assert "train.method dalr" in client.get_experiment(old).tags[tracking.DESCRIPTION_TAG]
    client.set_experiment_tag(old, tracking.DESCRIPTION_TAG, "my own notes")  # a user's description stays
    tracking.experiment(cfg, "dalr")
    assert client.get_experiment(old).tags[tracking.DESCRIPTION_TAG] == "my own notes"


def test_ui_url_opens_the_machine_learning_view():
    assert tracking.ui_url("http://127.0.0.1:5000/") == \
        "http://127.0.0.1:5000/#/experiments?workflowType=machine_learning"
    assert tracking.ui_url("http://127.0.0.1:5001", "7") == \
        "http://127.0.0.1:5001/#/experiments/7/runs?workflowType=machine_learning&viewStateShareKey=mmcse-headline"


def test_the_train_stage_run_is_named_method_seed_and_records_the_machine(project, monkeypatch, capfd):
    """The train stage's run is named <method>-seed<seed>; MLflow samples the machine while it trains
    (issue 55: `system/*` metrics, so a host-bound run shows as one), quietly."""
    from dataclasses import replace

    from mmcse.config import with_overrides
    from mmcse.pipeline.paths import Paths
    from mmcse.pipeline.train import run_train, train_run_name

    cfg = with_overrides(load_config("params.yaml"), {"train.max_steps": 2, "train.eval_steps": 2})
    # as the train stage calls it
    monkeypatch.setenv("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "0.2")
    summary = run_train(cfg, Paths.of(cfg), out_dir=project / "m", hooks=Hooks(progress=False))
    record = mlflow.MlflowClient().get_run(summary["run_id"])
    assert record.info.run_name == f"mcse-seed{cfg.base.seed}"
    history = mlflow.MlflowClient().get_metric_history(summary["run_id"], "system/cpu_utilization_percentage")
    assert history and all(0 <= m.value <= 100 for m in history)
    assert record.data.metrics["system/system_memory_usage_megabytes"] > 0
    assert "system metrics monitoring" not in capfd.readouterr().err
    other = replace(cfg, base=replace(cfg.base, seed=3), train=replace(cfg.train, method="dalr"))
    assert train_run_name(other) == "dalr-seed3"


@pytest.mark.slow  # end to end: the full suite runs it (fast tier under 5 min)
def test_ablation_parent_and_job_runs_read_as_the_table(project):
    """A job run is ``<variant>-seed<seed>``; the parent ``ablation <preset|title|variants>`` holds
    the ablation's settings from its start, the table's metrics after each job, and the table."""
    import sys
    from dataclasses import replace

    from tests.conftest import REPO

    sys.path.insert(0, str(REPO))
    from flows.ablations import ablation_params, log_partial
    from mmcse.analysis.tables import aggregate, table_metric, write_table
    from mmcse.config import with_overrides
    from mmcse.experiments.ablate import run_job
    from mmcse.experiments.ablation_record import log_ablation
    from mmcse.experiments.jobs import expand, job_run_name, parent_run_name
    from mmcse.pipeline.paths import Paths

    cfg = with_overrides(load_config("params.yaml"), {"train.max_steps": 2, "train.eval_steps": 2,
                                                       "ablate.seeds": [4]})
    assert parent_run_name(cfg) == "ablation variants"
    assert parent_run_name(replace(cfg, ablate=replace(cfg.ablate, title="Table 3"))) == "ablation Table 3"
    assert parent_run_name(replace(cfg, ablate=replace(cfg.ablate, preset="dalr-table3"))) == "ablation dalr-table3"
    jobs = expand(cfg)
    assert [job_run_name(j) for j in jobs] == ["mcse-seed4", "simcse-seed4"]
    paths = Paths.of(cfg)
    with tracking.run(cfg, "ablate", run_name=parent_run_name(cfg)) as parent:
        parent_id = parent.info.run_id
        mlflow.log_params(ablation_params(cfg, jobs))
        result = run_job(cfg, jobs[0], paths.ablations, parent_run_id=parent_id)
        log_partial(cfg, parent_id, [result], len(jobs))
        client = mlflow.MlflowClient()
        so_far = client.get_run(parent_id).data  # while the ablation still runs
        assert so_far.metrics["ablation/jobs_done"] == 1 and so_far.metrics["ablation/jobs"] == 2
        # the comparison so far is a figure; the aggregates come once, with the table (not a curve over jobs)
        assert not any(k.endswith(("_mean", "_std", "/seeds")) for k in so_far.metrics)
        assert "figures/ablation.png" in {a.path for a in client.list_artifacts(parent_id, "figures")}
        rows = aggregate(cfg, [result])
        files = write_table(rows, paths.ablations, table_metric(cfg), cfg.ablate.reference, cfg.ablate.title)
    # logged by id after the parent's block (a job's run may be the thread's active one)
    log_ablation(cfg, rows, files, paths, [result], run_id=parent_id)
    job_run = client.get_run(result["run_id"])
    assert job_run.info.run_name == "mcse-seed4"
    assert job_run.data.tags["mlflow.parentRunId"] == parent_id
    got = client.get_run(parent_id)
    assert got.info.run_name == "ablation variants"
    assert {k: got.data.params[k] for k in ("ablation.preset", "ablation.reference", "ablation.metric",
                                             "ablation.seeds", "ablation.variants", "ablation.jobs")} == {
        "ablation.preset": "none", "ablation.reference": "mcse", "ablation.metric": "avg",
        "ablation.seeds": "4", "ablation.variants": "mcse, simcse", "ablation.jobs": "2"}
    assert got.data.metrics["mcse/avg_mean"] == pytest.approx(rows[0]["avg_mean"])
    assert got.data.metrics["mcse/seeds"] == 1
    assert [m.step for m in client.get_metric_history(parent_id, "mcse/avg_mean")] == [0]  # one value per variant
    # the run page's description: the headline table (variant, headline scores as mean ± std, p, seeds)
    note = got.data.tags["mlflow.note.content"]
    assert note.startswith("| variant | STS avg | demo_NDCG@25_rouge_l | demo_rsum | p vs mcse (STS avg) |")
    assert f"| mcse | {rows[0]['avg_mean']:.2f} |" in note  # one seed: its value, no spread
    artifacts = {a.path for a in client.list_artifacts(parent_id)}
    assert {"ablation_table.json", "jobs.json", "ablation.csv", "ablation.md"} <= artifacts, artifacts


@pytest.mark.slow  # end to end: the real train stage in a subprocess
def test_a_damaged_tracking_store_is_one_line_before_training(project):
    """Issue 33.10: a truncated mlruns/mlflow.db, through the train stage: exit 2, one line naming the file
    and what to do, no training started."""
    import os
    import subprocess
    import sys

    from tests.conftest import REPO

    cfg = load_config("params.yaml")
    tracking.configure(cfg)  # a real store first
    tracking.experiment(cfg, "mcse")
    db = project / "mlruns/mlflow.db"
    db.write_bytes(db.read_bytes()[: db.stat().st_size // 3])
    got = subprocess.run([sys.executable, str(REPO / "stages/train.py")], cwd=project, capture_output=True,
                         text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=300)
    assert got.returncode == 2, got.stderr[-2000:]
    line = got.stderr.strip().splitlines()[-1]
    assert line.startswith(f"error: {db.resolve()}: the MLflow tracking store is damaged (") and \
        f"mv {db.resolve()} {db.resolve()}.damaged" in line, got.stderr[-2000:]
    assert "Traceback" not in got.stderr and not (project / "models/student/last").exists()


@pytest.mark.slow  # SQLite's busy timeout under MLflow is 20 s per attempt: the wait takes half a minute
def test_a_store_locked_by_another_process_is_waited_for(project, monkeypatch):
    """Issue 33.10: another process holds the SQLite store past SQLite's own 20 s wait while training
    flushes its metrics: the write is retried until the store is free and no value is lost."""
    import subprocess
    import sys

    from mmcse.config import with_overrides
    from mmcse.pipeline.paths import Paths
    from mmcse.pipeline.train import run_train

    cfg = with_overrides(load_config("params.yaml"), {"train.max_steps": 8, "train.eval_steps": 2,
                                                        "train.checkpoint_steps": 8})
    tracking.configure(cfg)
    holders = []

    def hold_store(step, score):
        if step == 4 and not holders:
            holder = subprocess.Popen(
                [sys.executable, "-c", "import sqlite3, sys, time; db = sqlite3.connect(sys.argv[1]); "
                 "db.execute('BEGIN EXCLUSIVE'); print('held', flush=True); time.sleep(25); db.rollback()",
                 str(project / "mlruns/mlflow.db")], stdout=subprocess.PIPE, text=True)
            assert holder.stdout.readline().strip() == "held"
            holders.append(holder)

    monkeypatch.setenv("MMCSE_STORE_RETRY_SECONDS", "60")
    summary = run_train(cfg, Paths.of(cfg), out_dir=project / "a", hooks=Hooks(progress=False, on_eval=hold_store))
    holders.pop().wait()
    history = mlflow.MlflowClient().get_metric_history(summary["run_id"], "dev_sts")
    assert [m.step for m in history] == [0, 2, 4, 6, 8]  # nothing lost to the wait


def test_locked_writes_are_retried_with_backoff_then_named_in_one_line(monkeypatch):
    from mmcse.errors import StageError

    sleeps = []
    monkeypatch.setattr("time.sleep", sleeps.append)
    attempts = []

    def locked_three_times():
        attempts.append(1)
        if len(attempts) <= 3:
            raise RuntimeError("(sqlite3.OperationalError) database is locked")
        return "written"

    monkeypatch.setenv("MMCSE_STORE_RETRY_SECONDS", "60")
    assert tracking.retry_locked(locked_three_times) == "written" and sleeps == [1.0, 2.0, 4.0]
    monkeypatch.setenv("MMCSE_STORE_RETRY_SECONDS", "0")
    with pytest.raises(StageError, match="the MLflow tracking store stayed locked for 0 s while this run's "
                                         "metrics waited"):
        tracking.retry_locked(lambda: (_ for _ in ()).throw(RuntimeError("database is locked")), "metrics")
    with pytest.raises(ValueError, match="not a lock"):  # other errors are not retried
        tracking.retry_locked(lambda: (_ for _ in ()).throw(ValueError("not a lock")))


def test_a_store_that_stays_locked_stops_training_after_a_resume_point(project, monkeypatch):
    """Issue 33.10: metrics that cannot be written (the store locked past its retries) stop training
    with one line, but only after a last resume point; the rerun continues from it."""
    import json

    import mmcse.tracking
    from mmcse.config import with_overrides
    from mmcse.errors import StageError
    from mmcse.pipeline.paths import Paths
    from mmcse.pipeline.train import run_train

    cfg = with_overrides(load_config("params.yaml"), {"train.max_steps": 8, "train.eval_steps": 2,
                                                        "train.checkpoint_steps": 8})
    write, calls = mmcse.tracking.log_metric_steps, []

    def locked_from_step_5(entries):
        if any(step >= 5 for _, step in entries):
            raise StageError("sqlite:///mlruns/mlflow.db: the MLflow tracking store stayed locked for 300 s")
        calls.append(entries)
        return write(entries)

    monkeypatch.setattr(mmcse.tracking, "log_metric_steps", locked_from_step_5)
    with pytest.raises(StageError, match="stayed locked"):
        run_train(cfg, Paths.of(cfg), out_dir=project / "b", hooks=Hooks(progress=False))
    step = json.loads((project / "b/last/state.json").read_text())["step"]
    assert step >= 5  # the step-8 checkpoint never came; a resume point was written before the error
    assert mlflow.active_run() is None
    monkeypatch.setattr(mmcse.tracking, "log_metric_steps", write)
    again = run_train(cfg, Paths.of(cfg), out_dir=project / "b", hooks=Hooks(progress=False))
    assert again["steps"] == 8
    assert mlflow.get_run(again["run_id"]).data.tags["mmcse.resumed_from_step"] == str(step)


def test_a_run_made_in_a_dvc_experiments_copy_lands_in_the_project(tmp_path, monkeypatch):
    """Issue 53.11: `dvc exp run --temp` and `dvc queue` workers run each stage in a copy under
    .dvc/tmp/exps/ that DVC deletes afterwards, with DVC_ROOT naming the project. The store, the artifacts,
    the finished jobs and the records of which run holds a folder are the project's, and a folder is
    recorded by its place in the workspace, so the workspace finds a run its copy made."""
    from pathlib import Path

    from mmcse.config import Config
    from mmcse.io import at_home, ensure_sqlite_parent
    from mmcse.pipeline.paths import Paths

    home, copy = tmp_path / "project", tmp_path / "project/.dvc/tmp/exps/tmpabc"
    copy.mkdir(parents=True)
    monkeypatch.chdir(copy)
    monkeypatch.setenv("DVC_ROOT", str(home))
    assert ensure_sqlite_parent("sqlite:///mlruns/mlflow.db") == f"sqlite:///{home.resolve()}/mlruns/mlflow.db"
    assert at_home("mlruns/artifacts") == home.resolve() / "mlruns/artifacts"
    cfg = Config()
    assert Paths.of(cfg).jobs == home.resolve() / "data/jobs" and Paths.of(cfg).student == Path("models/student")
    tracking.remember_run("models/student", "run-in-the-copy", config_hash="h")
    assert (home / "mlruns/records").is_dir() and not (copy / "mlruns").exists()
    monkeypatch.chdir(home)
    monkeypatch.delenv("DVC_ROOT")
    assert tracking.remembered_run("models/student", config_hash="h")["run_id"] == "run-in-the-copy"
    assert ensure_sqlite_parent("sqlite:///mlruns/mlflow.db") == f"sqlite:///{home.resolve()}/mlruns/mlflow.db"


def test_a_card_as_a_description_is_its_body_without_the_hubs_metadata_or_the_configuration():
    """Issue 67.5: what the training run's and its model's page show first, instead of "No description"."""
    from mmcse.tracking import DESCRIPTION_LIMIT as NOTE_LIMIT
    from mmcse.tracking.lineage import card_description

    card = ("---\nlibrary_name: sentence-transformers\n---\n\n# mmcse sentence encoder\n\n**Data**: x\n\n"
            "## Scores\n\n| score | value |\n\n## Training\n\n- mmcse commit: `abc`\n\n```yaml\nbase: {}\n```\n")
    assert card_description(card) == "# mmcse sentence encoder\n\n**Data**: x\n\n## Scores\n\n| score | value |"
    long = card_description("# t\n\n" + "x" * 20_000)
    assert len(long) <= NOTE_LIMIT and long.endswith("README.md)\n")


def test_mmcse_register_makes_a_version_whose_description_is_the_card(project, capsys):
    """Issue 67.5: `mmcse register` puts the train stage's evaluated model into MLflow's registry, its card as the
    registered model's and the version's description; a run without a model is one line."""
    import mlflow

    from mmcse import tracking
    from mmcse.cli import main
    from mmcse.experiments.params import load_config
    from mmcse.tracking import DESCRIPTION_TAG as NOTE_TAG
    from mmcse.tracking.lineage import MODEL_URI_TAG

    class Echo(mlflow.pyfunc.PythonModel):
        def predict(self, context, model_input):
            return model_input

    cfg = load_config("params.yaml")
    tracking.configure(cfg)
    # by id, not mlflow.set_experiment: that sets a process-wide active experiment that a later test's
    # continued run (another store) would be refused against
    exp_id = tracking.experiment(cfg, cfg.train.method)
    with mlflow.start_run(experiment_id=exp_id) as bare:
        pass
    with mlflow.start_run(experiment_id=exp_id) as run:
        info = mlflow.pyfunc.log_model(name="student", python_model=Echo(), pip_requirements=[])
        mlflow.set_tags({MODEL_URI_TAG: info.model_uri, NOTE_TAG: "# the card\n\n## Scores"})
    main(["register", "--name", "demo-student"])  # the newest evaluated run: `run`
    assert capsys.readouterr().out.strip().endswith("models:/demo-student/1")
    client = mlflow.MlflowClient()
    assert client.get_registered_model("demo-student").description == "# the card\n\n## Scores"
    version = client.get_model_version("demo-student", "1")
    assert (version.description, version.run_id) == ("# the card\n\n## Scores", run.info.run_id)
    with pytest.raises(SystemExit) as stopped:
        main(["register", "--name", "demo-student", "--run", bare.info.run_id])
    assert stopped.value.code == 2 and "logged no evaluated model" in capsys.readouterr().err
