"""Optuna sweep: worker processes on one storage finish exactly n_trials trials, every trial
recorded once; running trials count towards n_trials, stale ones (killed workers) do not."""

import os
import re
import sqlite3
import subprocess
import sys
import threading

import optuna
import pytest
import yaml
from optuna.trial import TrialState

from mmcse.experiments import sweep
from mmcse.experiments.params import load_config
from mmcse.pipeline.paths import Paths

N_TRIALS = 4
# a worker's progress line for a finished trial: "[sweep t] trial 3 PRUNED value 0.41 | best ..."
PROGRESS = re.compile(
    r"^\[sweep \S+\] trial (\d+) (COMPLETE|PRUNED|FAIL) value \S+ \| best .* \| (\d+)/(\d+) finished$", re.MULTILINE)


def write_params(project, study_name: str, n_trials: int, storage: str | None = None,
                 tracking: str | None = None) -> None:
    """The project's params.yaml with a sweep of ``n_trials`` short (4-step) trials."""
    raw = yaml.safe_load((project / "params.yaml").read_text())
    raw["sweep"].update(n_trials=n_trials, study_name=study_name, pruner_startup_trials=1)
    if storage:
        raw["sweep"]["storage"] = storage
    if tracking:
        raw["base"]["mlflow_tracking_uri"] = tracking
    raw["train"].update(max_steps=4, eval_steps=2)
    (project / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))


def run_sweep_workers(project, study_name: str, storage: str | None = None, tracking: str | None = None,
                      workers: int = 2) -> list:
    """Start ``workers`` `mmcse sweep` processes on one study (as on separate machines or GPUs:
    worker i with CUDA_VISIBLE_DEVICES=i), wait for them, and return the study's finished
    trials, checked: exactly N_TRIALS trials in the study, every one complete or pruned (none
    failed, none left running), each reported once by the worker that ran it."""
    write_params(project, study_name, N_TRIALS, storage, tracking)
    cmd = [sys.executable, "-m", "mmcse.cli", "sweep", "--params", "params.yaml"]
    # one GPU per worker, as `CUDA_VISIBLE_DEVICES=<i> prefect worker start` gives each (CPU here)
    procs = [subprocess.Popen(cmd, cwd=project, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "CUDA_VISIBLE_DEVICES": str(i)})
             for i in range(workers)]
    outs = [p.communicate(timeout=900) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-3000:]
    study = optuna.load_study(study_name=study_name, storage=storage or f"sqlite:///{project}/mlruns/optuna.db")
    assert len(study.trials) == N_TRIALS, [(t.number, t.state.name) for t in study.trials]
    finished = [t for t in study.trials if t.state.is_finished()]
    assert all(t.state in (TrialState.COMPLETE, TrialState.PRUNED) for t in finished)
    assert len(finished) == N_TRIALS
    reported = [m.groups() for _, err in outs for m in PROGRESS.finditer(err)]
    assert sorted(int(number) for number, *_ in reported) == [t.number for t in finished]
    assert {state for _, state, *_ in reported} <= {"COMPLETE", "PRUNED"}
    assert {total for *_, total in reported} == {str(N_TRIALS)}
    assert max(int(done) for _, _, done, _ in reported) == N_TRIALS
    return finished


