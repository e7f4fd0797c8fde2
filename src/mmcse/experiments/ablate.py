"""Ablations: variants × seeds, each a train + evaluate run, aggregated into one table.

A job's result is written atomically to ``<out>/<variant>/seed<k>/result.json``; a rerun
skips jobs whose result exists for the same configuration, so an interrupted ablation
resumes. Once the result is written the job's resume weights are released (its best
checkpoint and history stay), so a long ablation does not fill the disk or the DVC cache
with optimizer states. Failed jobs are kept in the table as failed, never dropped.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mmcse import tracking
from mmcse.config import Config
from mmcse.config.readings import encoder_of, reading_tags, row_reading
from mmcse.environment import environment
from mmcse.errors import InputError
from mmcse.experiments.estimate import estimate
from mmcse.experiments.jobs import (
    Job,
    expand,
    job_config,
    job_hash,
    job_identity,
    job_run_name,
    seed_free,
)
from mmcse.experiments.params import preset_row_keys
from mmcse.experiments.recipes import script_points
from mmcse.experiments.stand_ins import paper_stand_ins
from mmcse.experiments.upstream import resolve_on_record
from mmcse.integrity.code import EVALUATION_CODE, code_digest, code_files
from mmcse.io import build_dir, read_json, swap_in_dir, write_json
from mmcse.models.device import device_tags
from mmcse.pipeline.evaluate import EvalOutputs, TrainedOn, require_trained_with, run_evaluate
from mmcse.pipeline.paths import Paths
from mmcse.pipeline.train import JobArtifacts, RunNames, run_train
from mmcse.pipeline.train_processes import run_train_on_processes
from mmcse.tracking import remember_run, remembered_run
from mmcse.training.checkpoints import release_resume_point
from mmcse.training.engine import Hooks
from mmcse.training.launch import needs_launch


def finished_result(folder: Path, config_hash: str, store: Path | None = None) -> dict[str, Any] | None:
    """The result of a job finished in ``folder`` with ``config_hash`` (None: none), its MLflow run
    from the folder's run record (`mmcse.tracking.remembered_run`; result.json holds no run id). With
    ``store`` (`mmcse.pipeline.paths.Paths.jobs`), a job finished before but gone from ``folder`` (an
    interrupted `dvc exp run` restores ablation/ from its commit) is put back from the store first."""

    if store is not None and _own_result(folder, config_hash) is None:
        restore_finished(store, config_hash, folder)
    result = _own_result(folder, config_hash)
    if result is not None:
        record = remembered_run(folder)
        return result | ({"run_id": record["run_id"]} if record else {})
    return None


def _own_result(folder: Path, config_hash: str) -> dict[str, Any] | None:
    result = _finished(folder)
    return result if result is not None and result["config_hash"] == config_hash else None


def _finished(folder: Path) -> dict[str, Any] | None:
    """The result of the job finished in ``folder``, whatever its configuration (None: none, or a failed or
    damaged one: the job is trained again)."""
    try:
        result = read_json(folder / "result.json")
    except (OSError, ValueError):
        return None
    ok = isinstance(result, dict) and result.get("status") == "ok" and isinstance(result.get("config_hash"), str)
    return result if ok else None


def _link_tree(source: Path, dest: Path) -> None:
    """``dest`` as a copy of ``source`` (hard links where the filesystem allows: a job's best checkpoint
    is not duplicated), built beside and renamed into place."""

    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = build_dir(dest.parent, prefix=f".{dest.name}.")

    def link(src: str, dst: str) -> None:
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)

    try:
        shutil.copytree(source, tmp, copy_function=link, dirs_exist_ok=True)
        swap_in_dir(tmp, dest)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def keep_finished(folder: Path, config_hash: str, store: Path) -> None:
    """Keep the finished job in ``folder`` (result, summary, best checkpoint, history) in ``store`` under
    its configuration hash, outside every DVC output."""
    _link_tree(folder, store / config_hash)


def restore_finished(store: Path, config_hash: str, folder: Path) -> bool:
    """Put a job finished with ``config_hash`` back into ``folder`` from ``store``; False: none kept."""
    kept = store / config_hash
    if _own_result(kept, config_hash) is None:
        return False
    _link_tree(kept, folder)
    print(f"{folder}: restored from {kept} (finished before with this configuration)", flush=True)
    return True


def _write_result(folder: Path, result: dict[str, Any]) -> None:
    """result.json without the run id (random: the ablation folder is a DVC output), which goes to
    the folder's run record instead."""

    if result.get("run_id"):
        remember_run(folder, result["run_id"])
    write_json(folder / "result.json", {k: v for k, v in result.items() if k not in ("skipped", "run_id")})


# The version of the scores' names (`mmcse.evaluation.names`) a job's result.json holds: 2 = one key
# per number (R@K keyed RK, one STS task reported once as avg). A finished job recorded under older
# names is evaluated again (`rescore`), not trained again, so one table never mixes two namings.
SCORE_NAMES = 2


