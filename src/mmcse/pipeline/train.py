"""Stage ``train``: one method's training, tracked in MLflow, with its DVC plots."""

from __future__ import annotations

import csv
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import mlflow

from mmcse import tracking
from mmcse.config import RETRIEVAL_METHODS, Config, ConfigError, reads_pixels
from mmcse.evaluation.plots import geometry_trajectory, save_figure, training_curves
from mmcse.integrity.keys import Upstream, artifact_keys, artifact_tags, require_top_level
from mmcse.io import atomic_path, tracked, write_json
from mmcse.models.device import resolve_device, with_base_threads
from mmcse.models.precision import check_precision
from mmcse.pipeline.cache_regions import region_sets_for
from mmcse.pipeline.paths import Paths
from mmcse.processes import lead
from mmcse.tracking import TRAIN_MINUTES
from mmcse.training.batches import check_inputs
from mmcse.training.checkpoints import resume_point_run, run_definition_hash
from mmcse.training.distributed import joined, world
from mmcse.training.duet import best_checkpoint_files, train_duet
from mmcse.training.engine import Hooks, TrainResult
from mmcse.training.launch import check_split, needs_launch, processes
from mmcse.training.loop import train

# summary keys kept out of summary.json (a DVC output): they differ between two identical runs
VOLATILE = ("run_id", TRAIN_MINUTES)


def write_curves(history: list[dict[str, float]], plots_dir: Path, title: str = "dev geometry") -> None:
    """The DVC plots of a training history: ``train_loss.csv`` (step, loss), ``dev.csv`` (step, dev:
    the method's dev score, STS Spearman ×100 or, for the retrieval methods, val R@K rsum; one file
    for every method, so no declared plot is left empty), ``dev_geometry.csv`` (step, alignment,
    uniformity: every dev evaluation that logged them) and ``geometry_trajectory.png``
    (`mmcse.evaluation.plots.geometry_trajectory`)."""

    plots_dir.mkdir(parents=True, exist_ok=True)
    tables = (("train_loss.csv", ["loss"], ["loss"]), ("dev.csv", ["dev"], ["dev"]),
              ("dev_geometry.csv", ["dev_alignment", "dev_uniformity"], ["alignment", "uniformity"]))
    for name, keys, columns in tables:
        rows = [h for h in history if all(k in h for k in keys)]
        with atomic_path(plots_dir / name) as tmp, open(tmp, "w", newline="") as handle:
            writer = csv.writer(handle)
            writer.writerow(["step", *columns])
            writer.writerows([[h["step"], *(tracked(float(h[k])) for k in keys)] for h in rows])
    for stale in ("dev_sts.csv", "dev_rsum.csv"):  # the two files dev.csv replaced
        (plots_dir / stale).unlink(missing_ok=True)
    save_figure(geometry_trajectory(history, title), plots_dir / "geometry_trajectory.png")


def train_run_name(cfg: Config) -> str:
    """The MLflow run name of a training: ``<method>-seed<seed>`` (e.g. ``dalr-seed3``)."""
    return f"{cfg.train.method}-seed{cfg.base.seed}"


@dataclass(frozen=True)
class RunNames:
    """Where a training's MLflow run is filed: its experiment (default: the method), its name (default
    `train_run_name`) and the parent run (an ablation's, a sweep's)."""

    experiment: str | None = None
    run: str | None = None
    parent_id: str | None = None


@dataclass(frozen=True)
class JobArtifacts:
    """An ablation job's or sweep trial's own upstream: the pipeline's data seed and the artifacts of the job's
    configuration its runner found or computed (`mmcse.experiments.upstream.resolve`)."""

    data_seed: int
    upstream: Upstream