@pytest.mark.slow  # two worker processes, each training its trials
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
    assert sorted(names) == sorted(f"trial {t.number}" for t in finished)  # once each
    assert parents == 2 and logged >= len(finished)
    assert sorted(visible[p] for p in set(parent_of.values())) == ["0", "1"]  # each worker's sweep run
    assert parent_of and all(visible[run] == visible[p] for run, p in parent_of.items())  # trials: their worker's
    assert devices == {"cpu"}  # base.device cpu, resolved in each worker
    with sqlite3.connect(project / "mlruns/mlflow.db") as db:
        status = dict(db.execute("select name, status from runs").fetchall())
        pruned_runs = {r[0] for r in db.execute(
            "select r.name from runs r join tags t on t.run_uuid = r.run_uuid where t.key = 'optuna.state'")}
    pruned = {f"trial {t.number}" for t in finished if t.state == TrialState.PRUNED}
    assert pruned_runs == pruned  # tagged PRUNED, and ended as planned, not as a failure
    assert set(status.values()) == {"FINISHED"}, status
    complete = [t for t in finished if t.state == TrialState.COMPLETE]
    assert all(t.user_attrs["mlflow_run_id"] for t in complete)
    assert not any(k.startswith("mmcse.heartbeat") for t in finished for k in t.user_attrs)  # bookkeeping: hidden
    # each worker's sweep run carries the study's settings and how far the study got
    import mlflow

    from mmcse import tracking

    tracking.configure(load_config("params.yaml"))
    sweep_runs = mlflow.search_runs(experiment_names=["mmcse-sweep"], filter_string="attributes.run_name = 'sweep t'",
                                    output_format="list")
    assert len(sweep_runs) == 2
    for run in sweep_runs:
        params = run.data.params
        assert (params["sweep.study_name"], params["sweep.n_trials"], params["sweep.direction"]) == \
            ("t", str(N_TRIALS), "maximize")
        assert yaml.safe_load(params["sweep.space"])["loss.temperature"] == {"type": "float", "low": 0.02,
                                                                              "high": 0.1}
        assert params["sweep.storage"].endswith("/mlruns/optuna.db")
        assert 1 <= run.data.metrics["trials_finished"] <= N_TRIALS
    # the worker that finished last saw every trial: its last count is N_TRIALS and the study's best
    assert max(r.data.metrics["trials_finished"] for r in sweep_runs) == N_TRIALS
    if complete:
        best = max(t.value for t in complete)
        assert max(r.data.metrics.get("best_value", -1) for r in sweep_runs) == pytest.approx(best)


def _in_process_sweep(project, monkeypatch, study_name: str, n_trials: int, grace: int = 1):
    """params.yaml for an in-process sweep with 1 s heartbeats, a ``grace`` s grace period, a short
    poll, and the study created beforehand (as another worker of this checkout would have, its training
    code recorded); returns (cfg, storage URL, study)."""
    monkeypatch.setattr(sweep, "HEARTBEAT_INTERVAL", 1)
    monkeypatch.setattr(sweep, "GRACE_PERIOD", grace)
    monkeypatch.setattr(sweep, "POLL_SECONDS", 0.2)
    write_params(project, study_name, n_trials)
    cfg = load_config("params.yaml")
    url = f"sqlite:///{project}/mlruns/optuna.db"
    (project / "mlruns").mkdir(exist_ok=True)
    study = optuna.create_study(study_name=study_name, storage=url, direction=cfg.sweep.direction)
    sweep.claim_study_code(study, study_name, url)
    return cfg, url, study


def test_a_study_of_trials_trained_by_other_code_is_refused_by_name(monkeypatch):
    """A loss edited between two runs of one study (or a worker with another checkout): the study's
    values and new ones would be compared as if made alike; refused, naming the file. Enqueued trials
    (not yet trained) do not count."""
    from mmcse.errors import StageError
    from mmcse.integrity.code import TRAINING_CODE, code_digest, code_files

    study = optuna.create_study(direction="maximize")
    study.enqueue_trial({"x": 1})
    sweep.claim_study_code(study, "s", "memory")  # only an enqueued trial: claimed
    # issue 67.4: one digest in the user's view; the files' hashes (naming what changed) are bookkeeping
    assert study.user_attrs[sweep.CODE_ATTR] == code_digest(code_files(TRAINING_CODE))
    assert study._storage.get_study_system_attrs(study._study_id)[sweep.CODE_FILES_ATTR] == code_files(TRAINING_CODE)
    study.tell(study.ask(), 0.5)  # the enqueued trial, trained
    study.tell(study.ask(), 0.7)
    sweep.claim_study_code(study, "s", "memory")  # the same code: goes on
    monkeypatch.setattr(sweep, "code_files", lambda roots: {**code_files(roots), "mmcse/methods/terms/mcse.py": "0"})
    with pytest.raises(StageError, match=r"holds 2 trials trained by other library code \(changed since: "
                                         r"mmcse/methods/terms/mcse.py\).*new study"):
        sweep.claim_study_code(study, "s", "memory")
    unrecorded = optuna.create_study()
    unrecorded.tell(unrecorded.ask(), 0.1)  # trained by an mmcse that recorded no code
    with pytest.raises(StageError, match=r"unknown files \(not recorded\)"):
        sweep.claim_study_code(unrecorded, "u", "memory")