def _evaluate(job_cfg: Config, folder: Path, summary: dict[str, Any], run_id: str | None) -> dict[str, float]:
    """The test scores of the job's best checkpoint on the artifacts its training used (``summary``);
    a checkpoint that is damaged or not the job's configuration's is refused (`require_trained_with`)."""

    require_trained_with(job_cfg, folder / "best")
    trained_on = TrainedOn(Path(summary["data_dir"]), Path(summary["teacher_manifest"]),
                           tuple(Path(d) for d in summary["teacher_dirs"]),
                           {k: Path(v) for k, v in summary.get("region_sets", {}).items()})
    # mteb's results: DALR Table 5's rows
    outputs = EvalOutputs(run_id, "ablate", mteb_dir=folder / "mteb" if job_cfg.evaluate.mteb else None)
    return run_evaluate(job_cfg, Paths.of(job_cfg), folder / "best", outputs, trained_on,
                        transfer=job_cfg.ablate.transfer)


def evaluation_code() -> str:
    """The digest of the library code that scores a job (`mmcse.integrity.code.EVALUATION_CODE`)."""
    return code_digest(code_files(EVALUATION_CODE))


def rescore(job_cfg: Config, folder: Path, result: dict[str, Any]) -> dict[str, Any] | None:
    """A finished job whose result.json predates `SCORE_NAMES`, or whose scores were computed by
    evaluation code edited since: its best checkpoint evaluated again (into its MLflow run, when the run
    is still known) and the result rewritten with today's names and code; None (train it again) when
    its checkpoint or training summary is gone."""
    summary_file = folder / "summary.json"
    if not (folder / "best").is_dir() or not summary_file.is_file():
        return None

    try:
        require_trained_with(job_cfg, folder / "best")
    except ValueError as err:  # damaged, unsealed or another configuration's: trained again
        print(f"{result['variant']} seed={result['seed']}: {err}", flush=True)
        return None
    why = ("recorded under older score names" if result.get("score_names") != SCORE_NAMES
           else "scored by evaluation code edited since")
    print(f"{result['variant']} seed={result['seed']}: {why}; evaluating its checkpoint again (not retraining)",
          flush=True)
    scores = _evaluate(job_cfg, folder, read_json(summary_file), result.get("run_id"))
    rescored = {**result, "scores": scores, "score_names": SCORE_NAMES, "evaluation_code": evaluation_code()}
    _write_result(folder, rescored)
    return rescored


def run_job(
    cfg: Config,
    job: Job,
    root: Path,
    parent_run_id: str | None = None,
    tags: dict[str, str] | None = None,
    expected_hash: str | None = None,
) -> dict[str, Any]:
    """Train + evaluate one job (skipped when already finished); returns its result.

    The job's MLflow run is tagged with the device ``base.device`` resolves to in this process
    (`mmcse.models.device.device_tags`: device, cuda_visible_devices, host) and ``tags`` (e.g. the
    Prefect flow run). ``expected_hash``, from the process that submitted the job, guards a
    worker whose params.yaml differs from the submitter's. The job trains and evaluates on the
    upstream artifacts of its own configuration (`mmcse.experiments.upstream.resolve_on_record`: computed here when
    no job made them yet); their keys are in its result and tagged on its MLflow run."""

    job_cfg = job_config(cfg, job)
    folder = job.folder(root)
    config_hash = job_hash(job_cfg, cfg.base.seed)
    if expected_hash is not None and expected_hash != config_hash:
        raise InputError(
            f"params.yaml: job {job.variant!r} seed {job.seed} resolves to config hash {config_hash[:12]} here but "
            f"{expected_hash[:12]} where it was submitted: the worker's checkout differs (params.yaml or the "
            "library code; sync the checkout)"
        )
    paths = Paths.of(job_cfg)
    done = finished_result(folder, config_hash, paths.jobs)
    stale_scores = done is not None and (done.get("score_names") != SCORE_NAMES
                                         or done.get("evaluation_code") != evaluation_code())
    if stale_scores:
        done = rescore(job_cfg, folder, done)
    if done is not None:
        if parent_run_id is not None:  # this ablation's record says so, under the flow run that reused it
            tracking.record_reuse(parent_run_id, job_run_name(job), done.get("run_id"), tags or {})
        return done | {"skipped": True}
    where = device_tags(job_cfg.base.device)
    # the job's row and seed on its run: `mmcse.experiments.report` reads each row's training minutes
    # (and marks a row trained with allowed stand-in teachers under a paper profile)
    stood_in = paper_stand_ins(job_cfg)
    # per point where its paper and its authors' code differ, the reading the row follows (mmcse report marks it)
    reading = row_reading(tracking.flatten(job_identity(job_cfg)), encoder_of(job_cfg.model.name_or_path),
                          own=preset_row_keys(cfg, job.variant),
                          extra=script_points(Path("."), cfg.base.profile, job_cfg.train.method, job_cfg.data.pairs))
    with tracking.tagged({**where, **(tags or {}), tracking.VARIANT_TAG: job.variant,
                          tracking.SEED_TAG: str(job.seed), **reading_tags(cfg.ablate.reading, reading),
                          **({tracking.STAND_IN_TAG: "; ".join(stood_in)} if stood_in else {}),
                          **({tracking.SEED_FREE_TAG: "true"} if seed_free(job_cfg) else {})}):
        # found or computed before the job trains (a failure leaves the job's run FAILED)
        upstream = resolve_on_record(job_cfg, paths, cfg.base.seed, "ablate", job_run_name(job), parent_run_id)
        # several processes (train.devices: 2, or auto on a worker that sees several GPUs): torchrun starts them
        train_job = run_train_on_processes if needs_launch(job_cfg.train, job_cfg.base.device) else run_train
        summary = train_job(job_cfg, paths, folder, RunNames("ablate", job_run_name(job), parent_run_id),
                            Hooks(progress=False), JobArtifacts(cfg.base.seed, upstream))
    scores = _evaluate(job_cfg, folder, summary, summary["run_id"])
    result = {
        "variant": job.variant,
        "seed": job.seed,
        "status": "ok",
        "config_hash": config_hash,
        "run_id": summary["run_id"],
        "device": where["device"],
        "best_dev": summary["best_dev"],
        "dev_metric": summary["dev_metric"],
        "artifacts": summary["artifacts"],
        "environment": environment(job_cfg.base.device),
        "scores": scores,
        "score_names": SCORE_NAMES,
        "evaluation_code": evaluation_code(),
    }
    _write_result(folder, result)
    release_resume_point(folder)  # the result is recorded: a rerun skips this job
    keep_finished(folder, config_hash, paths.jobs)  # beside the DVC output too: an interrupted `dvc exp run` keeps it
    return result


