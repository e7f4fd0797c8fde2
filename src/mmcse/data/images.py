"""Images as pixels for a model that runs its CNN in the training loop (VSE++ with
``model.vsepp.image_input: pixels``): the data folder's image tables, the training crop and the
evaluation crop.

The crops are VSE++'s (fartashf/vsepp ``data.py`` ``get_transform``): training takes a random crop of
random area and aspect (torchvision's RandomResizedCrop: area 8–100 % of the image, aspect 3/4–4/3,
resized to ``crop``) flipped left–right half the time; evaluation resizes the shorter side to 8/7 of
``crop`` (256 for 224) and takes the center ``crop``. Both end in ImageNet's mean and std.

A training crop is drawn from a generator seeded by (seed, step, position in the batch), not from
torch's global state: a resumed run crops its replayed batches as the first run did, and decoding in
threads cannot reorder the draws.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from mmcse.errors import CorruptArtifact, MissingEntry
from mmcse.io import open_image, read_jsonl

IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
CROP_AREA, CROP_ASPECT = (0.08, 1.0), (3 / 4, 4 / 3)  # torchvision RandomResizedCrop's defaults (VSE++ keeps them)

# training, retrieval test, retrieval validation; a table an older data folder lacks is skipped
IMAGE_TABLES = ("images.jsonl", "retrieval/images.jsonl", "retrieval/val_images.jsonl")


def image_rows(raw_dir: str | Path, tables: Sequence[str] = IMAGE_TABLES) -> dict[str, dict[str, Any]]:
    """Image rows by id from the data folder's image tables that exist (training, retrieval test, then
    retrieval validation; a table an older data folder lacks is skipped)."""
    raw_dir = Path(raw_dir)
    rows: dict[str, dict[str, Any]] = {}
    for table in tables:
        if (raw_dir / table).is_file():
            for row in read_jsonl(raw_dir / table):
                rows.setdefault(row["image_id"], row)
    return rows


def random_crop_box(width: int, height: int, rng: np.random.Generator,
                    area: tuple[float, float] = CROP_AREA,
                    aspect: tuple[float, float] = CROP_ASPECT) -> tuple[int, int, int, int]:
    """``(top, left, h, w)`` of a random crop of a ``width`` × ``height`` image: area a uniform fraction
    of ``area``, aspect log-uniform in ``aspect``, at a uniform position; ten tries, then the largest
    center crop whose aspect is within bounds (the rule of torchvision's RandomResizedCrop)."""
    total = width * height
    log_lo, log_hi = math.log(aspect[0]), math.log(aspect[1])
    for _ in range(10):
        target = total * rng.uniform(*area)
        ratio = math.exp(rng.uniform(log_lo, log_hi))
        w, h = round(math.sqrt(target * ratio)), round(math.sqrt(target / ratio))
        if 0 < w <= width and 0 < h <= height:
            return int(rng.integers(0, height - h + 1)), int(rng.integers(0, width - w + 1)), h, w
    ratio = width / height
    if ratio < aspect[0]:
        w, h = width, round(width / aspect[0])
    elif ratio > aspect[1]:
        w, h = round(height * aspect[1]), height
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


def _to_tensor(img: Image.Image) -> torch.Tensor:
    from torchvision.transforms import functional as TF

    return TF.normalize(TF.to_tensor(img), IMAGENET_MEAN, IMAGENET_STD)  # (3, H, W)


def train_crop(img: Image.Image, crop: int, rng: np.random.Generator) -> torch.Tensor:
    """VSE++'s training transform of one image: a `random_crop_box` resized to ``crop`` × ``crop``
    (bilinear, antialiased), flipped left–right with probability 1/2, normalised: ``(3, crop, crop)``."""
    from torchvision.transforms import InterpolationMode
    from torchvision.transforms import functional as TF

    top, left, h, w = random_crop_box(img.width, img.height, rng)
    out = TF.resized_crop(img, top, left, h, w, [crop, crop], InterpolationMode.BILINEAR, antialias=True)
    if rng.random() < 0.5:
        out = TF.hflip(out)
    return _to_tensor(out)


def eval_crop(img: Image.Image, crop: int) -> torch.Tensor:
    """VSE++'s evaluation transform: the shorter side to round(crop·8/7) (256 for 224), the center
    ``crop``, normalised: ``(3, crop, crop)``."""
    from torchvision.transforms import InterpolationMode
    from torchvision.transforms import functional as TF

    resized = TF.resize(img, [round(crop * 256 / 224)], InterpolationMode.BILINEAR, antialias=True)
    return _to_tensor(TF.center_crop(resized, [crop, crop]))


class ImagePixels:
    """The image files of ``ids`` in a data folder, read as pixel batches: `train_batch` (random crops
    keyed by seed and step) and `eval_batch` (center crops); ``workers`` threads decode a batch."""

    def __init__(self, raw_dir: str | Path, ids: Sequence[str], crop: int, workers: int = 2) -> None:
        raw_dir = Path(raw_dir)
        rows = image_rows(raw_dir)
        missing = [i for i in dict.fromkeys(ids) if i not in rows]
        if missing:
            raise MissingEntry(f"{raw_dir}: no image row for {len(missing)} id(s) in "
                           f"{', '.join(t for t in IMAGE_TABLES if (raw_dir / t).is_file())}, "
                           f"e.g. {', '.join(missing[:5])}")
        self.ids = list(dict.fromkeys(ids))
        self.files = [raw_dir / rows[i]["file"] for i in self.ids]
        absent = [f for f in self.files if not f.is_file()]
        if absent:
            raise CorruptArtifact(absent[0], f"missing ({len(absent)} image file(s) of the tables are)",
                                  "rerun the download stage (dvc repro download)")
        self._row = {image_id: i for i, image_id in enumerate(self.ids)}
        self.crop, self.workers = int(crop), max(1, int(workers))

    def row_indices(self, ids: Sequence[str]) -> np.ndarray:
        """``(N,)`` rows of ``ids`` (a KeyError names an id this set does not hold)."""
        try:
            return np.asarray([self._row[i] for i in ids], dtype=np.int64)
        except KeyError as err:
            raise MissingEntry(f"image {err.args[0]} is not among this set's {len(self.ids)} images") from None

    def _read(self, rows: np.ndarray, transform) -> torch.Tensor:
        def one(k: int) -> torch.Tensor:
            img = open_image(self.files[int(rows[k])], "rerun the download stage (dvc repro download)")
            return transform(k, img.convert("RGB"))

        with ThreadPoolExecutor(self.workers) as pool:  # PIL decodes and resizes outside the GIL
            return torch.stack(list(pool.map(one, range(len(rows)))))  # (B, 3, crop, crop)

    def train_batch(self, rows: np.ndarray, seed: int, step: int) -> torch.Tensor:
        """``(B, 3, crop, crop)`` training crops of ``rows``; position k of step ``step`` draws from
        the generator seeded (seed, step, k), so the batch is a pure function of its arguments."""
        return self._read(rows, lambda k, img: train_crop(img, self.crop, np.random.default_rng([seed, step, k])))

    def eval_batch(self, rows: np.ndarray) -> torch.Tensor:
        """``(B, 3, crop, crop)`` center crops of ``rows``."""
        return self._read(rows, lambda k, img: eval_crop(img, self.crop))


class OneAhead:
    """Batches one step ahead: while step s trains, ``make(s + 1)`` runs in a background thread (decoding
    and cropping release the GIL), so the accelerator does not wait for the next batch. ``make`` must be a
    pure function of the step (`ImagePixels.train_batch` is): a batch that was not prefetched, after a
    resume or a skipped step, is made on the spot and is the same batch."""

    def __init__(self, make: Any) -> None:
        self.make = make
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="mmcse-prefetch")
        self.pending: tuple[int, Any] | None = None

    def get(self, step: int, next_step: int | None) -> Any:
        """The batch of ``step``; ``next_step``'s (None: no more) starts being made."""
        if self.pending is not None and self.pending[0] == step:
            batch = self.pending[1].result()  # an error in the thread is raised here, in the training step
        else:
            if self.pending is not None:
                self.pending[1].cancel()
            batch = self.make(step)
        self.pending = (next_step, self.pool.submit(self.make, next_step)) if next_step is not None else None
        return batch

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
