"""Region features for DUET (§4.1.1): per image, n region vectors ``r_i`` with boxes ``b_i`` (Eq. 23),
read once from a source and cached as memory-mapped arrays.

Sources
-------
``tsv``: the bottom-up-attention TSV that the retrieval and captioning community publishes, one image
per line, tab-separated, no header; boxes and features base64 of little-endian float32:

* 6 fields (peteanderson80/bottom-up-attention ``tools/generate_tsv.py``; what SCAN's precomp and
  self-critical's ``make_bu_data.py`` read): ``image_id, image_w, image_h, num_boxes, boxes, features``;
* 10 fields (LXMERT's ``obj36`` files): ``img_id, img_h, img_w, objects_id, objects_conf, attrs_id,
  attrs_conf, num_boxes, boxes, features`` (height before width; the label fields are not used).

``boxes`` decodes to ``(num_boxes, 4)`` x1, y1, x2, y2 in pixels, ``features`` to ``(num_boxes, d)``
(d = 2048 for the ResNet-101 Visual Genome detector). Several files (``...tsv.0``, ``...tsv.1``) may be
given; an image found twice keeps its first row.

``npy``: one folder with a file per image, named by its file id (below); per image the first of

* ``<id>.npz`` with ``x`` (``(n, d)``, or ``(d, n)`` as bottom-up-attention's
  ``tools/extract_feature_to_npz.py`` writes it; the orientation is read off ``bbox``), ``bbox``
  ``(n, 4)`` xyxy pixels, ``image_w``, ``image_h`` and optionally ``num_bbox`` (checked): the layout of
  that script and of the detectron2 ports (bua-extract-feature, py-bottom-up-attention);
* ``<id>.npz`` with ``feat`` ``(n, d)`` only: self-critical ``make_bu_data.py``'s ``<name>_att``
  folder, its boxes in the sibling ``<name>_box/<id>.npy`` ``(n, 4)``;
* ``<id>.npy`` ``(n, d)`` features with ``<id>_boxes.npy`` ``(n, 4)`` xyxy pixels beside it.

The last two record no image size: it is read from the image file's header (``images.jsonl`` /
``retrieval/images.jsonl`` / ``retrieval/val_images.jsonl``). SCAN's ``*_ims.npy`` precomp arrays are
not a source: they hold no boxes, and Eq. 23 needs them.

A file id is the image id as ``images.jsonl`` records it or without its dataset prefix
(``coco-391895`` → ``391895``, ``flickr30k-1000092795`` → ``1000092795``, what the published files
use); digit-only ids compare as integers (``000391895`` = ``391895``), and a TSV's COCO file-name ids
(LXMERT's ``COCO_val2014_000000391895``) as their COCO id.

``grid``: a CNN's last feature map over the whole image, one region per cell (VSE++'s ResNet-152:
7 × 7 cells of 2048; their mean is the pooled feature VSE++ reads), each cell's box in the image.

``objects`` (offline default): each image's objects cropped and encoded with the configured image
encoder (weight-free colour-edge-grid or ResNet-50). The objects are the image row's annotated objects
where it has them (the demo world: all objects, masked crops exactly as the detect stage cuts them),
otherwise the detect stage's objects for that image (``objects.jsonl``: its crop files are encoded).
Features already cached by ``cache_teachers`` are reused instead of encoding again: the ``object`` set
(rows keyed by crop path) and the ``image`` / ``retrieval_image`` sets (whole images).

Every image also gets the whole image as one more region, box ``[0, 0, W, H]``, while it has fewer
than ``max_regions`` objects: a global context region (the BUTD detector's near-full-frame boxes play
that part), and an image without objects still has one valid region, so no attention row is empty.

Cache
-----
``<cache_dir>/regions-<key>/`` holds ``regions.npy`` ``(N, n_max, d)`` (float16 by default: 36 × 2048
per image over COCO's 123k images is 18 GB in float16), ``boxes.npy`` ``(N, n_max, 5)`` float32 (Eq. 23:
``[x1/W, y1/H, x2/W, y2/H, (x2−x1)(y2−y1)/(WH)]``), ``counts.npy`` ``(N,)`` int32 valid regions per
image (the first ``counts[i]`` slots; padding is zero) and ``index.json`` (ids, source, fingerprint,
each array's shape and SHA-256), written last. The key hashes (source description, inputs
fingerprint, ids, ``max_regions``, dtype), so a rerun on the same inputs opens the set and reads no
input. The set is built in a temporary folder beside it and renamed into place; a set that fails its
checks is deleted and rebuilt. Images with more than ``max_regions`` regions keep the first ones in
file order (the 36-box files are already ``max_regions`` = 36).

Malformed input (a wrong field count, base64 that does not decode to ``num_boxes × 4 × 4`` and
``num_boxes × d × 4`` bytes, shapes that disagree, NaN or infinite values, boxes outside the image)
raises :class:`~mmcse.errors.CorruptArtifact` naming the file and the line / image id, before the set is
written.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import zipfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from numpy.lib.format import open_memmap
from PIL import Image, UnidentifiedImageError

from mmcse.cpu_isa import kernels_in_force
from mmcse.data.images import IMAGE_TABLES, image_rows
from mmcse.detection.crops import masked_crop, object_crop
from mmcse.detection.region_files import (
    FIX_INPUT,
    FLOAT16_MAX,
    Regions,
    canonical_id,
    check_regions,
    file_id_candidates,
    normalise_boxes,
    npy_region_file,
    read_butd_tsv,
    read_npy_regions,
)
from mmcse.errors import CorruptArtifact, InputError, MissingEntry
from mmcse.integrity.files import (
    HashingWriter,
    check_image_digests,
    check_npy,
    file_sha256,
    find_cached_set,
    read_json_artifact,
    remember_sha256,
)
from mmcse.io import build_dir, open_image, read_jsonl, sha256_file, sha256_json, write_json

log = logging.getLogger(__name__)


REBUILD = "delete the folder or rerun the stage that caches region features (it rebuilds the set)"


def image_size(path: Path) -> tuple[int, int]:
    """``(width, height)`` from an image file's header (nothing decoded)."""

    try:
        with Image.open(path) as img:
            return img.size
    except FileNotFoundError:
        raise CorruptArtifact(path, "image missing", "rerun the download stage") from None
    except (UnidentifiedImageError, OSError) as err:
        raise CorruptArtifact(path, f"unreadable image ({err})", "rerun the download stage") from None


