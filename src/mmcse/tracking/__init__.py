"""MLflow helpers: one experiment per method, the resolved config as params."""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import re
import socket
import sqlite3
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import mlflow
from mlflow.entities import Metric
from mlflow.exceptions import MlflowException

from mmcse.config import Config, to_dict
from mmcse.config.coercion import flatten
from mmcse.environment import TAG_PREFIX, describe, environment_tags
from mmcse.errors import StageError
from mmcse.integrity.code import TRAINING_CODE, code_digest, code_files, source_state
from mmcse.io import at_home, ensure_sqlite_parent

# which run holds a folder's record: mlflow-free (`mmcse.records`), named here too for the callers of this module;
# the tags runs are read back by live beside the store's mlflow-free reader (`mmcse.runstore`), named here too
from mmcse.records import (  # noqa: F401
    RUN_RECORDS,
    folder_key,
    folder_run_id,
    note_run,
    remember_run,
    remembered_run,
)
from mmcse.runstore import (  # noqa: F401
    CHANGED_TAG,
    CODE_TAG,
    COMMIT_TAG,
    DIRTY_TAG,
    SEED_FREE_TAG,
    SEED_TAG,
    STAND_IN_TAG,
    TRAIN_MINUTES,
    VARIANT_TAG,
)

# Tags added to every run started (not resumed) inside `tagged(...)`: where a job ran
# (device, CUDA_VISIBLE_DEVICES, Prefect flow run) reaches the runs that library code starts.
_EXTRA_TAGS: contextvars.ContextVar[dict[str, str] | None] = contextvars.ContextVar("mmcse_extra_tags", default=None)


def configure(cfg: Config) -> None:
    """Point MLflow at the configured store (a relative SQLite path is under the project, `mmcse.io.at_home`),
    checked first (`check_store`: a damaged SQLite file is one line, not SQLAlchemy's traceback)."""

    uri = ensure_sqlite_parent(cfg.base.mlflow_tracking_uri)
    check_store(uri)
    mlflow.set_tracking_uri(uri)
    # Quiet MLflow's own console chatter in stage logs.
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")


_CHECKED_STORES: dict[tuple[str, int, int], None] = {}


def check_store(uri: str) -> None:
    """A SQLite tracking store that exists must be a whole database: ``PRAGMA quick_check`` once per
    process and file version; a damaged one is a `mmcse.errors.StageError` naming the file and what to
    do (a locked one is not damaged: it is waited for where runs are written, `retry_locked`)."""

    if not uri.startswith("sqlite:///"):
        return
    path = Path(uri[len("sqlite:///"):].split("?")[0])
    if not path.is_file():
        return  # MLflow creates it
    st = path.stat()
    key = (str(path), st.st_size, st.st_mtime_ns)
    if key in _CHECKED_STORES:
        return
    problem = None
    try:
        with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=30)) as db:
            found = db.execute("PRAGMA quick_check").fetchone()
            if not found or found[0] != "ok":
                problem = str(found[0] if found else "no answer")
            elif st.st_size and not db.execute("SELECT name FROM sqlite_master WHERE type='table'").fetchall():
                problem = "not an MLflow database (no tables)"
    except sqlite3.DatabaseError as err:
        if "locked" in str(err) or "busy" in str(err):
            return
        problem = str(err)
    if problem is not None:
        raise StageError(f"{path}: the MLflow tracking store is damaged ({problem}); move it aside (mv {path} "
                         f"{path}.damaged) and rerun to start a new store, or put back a backup of it")
    _CHECKED_STORES[key] = None


STORE_RETRY_SECONDS = 300.0  # how long a write waits for a locked store (MMCSE_STORE_RETRY_SECONDS)


def _locked(err: BaseException) -> bool:
    text = str(err).lower()
    return "database is locked" in text or "database is busy" in text or "database table is locked" in text


def retry_locked(write: Any, what: str = "write") -> Any:
    """``write()``, retried with backoff (1, 2, 4 … 15 s between attempts) while the tracking store is
    locked by another process, for ``MMCSE_STORE_RETRY_SECONDS`` (default 300) at most; then a
    `mmcse.errors.StageError` in one line. Other errors pass through."""

    limit = float(os.environ.get("MMCSE_STORE_RETRY_SECONDS", STORE_RETRY_SECONDS))
    started, pause = time.monotonic(), 1.0
    while True:
        try:
            return write()
        except Exception as err:
            if not _locked(err):
                raise
            waited = time.monotonic() - started  # each attempt itself waits SQLite's busy timeout (MLflow: 20 s)
            if waited >= limit:

                raise StageError(f"{mlflow.get_tracking_uri()}: the MLflow tracking store stayed locked for "
                                 f"{waited:.0f} s while this run's {what} waited (another process holds it: an "
                                 "`mlflow ui` or a second training on a SQLite store); stop it or use a server "
                                 "store, then rerun") from None
            time.sleep(min(pause, max(limit - waited, 0.1)))
            pause = min(pause * 2, 15.0)


