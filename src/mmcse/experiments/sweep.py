"""Optuna sweeps over ``sweep.space``: objective = best dev STS, pruned on the way.

The study lives in ``sweep.storage`` (SQLite under ``mlruns/`` by default, PostgreSQL
for many machines) and is resumed by name: any number of worker processes may run
``run_sweep`` on the same storage; together they finish exactly ``n_trials`` trials (complete
or pruned): under a lock shared by the workers (`trial_lock`) a worker starts a trial only while
finished + running trials are fewer. Running trials send heartbeats; one whose worker was
killed goes stale after ``GRACE_PERIOD`` s, is failed, and its slot is run again.
Each trial is an MLflow run nested under its worker's sweep run, with its params; its best checkpoint
is a logged model of that run (`link_trial`: the drawn params, the best dev score, the study and trial as
tags), and the trial's user attrs name the run, the model and the checkpoint. Sweep and trial runs
carry the device ``base.device`` resolved to in the worker (`mmcse.models.device.device_tags`), so
with one worker per GPU (``CUDA_VISIBLE_DEVICES=<i>``) every trial says which GPU ran it.
"""

from __future__ import annotations

import hashlib
import json
import sys
import threading
import time
import warnings
from collections.abc import Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlflow
import optuna
import sqlalchemy
from filelock import FileLock
from optuna.trial import TrialState
from sqlalchemy.pool import NullPool
from tqdm.auto import tqdm

from mmcse import tracking
from mmcse.config import RETRIEVAL_METHODS, Config, with_overrides
from mmcse.errors import StageError, StoppedEarly, TrainingDiverged
from mmcse.experiments.upstream import resolve_on_record
from mmcse.integrity.code import TRAINING_CODE, changed_code, code_digest, code_files
from mmcse.integrity.files import SEAL
from mmcse.io import at_home, ensure_sqlite_parent
from mmcse.methods.objectives import Objective, check_sweep_space
from mmcse.models.device import device_tags
from mmcse.pipeline.train import JobArtifacts, RunNames, run_train
from mmcse.records import folder_run_id
from mmcse.tracking.lineage import link_checkpoint_model
from mmcse.training.checkpoints import run_definition_hash
from mmcse.training.engine import Hooks