def test_stale_running_trials_are_failed_and_their_slots_run_again(project, monkeypatch, capsys):
    cfg, url, study = _in_process_sweep(project, monkeypatch, "stale", n_trials=2)
    # two workers killed with kill -9 mid-trial: one after a heartbeat, one before its first
    # (or an mmcse without heartbeats); both RUNNING forever and, at first, filling the budget
    killed = study.ask()
    optuna.storages.RDBStorage(url).record_heartbeat(killed._trial_id)
    orphan = study.ask()

    summary = sweep.run_sweep(cfg, Paths.of(cfg))

    states = {t.number: t.state for t in optuna.load_study(study_name="stale", storage=url).trials}
    assert states[killed.number] == TrialState.FAIL and states[orphan.number] == TrialState.FAIL
    assert sorted(n for n, s in states.items() if s in (TrialState.COMPLETE, TrialState.PRUNED)) == [2, 3]
    assert len(states) == 4  # no trial beyond the two replacements
    assert summary["trials"] == 2 and summary["complete"] + summary["pruned"] == 2
    err = capsys.readouterr().err
    reported = PROGRESS.findall(err)
    assert [(number, done) for number, _, done, _ in reported] == [("2", "1"), ("3", "2")]
    # the running trial's dev evaluations as they happen, and the objective's name for optuna-dashboard
    assert re.search(r"\[sweep stale\] trial 2: step \d+, dev STS -?\d+\.\d\d", err)
    assert optuna.load_study(study_name="stale", storage=url).metric_names == ["dev STS"]


def test_a_running_trial_of_another_worker_counts_towards_n_trials(project, monkeypatch):
    # a 10 s grace: the other worker's heartbeat thread may be starved for a second on a loaded machine,
    # and its trial must stay alive here (the stale-trial test keeps 1 s: there the trials are dead)
    cfg, url, study = _in_process_sweep(project, monkeypatch, "shared", n_trials=2, grace=10)
    other = study.ask()  # another worker's trial, alive: it beats until this worker has finished one
    storage = optuna.storages.RDBStorage(url)
    first_done = threading.Event()

    def other_worker() -> None:
        watcher = optuna.load_study(study_name="shared", storage=url)
        while not first_done.is_set():
            storage.record_heartbeat(other._trial_id)
            if watcher.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED)):
                first_done.set()
            else:
                first_done.wait(0.2)
        watcher.tell(other.number, 0.5)

    thread = threading.Thread(target=other_worker, daemon=True)
    thread.start()
    summary = sweep.run_sweep(cfg, Paths.of(cfg))
    thread.join(timeout=60)

    trials = optuna.load_study(study_name="shared", storage=url).trials
    # this worker ran one trial and then waited for the other's, rather than starting a second
    assert [(t.number, t.state.is_finished()) for t in trials] == [(0, True), (1, True)]
    assert trials[0].state == TrialState.COMPLETE and trials[0].value == 0.5
    assert summary["trials"] == 2


def test_the_trial_lock_of_a_sqlite_study_is_a_file_lock_next_to_its_database(tmp_path):
    from filelock import FileLock

    lock = sweep.trial_lock(f"sqlite:///{tmp_path}/db/optuna.db", "s")
    assert isinstance(lock, FileLock) and lock.lock_file == f"{tmp_path}/db/optuna.db.lock"
    with lock:  # held by this process: another process's attempt times out
        other = subprocess.run([sys.executable, "-c", "import filelock, sys; filelock.FileLock(sys.argv[1]).acquire("
                                "timeout=0.2)", lock.lock_file], capture_output=True, text=True)
    assert other.returncode != 0 and "Timeout" in other.stderr


def _study_with_every_state(direction: str, storage: str | None = None, name: str = "p") -> optuna.Study:
    """COMPLETE 0.3 and 0.7, one PRUNED, one FAIL, one RUNNING trial."""
    study = optuna.create_study(direction=direction, storage=storage, study_name=name)
    for value in (0.3, 0.7):
        study.tell(study.ask(), value)
    study.tell(study.ask(), state=TrialState.PRUNED)
    study.tell(study.ask(), state=TrialState.FAIL)
    study.ask()  # running
    return study


def test_progress_counts_finished_trials_of_every_worker_and_the_best_value():
    assert sweep.progress_counts(_study_with_every_state("maximize"), 6) == (3, 6, 0.7)
    assert sweep.progress_counts(_study_with_every_state("minimize"), 6) == (3, 6, 0.3)
    empty = optuna.create_study()
    assert sweep.progress_counts(empty, 4) == (0, 4, None)