def train_model(cfg: Config, up: Upstream, region_sets: dict[str, Path], out_dir: Path, hooks: Hooks) -> TrainResult:
    """The one training loop on ``up``'s artifacts: a student's (`mmcse.training.loop.train`) or a retrieval
    model's on the region sets ``region_sets`` (`mmcse.training.duet.train_duet`)."""
    if cfg.train.method in RETRIEVAL_METHODS:
        return train_duet(cfg, up.raw, region_sets, out_dir, hooks)
    return train(cfg, up.raw, up.teachers, out_dir, hooks, upstream=up)


def job_region_sets(cfg: Config, paths: Paths, up: Upstream) -> dict[str, Path]:
    """The region sets a retrieval model on region features trains on (``{}`` for the others): a set that
    cannot be had fails here, before a run is started."""
    if cfg.train.method in RETRIEVAL_METHODS and not reads_pixels(cfg):
        return region_sets_for(cfg, paths, up)
    return {}


@with_base_threads
def run_train(cfg: Config, paths: Paths, out_dir: Path | None = None, names: RunNames | None = None,
              hooks: Hooks | None = None, job: JobArtifacts | None = None) -> dict[str, Any]:
    """Train ``cfg`` (see `train_tracked`) in this process, or, started by torchrun for a job on several
    processes (``train.devices``), as one of them: rank 0 trains with the run record and writes the outputs
    (its summary is returned), the others train beside it and return ``{}``. Refused before any compute when
    the job needs several processes that torchrun did not start (`mmcse.training.launch`)."""
    if needs_launch(cfg.train, cfg.base.device):
        raise ConfigError(f"train.devices: {cfg.train.devices} × train.nodes: {cfg.train.nodes} is "
                          f"{processes(cfg.train, cfg.base.device)} processes, which torchrun starts for the train "
                          "stage (dvc repro train, or python stages/train.py) and an ablation job "
                          "(mmcse.pipeline.train_processes); a sweep trial trains in one process: set "
                          "train.devices: 1 for it")
    check_split(cfg.train, cfg.base.device)
    names, hooks = names or RunNames(), hooks or Hooks()
    with joined(cfg.base.device):
        if lead():
            return train_tracked(cfg, paths, out_dir, names, hooks, job)
        up = require_top_level(cfg, paths) if job is None else job.upstream
        # the same training beside rank 0: no run record, no output written (`Checkpoints.writes`)
        train_model(cfg, up, job_region_sets(cfg, paths, up), out_dir or paths.student, Hooks(progress=False))
        return {}


