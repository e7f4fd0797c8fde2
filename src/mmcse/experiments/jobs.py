"""What an ablation is made of, known before anything runs: its jobs (variant × seed, each with its
overrides), each job's configuration and hash, and the ablation's hash. `mmcse plan` and the checks
before a stage starts read these without importing the training stack (`mmcse.experiments.ablate`
runs the jobs)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mmcse.config import LAUNCH_KEYS, RETRIEVAL_METHODS, Config, to_dict, with_overrides
from mmcse.config.coercion import flatten
from mmcse.errors import InputError
from mmcse.integrity.code import TRAINING_CODE, code_digest, code_files
from mmcse.integrity.keys import artifact_keys
from mmcse.io import sha256_json
from mmcse.methods.objectives import Objective, needed_features, objective_keys

RETRIEVAL_MODELS = ("duet", "vsepp", "vsrn")  # model.<name>: read by that retrieval method alone


@dataclass(frozen=True)
class Job:
    variant: str
    seed: int
    overrides: dict[str, Any]

    def folder(self, root: Path) -> Path:
        return root / slug(self.variant) / f"seed{self.seed}"


def slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.=-]+", "_", name).strip("_") or "variant"


def seed_free(job_cfg: Config) -> bool:
    """Whether no seed can change a job's result: it trains no step (``train.epochs: 0``) from pretrained weights and
    scores only what those weights give (SimCSE's untrained encoder, pooled without its fresh MLP: MCSEO Table 1's
    first row). Such a row runs on the table's first seed alone."""
    return (job_cfg.train.epochs == 0 and job_cfg.train.method == "simcse" and job_cfg.model.init == "pretrained"
            and job_cfg.evaluate.pooler != "cls")


def _row_seeds(cfg: Config, name: str, overrides: dict[str, Any]) -> list[int]:
    """The seeds a row trains on: the table's, or its first alone for a `seed_free` row (read from the row's first
    job's configuration, which holds its own variant alone: with the table's every row, each row's check would
    build every other row again)."""
    seeds = list(cfg.ablate.seeds)
    try:
        free = seed_free(job_config(cfg, Job(name, seeds[0], {**overrides, "base.seed": seeds[0]})))
    except ValueError:  # a bad override fails as its jobs do, later, with its own message
        free = False
    return seeds[:1] if free else seeds


def expand(cfg: Config) -> list[Job]:
    """Every (variant, seed) with its overrides (seed included), in params.yaml order; a `seed_free` row once."""
    jobs = []
    for name, overrides in cfg.ablate.variants.items():
        for seed in _row_seeds(cfg, name, overrides):
            jobs.append(Job(name, seed, {**overrides, "base.seed": seed}))
    slugs = [slug(n) for n in cfg.ablate.variants]
    if len(set(slugs)) != len(slugs):
        raise InputError(f"params.yaml: ablate.variants names collide as folder names: {slugs}")
    return jobs


def job_run_name(job: Job) -> str:
    """The MLflow run name of an ablation job: ``<variant>-seed<seed>`` (e.g. ``no-teacher-seed2``)."""
    return f"{job.variant}-seed{job.seed}"


def parent_run_name(cfg: Config) -> str:
    """The MLflow run name of an ablation's parent run: ``ablation <preset>``, else ``ablation
    <ablate.title>``, else ``ablation variants``."""
    return f"ablation {table_label(cfg)}"


def table_params(cfg: Config, jobs: Sequence[Job]) -> dict[str, str]:
    """An ablation parent run's params where ``cfg``'s are not the table's: a key every job sets to one value (a
    preset's ``base``) has that value; one the jobs hold different values of (a key a row leaves alone has
    ``cfg``'s), and ``base.seed`` (a job's seed replaces it), read ``table: <table_label>``: no row's value stands
    for a table that mixes them."""
    flat = flatten(to_dict(cfg))
    table = f"table: {table_label(cfg)}"
    params = {"base.seed": table}
    for key in sorted({key for job in jobs for key in job.overrides}):
        values = {repr(job.overrides.get(key, flat.get(key))): job.overrides.get(key, flat.get(key)) for job in jobs}
        params[key] = str(next(iter(values.values()))) if len(values) == 1 else table
    return params


def table_label(cfg: Config) -> str:
    """What an ablation's table is (its parent run's name and its row keys' value): its preset, else its title, else
    ``variants`` (params.yaml's ``ablate.variants``)."""
    if cfg.ablate.preset != "none":
        return cfg.ablate.preset
    return cfg.ablate.title.strip() or "variants"