def _missing_images(raw_dir: Path, ids: Sequence[str], rows: dict[str, Any], tables: Sequence[str]) -> None:
    missing = [i for i in ids if i not in rows]
    if missing:
        present = [t for t in tables if (raw_dir / t).is_file()] or list(tables)  # the tables searched
        names = ", ".join(str(raw_dir / t) for t in present)
        raise MissingEntry(f"{names}: no image row for {len(missing)} id(s), e.g. {', '.join(missing[:5])}")


# mmcse.teachers.cache.ImageEncoder: (files, label) -> (N, d)
ImageEncoder = Callable[[Sequence[Path], str], np.ndarray]


def _detected_objects(objects_dir: Path) -> dict[str, list[dict[str, Any]]]:
    """The detect stage's objects per image (objects.jsonl rows are per pair: each object once)."""
    table = objects_dir / "objects.jsonl"
    if not table.is_file():
        return {}
    out: dict[str, dict[Any, dict[str, Any]]] = {}
    for row in read_jsonl(table):
        seen = out.setdefault(row["image_id"], {})
        for obj in row["objects"]:
            seen.setdefault(obj["object"], obj)
    return {image: list(objs.values()) for image, objs in out.items()}


def _lookup(stores: Sequence[Any], encoder_key: dict[str, Any] | None) -> dict[str, tuple[Any, int]]:
    """id → (store, row) over FeatureStores made with ``encoder_key`` (others are skipped with a warning)."""
    out: dict[str, tuple[Any, int]] = {}
    for store in stores:
        if encoder_key is not None and store.meta.get("teacher") != encoder_key:
            log.warning("%s: cached with another image encoder; not reused for regions", store.folder)
            continue
        for i, key in enumerate(store.ids):
            out.setdefault(key, (store, i))
    return out