# A running trial records a heartbeat every HEARTBEAT_INTERVAL s (Optuna wants whole seconds);
# one silent for GRACE_PERIOD s is failed by the next worker that looks (its worker was killed),
# and no longer counts towards n_trials. POLL_SECONDS: how often a worker whose budget is taken
# by other workers' running trials looks again (one of them may fail or go stale).
HEARTBEAT_INTERVAL = 30
GRACE_PERIOD = 120
POLL_SECONDS = 5.0
HEARTBEAT_ATTR = "mmcse.heartbeat"  # trial system attr (bookkeeping, not the user's): its heartbeats are kept
# Towards n_trials count finished trials and running ones (another worker's trial will finish).
# Not WAITING (enqueued) ones: `study.ask` hands those out first, so they are run, not skipped.
REQUEUED_ATTR = "mmcse.requeued_from"  # a trial whose parameters are those of a stopped one (its number)
COUNTED_STATES = ("COMPLETE", "PRUNED", "RUNNING")  # names: optuna is imported lazily
WAIT = object()  # _next_trial: no trial for now, look again
# A trial whose training diverged (`mmcse.errors.TrainingDiverged`) ends FAIL with this user attr (the
# reason) and counts towards n_trials: a space that diverges everywhere ends, the study goes on otherwise.
DIVERGED_ATTR = "mmcse.diverged"
CODE_ATTR = "mmcse.training_code"  # study user attr: one digest of the code its trials train with
CODE_FILES_ATTR = "mmcse.training_code_files"  # study system attr: {file: SHA-256} behind it (names what changed)
# the study -> MLflow links (the MLflow -> study ones are the runs' and models' tags, `trial_tags`): the
# study's experiment, and each finished trial's run, logged model and checkpoint folder
EXPERIMENT_ATTR = "mlflow_experiment_id"
RUN_ATTR = "mlflow_run_id"
MODEL_ATTR = "mlflow_model_id"
CHECKPOINT_ATTR = "checkpoint"


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
    progress: bool = True,
) -> dict[str, Any]:
    """Run trials until the study holds ``n_trials`` finished (complete or pruned) ones, counted
    over every worker on the storage; the worker's sweep run and its trial runs are tagged with
    the device and ``tags``. The sweep run (``sweep <study>``) carries the study's settings as
    params and ``trials_finished`` / ``best_value`` as metrics; its trials are runs ``trial <n>``.
    ``progress``: a bar on stderr when it is a terminal (`SweepProgress`: finished / n_trials over all
    workers, best so far); elsewhere (logs, pipes) one line per finished trial only."""

    check_sweep_space(Objective.of(cfg), cfg.sweep.space)  # before any storage or run is created
    n_trials = n_trials or cfg.sweep.n_trials
    study_name = study_name or cfg.sweep.study_name
    storage_url = ensure_sqlite_parent(storage or cfg.sweep.storage)
    study, rdb = open_study(cfg, study_name, storage_url)
    lock = trial_lock(storage_url, study_name)
    bar = SweepProgress(study, study_name, n_trials, disable=None if progress else True)
    with (
        bar,
        tracking.tagged({**device_tags(cfg.base.device), **(tags or {})}),
        tracking.run(cfg, "sweep", run_name=f"sweep {study_name}",
                     tags={"study": study_name, **study_tags(study_name, storage_url)}) as parent,
    ):
        mlflow.log_params(sweep_params(cfg, study_name, n_trials, storage_url))
        study.set_user_attr(EXPERIMENT_ATTR, parent.info.experiment_id)
        objective = TrialObjective(cfg, paths, study_name, storage_url, parent.info.run_id, bar.write)
        waiting = False
        while (trial := _next_trial(study, rdb, lock, n_trials)) is not None:
            if trial is WAIT:
                if not waiting:  # once per wait, not once per poll
                    bar.write(f"[sweep {study_name}] waiting: the other trials of the budget are running "
                              "in other workers")
                waiting = True
                time.sleep(POLL_SECONDS)
                continue
            waiting = False
            _run_trial(study, rdb, trial, objective, study_name, n_trials, bar.write)
            finished, _, best = bar.refresh()  # into the sweep run: how far the study is, over all workers
            mlflow.log_metrics({"trials_finished": finished, **({"best_value": best} if best is not None else {})},
                               step=finished)
    return study_summary(study, study_name)


def open_study(cfg: Config, study_name: str, storage_url: str) -> tuple[Any, Any]:
    """The study (created, or loaded when it exists) and its RDB storage, its metric named, its code claimed
    (`claim_study_code`) and the sweep's MLflow experiment made; workers started together would race to create
    the SQLite schemas, so this runs under a file lock."""
    at_home("mlruns").mkdir(exist_ok=True)
    with FileLock(str(at_home("mlruns") / ".sweep-setup.lock")), warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)  # heartbeat_interval
        rdb = optuna.storages.RDBStorage(
            storage_url, engine_kwargs={"pool_pre_ping": True},
            heartbeat_interval=HEARTBEAT_INTERVAL, grace_period=GRACE_PERIOD,
        )
        study = optuna.create_study(
            study_name=study_name,
            storage=rdb,
            load_if_exists=True,
            direction=cfg.sweep.direction,
            pruner=optuna.pruners.MedianPruner(
                n_startup_trials=cfg.sweep.pruner_startup_trials, n_warmup_steps=cfg.sweep.pruner_warmup_steps
            ),
        )
        # the objective's name, for optuna-dashboard and study.trials_dataframe (not "Objective 0")
        study.set_metric_names([objective_name(cfg)])
        claim_study_code(study, study_name, storage_url)
        tracking.experiment(cfg, "sweep")
    return study, rdb


