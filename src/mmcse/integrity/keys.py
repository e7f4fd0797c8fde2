"""Artifact keys: which configuration made an upstream artifact (``data/raw``, ``data/objects``,
a teacher manifest), so that a job trains only on artifacts of its own configuration.

A key is a hash of the config section that makes the artifact and of its inputs' keys
(data ← objects ← teachers). Each artifact records its key when written (a manifest
field); training refuses top-level artifacts whose key is not its configuration's.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mmcse.config import Config, to_dict
from mmcse.errors import InputError
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
    for bookkeeping in ("cache_dir", "num_workers", "stand_ins"):
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
        raise InputError(
            f"{', '.join(stale)}: params.yaml names other upstream artifacts: run `dvc repro` (or the download, "
            "detect_objects and cache_teachers stages) first"
        )
    return up


def record_key(record: Path, key: str, content: dict[str, Any] | None = None) -> None:
    """Write ``artifact_key`` into an artifact's record file (written last: marks it complete)."""
    write_json(record, {**(content or {}), "artifact_key": key})
