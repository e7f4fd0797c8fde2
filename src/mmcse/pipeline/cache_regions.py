"""Stage ``cache_regions``: DUET's and VSE++'s region sets (from the detected objects or BUTD files),
computed once per (source, images) and content-addressed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from filelock import FileLock

from mmcse.config import Config
from mmcse.data.images import IMAGE_TABLES
from mmcse.detection.regions import (
    build_region_cache,
    grid_source,
    npy_source,
    objects_source,
    tsv_source,
)
from mmcse.integrity.files import verify_images
from mmcse.io import read_json, read_jsonl
from mmcse.models.device import resolve_device, with_base_threads
from mmcse.pipeline.paths import Paths
from mmcse.teachers.cache import FeatureStore, image_encoder
from mmcse.teachers.encoders import build_resnet50, crop_grid_boxes, resnet_grid_features, resolve_resnet50
from mmcse.training.batches import teacher_set_folder

REGION_SPLITS = {"train": "images.jsonl", "val": "retrieval/val_images.jsonl", "test": "retrieval/images.jsonl"}


def region_source(cfg: Config, raw: Path, objects: Path, teacher_manifest: Path,
                  teacher_dirs: tuple[Path, ...] = ()) -> Any:
    """The `mmcse.detection.regions.RegionSource` of ``regions.source``: the TSV files, the per-image
    folder, or (``objects``) the images' objects and the whole image encoded with
    ``teachers.image_encoder``, reusing the crops and images cache_teachers already encoded (the
    sets ``teacher_manifest`` names). A missing file or folder is named here, before any compute."""

    r = cfg.regions
    if r.source == "tsv":
        return tsv_source([Path(f).expanduser() for f in r.files], r.dim or None)
    if r.source == "npy":
        return npy_source(Path(r.folder).expanduser(), raw, r.dim or None)
    if r.source == "grid":
        return resnet_grid_source(cfg, raw)

    encoder_key, encode = image_encoder(cfg.teachers, resolve_device(cfg.base.device))
    sets = read_json(teacher_manifest)["sets"] if teacher_manifest.is_file() else {}
    dirs = tuple(teacher_dirs)

    def stores(*names: str) -> list[Any]:
        found = [teacher_set_folder(sets[n], dirs[0], dirs[1:]) for n in names if n in sets] if dirs else []
        return [FeatureStore.open(f) for f in found if (f / "index.json").is_file()]

    return objects_source(raw, objects, encoder_key, encode, r.whole_image, stores("object"),
                          stores("image", "retrieval_image"))


def resnet_grid_source(cfg: Config, raw: Path) -> Any:
    """``regions.source: grid``: ``regions.grid_model``'s 7 × 7 last feature map of each whole image, the
    cells' boxes in the image. The weights are found (or refused offline) here; the model is built when
    the first images are encoded, so a cached set loads no CNN."""
    r = cfg.regions
    path, _, described = resolve_resnet50(r.grid_weights, r.grid_model, "regions.grid_weights")
    described = {k: v for k, v in described.items() if k != "preprocess"} | {"grid": "resize 256, crop 224, 7x7"}
    device, built = resolve_device(cfg.base.device), []

    def encode(files: Any, sizes: Any) -> tuple[Any, Any]:
        if not built:
            built.append(build_resnet50(path, r.grid_model))
        features = resnet_grid_features(files, built[0], cfg.teachers.batch_size, cfg.teachers.num_workers, device)
        return features, np.stack([crop_grid_boxes(w, h) for w, h in sizes])

    return grid_source(raw, described, encode)


@with_base_threads
def run_cache_regions(cfg: Config, paths: Paths, raw: Path | None = None, objects: Path | None = None,
                      teacher_manifest: Path | None = None, teacher_dirs: tuple[Path, ...] | None = None,
                      out_dir: Path | None = None, read_only: tuple[Path, ...] = ()) -> dict[str, Any]:
    """DUET's region sets (`mmcse.detection.regions.build_region_cache`) for each image set of
    `REGION_SPLITS` the data has: ``{"sets": {split: folder name}, "hits": {split: bool}, "images":
    {split: count}, "dim"}``.
    Sets are content-addressed (source, inputs, image ids, ``max_regions``, ``dtype``): a set
    already in ``out_dir`` (default ``paths.regions``) or one of ``read_only`` is opened, not rebuilt."""

    raw, objects = raw or paths.raw, objects or paths.objects
    if cfg.regions.source in ("objects", "grid"):  # the images are read (crops, whole images): checked, cached or not
        verify_images(raw, IMAGE_TABLES)
    source = region_source(cfg, raw, objects, teacher_manifest or paths.teachers / "manifest.json",
                           (paths.teachers,) if teacher_dirs is None else teacher_dirs)
    result: dict[str, Any] = {"sets": {}, "hits": {}, "images": {}, "folders": {}, "source": cfg.regions.source}
    for split, table in REGION_SPLITS.items():
        ids = [row["image_id"] for row in read_jsonl(raw / table)] if (raw / table).is_file() else []
        if not ids:
            continue
        store, hit = build_region_cache(out_dir or paths.regions, ids, source, cfg.regions.max_regions,
                                        cfg.regions.dtype, read_only)
        result["sets"][split], result["hits"][split], result["images"][split] = store.folder.name, hit, len(ids)
        result["folders"][split] = store.folder  # where the intact set is: a damaged read-only one is passed by
        result["dim"] = store.dim
    return result


def region_sets_for(cfg: Config, paths: Paths, up: Any) -> dict[str, Path]:
    """The region sets of a training's upstream artifacts ``up`` (`mmcse.integrity.keys.Upstream`): opened
    (and checked) from the cache_regions stage's folder when it holds them intact, else built once
    (under a file lock: concurrent jobs share the work) in ``<data>/upstream/regions``. ``{split: folder}``."""

    shared = paths.raw.parent / "upstream" / "regions"
    shared.mkdir(parents=True, exist_ok=True)
    with FileLock(str(shared / ".lock")):
        result = run_cache_regions(cfg, paths, up.raw, up.objects, up.teacher_manifest, up.teacher_dirs,
                                   out_dir=shared, read_only=(paths.regions,))
    # the folder the lookup opened and checked: a damaged set in the stage's folder is never used,
    # its rebuilt copy under `shared` is
    return dict(result["folders"])