# The MLflow 3 UI shows an experiment as "GenAI apps & agents" (Traces overview) or as model training
# (runs table, metrics, charts). Its bundle (mlflow 3.17.2, server/js) has two ways to choose:
# - the experiment tag below (values genai_development | custom_model_development; an untagged
#   experiment gets a kind inferred, and saved, by the UI), read while the sidebar switch is off;
# - with the sidebar switch ("GenAI" / "Model training", the 3.17 default): the ``workflowType`` URL
#   query parameter (genai | machine_learning), else the switch's choice kept in the browser
#   (localStorage ``mlflow.workflowType``, default genai); the tag is not read then.
# mmcse tags every experiment it creates or uses, and `ui_url` adds the parameter.
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
EXPERIMENT_KIND = "custom_model_development"
WORKFLOW_TYPE = "machine_learning"


def ui_url(base: str, experiment_id: str | None = None) -> str:
    """The MLflow UI address ``base`` (``http://host:port``) opening the experiments list, or
    experiment ``experiment_id``, in the model-training ("Machine learning") view, its runs table
    showing the headline columns (`HEADLINE_VIEW`, `mmcse.analysis.views`)."""
    if experiment_id is None:
        return f"{base.rstrip('/')}/#/experiments?workflowType={WORKFLOW_TYPE}"
    return (f"{base.rstrip('/')}/#/experiments/{experiment_id}/runs?workflowType={WORKFLOW_TYPE}"
            f"&{VIEW_SHARE_PARAM}={HEADLINE_VIEW}")


# The runs table of MLflow 3.17's UI shows Run Name / Created / Dataset / Duration / Source / Models
# by default (server/js: the UI state's ``selectedColumns``), no score. What it offers instead of
# configuring by hand is a shared view: an experiment tag ``mlflow.sharedViewState.<key>`` holding
# the view's state as JSON (selected columns, sort), opened by ``?viewStateShareKey=<key>``; the
# user can keep it as their own view from its banner. mmcse writes one, `HEADLINE_VIEW`, per
# experiment from the scores its runs hold (`mmcse.analysis.views`), and `ui_url` opens it.
VIEW_SHARE_PARAM = "viewStateShareKey"
SHARED_VIEW_TAG = "mlflow.sharedViewState."
HEADLINE_VIEW = "mmcse-headline"
def experiment_urls(cfg: Config, base: str) -> dict[str, str]:
    """``{name: ui_url}`` of every experiment ``<prefix>-*`` in the configured store, each tagged as
    model training on the way (experiments made before mmcse tagged them). The list page of MLflow
    3.17 links an experiment without ``workflowType``: these links keep the training view."""

    configure(cfg)
    found = mlflow.search_experiments(filter_string=f"name LIKE '{cfg.base.experiment_prefix}-%'",
                                      order_by=["name ASC"])
    for exp in found:
        mark_model_training(exp.experiment_id, exp.tags)
    return {exp.name: ui_url(base, exp.experiment_id) for exp in found}


def latest_ablation_url(cfg: Config, base: str) -> str | None:
    """The UI address of the newest ablation's parent run (``ablation <preset>`` in
    ``<prefix>-ablate``, whose page starts with the variants' headline table), or None."""

    configure(cfg)
    found = mlflow.get_experiment_by_name(f"{cfg.base.experiment_prefix}-ablate")
    if found is None:
        return None
    runs = mlflow.MlflowClient().search_runs(
        [found.experiment_id], "tags.mlflow.runName LIKE 'ablation %'", order_by=["attributes.start_time DESC"],
        max_results=1)
    if not runs:
        return None
    return (f"{base.rstrip('/')}/#/experiments/{found.experiment_id}/runs/{runs[0].info.run_id}"
            f"?workflowType={WORKFLOW_TYPE}")


