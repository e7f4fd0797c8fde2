"""How long an ablation will take on this machine, said before it starts (`mmcse plan`, the ablate
stage's first line): the train stage's last measured pace (its run's ``train_minutes`` over its steps, as
its record beside the MLflow store keeps them: `mmcse.records`, no MLflow loaded) times each job's steps,
plus that run's evaluation minutes per job. A job's steps follow from its
data's size, known here when the job trains on the data the download stage made for params.yaml; a job
on other data (another data set, a caption choice) has no estimate and is counted as such."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from mmcse.config import Config, reads_pixels
from mmcse.config.training import RETRIEVAL_METHODS
from mmcse.integrity.keys import artifact_keys
from mmcse.io import read_json
from mmcse.pipeline.paths import Paths
from mmcse.records import remembered_run
from mmcse.training.schedule import batches_per_epoch


@dataclass(frozen=True)
class Pace:
    """The train stage's last run: wall-clock training minutes (loading and dev evaluations included)
    over the optimizer steps it took."""

    minutes: float
    steps: int
    eval_minutes: float = 0.0  # the evaluate stage's minutes on that run (0: not recorded)

    @property
    def minutes_per_step(self) -> float:
        return self.minutes / self.steps


def measured_pace(cfg: Config, root: str | Path = ".") -> Pace | None:
    """The train stage's pace on this machine, or None when it has not trained here (no summary, no
    recorded run, or a store without it)."""
    paths = Paths.of(cfg, Path(root))
    try:
        steps = int(read_json(paths.student / "summary.json")["steps"])
        record = remembered_run(paths.student) or {}
        minutes, eval_minutes = float(record.get("train_minutes") or 0.0), float(record.get("eval_minutes") or 0.0)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return Pace(minutes, steps, eval_minutes) if minutes > 0 and steps > 0 else None


def downloaded_counts(params: Config, root: str | Path = ".") -> dict[str, int] | None:
    """The counts the download stage recorded for ``params``' data, or None when it has not run or
    its folder holds another configuration's data (another profile's: its sizes are not these)."""
    try:
        manifest = read_json(Paths.of(params, Path(root)).raw / "manifest.json")
        return manifest["counts"] if manifest.get("artifact_key") == artifact_keys(params)["data"] else None
    except (OSError, ValueError, KeyError):
        return None


def job_steps(job: Config, params: Config, root: str | Path = ".",
              counts: dict[str, int] | None = None) -> int | None:
    """The optimizer steps of ``job``: its epochs of batches over the corpus and pairs the download
    stage counted for ``params``' data (``counts``, read once by the caller; else read here), capped by
    ``train.max_steps``; None when the job reads other data or none was downloaded."""
    if job.data != params.data:
        return None
    counts = counts if counts is not None else downloaded_counts(params, root)
    try:
        if job.train.method in RETRIEVAL_METHODS:  # image–caption pairs only, full batches (`train_duet`)
            per_epoch = int(counts["pairs"]) // job.train.batch_size
        else:
            per_epoch = batches_per_epoch(int(counts["corpus_sentences"]), int(counts["pairs"]), job.train.batch_size,
                                          job.train.batch_order)
    except (TypeError, ValueError, KeyError):
        return None
    finetune = job.model.vsepp.finetune_epochs if reads_pixels(job) else 0  # VSE++'s fine-tuning epochs follow
    total = per_epoch * (job.train.epochs + finetune)
    return min(total, job.train.max_steps) if job.train.max_steps else total


@dataclass(frozen=True)
class Estimate:
    jobs: int
    minutes: float | None  # the jobs with an estimate, summed
    unknown: int  # jobs without one (other data, or no pace measured here)
    pace: Pace | None

    def line(self) -> str:
        """One line: the jobs and how long their training will take here."""
        if self.pace is None:
            return (f"{self.jobs} job(s); no time estimate: the train stage has not trained on this machine "
                    "(dvc repro train measures its pace)")
        known = self.jobs - self.unknown
        said = f"{self.jobs} job(s)"
        if known:
            evaluated = (f", evaluated in {self.pace.eval_minutes:.1f} min" if self.pace.eval_minutes
                         else "; evaluation not measured yet: dvc repro evaluate")
            said += (f"; about {self.minutes:.0f} min for {known} of them on this machine (the train stage's "
                     f"last run: {self.pace.minutes:.1f} min for {self.pace.steps} steps{evaluated})")
        if self.unknown:
            said += f"; {self.unknown} on data not downloaded here: no estimate"
        return said


def estimate(params: Config, jobs: list[Config], root: str | Path = ".") -> Estimate:
    """How long ``jobs`` (each job's configuration) train at the train stage's measured pace."""
    pace = measured_pace(params, root)
    counts = downloaded_counts(params, root) if pace is not None else None
    steps = [job_steps(job, params, root, counts) for job in jobs] if counts is not None else [None] * len(jobs)
    known = [s for s in steps if s is not None]
    minutes = sum(known) * pace.minutes_per_step + len(known) * pace.eval_minutes if pace is not None and known \
        else None
    return Estimate(len(jobs), minutes, len(jobs) - len(known), pace)
