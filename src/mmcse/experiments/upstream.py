"""A job's upstream artifacts, found or computed for the configuration that makes them.

The download, detect_objects and cache_teachers stages write ``data/raw``, ``data/objects``
and ``data/teachers`` for the configuration in params.yaml. An ablation variant or a sweep
trial may change what those stages read (``data.captions``, ``detect.*``, ``teachers.*``,
the tokenizer), so a job cannot simply train on the top-level folders. Each artifact has a
key: a hash of the config section that makes it and of the keys of its inputs
(`mmcse.integrity.keys.artifact_keys`). A job looks its artifacts up by key: the top-level folder when it
records the same key, else ``<data_dir>/upstream/<kind>-<key>``, computed there once (under a
file lock, so jobs running at the same time on one machine share the work) and reused by
every later job with the same key. Teacher feature sets are content-addressed already
(:mod:`mmcse.teachers.cache`); a variant's sets go to ``<data_dir>/upstream/teachers`` (the DVC-tracked
top-level cache is only read) and its manifest to ``manifests/<key>.json`` there.

Data is generated and selected with the pipeline's seed (``base.seed`` of params.yaml), not an
ablation job's seed: seeds repeat training, on the same data.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from filelock import FileLock

from mmcse import tracking
from mmcse.config import Config
from mmcse.integrity.keys import Upstream, recorded_key, top_level
from mmcse.pipeline.cache_teachers import run_cache_teachers
from mmcse.pipeline.detect import run_detect
from mmcse.pipeline.download import run_download


def resolve(cfg: Config, paths: Any, data_seed: int) -> Upstream:
    """The upstream artifacts of job configuration ``cfg``: the top-level ones where their keys
    match, else the keyed ones under ``<data_dir>/upstream``, computed when absent (under a
    file lock: concurrent jobs with the same key compute once)."""

    top = top_level(cfg, paths, data_seed)
    keys = top.keys
    root = paths.raw.parent / "upstream"
    lock_dir = root / "locks"
    lock_dir.mkdir(parents=True, exist_ok=True)

    def pick(kind: str, top_folder: Path, keyed: Path) -> tuple[Path, bool]:
        if recorded_key(kind, top_folder) == keys[kind]:
            return top_folder, False
        return keyed, recorded_key(kind, keyed) != keys[kind]

    data_cfg = dataclasses.replace(cfg, base=dataclasses.replace(cfg.base, seed=data_seed))
    raw, todo = pick("data", top.raw, root / f"raw-{keys['data']}")
    if todo:
        with FileLock(str(lock_dir / f"raw-{keys['data']}.lock")):
            if recorded_key("data", raw) != keys["data"]:  # not made by a job that held the lock before
                run_download(data_cfg, dataclasses.replace(paths, raw=raw))
    objects, todo = pick("objects", top.objects, root / f"objects-{keys['objects']}")
    if todo:
        with FileLock(str(lock_dir / f"objects-{keys['objects']}.lock")):
            if recorded_key("objects", objects) != keys["objects"]:
                run_detect(data_cfg, dataclasses.replace(paths, raw=raw, objects=objects), write_metrics=False)
    teachers = root / "teachers"
    manifest, todo = pick("teachers", top.teacher_manifest, teachers / "manifests" / f"{keys['teachers']}.json")
    if todo:
        with FileLock(str(lock_dir / f"teachers-{keys['teachers']}.lock")):
            if recorded_key("teachers", manifest) != keys["teachers"]:
                run_cache_teachers(data_cfg, dataclasses.replace(paths, raw=raw, objects=objects, teachers=teachers),
                                   manifest_path=manifest, read_only=(paths.teachers,))
    return Upstream(raw, objects, teachers, manifest, (teachers, paths.teachers), keys)


def resolve_on_record(cfg: Config, paths: Any, data_seed: int, experiment_name: str, run_name: str,
                      parent_run_id: str | None = None) -> Upstream:
    """`resolve`, before the job trains; when it fails (a model that cannot be loaded, a download that
    fails) the job's MLflow run is still left, ending FAILED with the reason (`mmcse.tracking.run`), so
    an attempt that never reached training is on the record like one that failed in it."""
    try:
        return resolve(cfg, paths, data_seed)
    except Exception:
        tracking.configure(cfg)
        with tracking.run(cfg, experiment_name, run_name=run_name, parent_run_id=parent_run_id):
            raise
