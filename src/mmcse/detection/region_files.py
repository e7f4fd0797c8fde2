"""Region features from files: bottom-up-attention TSV (6-field ``generate_tsv.py`` or LXMERT's
10-field ``obj36``) and per-image ``.npz`` / ``.npy`` files, each checked (widths, boxes inside
the image, finite values) and named in one line when it is not what DUET can read.
"""

from __future__ import annotations

import base64
import binascii
import re
import zipfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import NamedTuple

import numpy as np

from mmcse.errors import CorruptArtifact

FIX_INPUT = "re-download or re-extract the region features"


BUTD_FIELDS = ("image_id", "image_w", "image_h", "num_boxes", "boxes", "features")


LXMERT_FIELDS = ("img_id", "img_h", "img_w", "objects_id", "objects_conf", "attrs_id", "attrs_conf", "num_boxes",
                 "boxes", "features")


BOX_TOLERANCE = 1.0  # pixels a box may reach past the image edge (rounding) before it is an error; then clipped


FLOAT16_MAX = float(np.finfo(np.float16).max)


class Regions(NamedTuple):
    """One image's regions, as read from a source (unpacks as ``(image_id, boxes, features, width, height)``)."""

    image_id: str
    boxes: np.ndarray  # (n, 4) float32 x1, y1, x2, y2 in pixels of the (width, height) image
    features: np.ndarray  # (n, d) float32
    width: int
    height: int


def normalise_boxes(boxes: np.ndarray, width: float, height: float) -> np.ndarray:
    """DUET Eq. 23: pixel boxes ``(n, 4)`` xyxy → ``(n, 5)`` float32
    ``[x1/W, y1/H, x2/W, y2/H, (x2 − x1)(y2 − y1)/(W·H)]``."""
    b = np.asarray(boxes, dtype=np.float64).reshape(-1, 4)
    x1, y1, x2, y2 = b[:, 0], b[:, 1], b[:, 2], b[:, 3]
    area = (x2 - x1) * (y2 - y1) / (width * height)
    return np.stack([x1 / width, y1 / height, x2 / width, y2 / height, area], axis=1).astype(np.float32)


