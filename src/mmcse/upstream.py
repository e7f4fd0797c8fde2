"""Upstream artifacts addressed by the configuration that makes them.

The download, detect_objects and cache_teachers stages write ``data/raw``, ``data/objects``
and ``data/teachers`` for the configuration in params.yaml. An ablation variant or a sweep
trial may change what those stages read (``data.captions``, ``detect.*``, ``teachers.*``,
the tokenizer), so a job cannot simply train on the top-level folders. Each artifact has a
key: a hash of the config section that makes it and of the keys of its inputs
(:func:`artifact_keys`). A job looks its artifacts up by key: the top-level folder when it
records the same key, else ``<data_dir>/upstream/<kind>-<key>``, computed there once (under a
file lock, so jobs running at the same time on one machine share the work) and reused by
every later job with the same key. Teacher feature sets are content-addressed already
(:mod:`mmcse.teachers`); a variant's sets go to ``<data_dir>/upstream/teachers`` (the DVC-tracked
top-level cache is only read) and its manifest to ``manifests/<key>.json`` there.

Data is generated and selected with the pipeline's seed (``base.seed`` of params.yaml), not an
ablation job's seed: seeds repeat training, on the same data.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mmcse.config import Config, to_dict
from mmcse.io import read_json, sha256_json, write_json

KINDS = ("data", "objects", "teachers")


def artifact_keys(cfg: Config, data_seed: int | None = None) -> dict[str, str]:
    """The key of each upstream artifact ``cfg`` trains on: ``data`` (download: pairs, corpus,
    STS sets), ``objects`` (detect_objects) and ``teachers`` (cache_teachers manifest), each a
    hash of its config section and its inputs' keys. ``data_seed``: the pipeline's seed (default
    ``cfg.base.seed``)."""
    seed = cfg.base.seed if data_seed is None else data_seed
    data = sha256_json({"data": to_dict(cfg.data), "seed": seed})[:16]
    detect = to_dict(cfg.detect)
    detect.pop("shard_size")  # how work is chunked, not what it computes
    objects = sha256_json({"detect": detect, "tokenizer": cfg.model.name_or_path,
                           "max_seq_len": cfg.model.max_seq_len, "data": data})[:16]
    teachers = to_dict(cfg.teachers)
    for bookkeeping in ("cache_dir", "num_workers"):
        teachers.pop(bookkeeping)
    return {"data": data, "objects": objects,
            "teachers": sha256_json({"teachers": teachers, "data": data, "objects": objects})[:16]}


@dataclass(frozen=True)
class Upstream:
    """Where one configuration's upstream artifacts are, and their keys."""

    raw: Path
    objects: Path
    teachers: Path  # the cache a missing teacher set is written to
    teacher_manifest: Path
    teacher_dirs: tuple[Path, ...]  # where the manifest's sets are looked up, in order
    keys: dict[str, str]


def artifact_tags(keys: dict[str, str]) -> dict[str, str]:
    """MLflow tags naming the artifacts a run trains on (``artifact.data|objects|teachers``)."""
    return {f"artifact.{kind}": key for kind, key in keys.items()}


def recorded_key(kind: str, folder: Path) -> str | None:
    """The key an artifact was made with; None when absent or incomplete (its record is written last)."""
    # data: download's manifest; objects: a record detect_objects writes last; teachers: the manifest file itself
    record = {"data": folder / "manifest.json", "objects": folder / "artifact.json", "teachers": folder}[kind]
    if not record.is_file():
        return None
    try:
        return str(read_json(record).get("artifact_key", ""))  # "": made before artifacts had keys
    except ValueError:
        return ""  # a damaged record: remade


def top_level(cfg: Config, paths: Any, data_seed: int | None = None) -> Upstream:
    """The DVC-tracked artifacts (``data/raw``, ``data/objects``, ``data/teachers``) as ``cfg``'s."""
    return Upstream(paths.raw, paths.objects, paths.teachers, paths.teachers / "manifest.json",
                    (paths.teachers,), artifact_keys(cfg, data_seed))


def stale_artifacts(up: Upstream) -> list[str]:
    """Which of ``up``'s artifacts are missing or were made from another configuration."""
    where = {"data": up.raw, "objects": up.objects, "teachers": up.teacher_manifest}
    stale = []
    for kind in KINDS:
        key = recorded_key(kind, where[kind])
        if key != up.keys[kind]:
            stale.append(f"{where[kind]} ({kind}: {'missing' if key is None else 'made from another configuration'})")
    return stale


def require_top_level(cfg: Config, paths: Any) -> Upstream:
    """The top-level artifacts, checked to be made from ``cfg`` (the train stage): a folder made
    from another configuration is refused, so a number never comes from artifacts it does not name."""
    up = top_level(cfg, paths)
    stale = stale_artifacts(up)
    if stale:
        raise ValueError(
            f"{', '.join(stale)}: params.yaml names other upstream artifacts: run `dvc repro` (or the download, "
            "detect_objects and cache_teachers stages) first"
        )
    return up


def resolve(cfg: Config, paths: Any, data_seed: int) -> Upstream:
    """The upstream artifacts of job configuration ``cfg``: the top-level ones where their keys
    match, else the keyed ones under ``<data_dir>/upstream``, computed when absent (under a
    file lock: concurrent jobs with the same key compute once)."""
    from filelock import FileLock

    from mmcse.pipeline import run_cache_teachers, run_detect, run_download

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


def record_key(record: Path, key: str, content: dict[str, Any] | None = None) -> None:
    """Write ``artifact_key`` into an artifact's record file (written last: marks it complete)."""
    write_json(record, {**(content or {}), "artifact_key": key})
