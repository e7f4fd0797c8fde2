"""The ``detect_objects`` stage: image–caption pairs → object–phrase pairs (MCSEO §3.3).

Backend ``annotations`` uses the generator's ground-truth boxes, masks and phrase
character spans; backend ``sam2`` (:mod:`mmcse.detection.sam2`) finds them with MCSEO's models,
Florence-2 phrase grounding and SAM 2. Either way each object is cropped to its box and
pasted on a transparent background (alpha = its mask), each phrase's character span
becomes a token span of the student's tokenizer, and, as MCSEO does, phrases cut off by
the maximum sequence length are dropped, and so are pairs left with fewer than
``min_objects`` objects. Both write the same ``objects.jsonl`` rows.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerBase

from mmcse.config import DetectConfig
from mmcse.detection.crops import (
    caption_offsets,
    char_span_to_token_span,
    masked_crop,
    object_crop,
    object_record,
    write_objects,
)
from mmcse.detection.sam2 import detect_objects_sam2
from mmcse.errors import InputError, MissingEntry
from mmcse.io import atomic_path, open_image, read_jsonl

log = logging.getLogger(__name__)


def detect_objects(
    data_dir: str | Path,
    out_dir: str | Path,
    cfg: DetectConfig,
    tokenizer: PreTrainedTokenizerBase,
    max_seq_len: int,
    device: str = "cpu",
) -> dict[str, Any]:
    """Image–caption pairs → object–phrase pairs (MCSEO §3.3) with ``cfg.backend``: write
    ``objects.jsonl`` and ``crops/`` under ``out_dir``; return counts for metrics.
    ``device`` (``base.device``) runs the sam2 backend's models."""
    if cfg.backend == "sam2":

        return detect_objects_sam2(data_dir, out_dir, cfg, tokenizer, max_seq_len, device)
    return detect_objects_annotations(data_dir, out_dir, cfg, tokenizer, max_seq_len)


def detect_objects_annotations(
    data_dir: str | Path,
    out_dir: str | Path,
    cfg: DetectConfig,
    tokenizer: PreTrainedTokenizerBase,
    max_seq_len: int,
) -> dict[str, Any]:
    """Backend ``annotations``: the pairs' own phrase spans and their objects' boxes — the demo
    generator's (with label masks) or Flickr30k Entities' (boxes only: the whole box is the
    object). Pairs without phrase annotations are counted (``pairs_unannotated``)."""
    data_dir, out_dir = Path(data_dir), Path(out_dir)
    images = {row["image_id"]: row for row in read_jsonl(data_dir / "images.jsonl")}
    pairs = read_jsonl(data_dir / "pairs.jsonl")
    stats = {"pairs_in": len(pairs), "pairs_kept": 0, "pairs_too_few_objects": 0, "phrases_truncated": 0,
             "pairs_unannotated": 0}
    rows = []
    crops_done: set[tuple[str, int]] = set()
    for pair in tqdm(pairs, desc="detect_objects: annotations", unit="pair"):
        stats["pairs_unannotated"] += not pair.get("phrases")
        caption = pair["caption"]
        if not caption.strip():
            raise InputError(f"{data_dir / 'pairs.jsonl'}: pair {pair['pair_id']} has an empty caption")
        image_row = images.get(pair["image_id"])
        if image_row is None:
            raise MissingEntry(f"{data_dir / 'pairs.jsonl'}: pair {pair['pair_id']} names unknown image")
        offsets = caption_offsets(tokenizer, caption, max_seq_len)
        objects = []
        for phrase in pair["phrases"]:
            span = char_span_to_token_span(offsets, phrase["start"], phrase["end"])
            if span is None:
                stats["phrases_truncated"] += 1
                continue
            k = phrase["object"]
            objects.append(object_record(k, f"crops/{pair['image_id']}-o{k}.png", image_row["objects"][k]["box"],
                                         caption, phrase["start"], phrase["end"], span))
        if len(objects) < cfg.min_objects:
            stats["pairs_too_few_objects"] += 1
            continue
        todo = [obj for obj in objects if (pair["image_id"], obj["object"]) not in crops_done]
        if todo:
            image = open_image(data_dir / image_row["file"], "rerun the download stage")
            labels = (np.asarray(open_image(data_dir / image_row["mask"], "rerun the download stage"))
                      if "mask" in image_row else None)
        for obj in todo:
            if labels is None:  # boxes only: clipped to the image, every pixel of the box is the object
                x0, y0, x1, y1 = obj["box"]
                obj["box"] = [max(x0, 0), max(y0, 0), min(x1, image.width), min(y1, image.height)]
                crop = masked_crop(image, np.ones((image.height, image.width), bool), obj["box"])
            else:
                crop = object_crop(image, labels, obj["object"], obj["box"])
            with atomic_path(out_dir / obj["crop"]) as tmp:
                crop.save(tmp, format="PNG")
            crops_done.add((pair["image_id"], obj["object"]))
        rows.append({"pair_id": pair["pair_id"], "image_id": pair["image_id"], "objects": objects})
        stats["pairs_kept"] += 1
    stats["objects"] = sum(len(r["objects"]) for r in rows)
    stats["crops"] = len(crops_done)
    if pairs and stats["pairs_unannotated"] == len(pairs):
        log.warning("%s: no pair has phrase annotations, so no object–phrase pairs (MCSEO needs them): use "
                    "detect.backend sam2, or data.annotations flickr30k_entities with Flickr30k", data_dir)
    write_objects(out_dir, rows)
    return stats