def train_tracked(cfg: Config, paths: Paths, out_dir: Path | None = None, names: RunNames | None = None,
                  hooks: Hooks | None = None, job: JobArtifacts | None = None) -> dict[str, Any]:
    """Train in this process with MLflow tracking; returns the summary written to ``<out>/summary.json``.

    Without ``job`` (the train stage) it trains on the top-level artifacts, refused unless they were made
    from ``cfg``. With it (an ablation job, a sweep trial) on the job's own artifacts, which its runner found or
    computed before: this module never calls back into the runner. The run is tagged with
    the artifacts' keys (``artifact.data|objects|teachers``), also in the summary with the data
    folder (``data_dir``). A training resumed from ``<out>/last`` continues the MLflow run its
    resume point names: a killed and resumed training is one run with one contiguous history."""

    out_dir, names, hooks = out_dir or paths.student, names or RunNames(), hooks or Hooks()
    keys = artifact_keys(cfg, None if job is None else job.data_seed)
    up = require_top_level(cfg, paths) if job is None else job.upstream
    check_inputs(up.raw, up.teachers, up.teacher_manifest, up.teacher_dirs)
    check_precision(cfg.train.precision, resolve_device(cfg.base.device))  # before a run is started
    duet = cfg.train.method in RETRIEVAL_METHODS  # DUET, VSE++: retrieval models on region sets
    region_sets = job_region_sets(cfg, paths, up)  # pre-flight: a set that cannot be had fails before a run starts
    tracking.configure(cfg)
    # continue the folder's run only when training will continue its resume point (a damaged best or
    # resume point restarts from step 0: a new run, the old one closed with the reason)
    decision = resume_point_run(out_dir, cfg, best_checkpoint_files(cfg.train.method) if duet else ())
    resumed_run, resumed_step = tracking.existing_run(decision.run_id), decision.step
    with tracking.run(
        cfg, names.experiment or cfg.train.method, run_name=names.run or train_run_name(cfg), run_id=resumed_run,
        parent_run_id=names.parent_id, tags=artifact_tags(keys),
        job=str(out_dir.resolve()), system_metrics=True,
    ) as active:
        # not in out_dir (a DVC output holds nothing random); per configuration, so a folder another
        # configuration trained in meanwhile never continues this run
        tracking.remember_run(out_dir, active.info.run_id, config_hash=run_definition_hash(cfg))
        if decision.stale_run and resumed_run is None:
            tracking.supersede_run(decision.stale_run, active.info.run_id, decision.reason)
            mlflow.set_tags({"mmcse.restarted_from_run": decision.stale_run,
                             "mmcse.restart_reason": decision.reason[:500]})
        mlflow.set_tag("mmcse.processes", str(world()[1]))  # train.devices × train.nodes as it ran
        if resumed_run is None:
            tracking.log_config(cfg)
        else:
            mlflow.set_tag("mmcse.resumed_from_step", str(resumed_step))
        # wall-clock minutes of training (model and data loading, dev evaluations included: DALR
        # Table 7's "total time"), summed over the run's resumed sessions (`tracking.TRAIN_MINUTES`)
        started = time.perf_counter()
        before = (mlflow.get_run(active.info.run_id).data.metrics.get(TRAIN_MINUTES, 0.0)
                  if resumed_run else 0.0)
        # a retrieval model's dev score is the val rsum (`mmcse.training.duet`), a student's dev STS
        result = train_model(cfg, up, region_sets, out_dir, replace(hooks, log_metrics=tracking.log_metric_steps))
        title = f"{cfg.train.method} (seed {cfg.base.seed})"
        figures = [(training_curves(result.history, title, dev_label="val rsum" if duet else "dev STS"),
                    "training_curves.png")]
        if not duet:
            figures.append((geometry_trajectory(result.history, title, result.best_step), "geometry_trajectory.png"))
        for fig, name in figures:
            mlflow.log_artifact(str(save_figure(fig, out_dir / name)), "figures")
        minutes = before + (time.perf_counter() - started) / 60.0
        mlflow.log_metric(TRAIN_MINUTES, minutes)
        tracking.note_run(out_dir, train_minutes=minutes)  # the pace a plan estimates from (no MLflow to read it)
        best_geometry = {f"best_{k}": v for k, v in result.best_geometry.items()}  # best_dev_alignment, ...
        dev_key = "best_dev_rsum" if duet else "best_dev_sts"  # val R@K rsum | dev STS Spearman ×100
        mlflow.log_metrics({dev_key: result.best_score, "best_step": result.best_step, **best_geometry})
        summary = {
            "run_id": active.info.run_id,
            dev_key: result.best_score,
            "best_dev": result.best_score,  # whichever the method's dev score is (sweeps maximise it)
            "dev_metric": "val_rsum" if duet else "dev_sts",
            "best_step": result.best_step,
            **best_geometry,
            "steps": result.steps,
            TRAIN_MINUTES: minutes,
            "checkpoint": str(result.best_dir),
            "artifacts": up.keys,
            "data_dir": str(up.raw),
            "teacher_manifest": str(up.teacher_manifest),
            "teacher_dirs": [str(d) for d in up.teacher_dirs],
            "region_sets": {split: str(folder) for split, folder in region_sets.items()},
        }
    # the run id stays out of the folder (a DVC output): `tracking.folder_run_id(out_dir)` finds it
    write_json(out_dir / "summary.json", {k: v for k, v in summary.items() if k not in VOLATILE})
    return summary