@dataclass(frozen=True)
class ReusedFeatures:
    """Cached FeatureStores whose rows are reused instead of encoding: ``objects`` (``cache_teachers``' ``object``
    set, keyed by crop path) and ``images`` (``image`` / ``retrieval_image``, by image id); only stores made with
    ``encoder_key`` when it is given."""

    objects: Sequence[Any] = ()
    images: Sequence[Any] = ()
    encoder_key: dict[str, Any] | None = None


def regions_from_objects(
    raw_dir: str | Path,
    objects_dir: str | Path,
    image_ids: Sequence[str],
    encoder: ImageEncoder,
    max_regions: int = 36,
    whole_image: bool = True,
    reused: ReusedFeatures | None = None,
    chunk: int = 256,
) -> Iterator[Regions]:
    """Regions of ``image_ids`` from their objects, encoded with ``encoder`` (module doc, source ``objects``).

    Per image: its annotated objects (image row ``objects``; crops masked by the row's label ``mask``
    like the detect stage's, else the box clipped to the image), else the detect stage's objects in
    ``objects_dir/objects.jsonl`` (their crop files), at most ``max_regions``; then, while there is room
    and ``whole_image``, the whole image; ``reused``: cached features taken instead of encoding.
    Yields in ``image_ids`` order; ``chunk`` images' crops are encoded per call."""

    raw_dir, objects_dir = Path(raw_dir), Path(objects_dir)
    if max_regions < 1:
        raise InputError(f"max_regions={max_regions}: must be >= 1")
    rows = image_rows(raw_dir)
    _missing_images(raw_dir, image_ids, rows, IMAGE_TABLES)
    detected = _detected_objects(objects_dir)
    reused = reused or ReusedFeatures()
    cached_crops = _lookup(reused.objects, reused.encoder_key)
    cached_images = _lookup(reused.images, reused.encoder_key)
    with tempfile.TemporaryDirectory(prefix="regions-crops-") as scratch:
        for start in range(0, len(image_ids), chunk):
            ids = image_ids[start : start + chunk]
            # plan: per image [(kind, key, box)], kind "crop" (key: crop id) or "image" (key: image id)
            plans: list[list[tuple[str, str, list[float]]]] = []
            sizes: list[tuple[int, int]] = []
            render: dict[str, Path] = {}  # crop id → file to encode (rendered here or detect's crop file)
            # the recorded bytes: a changed image is named, never encoded under this set's key
            check_image_digests([rows[i] for i in ids], [raw_dir / rows[i]["file"] for i in ids],
                                "rerun the download stage")
            for image_id in ids:
                row = rows[image_id]
                file = raw_dir / row["file"]
                width, height = image_size(file)
                plan: list[tuple[str, str, list[float]]] = []
                if row.get("objects"):
                    picture = labels = None
                    for k, obj in enumerate(row["objects"][:max_regions]):
                        crop_id = f"crops/{image_id}-o{k}.png"  # the detect stage's name for this object's crop
                        x0, y0, x1, y1 = obj["box"]
                        box = [max(x0, 0), max(y0, 0), min(x1, width), min(y1, height)]
                        plan.append(("crop", crop_id, box))
                        if crop_id in cached_crops or crop_id in render:
                            continue
                        if picture is None:
                            picture = open_image(file, "rerun the download stage")
                            labels = (np.asarray(open_image(raw_dir / row["mask"], "rerun the download stage"))
                                      if "mask" in row else None)
                        crop = (object_crop(picture, labels, k, obj["box"]) if labels is not None
                                else masked_crop(picture, np.ones((height, width), bool), box))
                        out = Path(scratch) / f"{len(render)}.png"
                        crop.save(out, format="PNG")
                        render[crop_id] = out
                else:
                    for obj in detected.get(image_id, [])[:max_regions]:
                        plan.append(("crop", obj["crop"], [float(v) for v in obj["box"]]))
                        if obj["crop"] not in cached_crops:
                            render.setdefault(obj["crop"], objects_dir / obj["crop"])
                if whole_image and len(plan) < max_regions:
                    plan.append(("image", image_id, [0, 0, width, height]))
                if not plan:
                    raise InputError(f"{file}: no objects and whole_image is off, so image {image_id} has no region")
                plans.append(plan)
                sizes.append((width, height))
            encoded: dict[tuple[str, str], np.ndarray] = {}
            if render:
                crop_ids = list(render)
                feats = encoder([render[c] for c in crop_ids], "region crops")
                encoded |= {("crop", c): f for c, f in zip(crop_ids, feats, strict=True)}
            whole = [i for i, plan in zip(ids, plans, strict=True)
                     if any(kind == "image" for kind, _, _ in plan) and i not in cached_images]
            if whole:
                feats = encoder([raw_dir / rows[i]["file"] for i in whole], "whole images")
                encoded |= {("image", i): f for i, f in zip(whole, feats, strict=True)}
            for image_id, plan, (width, height) in zip(ids, plans, sizes, strict=True):
                vectors = []
                for kind, key, _ in plan:
                    hit = (cached_crops if kind == "crop" else cached_images).get(key)
                    vectors.append(np.asarray(hit[0].features[hit[1]]) if hit else encoded[(kind, key)])
                boxes = np.asarray([box for _, _, box in plan], np.float32)
                boxes, features = check_regions(raw_dir / rows[image_id]["file"], f"image {image_id}", boxes,
                                                np.stack(vectors), width, height)
                yield Regions(image_id, boxes, features, width, height)