@dataclass(frozen=True)
class TrialEnd:
    """How a trial ended: the MLflow run that trained it, its best checkpoint, that checkpoint's dev score and
    step, and the trial's state (COMPLETE, PRUNED)."""

    run_id: str
    checkpoint: Path
    best: float
    best_step: int
    state: str


@dataclass
class TrialObjective:
    """Optuna's objective of a sweep worker: one trial's configuration drawn from ``sweep.space``, trained as a
    run under the sweep run ``parent_id`` on its own upstream artifacts, reported at each dev evaluation (pruned
    there by the study's pruner) and linked to its best checkpoint (`link_trial`). Returns the best dev score."""

    cfg: Config
    paths: Any
    study_name: str
    storage_url: str
    parent_id: str
    write: Any  # a line to the worker's output (the progress bar's `write`)

    def __call__(self, trial: optuna.Trial) -> float:
        cfg, study_name = self.cfg, self.study_name
        overrides = suggest(trial, cfg.sweep.space)
        trial_cfg = with_overrides(cfg, overrides, where=f"sweep trial {trial.number}")
        out_dir = Path("sweeps") / study_name / f"trial-{trial.number}"

        def report(step: int, score: float) -> None:
            self.write(f"[sweep {study_name}] trial {trial.number}: step {step}, {objective_name(cfg)} {score:.2f}")
            trial.report(score, step)
            if trial.should_prune():
                mlflow.set_tags({"optuna.pruned": f"step {step}", "optuna.state": "PRUNED"})
                # a planned stop: the loop writes the best checkpoint first, the run ends FINISHED
                raise StoppedEarly(f"pruned at step {step} (dev {score:.2f})")

        # every run of the trial (its upstream's, its training's) names its study and trial
        with tracking.tagged(trial_tags(study_name, trial.number, self.storage_url)):
            upstream = resolve_on_record(trial_cfg, self.paths, cfg.base.seed, "sweep", trial_run_name(trial.number),
                                         self.parent_id)  # a trial's own upstream artifacts, before it trains
            try:
                summary = run_train(
                    trial_cfg, self.paths, out_dir=out_dir,
                    names=RunNames(experiment="sweep", run=trial_run_name(trial.number), parent_id=self.parent_id),
                    hooks=Hooks(on_eval=report, progress=False), job=JobArtifacts(cfg.base.seed, upstream),
                )
            except StoppedEarly as pruned:
                # its best checkpoint up to the pruning step is a model too (the loop wrote it and says which); none
                # when no evaluation gave a finite score
                if pruned.best_step >= 0 and (out_dir / "best" / SEAL).is_file():
                    run_id = folder_run_id(out_dir, config_hash=run_definition_hash(trial_cfg))
                    link_trial(trial, study_name, self.storage_url, trial_cfg, overrides,
                               TrialEnd(run_id, out_dir / "best", pruned.best_score, pruned.best_step, "PRUNED"))
                raise optuna.TrialPruned(str(pruned)) from None
        link_trial(trial, study_name, self.storage_url, trial_cfg, overrides,
                   TrialEnd(summary["run_id"], Path(summary["checkpoint"]), summary["best_dev"], summary["best_step"],
                            "COMPLETE"))
        return summary["best_dev"]  # dev STS, or DUET's val rsum


def study_summary(study: Any, study_name: str) -> dict[str, Any]:
    """The study's finished (complete and pruned) trials, counted, and its best value and params so far."""
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
        # where the best trial's model is: its checkpoint folder, its MLflow run and logged model (`link_trial`)
        "best_trial": best.number if best else None,
        "best_checkpoint": best.user_attrs.get(CHECKPOINT_ATTR) if best else None,
        "best_run_id": best.user_attrs.get(RUN_ATTR) if best else None,
        "best_model_id": best.user_attrs.get(MODEL_ATTR) if best else None,
    }