DESCRIPTION_TAG = "mlflow.note.content"  # what the MLflow UI shows as an experiment's (a run's, a model's) description
DESCRIPTION_LIMIT = 8000  # characters: MLflow's limit on a run tag's value


def run_description(markdown: str, rest: str, limit: int = DESCRIPTION_LIMIT) -> str:
    """Markdown as a run's (or a model's) description: whole lines up to ``limit`` characters, and a last line
    saying where ``rest`` is (e.g. "the whole table is the run's artifact ablation.md") when it had to be cut."""
    if len(markdown) <= limit:
        return markdown
    tail = f"\n\n(cut here: {rest})\n"
    kept = markdown[: limit - len(tail)]
    return kept[: kept.rfind("\n") + 1] + tail

EXPERIMENT_DESCRIPTIONS = {
    "ablate": "Ablation tables (DVC stage ablate, Prefect flow ablations). One parent run per ablation, "
              "named `ablation <preset>`: the table (ablation_table.md / .json), each variant's mean, std and "
              "seeds as metrics `<variant>/<score>_mean|_std|seeds`, the comparison figure (figures/ablation.png: "
              "the headline scores per variant) and the paper figures its preset asks for. Each variant x seed is "
              "a nested run `<variant>-seed<seed>` (tags ablation.variant, ablation.seed) with its training "
              "curves and `test_*` scores.",
    "sweep": "Optuna sweeps (mmcse sweep, Prefect flow sweep). One run per worker, named `sweep <study>`, "
             "with trials_finished and best_value; each trial is a nested run `trial <n>` whose value is its best "
             "dev score (val rsum for duet / vsepp / vsrn), and its best checkpoint the logged model `trial-<n>` "
             "(the drawn params, the best dev score; tags optuna.study, optuna.trial_number).",
    "figures": "Figures comparing finished runs (mmcse figures), logged when no parent run is named.",
}


def experiment_description(name: str) -> str:
    """The description of experiment ``<prefix>-<name>``: the ablate / sweep / figures record, or a
    train stage experiment (``name`` = the method)."""
    return EXPERIMENT_DESCRIPTIONS.get(name, (
        f"Trainings of train.method {name} (DVC stages train + evaluate). One run per training, named "
        f"`{name}-seed<seed>`: params (the whole config), the dev score at each dev evaluation (dev_sts, or "
        "dev_rsum for duet / vsepp / vsrn), loss terms `loss/*`, `best_dev_*` at the end, the test scores `test_*` "
        "(the keys of metrics/eval.json), figures and the environment (`env.*` tags). A resumed training "
        "continues its run (mmcse.resumed_from_step); a restart from step 0 opens a new one "
        "(mmcse.restarted_from_run)."))


def mark_model_training(experiment_id: str, tags: dict[str, str] | None = None, name: str | None = None) -> None:
    """Tag experiment ``experiment_id`` as model training (`EXPERIMENT_KIND_TAG`) unless it already
    is, and give it its description (`experiment_description` of ``name``) when it has none;
    ``tags``: its current tags when known (saves a request)."""

    client = mlflow.MlflowClient()
    if tags is None:
        tags = client.get_experiment(experiment_id).tags
    if tags.get(EXPERIMENT_KIND_TAG) != EXPERIMENT_KIND:
        client.set_experiment_tag(experiment_id, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND)
    if name is not None and not tags.get(DESCRIPTION_TAG):
        client.set_experiment_tag(experiment_id, DESCRIPTION_TAG, experiment_description(name))


def experiment(cfg: Config, name: str) -> str:
    """Create (or find) experiment ``<prefix>-<name>`` with artifacts under ``mlruns/artifacts``,
    tagged as model training (`EXPERIMENT_KIND_TAG`) and described (`experiment_description`); an
    existing experiment gets the tag, and the description when it has none."""

    configure(cfg)
    full = f"{cfg.base.experiment_prefix}-{name}"
    found = mlflow.get_experiment_by_name(full)
    if found is not None:
        mark_model_training(found.experiment_id, found.tags, name)
        return found.experiment_id
    kind = {EXPERIMENT_KIND_TAG: EXPERIMENT_KIND, DESCRIPTION_TAG: experiment_description(name)}
    artifacts = at_home("mlruns") / "artifacts"  # the project's, also from a DVC experiment's copy
    if cfg.base.mlflow_tracking_uri.startswith("sqlite:///mlruns/"):
        artifacts.mkdir(parents=True, exist_ok=True)
        try:
            return mlflow.create_experiment(full, artifact_location=artifacts.resolve().as_uri(), tags=kind)
        except Exception:  # created concurrently by another worker
            found = mlflow.get_experiment_by_name(full)
            if found is None:
                raise
            mark_model_training(found.experiment_id, found.tags, name)
            return found.experiment_id
    return mlflow.create_experiment(full, tags=kind)