def test_the_progress_bar_moves_when_another_worker_finishes_a_trial(tmp_path):
    import io

    url = f"sqlite:///{tmp_path}/optuna.db"
    study = _study_with_every_state("maximize", url)
    out = io.StringIO()
    progress = sweep.SweepProgress(study, "p", 6, interval=0.05, file=out, disable=False)
    with progress:
        assert (progress.bar.n, progress.bar.total) == (3, 6)
        assert "3/6" in out.getvalue() and "best 0.7" in out.getvalue()
        other = optuna.load_study(study_name="p", storage=url)  # another worker's process, same storage
        other.tell(other.ask(), 0.9)
        for _ in range(400):  # the bar's own thread reads the storage; no refresh() from here
            if progress.bar.n == 4:
                break
            threading.Event().wait(0.05)
        assert progress.bar.n == 4
        progress.write("[sweep p] a line above the bar")
    text = out.getvalue()
    assert "4/6" in text and "best 0.9" in text and "[sweep p] a line above the bar\n" in text


def test_without_a_terminal_the_bar_is_off_and_lines_go_to_stderr(capsys):
    import io

    progress = sweep.SweepProgress(_study_with_every_state("maximize"), "p", 6, file=io.StringIO())
    with progress:
        progress.write("[sweep p] trial 9 COMPLETE")
    assert progress.bar.disable and capsys.readouterr().err == "[sweep p] trial 9 COMPLETE\n"


def test_a_diverged_trial_fails_as_such_and_the_study_goes_on(project, monkeypatch, capsys):
    """Issue 33.3: every trial of this space diverges; each ends FAIL with its reason, counts towards
    n_trials, and the sweep ends normally instead of stopping at the first."""
    cfg, url, _ = _in_process_sweep(project, monkeypatch, "diverging", n_trials=2)
    raw = yaml.safe_load((project / "params.yaml").read_text())
    raw["sweep"]["space"] = {"train.learning_rate": {"type": "float", "low": 1e28, "high": 1e30, "log": True}}
    (project / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    summary = sweep.run_sweep(load_config("params.yaml"), Paths.of(cfg))
    trials = optuna.load_study(study_name="diverging", storage=url).trials
    assert [t.state for t in trials] == [TrialState.FAIL, TrialState.FAIL]
    assert all(t.user_attrs[sweep.DIVERGED_ATTR].startswith("training diverged at step ") for t in trials)
    assert summary["trials"] == 0 and summary["best_value"] is None
    said = capsys.readouterr().err
    assert len(re.findall(r"trial \d: training diverged at step \d+: .*; the study goes on", said)) == 2


def test_a_stopped_trials_parameters_are_queued_and_a_rerun_trains_them_first(tmp_path):
    """Issue 53.13: Ctrl-C (or SIGTERM) mid-trial ends it FAIL, and its parameters are what the next ask gives."""
    url = f"sqlite:///{tmp_path}/optuna.db"
    rdb = optuna.storages.RDBStorage(url, heartbeat_interval=1, grace_period=5)
    study = optuna.create_study(study_name="stopped", storage=rdb, direction="maximize")
    trial = study.ask()
    x = trial.suggest_float("x", 0.0, 1.0)

    def stopped(_trial):
        raise KeyboardInterrupt

    said = []
    with pytest.raises(KeyboardInterrupt):
        sweep._run_trial(study, rdb, trial, stopped, "stopped", 4, say=said.append)
    assert said[-1] == ("[sweep stopped] trial 0 stopped: its parameters are queued, and a rerun trains them first "
                        "(the study still ends at 4 finished trials)")
    states = [t.state for t in study.trials]
    assert states == [TrialState.FAIL, TrialState.WAITING]
    rerun = study.ask()  # the rerun takes the queued parameters first, and is stopped again
    assert rerun.suggest_float("x", 0.0, 1.0) == x
    with pytest.raises(KeyboardInterrupt):
        sweep._run_trial(study, rdb, rerun, stopped, "stopped", 4, say=said.append)
    assert [t.state for t in study.trials] == [TrialState.FAIL, TrialState.FAIL, TrialState.WAITING]
    again = study.ask()
    assert again.suggest_float("x", 0.0, 1.0) == x and again.user_attrs[sweep.REQUEUED_ATTR] == 1