def best_line(summary: Mapping[str, Any]) -> str:
    """A sweep's last line: the best trial, its value and drawn values, where its checkpoint, MLflow run and
    model are (`study_summary`)."""
    if summary.get("best_trial") is None:
        return f"sweep {summary['study']}: {summary['trials']} trials finished, none complete: no best trial yet"
    drawn = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                      for k, v in (summary.get("best_params") or {}).items())
    return (f"sweep {summary['study']}: best trial {summary['best_trial']} ({summary['best_value']:.2f}; {drawn}) of "
            f"{summary['trials']}; checkpoint {summary['best_checkpoint']}; MLflow run {summary['best_run_id']}, "
            f"model {summary['best_model_id']}")


def claim_study_code(study: Any, study_name: str, storage_url: str) -> None:
    """Record the library code that trains (`mmcse.integrity.code.TRAINING_CODE`) on a new study, and
    refuse a study whose trials were trained by other code (a loss or the loop edited since, or a worker
    with another checkout): their values and a new trial's would be compared as if made alike."""
    current = code_files(TRAINING_CODE)
    files = study._storage.get_study_system_attrs(study._study_id).get(CODE_FILES_ATTR)
    recorded = study.user_attrs.get(CODE_ATTR)
    if isinstance(recorded, dict):  # a study of an mmcse that kept the files' hashes as the user attr
        files, recorded = recorded, code_digest(recorded)
    if recorded is not None and recorded == code_digest(current):
        return
    made = [t for t in study.get_trials(deepcopy=False) if t.state != TrialState.WAITING]
    if made:
        raise StageError(
            f"sweep study {study_name!r} in {storage_url} holds {len(made)} trial{'s' * (len(made) != 1)} trained by "
            f"other library code "
            f"(changed since: {changed_code(files, current)}); their values cannot be set against new trials'. "
            "Name a new study (sweep.study_name, or --study-name) or delete this one (optuna delete-study)")
    study.set_user_attr(CODE_ATTR, code_digest(current))  # what a user sees: one digest
    study._storage.set_study_system_attr(study._study_id, CODE_FILES_ATTR, current)


def study_tags(study_name: str, storage_url: str) -> dict[str, str]:
    """The MLflow tags naming an Optuna study: its name and storage (without a password)."""
    return {"optuna.study": study_name, "optuna.storage": masked_url(storage_url)}


def trial_tags(study_name: str, number: int, storage_url: str) -> dict[str, str]:
    """The MLflow tags of a trial's runs and model: its study (`study_tags`) and its number."""
    return {**study_tags(study_name, storage_url), "optuna.trial_number": str(number)}


def link_trial(trial: Any, study_name: str, storage_url: str, trial_cfg: Config, drawn: Mapping[str, Any],
               end: TrialEnd) -> str:
    """A finished trial's best checkpoint as an MLflow model of its run (`mmcse.tracking.lineage`): the
    parameters the trial drew as the model's params, its best dev score and step as its metrics, the study
    and trial as its tags; the trial's user attrs name the run, the model and the checkpoint, so each end
    finds the other. Returns the model id."""

    dev_key = "best_dev_rsum" if trial_cfg.train.method in RETRIEVAL_METHODS else "best_dev_sts"
    model_id = link_checkpoint_model(
        end.run_id, end.checkpoint, name=f"trial-{trial.number}", params=drawn,
        metrics={dev_key: end.best, "best_step": end.best_step},
        tags={**trial_tags(study_name, trial.number, storage_url), "optuna.state": end.state,
              "method": trial_cfg.train.method},
        model_type=f"mmcse {'retrieval model' if trial_cfg.train.method in RETRIEVAL_METHODS else 'student'}",
    )
    for key, value in {RUN_ATTR: end.run_id, MODEL_ATTR: model_id,
                       CHECKPOINT_ATTR: str(end.checkpoint.resolve())}.items():
        trial.set_user_attr(key, value)
    return model_id