def log_config(cfg: Config, replaced: Mapping[str, str] | None = None) -> None:
    """``cfg``'s every dotted key as a param of the active run, those of ``replaced`` with its values instead (an
    ablation's parent run: `mmcse.experiments.jobs.table_params`)."""
    params = {k: str(v)[:500] for k, v in flatten(to_dict(cfg)).items()}
    params.update({key: value[:500] for key, value in (replaced or {}).items() if key in params})
    items = list(params.items())
    for start in range(0, len(items), 90):  # MLflow caps params per batch
        mlflow.log_params(dict(items[start : start + 90]))


@contextlib.contextmanager
def tagged(tags: dict[str, str]) -> Iterator[None]:
    """Add ``tags`` to every MLflow run started by `run` inside this block (nested blocks merge)."""
    token = _EXTRA_TAGS.set({**(_EXTRA_TAGS.get() or {}), **{k: str(v) for k, v in tags.items()}})
    try:
        yield
    finally:
        _EXTRA_TAGS.reset(token)


def extra_tags() -> dict[str, str]:
    """The tags `tagged` blocks around this point add to a run (a job started in other processes takes them)."""
    return dict(_EXTRA_TAGS.get() or {})


JOB_TAG = "mmcse.job"  # what a run computes into (its output folder): runs of one job share it
EVAL_MINUTES = "eval_minutes"  # wall-clock minutes of a checkpoint's test evaluation, on its training run
def existing_run(run_id: str | None) -> str | None:
    """``run_id`` if the tracking store holds it and it is not deleted (a resume point may name a
    run of another store, or one a user deleted: then a new run starts)."""

    if not run_id:
        return None
    try:
        found = mlflow.MlflowClient().get_run(run_id)
    except MlflowException:
        return None
    return run_id if found.info.lifecycle_stage == "active" else None


def supersede_run(run_id: str | None, new_run_id: str, reason: str) -> None:
    """Close the record of a training that restarts from step 0 in a new run ``new_run_id``: the
    old run (if the store still holds it) is tagged with the reason and its successor, and ends
    KILLED when it was left RUNNING (a killed process); a FINISHED or FAILED run keeps its status."""

    if existing_run(run_id) is None or run_id == new_run_id:
        return
    client = mlflow.MlflowClient()
    client.set_tag(run_id, "mmcse.superseded_by", new_run_id)
    client.set_tag(run_id, "mmcse.superseded_reason", reason[:500])
    if client.get_run(run_id).info.status == "RUNNING":
        client.set_terminated(run_id, status="KILLED")


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def end_stale_runs(experiment_id: str, job: str, keep: str | None = None) -> list[str]:
    """Mark KILLED the runs of ``job`` left RUNNING by a process that died without ending them
    (kill -9, power loss): same host, process gone. Runs of a live process, or of another host
    (whose processes cannot be checked from here), are left as they are. Returns the ids ended."""

    client = mlflow.MlflowClient()
    host = socket.gethostname()
    runs = client.search_runs(
        [experiment_id], filter_string=f"tags.`{JOB_TAG}` = '{job}' and attributes.status = 'RUNNING'",
        max_results=1000,
    )
    ended = []
    for r in runs:
        pid = r.data.tags.get("mmcse.pid", "")
        if r.info.run_id == keep or r.data.tags.get("mmcse.host") != host or not pid.isdigit():
            continue
        if int(pid) != os.getpid() and not _process_alive(int(pid)):
            client.set_tag(r.info.run_id, "mmcse.ended_by", f"next run of the job (process {pid} was gone)")
            client.set_terminated(r.info.run_id, "KILLED")
            ended.append(r.info.run_id)
    return ended




def provenance_tags() -> dict[str, str]:
    """What code made a run, beside MLflow's own source tags: the commit, whether the checkout's code differed
    from it and which files (`mmcse.integrity.code.source_state`), and the digest of the training code this
    process imported (`code_digest`: the same code gives the same digest, committed or not)."""
    state = source_state()
    tags = {COMMIT_TAG: state["commit"], DIRTY_TAG: {True: "true", False: "false", None: "unknown"}[state["dirty"]],
            CODE_TAG: code_digest(code_files(TRAINING_CODE))[:16]}
    if state["changed"]:
        tags[CHANGED_TAG] = ", ".join(state["changed"])[:5000]
    return tags