def check_regions(file: str | Path, where: str, boxes: np.ndarray, features: np.ndarray, width: int, height: int,
                  dim: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Validate one image's regions read from ``file`` (``where``: line / image id); return the boxes
    clipped to the image and both arrays as float32. Anything wrong is one CorruptArtifact line."""

    def bad(problem: str) -> CorruptArtifact:
        return CorruptArtifact(file, f"{where}: {problem}", FIX_INPUT)

    if width <= 0 or height <= 0:
        raise bad(f"image size {width}×{height} is not positive")
    if boxes.ndim != 2 or boxes.shape[1] != 4:
        raise bad(f"boxes have shape {boxes.shape}, need (n, 4)")
    if features.ndim != 2:
        raise bad(f"features have shape {features.shape}, need (n, d)")
    if boxes.shape[0] != features.shape[0]:
        raise bad(f"{boxes.shape[0]} boxes but {features.shape[0]} feature rows")
    if boxes.shape[0] == 0:
        raise bad("no regions")
    if dim is not None and features.shape[1] != dim:
        raise bad(f"features are {features.shape[1]}-d, expected {dim}-d")
    if not np.isfinite(boxes).all():
        raise bad("boxes hold NaN or infinite values")
    if not np.isfinite(features).all():
        raise bad("features hold NaN or infinite values")
    x1, y1, x2, y2 = boxes[:, 0], boxes[:, 1], boxes[:, 2], boxes[:, 3]
    if (x2 < x1).any() or (y2 < y1).any():
        raise bad("a box has x2 < x1 or y2 < y1 (boxes must be x1, y1, x2, y2)")
    t = BOX_TOLERANCE
    if (boxes[:, [0, 2]] < -t).any() or (boxes[:, [0, 2]] > width + t).any() or \
            (boxes[:, [1, 3]] < -t).any() or (boxes[:, [1, 3]] > height + t).any():
        raise bad(f"a box lies outside the {width}×{height} image (width and height swapped?)")
    clipped = np.empty(boxes.shape, np.float32)
    clipped[:, [0, 2]] = np.clip(boxes[:, [0, 2]], 0, width)
    clipped[:, [1, 3]] = np.clip(boxes[:, [1, 3]], 0, height)
    return clipped, np.ascontiguousarray(features, dtype=np.float32)


_COCO_NAME = re.compile(r"COCO_[A-Za-z]+\d*_(\d+)")  # LXMERT's COCO ids: COCO_val2014_000000000042


def canonical_id(file_id: str) -> str:
    """An id as published files are matched: digit-only ids as integers (no leading zeros), COCO
    file names (``COCO_val2014_000000000042``) as their integer COCO id."""
    named = _COCO_NAME.fullmatch(file_id)
    if named:
        file_id = named.group(1)
    return str(int(file_id)) if file_id.isdigit() else file_id


def file_id_candidates(image_id: str) -> list[str]:
    """The ids a published file may use for ``image_id``: itself, then without its ``<dataset>-`` prefix."""
    out = [image_id]
    if "-" in image_id:
        out.append(image_id.split("-", 1)[1])
    return out


def _b64(file: Path, where: str, name: str, data: bytes) -> bytes:
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as err:
        raise CorruptArtifact(file, f"{where}: field {name} is not valid base64 (truncated?): {err}", FIX_INPUT) \
            from None


def read_butd_tsv(path: str | Path, wanted_ids: Iterable[str] | None = None, dim: int | None = None
                  ) -> Iterator[Regions]:
    """Regions of a bottom-up-attention TSV (6-field or LXMERT 10-field layout, see the module doc),
    in file order, only the images whose :func:`canonical_id` is in ``wanted_ids`` (None: all).
    ``dim``: the feature width required (None: the first row's, then every row must match).
    Yields the file's own ids; boxes ``(n, 4)`` xyxy pixels clipped to the image, features ``(n, d)``."""
    path = Path(path)
    if not path.is_file():
        raise CorruptArtifact(path, "missing", FIX_INPUT)
    wanted = None if wanted_ids is None else {canonical_id(i) for i in wanted_ids}
    with open(path, "rb") as handle:
        for lineno, raw in enumerate(handle, 1):
            line = raw.rstrip(b"\r\n")
            if not line.strip():
                continue
            fields = line.split(b"\t")
            if len(fields) == len(BUTD_FIELDS):
                file_id, w, h, n, boxes_b64, feats_b64 = fields
            elif len(fields) == len(LXMERT_FIELDS):
                file_id, h, w, _, _, _, _, n, boxes_b64, feats_b64 = fields
            else:
                raise CorruptArtifact(
                    path, f"line {lineno}: {len(fields)} tab-separated fields; the bottom-up-attention TSV has "
                    f"{len(BUTD_FIELDS)} ({', '.join(BUTD_FIELDS)}) and LXMERT's {len(LXMERT_FIELDS)} "
                    f"({', '.join(LXMERT_FIELDS)})", FIX_INPUT)
            image_id = file_id.decode("utf-8", "replace")
            if wanted is not None and canonical_id(image_id) not in wanted:
                continue  # not decoded: a 123k-line file is skimmed for the few images asked for
            where = f"line {lineno} (image {image_id})"
            try:
                width, height, count = int(w), int(h), int(n)
            except ValueError:
                raise CorruptArtifact(path, f"{where}: image size / num_boxes are not integers", FIX_INPUT) from None
            if count <= 0:
                raise CorruptArtifact(path, f"{where}: num_boxes is {count}", FIX_INPUT)
            box_bytes = _b64(path, where, "boxes", boxes_b64)
            feat_bytes = _b64(path, where, "features", feats_b64)
            if len(box_bytes) != count * 4 * 4:
                raise CorruptArtifact(path, f"{where}: boxes decode to {len(box_bytes)} bytes, num_boxes={count} "
                                            f"needs {count} × 4 × 4 = {count * 16}", FIX_INPUT)
            if dim is None:
                if len(feat_bytes) == 0 or len(feat_bytes) % (count * 4):
                    raise CorruptArtifact(path, f"{where}: features decode to {len(feat_bytes)} bytes, not a "
                                                f"multiple of num_boxes × 4 = {count * 4}", FIX_INPUT)
                dim = len(feat_bytes) // (count * 4)
            elif len(feat_bytes) != count * dim * 4:
                raise CorruptArtifact(path, f"{where}: features decode to {len(feat_bytes)} bytes, num_boxes={count} "
                                            f"× {dim}-d × 4 needs {count * dim * 4}", FIX_INPUT)
            boxes = np.frombuffer(box_bytes, dtype="<f4").reshape(count, 4)
            features = np.frombuffer(feat_bytes, dtype="<f4").reshape(count, dim)
            boxes, features = check_regions(path, where, boxes, features, width, height, dim)
            yield Regions(image_id, boxes, features, width, height)


def _load_npz(file: Path) -> dict[str, np.ndarray]:
    """The numeric arrays of an ``.npz`` (pickled entries, e.g. bua's ``info`` dict, are skipped)."""
    try:
        with np.load(file, allow_pickle=False) as data:
            out = {}
            for key in data.files:
                try:
                    out[key] = data[key]
                except ValueError:  # an object array: needs pickle, and nothing here reads it
                    continue
            return out
    except (zipfile.BadZipFile, OSError, EOFError, ValueError, KeyError) as err:
        raise CorruptArtifact(file, f"unreadable .npz ({type(err).__name__}: {str(err)[:200]})", FIX_INPUT) from None


def _load_npy(file: Path) -> np.ndarray:
    if not file.is_file():
        raise CorruptArtifact(file, "missing", FIX_INPUT)
    try:
        return np.load(file, allow_pickle=False)
    except (OSError, EOFError, ValueError) as err:
        raise CorruptArtifact(file, f"unreadable .npy ({type(err).__name__}: {str(err)[:200]})", FIX_INPUT) from None


def _scalar(file: Path, data: dict[str, np.ndarray], key: str) -> int:
    try:
        return int(np.asarray(data[key]).reshape(()))
    except (ValueError, TypeError):
        raise CorruptArtifact(file, f"{key} is not one integer", FIX_INPUT) from None


def npy_region_file(folder: str | Path, file_id: str) -> Path | None:
    """The per-image file of ``file_id`` in ``folder`` (``.npz`` first, then ``.npy``), None if neither."""
    folder = Path(folder)
    for name in (f"{file_id}.npz", f"{file_id}.npy"):
        if (folder / name).is_file():
            return folder / name
    return None


def read_npy_regions(folder: str | Path, file_id: str, image_size: tuple[int, int] | None = None,
                     dim: int | None = None) -> Regions:
    """One image's regions from a per-image folder (the three layouts in the module doc).
    ``image_size`` ``(width, height)``: needed by the layouts that record none (``feat``-only ``.npz``,
    ``.npy`` + ``_boxes.npy``). A missing or malformed file raises CorruptArtifact naming it."""
    folder = Path(folder)
    file = npy_region_file(folder, file_id)
    if file is None:
        raise CorruptArtifact(folder / f"{file_id}.npz", f"missing (nor is there {file_id}.npy)", FIX_INPUT)
    where = f"image {file_id}"
    size_from: Path = file
    width = height = None
    if file.suffix == ".npz":
        data = _load_npz(file)
        if "x" in data and "bbox" in data:
            features, boxes = np.asarray(data["x"]), np.asarray(data["bbox"])
            if boxes.ndim == 2 and features.ndim == 2 and features.shape[0] != boxes.shape[0] \
                    and features.shape[1] == boxes.shape[0]:
                features = features.T  # extract_feature_to_npz.py stores x as (d, n)
            if "num_bbox" in data and _scalar(file, data, "num_bbox") != boxes.shape[0]:
                raise CorruptArtifact(file, f"{where}: num_bbox={_scalar(file, data, 'num_bbox')} but bbox has "
                                            f"{boxes.shape[0]} rows", FIX_INPUT)
            if "image_w" in data and "image_h" in data:
                width, height = _scalar(file, data, "image_w"), _scalar(file, data, "image_h")
        elif "feat" in data:
            features = np.asarray(data["feat"])
            if not folder.name.endswith("_att"):
                raise CorruptArtifact(file, f"{where}: holds only 'feat'; its boxes are looked for in a sibling "
                                            "<name>_box folder, which needs the folder to be named <name>_att",
                                      FIX_INPUT)
            size_from = folder.parent / f"{folder.name[: -len('_att')]}_box" / f"{file_id}.npy"
            boxes = _load_npy(size_from)
        else:
            raise CorruptArtifact(file, f"{where}: holds {sorted(data)}, need 'x' and 'bbox' (bottom-up-attention "
                                        "npz) or 'feat' (make_bu_data)", FIX_INPUT)
    else:
        features = _load_npy(file)
        size_from = folder / f"{file_id}_boxes.npy"
        boxes = _load_npy(size_from)
    if width is None or height is None:
        if image_size is None:
            raise CorruptArtifact(size_from, f"{where}: the layout records no image size and none was given",
                                  FIX_INPUT)
        width, height = int(image_size[0]), int(image_size[1])
    if not (np.issubdtype(features.dtype, np.number) and np.issubdtype(boxes.dtype, np.number)):
        raise CorruptArtifact(file, f"{where}: arrays are not numeric ({features.dtype}, {boxes.dtype})", FIX_INPUT)
    boxes, features = check_regions(file, where, boxes.astype(np.float32), features.astype(np.float32),
                                     width, height, dim)
    return Regions(file_id, boxes, features, width, height)