def masked_url(url: str) -> str:
    """A database URL as it may be shown: its password hidden."""
    return sqlalchemy.engine.make_url(url).render_as_string(hide_password=True)


def objective_name(cfg: Config) -> str:
    """What a trial's value is: the best dev STS (Spearman ×100), or for the retrieval methods the
    best val R@K rsum."""
    return "val rsum" if cfg.train.method in RETRIEVAL_METHODS else "dev STS"


def _next_trial(study: Any, rdb: Any, lock: AbstractContextManager[Any], n_trials: int) -> Any:
    """Under the study's lock: fail stale trials, then a new RUNNING trial with its first
    heartbeat if finished + running trials are below ``n_trials``; ``WAIT`` if running trials of
    other workers fill the budget (one may still fail); ``None`` when ``n_trials`` are finished."""

    with lock, warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)  # fail_stale_trials
        # ask() warns that heartbeats are meant for optimize(): this loop records them itself
        warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed to be used")
        for orphan in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            if HEARTBEAT_ATTR not in orphan.system_attrs:
                # RUNNING with no heartbeat ever (its worker died between ask and first beat, or an
                # older mmcse, or another tool): Optuna never fails such a trial, so give it one beat;
                # it goes stale GRACE_PERIOD s later unless its worker beats (a live older mmcse
                # worker does not: its trial is failed then, and its tell is skipped or errors).
                try:
                    rdb.set_trial_system_attr(orphan._trial_id, HEARTBEAT_ATTR, "adopted")
                except optuna.exceptions.UpdateFinishedTrialError:
                    continue  # finished meanwhile by a worker that does not take the lock
                rdb.record_heartbeat(orphan._trial_id)
        optuna.storages.fail_stale_trials(study)
        counted = study.get_trials(deepcopy=False, states=tuple(TrialState[name] for name in COUNTED_STATES))
        counted += [t for t in study.get_trials(deepcopy=False, states=(TrialState.FAIL,))
                    if DIVERGED_ATTR in t.user_attrs]
        finished = sum(t.state != TrialState.RUNNING for t in counted)
        if finished >= n_trials:
            return None
        if len(counted) >= n_trials:
            return WAIT
        trial = study.ask()  # takes an enqueued (WAITING) trial first, if any
        # first beat before the lock is released: no other worker sees this trial without one
        rdb.record_heartbeat(trial._trial_id)  # no public trial id; Optuna's _optimize uses it too
        rdb.set_trial_system_attr(trial._trial_id, HEARTBEAT_ATTR, "worker")
        return trial


def _run_trial(study: Any, rdb: Any, trial: Any, objective: Any, study_name: str, n_trials: int,
               say: Any = None) -> None:
    """``objective(trial)`` with heartbeats, told as Optuna's ``optimize`` tells it: PRUNED on
    ``TrialPruned``; FAIL and re-raised on any other exception or Ctrl-C."""

    state: TrialState | None = None
    value: float | None = None
    error: BaseException | None = None
    with _Heartbeat(rdb, trial._trial_id, HEARTBEAT_INTERVAL):
        try:
            value = objective(trial)
        except optuna.TrialPruned:
            state = TrialState.PRUNED
        except (Exception, KeyboardInterrupt) as err:
            state, error = TrialState.FAIL, err
            if isinstance(err, TrainingDiverged):
                trial.set_user_attr(DIVERGED_ATTR, str(err)[:500])
    # state None: COMPLETE, or FAIL if the value is None/NaN (as optimize); a trial another worker
    # failed as stale meanwhile (its heartbeats stopped) stays FAIL instead of raising here
    frozen = study.tell(trial, value if state is None else None, state=state, skip_if_finished=True)
    finished = len(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED)))
    try:
        best = study.best_trial
        best_text = f"best {best.value:.4g} (trial {best.number})"
    except ValueError:  # no complete trial yet
        best_text = "best -"
    shown = "-" if frozen.value is None else f"{frozen.value:.4g}"
    (say or _say)(f"[sweep {study_name}] trial {frozen.number} {frozen.state.name} value {shown} | {best_text} | "
                  f"{finished}/{n_trials} finished")
    if isinstance(error, TrainingDiverged):  # a failed trial, not a failed sweep
        (say or _say)(f"[sweep {study_name}] trial {frozen.number}: {error}; the study goes on")
    elif error is not None:
        if isinstance(error, KeyboardInterrupt) and frozen.state == TrialState.FAIL:
            # stopped, not failed: its parameters are asked again first (study.ask takes a WAITING trial first)
            waiting = study.get_trials(deepcopy=False, states=(TrialState.WAITING,))
            if not any(frozen.params in (w.params, w.system_attrs.get("fixed_params")) for w in waiting):
                study.enqueue_trial(frozen.params, user_attrs={REQUEUED_ATTR: frozen.number})
            (say or _say)(f"[sweep {study_name}] trial {frozen.number} stopped: its parameters are queued, and a "
                          f"rerun trains them first (the study still ends at {n_trials} finished trials)")
        raise error