def prune_other_tables(root: Path, jobs: Sequence[Job], store: Path) -> list[str]:
    """Remove from ``root`` (the ablation folder, a DVC output) the job folders no job of this table owns, so
    the output, and dvc.lock, hold this table alone whatever tables ran there before. A finished one is kept in
    ``store`` first (`keep_finished`: its table, run again, restores it); one that holds no finished result (an
    interrupted job's resume point) stays: returns a line naming each such folder."""

    owned = {job.folder(root) for job in jobs}
    kept_back = []
    for variant in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")):
        for folder in sorted(p for p in variant.iterdir() if p.is_dir() and not p.name.startswith(".")):
            if folder in owned:
                continue
            finished = _finished(folder)
            if finished is None:
                kept_back.append(f"{folder}: a job of another table that did not finish, kept for its resume "
                                 "point (delete it to leave it out of the output)")
                continue
            if _own_result(store / finished["config_hash"], finished["config_hash"]) is None:
                keep_finished(folder, finished["config_hash"], store)
            shutil.rmtree(folder)
        if not any(variant.iterdir()):
            variant.rmdir()
    return kept_back


def previous_parent(root: Path, ablation: str) -> str | None:
    """The MLflow parent run an interrupted (or finished) run of this same ablation started."""

    record = remembered_run(root, "ablation")
    return record["run_id"] if record and record.get("ablation") == ablation else None


def remember_parent(root: Path, ablation: str, run_id: str) -> None:
    """Remember the parent run of ablation ``ablation`` (its hash) for ``root``, beside mlruns/ (not in
    ``root``, a DVC output: a run id is random)."""

    remember_run(root, run_id, "ablation", ablation=ablation)


def record_result(root: Path, job: Job, result: dict[str, Any]) -> None:
    """Keep a finished job's result that was computed elsewhere (another worker's checkout)
    under ``root`` too, so a rerun here skips the job and the table's folder is complete."""
    if result.get("status") != "ok":
        return
    folder = job.folder(root)
    here = finished_result(folder, result["config_hash"])
    if here is None or any(here.get(k) != result.get(k) for k in ("score_names", "evaluation_code")):
        _write_result(folder, result)


def failed_result(job: Job, error: BaseException | str) -> dict[str, Any]:
    return {"variant": job.variant, "seed": job.seed, "status": "failed", "error": str(error)[:500]}


def start_line(cfg: Config) -> str:
    """The ablate stage's first line: its jobs, how many finished before with the same configuration and code
    (reused, not trained again), and how long the rest train here (`mmcse.experiments.estimate`)."""
    paths = Paths.of(cfg)
    jobs = [(job, job_config(cfg, job)) for job in expand(cfg)]
    todo = [job_cfg for job, job_cfg in jobs
            if finished_result(job.folder(paths.ablations), job_hash(job_cfg, cfg.base.seed), paths.jobs) is None]
    reused = len(jobs) - len(todo)
    if not todo:
        return f"{len(jobs)} job(s): all {reused} finished before, reused; nothing to train"
    line = estimate(cfg, todo).line()
    return line if not reused else f"{len(jobs)} job(s): {reused} finished before, reused; the rest: {line}"