@dataclass(frozen=True)
class RegionSource:
    """Where regions come from: ``describe`` (cache key: the kind and its settings), ``fingerprint``
    (the inputs' identity), ``inputs`` (what an error names) and ``read(ids, max_regions)``, yielding
    :class:`Regions` under the project's image ids, in any order (ids it lacks are reported by the
    cache builder, naming ``inputs``; regions past ``max_regions`` are dropped by the builder)."""

    describe: dict[str, Any]
    fingerprint: str
    inputs: str
    read: Callable[[Sequence[str], int], Iterator[Regions]]


def _stat_fingerprint(files: Iterable[Path]) -> str:
    """Published feature files are GBs: identified by resolved path, size and mtime, not hashed."""
    described = []
    for f in files:
        st = f.stat()
        described.append([str(f.resolve()), st.st_size, st.st_mtime_ns])
    return sha256_json(described)


def _id_map(ids: Sequence[str]) -> dict[str, list[str]]:
    """canonical file id → the project ids it stands for; a file id equal to a project id stands for
    that id only, otherwise for every project id it is the prefix-stripped form of."""
    exact = {canonical_id(i): [i] for i in ids}
    stripped: dict[str, list[str]] = {}
    for image_id in ids:
        for candidate in file_id_candidates(image_id)[1:]:
            if canonical_id(candidate) not in exact:
                stripped.setdefault(canonical_id(candidate), []).append(image_id)
    return exact | stripped