def _say(message: str) -> None:
    # stderr: `mmcse sweep` prints its JSON summary on stdout; Prefect logs both (log_prints)
    print(message, file=sys.stderr, flush=True)


def trial_run_name(number: int) -> str:
    """The MLflow run name of sweep trial ``number`` (nested under its worker's ``sweep <study>`` run)."""
    return f"trial {number}"


def sweep_params(cfg: Config, study_name: str, n_trials: int, storage_url: str) -> dict[str, str]:
    """The sweep's settings as params of a worker's sweep run (the storage without its password)."""

    s = cfg.sweep
    return {
        "sweep.study_name": study_name,
        "sweep.n_trials": str(n_trials),
        "sweep.direction": s.direction,
        "sweep.storage": masked_url(storage_url)[:500],
        "sweep.space": json.dumps(s.space, sort_keys=True)[:6000],
        "sweep.pruner": f"median (startup {s.pruner_startup_trials} trials, warmup {s.pruner_warmup_steps} steps)",
    }


def progress_counts(study: Any, n_trials: int) -> tuple[int, int, float | None]:
    """(finished, n_trials, best): trials of ``study`` finished (COMPLETE or PRUNED, by any worker)
    and the best COMPLETE value in the study's direction (None before the first)."""

    finished = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED))
    values = [t.value for t in finished if t.state == TrialState.COMPLETE and t.value is not None]
    if not values:
        return len(finished), n_trials, None
    maximize = study.direction.name == "MAXIMIZE"
    return len(finished), n_trials, max(values) if maximize else min(values)