@contextlib.contextmanager
def run(
    cfg: Config,
    experiment_name: str,
    run_name: str | None = None,
    run_id: str | None = None,
    parent_run_id: str | None = None,
    tags: dict[str, str] | None = None,
    job: str | None = None,
    system_metrics: bool = False,
) -> Iterator[Any]:
    """An MLflow run in experiment ``<prefix>-<experiment_name>``, or run ``run_id`` continued.

    A new run is tagged with the environment it computes in (`mmcse.environment.environment_tags`:
    ``env.python|torch|cuda|cudnn|transformers|numpy|device|lock_sha256|locked|hash``); a continued
    one whose environment changed gets ``env.resumed_under`` (`note_resumed_environment`).

    ``job`` (e.g. the output folder) names what the run computes: the run is tagged with it,
    the host and this process id, and runs of the same job left RUNNING by a dead process are
    marked KILLED first (`end_stale_runs`). The run ends FINISHED, or with the status the
    exception that leaves the block names (``mlflow_status``; Ctrl-C: KILLED; else FAILED).

    ``system_metrics``: MLflow samples the machine while the run is open (``system/*``: CPU, memory, disk,
    network, and each GPU's utilisation and memory through NVML) every 10 s (MLflow's default;
    ``MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL`` sets another): a host-bound training run shows as one."""

    exp_id = experiment(cfg, experiment_name)
    extra = _EXTRA_TAGS.get()
    if run_id is None and extra:  # a resumed run keeps the tags it was started with
        tags = {**extra, **(tags or {})}
    env = environment_tags(cfg.base.device)
    if run_id is None:
        tags = {**env, **provenance_tags(), **(tags or {})}
    if job is not None:
        tags = {**(tags or {}), JOB_TAG: job, "mmcse.host": socket.gethostname(), "mmcse.pid": str(os.getpid())}
        end_stale_runs(exp_id, job, keep=run_id)
    if system_metrics:  # its start/stop lines are MLflow's business, not the run's output
        logging.getLogger("mlflow.system_metrics").setLevel(logging.WARNING)
    active = mlflow.start_run(
        run_id=run_id,
        experiment_id=None if run_id else exp_id,
        run_name=run_name,
        parent_run_id=parent_run_id,
        nested=parent_run_id is not None or mlflow.active_run() is not None,
        tags=tags,
        log_system_metrics=system_metrics,
    )
    if run_id is not None:
        note_resumed_environment(run_id, env)
        retire_end_reason(run_id)
    try:
        yield active
    except BaseException as err:
        # An exception may say how the run ended (`mlflow_status`): a pruned sweep trial
        # stopped as planned and is FINISHED, not FAILED; Ctrl-C is KILLED.
        default = "KILLED" if isinstance(err, (KeyboardInterrupt, SystemExit)) else "FAILED"
        status = getattr(err, "mlflow_status", default)
        # the store may be what failed: the error is the one to report, and the run is always left (MLflow
        # pops it before writing its status; one the store refused stays RUNNING until the job's next run)
        if status != "FINISHED":  # the record says why, in one line
            with contextlib.suppress(Exception):
                mlflow.set_tag(END_REASON_TAG, end_reason(err))
        with contextlib.suppress(Exception):
            mlflow.end_run(status)
        raise
    mlflow.end_run("FINISHED")


END_REASON_TAG = "mmcse.end_reason"  # why a run ended FAILED or KILLED


def end_reason(err: BaseException) -> str:
    """One line saying why a run ended early: the error's own message (first line), or the signal."""
    if isinstance(err, KeyboardInterrupt):  # Ctrl-C, or `mmcse.stopping.StopRequested` with what it kept
        return (str(err).strip().splitlines() or ["interrupted (Ctrl-C / SIGINT)"])[0][:500]
    if isinstance(err, SystemExit):
        return f"stopped (exit {err.code})" if not isinstance(err.code, str) else f"stopped: {err.code}"
    text = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return f"{type(err).__name__}: {text}"[:500]


EARLIER_END_TAG = "mmcse.end_reason.earlier"  # why earlier attempts of a continued run ended, oldest first