def job_config(cfg: Config, job: Job) -> Config:
    """``cfg`` with the job's overrides. Its ablate section keeps only the job's own variant (the
    others were checked against ``cfg``; checked against a row that drops the image–caption pairs,
    e.g. a wiki-only SimCSE row, every other row would fail). `job_hash` leaves the section out."""
    caveat = {job.variant: cfg.ablate.caveats[job.variant]} if job.variant in cfg.ablate.caveats else {}
    own = {"ablate.variants": {job.variant: job.overrides}, "ablate.reference": job.variant, "ablate.caveats": caveat}
    return with_overrides(cfg, {**job.overrides, **own}, where=f"params.yaml (ablate.variants.{job.variant})")


def _kept(tree: dict[str, Any], keys: set[str], prefix: str) -> dict[str, Any]:
    """``tree`` (the section at dotted ``prefix``) with only the parameters ``keys`` names (a key may
    name a whole section)."""
    out = {}
    for name, value in tree.items():
        path = f"{prefix}.{name}"
        if path in keys or any(path.startswith(k + ".") for k in keys):
            out[name] = value
        elif isinstance(value, dict) and any(k.startswith(path + ".") for k in keys):
            out[name] = _kept(value, keys, path)
    return out


def job_identity(job_cfg: Config, data_seed: int | None = None) -> dict[str, Any]:
    """The configuration a job's result depends on: everything but the ablation's bookkeeping and the
    sweep, less what its method never reads — the loss parameters its step does not read
    (`mmcse.methods.objectives.objective_keys`; a retrieval method reads ``loss.<method>``), the other
    retrieval models' ``model.*``, ``regions`` for a sentence encoder, and the teachers (with their
    cache's key) and the detected objects for a method that trains on no cached teacher feature (SimCSE;
    VSE++ / VSRN on region files), the joint teacher's settings for one that reads none of its features
    (MCSE) — plus the keys of the upstream artifacts it trains on (``data_seed``:
    the pipeline's seed the data is made with, `mmcse.experiments.upstream`)."""
    tree = to_dict(job_cfg)
    tree.pop("ablate")
    tree.pop("sweep")
    for key in LAUNCH_KEYS:  # over how many processes: the same result
        tree["train"].pop(key)
    method = job_cfg.train.method
    retrieval = method in RETRIEVAL_METHODS
    o = Objective.of(job_cfg)
    tree["loss"] = _kept(tree["loss"], {f"loss.{method}"} if retrieval else objective_keys(o), "loss")
    for name in RETRIEVAL_MODELS:
        if name != method:
            tree["model"].pop(name)
    if not retrieval:
        tree.pop("regions")
    artifacts = artifact_keys(job_cfg, data_seed)
    # a retrieval model reads teachers only through object regions (encoded with teachers.image_encoder)
    reads_teachers = (job_cfg.regions.source == "objects" if retrieval
                      else bool(needed_features(o, True) | needed_features(o, False)))
    if not reads_teachers:
        tree.pop("teachers")
        tree.pop("detect")
        artifacts.pop("teachers")
        artifacts.pop("objects")
    elif not retrieval and "joint" not in needed_features(o, True) | needed_features(o, False):
        tree["teachers"].pop("joint")  # MCSE, MCSEO: no CLIP feature reaches their step
    tree["artifacts"] = artifacts
    return tree


def job_hash(job_cfg: Config, data_seed: int | None = None) -> str:
    """What makes a job's result: `job_identity` (what its method reads, the keys of the upstream
    artifacts it trains on) and the library code that trains (`mmcse.integrity.code.TRAINING_CODE`: a
    job finished before a loss was edited is trained again); ``ablate.transfer`` counts (a result without
    transfer scores is not finished when they are asked for). The code that scores is checked apart
    (`evaluation_code`): its change only rescores."""
    tree = job_identity(job_cfg, data_seed)
    tree["code"] = code_digest(code_files(TRAINING_CODE))
    if job_cfg.ablate.transfer:
        tree["ablate.transfer"] = True
    return sha256_json(tree)


def ablation_hash(cfg: Config, jobs: Sequence[Job]) -> str:
    """What one ablation is: its jobs (each job's hash, or its config error) and how the table is
    made. A rerun with the same hash continues the same MLflow parent run."""
    hashes = []
    for job in jobs:
        try:
            hashes.append(job_hash(job_config(cfg, job), cfg.base.seed))
        except ValueError as err:  # a bad override fails as a job; it still names the ablation
            hashes.append(f"invalid: {err}")
    a = cfg.ablate
    return sha256_json({"jobs": [[j.variant, j.seed, h] for j, h in zip(jobs, hashes, strict=True)],
                        "table": [a.reference, a.metric, a.plot_x, a.title, a.preset]})