class SweepProgress:
    """A tqdm bar of one worker: trials finished / ``n_trials`` over every worker on the storage,
    the best value so far in its postfix. `refresh` reads the study; while the block runs a daemon
    thread also calls it every ``interval`` s, so other workers' trials move the bar during a long
    trial of this one. `write` prints a line above the bar. ``disable``: None shows the bar only
    when ``file`` is a terminal (tqdm's rule: no control characters in a log file)."""

    def __init__(self, study: Any, study_name: str, n_trials: int, interval: float | None = None,
                 file: Any = None, disable: bool | None = None) -> None:

        self._study, self._n_trials = study, n_trials
        self._interval = POLL_SECONDS if interval is None else interval
        self._file = file if file is not None else sys.stderr
        self.bar = tqdm(total=n_trials, desc=f"sweep {study_name}", unit="trial", file=self._file,
                        disable=disable, dynamic_ncols=True, leave=True)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, name=f"sweep-progress-{study_name}", daemon=True)
        self._disabled = bool(self.bar.disable)

    def refresh(self) -> tuple[int, int, float | None]:
        counts = progress_counts(self._study, self._n_trials)
        finished, _, best = counts
        with self._lock:
            self.bar.n = min(finished, self._n_trials)
            self.bar.set_postfix_str("best -" if best is None else f"best {best:.4g}", refresh=False)
            self.bar.refresh()
        return counts

    def write(self, message: str) -> None:
        if self._disabled:
            _say(message)
            return

        with self._lock:
            tqdm.write(message, file=self._file)

    def _poll(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self.refresh()
            except Exception as err:  # a storage hiccup must not end the sweep; the next poll retries
                self.write(f"progress: reading the study failed: {err!r}")

    def __enter__(self) -> SweepProgress:
        self.refresh()
        if not self._disabled:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        try:
            self.refresh()  # the final count
        except Exception:  # noqa: BLE001  the storage may be what failed; the bar still closes
            pass
        finally:
            self.bar.close()


class _Heartbeat:
    """A daemon thread recording the trial's heartbeat every ``interval`` s while the block
    runs (as Optuna's ``optimize`` does); a failed beat is reported and retried, not fatal."""

    def __init__(self, rdb: Any, trial_id: int, interval: float) -> None:
        self._rdb, self._trial_id, self._interval = rdb, trial_id, interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name=f"heartbeat-{trial_id}", daemon=True)

    def _beat(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self._rdb.record_heartbeat(self._trial_id)
            except Exception as err:  # a DB hiccup; GRACE_PERIOD covers a few missed beats
                print(f"heartbeat of trial id {self._trial_id} failed: {err!r}", file=sys.stderr, flush=True)

    def __enter__(self) -> _Heartbeat:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


class _AdvisoryLock:
    """A PostgreSQL session-level advisory lock, taken on a connection of its own (released by
    the server when that connection closes, so a killed worker never leaves it held)."""

    def __init__(self, url: str, key: int) -> None:
        self._engine = sqlalchemy.create_engine(url, poolclass=NullPool)  # close() really disconnects
        self._key = key
        self._conn: Any = None

    def __enter__(self) -> _AdvisoryLock:
        conn = self._engine.connect()
        try:
            conn.execute(sqlalchemy.text("SELECT pg_advisory_lock(:key)"), {"key": self._key})
            conn.commit()
        except BaseException:
            conn.close()
            raise
        self._conn = conn
        return self

    def __exit__(self, *exc: object) -> None:
        conn, self._conn = self._conn, None
        try:
            conn.execute(sqlalchemy.text("SELECT pg_advisory_unlock(:key)"), {"key": self._key})
            conn.commit()
        finally:
            conn.close()


def trial_lock(storage_url: str, study_name: str) -> AbstractContextManager[Any]:
    """The cross-process lock under which a worker counts the study's trials and creates one:
    SQLite: a file lock next to the database file; PostgreSQL: an advisory lock keyed by the
    study name; other databases: a file lock under ``mlruns/``, race-free among the workers of
    one host only (with a warning)."""

    url = sqlalchemy.engine.make_url(storage_url)
    backend = url.get_backend_name()
    if backend == "sqlite":
        if not url.database or url.database == ":memory:":
            return threading.Lock()  # an in-memory database lives in this process only
        return FileLock(f"{Path(url.database).resolve()}.lock")
    key = int.from_bytes(hashlib.blake2b(f"mmcse-sweep:{study_name}".encode(), digest_size=8).digest(), "big",
                         signed=True)  # pg_advisory_lock takes a bigint
    if backend == "postgresql":
        return _AdvisoryLock(storage_url, key)
    warnings.warn(
        f"sweep.storage {url.drivername}://...: no cross-host lock for this database; workers on "
        "different hosts may together run a few trials more than n_trials (use SQLite or PostgreSQL)",
        stacklevel=2,
    )
    at_home("mlruns").mkdir(exist_ok=True)
    return FileLock(str(at_home("mlruns") / f".sweep-{key & 0xFFFFFFFF:08x}.lock"))