def tsv_source(files: Sequence[str | Path], dim: int | None = None) -> RegionSource:
    """Bottom-up-attention TSV file(s) (module doc); every file must exist."""
    paths = [Path(f) for f in files]
    if not paths:
        raise InputError("tsv_source: no TSV files given")
    for p in paths:
        if not p.is_file():
            raise CorruptArtifact(p, "missing", FIX_INPUT)

    def read(ids: Sequence[str], max_regions: int) -> Iterator[Regions]:
        mapping = _id_map(ids)
        for path in paths:
            for regions in read_butd_tsv(path, mapping.keys(), dim):
                for image_id in mapping[canonical_id(regions.image_id)]:
                    yield regions._replace(image_id=image_id)

    return RegionSource({"kind": "tsv", "files": [p.name for p in paths], "dim": dim},
                        _stat_fingerprint(paths), ", ".join(map(str, paths)), read)


def npy_source(folder: str | Path, raw_dir: str | Path | None = None, dim: int | None = None) -> RegionSource:
    """A per-image folder (module doc). ``raw_dir``: the data folder whose image tables give the image
    sizes the ``feat`` / ``.npy`` layouts lack (and file ids must resolve against its images)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise CorruptArtifact(folder, "missing (a folder of per-image region files)", FIX_INPUT)

    def read(ids: Sequence[str], max_regions: int) -> Iterator[Regions]:
        rows = image_rows(raw_dir) if raw_dir is not None else {}
        for image_id in ids:
            candidates = file_id_candidates(image_id)
            # none found: the last candidate (the published files' plain id) is the file the reader names
            file_id = next((c for c in candidates if npy_region_file(folder, c)), candidates[-1])
            file = npy_region_file(folder, file_id)
            size = None
            if file is not None and (file.suffix == ".npy" or "feat" in _npz_keys(file)) and image_id in rows:
                size = image_size(Path(raw_dir) / rows[image_id]["file"])  # the layout records none
            yield read_npy_regions(folder, file_id, size, dim)._replace(image_id=image_id)

    # The folder's listing (names, sizes, mtimes) fingerprints it: 123k stats, no reads.
    files = sorted(p for p in folder.iterdir() if p.suffix in (".npz", ".npy"))
    sibling = folder.parent / f"{folder.name[: -len('_att')]}_box" if folder.name.endswith("_att") else None
    if sibling is not None and sibling.is_dir():
        files += sorted(p for p in sibling.iterdir() if p.suffix == ".npy")
    return RegionSource({"kind": "npy", "folder": folder.name, "dim": dim}, _stat_fingerprint(files), str(folder),
                        read)


def _npz_keys(file: Path) -> list[str]:
    try:
        with np.load(file, allow_pickle=False) as data:
            return list(data.files)
    except (zipfile.BadZipFile, OSError, EOFError, ValueError):
        return []  # the reader reports the unreadable file


def objects_source(
    raw_dir: str | Path,
    objects_dir: str | Path,
    encoder_key: dict[str, Any],
    encoder: ImageEncoder,
    whole_image: bool = True,
    object_features: Sequence[Any] = (),
    image_features: Sequence[Any] = (),
) -> RegionSource:
    """The detect stage's / demo world's objects encoded with ``encoder`` (``encoder_key``: its cache-key
    description, ``teachers.image_encoder``'s first return). Fingerprint: the image tables and
    ``objects.jsonl`` (image bytes are in the tables' SHA-256 column)."""
    raw_dir, objects_dir = Path(raw_dir), Path(objects_dir)
    tables = [raw_dir / t for t in IMAGE_TABLES if (raw_dir / t).is_file()]
    if not tables:
        raise CorruptArtifact(raw_dir / IMAGE_TABLES[0], "missing", "rerun the download stage")
    if (objects_dir / "objects.jsonl").is_file():
        tables.append(objects_dir / "objects.jsonl")
    fingerprint = sha256_json([[t.parent.name + "/" + t.name, sha256_file(t)] for t in tables])
    described = {"kind": "objects", "encoder": encoder_key, "whole_image": whole_image}

    def read(ids: Sequence[str], max_regions: int) -> Iterator[Regions]:
        return regions_from_objects(raw_dir, objects_dir, ids, encoder, max_regions, whole_image,
                                    ReusedFeatures(object_features, image_features, encoder_key))

    return RegionSource(described, fingerprint, f"{raw_dir} / {objects_dir}", read)


GridEncoder = Callable[[Sequence[Path], Sequence[tuple[int, int]]], tuple[np.ndarray, np.ndarray]]


def grid_source(raw_dir: str | Path, encoder_key: dict[str, Any], encode: GridEncoder,
                chunk: int = 256) -> RegionSource:
    """A CNN's last feature map over each whole image as its regions (``regions.source: grid``; VSE++'s
    ResNet-152 features: their mean is the pooled feature). ``encode(files, sizes)`` gives ``(features
    (N, g·g, d), boxes (N, g·g, 4) xyxy pixels)``; ``encoder_key`` describes it for the cache key.
    Fingerprint: the image tables (image bytes are in their SHA-256 column)."""
    raw_dir = Path(raw_dir)
    tables = [raw_dir / t for t in IMAGE_TABLES if (raw_dir / t).is_file()]
    if not tables:
        raise CorruptArtifact(raw_dir / IMAGE_TABLES[0], "missing", "rerun the download stage")
    fingerprint = sha256_json([[t.parent.name + "/" + t.name, sha256_file(t)] for t in tables])

    def read(ids: Sequence[str], max_regions: int) -> Iterator[Regions]:
        rows = image_rows(raw_dir)
        _missing_images(raw_dir, ids, rows, IMAGE_TABLES)
        for start in range(0, len(ids), chunk):
            part = ids[start : start + chunk]
            files = [raw_dir / rows[i]["file"] for i in part]
            check_image_digests([rows[i] for i in part], files, "rerun the download stage")
            sizes = [image_size(f) for f in files]
            features, boxes = encode(files, sizes)  # (n, g·g, d), (n, g·g, 4)
            for image_id, file, (width, height), f, b in zip(part, files, sizes, features, boxes, strict=True):
                b, f = check_regions(file, f"image {image_id}", b, f, width, height)
                yield Regions(image_id, b, f, width, height)

    return RegionSource({"kind": "grid", "encoder": encoder_key}, fingerprint, str(raw_dir), read)


@dataclass(frozen=True)
class RegionStore:
    """A read-only region set: ``regions`` ``(N, n_max, d)`` memory-mapped, ``boxes`` ``(N, n_max, 5)``
    (Eq. 23), ``counts`` ``(N,)`` valid regions per image, with id → row lookup."""

    folder: Path
    ids: tuple[str, ...]
    regions: np.ndarray
    boxes: np.ndarray
    counts: np.ndarray
    meta: dict[str, Any]

    @classmethod
    def open(cls, folder: str | Path) -> RegionStore:
        """Open a set, checked first: each array's header against its size, its shape and SHA-256
        against ``index.json`` (hashed once per process per unchanged file), the shapes against each
        other and the ids, the counts within ``[1, n_max]``. A bad set raises CorruptArtifact naming
        the file."""
        folder = Path(folder)
        index = read_json_artifact(folder / "index.json", REBUILD)
        ids = index.get("ids") if isinstance(index, dict) else None
        arrays = index.get("arrays") if isinstance(index, dict) else None
        if not isinstance(ids, list) or not isinstance(arrays, dict):
            raise CorruptArtifact(folder / "index.json", "no list of ids or no array records", REBUILD)
        headers = {}
        for name in ("regions", "boxes", "counts"):
            record = arrays.get(name)
            if not isinstance(record, dict):
                raise CorruptArtifact(folder / "index.json", f"no record of {name}.npy", REBUILD)
            headers[name] = check_npy(folder / f"{name}.npy", REBUILD, shape=record.get("shape"),
                                      sha256=record.get("sha256"))
        n = len(ids)
        r, b, c = headers["regions"].shape, headers["boxes"].shape, headers["counts"].shape
        if len(r) != 3 or r[0] != n:
            raise CorruptArtifact(folder / "regions.npy", f"holds shape {r}, index.json lists {n} ids", REBUILD)
        if b != (n, r[1], 5):
            raise CorruptArtifact(folder / "boxes.npy", f"holds shape {b}, need {(n, r[1], 5)}", REBUILD)
        if c != (n,):
            raise CorruptArtifact(folder / "counts.npy", f"holds shape {c}, need {(n,)}", REBUILD)
        counts = np.load(folder / "counts.npy")
        if n and (counts.min() < 1 or counts.max() > r[1]):
            raise CorruptArtifact(folder / "counts.npy", f"counts outside [1, {r[1]}]", REBUILD)
        regions = np.load(folder / "regions.npy", mmap_mode="r")
        boxes = np.load(folder / "boxes.npy")
        return cls(folder, tuple(ids), regions, boxes, counts, index)

    @property
    def max_regions(self) -> int:
        return int(self.regions.shape[1])

    @property
    def dim(self) -> int:
        return int(self.regions.shape[2])

    def row_indices(self, ids: Sequence[str]) -> np.ndarray:
        """Row numbers ``(n,)`` of ``ids``; an unknown id is a KeyError naming the set."""
        lookup = self.__dict__.get("_lookup")
        if lookup is None:
            lookup = {k: i for i, k in enumerate(self.ids)}
            object.__setattr__(self, "_lookup", lookup)
        try:
            return np.fromiter((lookup[i] for i in ids), dtype=np.int64, count=len(ids))
        except KeyError as err:
            raise MissingEntry(f"{self.folder}: no cached regions for image {err.args[0]!r}") from None

    def take(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(regions (B, n_max, d) float32, boxes (B, n_max, 5) float32, mask (B, n_max) bool)`` of row
        numbers ``rows``; ``mask[b, j]``: slot j holds a region (padding slots are zero)."""
        rows = np.asarray(rows, dtype=np.int64)
        regions = np.asarray(self.regions[rows], dtype=np.float32)
        mask = np.arange(self.max_regions)[None, :] < self.counts[rows][:, None]
        return regions, np.asarray(self.boxes[rows], dtype=np.float32), mask

    def rows(self, ids: Sequence[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """:meth:`take` of ``ids``."""
        return self.take(self.row_indices(ids))


def region_cache_key(source: RegionSource, ids: Sequence[str], max_regions: int, dtype: str) -> str:
    return sha256_json({"source": source.describe, "data": source.fingerprint, "ids": sha256_json(list(ids)),
                        "max_regions": max_regions, "dtype": dtype, "kernels": kernels_in_force()})[:16]


def _save(path: Path, array: np.ndarray) -> dict[str, Any]:
    with open(path, "wb") as handle:
        writer = HashingWriter(handle)  # the digest is taken while writing: no second read
        np.save(writer, array)
    return {"shape": list(array.shape), "sha256": writer.hexdigest()}


def _write_set(folder: Path, ids: Sequence[str], source: RegionSource, max_regions: int, dtype: str) -> dict:
    """Fill ``folder`` with the arrays of ``ids`` streamed from ``source``; return the array records."""

    n = len(ids)
    row_of = {image_id: i for i, image_id in enumerate(ids)}
    boxes = np.zeros((n, max_regions, 5), np.float32)  # (N, n_max, 5): 720 B per image, kept in memory
    counts = np.zeros(n, np.int32)
    regions: np.ndarray | None = None  # (N, n_max, d) written through a memory map: GBs for COCO
    try:
        for item in source.read(ids, max_regions):
            i = row_of.get(item.image_id)
            if i is None or counts[i]:
                continue  # not asked for, or found before (first occurrence wins)
            if regions is None:
                regions = open_memmap(folder / "regions.npy", mode="w+", dtype=np.dtype(dtype),
                                      shape=(n, max_regions, item.features.shape[1]))
            elif item.features.shape[1] != regions.shape[2]:
                raise CorruptArtifact(source.inputs, f"image {item.image_id}: {item.features.shape[1]}-d features, "
                                                     f"earlier images' are {regions.shape[2]}-d", FIX_INPUT)
            k = min(len(item.boxes), max_regions)
            if dtype == "float16" and np.abs(item.features[:k]).max() > FLOAT16_MAX:
                raise CorruptArtifact(source.inputs, f"image {item.image_id}: feature values beyond float16's range; "
                                                     "cache them as float32", FIX_INPUT)
            regions[i, :k] = item.features[:k]
            boxes[i, :k] = normalise_boxes(item.boxes[:k], item.width, item.height)
            counts[i] = k
        missing = [ids[i] for i in np.flatnonzero(counts == 0)]
        if missing:
            raise CorruptArtifact(source.inputs, f"no regions for {len(missing)} of {n} image(s), e.g. "
                                                 f"{', '.join(missing[:5])}", FIX_INPUT)
        if regions is None:  # no ids: an empty set
            regions = open_memmap(folder / "regions.npy", mode="w+", dtype=np.dtype(dtype), shape=(0, max_regions, 0))
        regions.flush()
        shape = list(regions.shape)
    finally:
        del regions  # closes the memory map before the file is hashed and renamed
    return {"regions": {"shape": shape, "sha256": file_sha256(folder / "regions.npy")},
            "boxes": _save(folder / "boxes.npy", boxes), "counts": _save(folder / "counts.npy", counts)}


def build_region_cache(
    out_dir: str | Path,
    image_ids: Sequence[str],
    source: RegionSource,
    max_regions: int = 36,
    dtype: str = "float16",
    read_only: Sequence[str | Path] = (),
) -> tuple[RegionStore, bool]:
    """Open the cached region set of (source, inputs, ids, ``max_regions``, ``dtype``) or build it.

    ``read_only``: other caches looked in first (never written or deleted). A set that fails
    :meth:`RegionStore.open` is deleted and rebuilt. Built in a temporary folder in ``out_dir`` and
    renamed into place when complete. Returns the store and whether it was a cache hit."""
    if max_regions < 1:
        raise InputError(f"max_regions={max_regions}: must be >= 1")
    if dtype not in ("float16", "float32"):
        raise InputError(f"dtype={dtype!r}: choices float16, float32")
    ids = list(image_ids)
    if len(set(ids)) != len(ids):
        raise ValueError("build_region_cache: image_ids lists an id twice")
    set_name = f"regions-{region_cache_key(source, ids, max_regions, dtype)}"
    out_dir = Path(out_dir)
    found = find_cached_set(set_name, out_dir, read_only, RegionStore.open, "region set", "building")
    if found is not None:
        return found, True
    folder = out_dir / set_name
    out_dir.mkdir(parents=True, exist_ok=True)
    build = build_dir(out_dir, prefix=f".{set_name}.")
    try:
        arrays = _write_set(build, ids, source, max_regions, dtype)
        write_json(build / "index.json", {
            "ids": ids, "source": source.describe, "fingerprint": source.fingerprint, "max_regions": max_regions,
            "dtype": dtype, "arrays": arrays, "box_format": "x1/W, y1/H, x2/W, y2/H, area/(W*H) (DUET Eq. 23)"})
        if folder.exists():
            shutil.rmtree(folder)  # an interrupted earlier build, or the damaged set above
        os.replace(build, folder)
    finally:
        if build.exists():
            shutil.rmtree(build, ignore_errors=True)
    for name, record in arrays.items():  # hashed while writing: opening does not read GBs again
        remember_sha256(folder / f"{name}.npy", record["sha256"])
    return RegionStore.open(folder), False