def retire_end_reason(run_id: str) -> None:
    """A continued run's tags describe its last attempt: why an earlier attempt ended (``mmcse.end_reason``)
    moves to ``mmcse.end_reason.earlier``, so a run resumed to FINISHED does not still say it failed."""
    client = mlflow.MlflowClient()
    tags = client.get_run(run_id).data.tags
    if END_REASON_TAG in tags:
        earlier = "; ".join(x for x in (tags.get(EARLIER_END_TAG), tags[END_REASON_TAG]) if x)
        client.set_tag(run_id, EARLIER_END_TAG, earlier[-5000:])
        client.delete_tag(run_id, END_REASON_TAG)


RESUMED_ENV_TAG = "env.resumed_under"


def note_resumed_environment(run_id: str, env: dict[str, str]) -> None:
    """A run continued under another environment than it started in (``env.hash`` differs) gets the
    tag ``env.resumed_under``: the new environment, described, so its numbers are not taken for one
    environment's."""

    started = mlflow.MlflowClient().get_run(run_id).data.tags
    now = {k[len(TAG_PREFIX):]: v for k, v in env.items()}
    if started.get(f"{TAG_PREFIX}hash") not in (None, now["hash"]):
        mlflow.MlflowClient().set_tag(run_id, RESUMED_ENV_TAG, describe(now)[:500])


def metric_name(key: str) -> str:
    """A name as MLflow accepts it (alphanumerics, ``_ - . / :`` and spaces). Score keys already
    are (`mmcse.evaluation.names`: ``i2t_R1``, the same key in metrics/*.json); a name written the
    conventional way (``i2t_R@1``) gets that same mapping, anything else MLflow refuses is dropped."""
    return re.sub(r"[^A-Za-z0-9_\-./: ]", "", key.replace("@", ""))


def log_metrics(metrics: dict[str, float], step: int | None = None) -> None:
    mlflow.log_metrics({k: float(v) for k, v in metrics.items()}, step=step)


REUSED_TAG = "mmcse.reused_run"  # on a reuse record: the run whose finished result a job took again


def record_reuse(parent_run_id: str, name: str, reused_run_id: str | None, tags: dict[str, str]) -> str:
    """A job an ablation took from an earlier run (finished with the same configuration) as a short FINISHED run
    ``reused: <name>`` under ``parent_run_id``, tagged ``tags`` (the Prefect flow run that reused it) and the run it
    reused: MLflow says what this ablation run did with the job, while the scores stay the earlier run's (it
    carries no row or seed tag, so no table or report counts it twice). Returns its run id."""
    client = mlflow.MlflowClient()
    parent = client.get_run(parent_run_id)
    note = (f"{name}: finished before with the same configuration; reused, not trained again (its run: "
            f"{reused_run_id or 'not recorded'})")
    run = client.create_run(parent.info.experiment_id, run_name=f"reused: {name}", tags={
        "mlflow.parentRunId": parent_run_id, DESCRIPTION_TAG: note,
        **({REUSED_TAG: reused_run_id} if reused_run_id else {}), **tags})
    client.set_terminated(run.info.run_id, "FINISHED")
    return run.info.run_id


def prefect_tags() -> dict[str, str]:
    """The Prefect flow run this process works for and the worker that started it (tags
    ``prefect.flow_run_id``, ``prefect.flow_run``, ``prefect.worker``); empty outside Prefect."""
    from prefect.runtime import flow_run

    tags: dict[str, str] = {}
    if flow_run.id:
        tags["prefect.flow_run_id"] = str(flow_run.id)
        tags["prefect.flow_run"] = str(flow_run.name)
    if os.environ.get("PREFECT__WORKER_NAME"):  # set by a Prefect worker for the flow runs it starts
        tags["prefect.worker"] = os.environ["PREFECT__WORKER_NAME"]
    return tags


def log_metric_steps(entries: list[tuple[dict[str, float], int]]) -> None:
    """Log many steps' metrics into the active run in one request per 1000 values (MLflow's
    batch limit) instead of one per step: training hands over its buffered values this way."""

    active = mlflow.active_run()
    if active is None:
        raise RuntimeError("log_metric_steps needs an active MLflow run")
    now = int(time.time() * 1000)
    metrics = [Metric(key, float(value), now, step) for values, step in entries for key, value in values.items()]
    client = mlflow.MlflowClient()
    for start in range(0, len(metrics), 1000):
        batch = metrics[start : start + 1000]
        retry_locked(lambda batch=batch: client.log_batch(active.info.run_id, metrics=batch), "metrics")
