"""The ``detect_objects`` stage: image–caption pairs → object–phrase pairs (MCSEO §3.3).

Backend ``annotations`` uses the generator's ground-truth boxes, masks and phrase
character spans. Each object is cropped to its box and pasted on a transparent
background (alpha = its mask); each phrase's character span becomes a token span
of the student's tokenizer. As MCSEO does, phrases cut off by the maximum sequence
length are dropped, and so are pairs left with fewer than ``min_objects`` objects.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image
from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerBase

from mmcse.config import DetectConfig
from mmcse.io import atomic_path, open_image, read_jsonl, write_jsonl


def char_span_to_token_span(offsets: list[tuple[int, int]], start: int, end: int) -> tuple[int, int] | None:
    """Token indices ``[first, last)`` covering characters ``[start, end)``; None if any part
    of the span fell outside the kept (non-truncated) tokens. Special tokens have (0, 0)."""
    tokens = [i for i, (a, b) in enumerate(offsets) if b > a and a < end and b > start]
    if not tokens:
        return None
    kept_end = max(b for a, b in offsets if b > a)
    if kept_end < end:  # truncation cut the phrase
        return None
    return tokens[0], tokens[-1] + 1


def object_crop(image: Image.Image, labels: np.ndarray, object_index: int, box: list[int]) -> Image.Image:
    """The object's box as RGBA with every non-object pixel fully transparent."""
    x0, y0, x1, y1 = box
    rgb = np.asarray(image.convert("RGB"))[y0:y1, x0:x1]  # (h, w, 3)
    alpha = (labels[y0:y1, x0:x1] == object_index + 1).astype(np.uint8) * 255  # (h, w)
    return Image.fromarray(np.dstack([rgb, alpha]), "RGBA")


def detect_objects(
    data_dir: str | Path,
    out_dir: str | Path,
    cfg: DetectConfig,
    tokenizer: PreTrainedTokenizerBase,
    max_seq_len: int,
) -> dict[str, Any]:
    """Write ``objects.jsonl`` and ``crops/`` under ``out_dir``; return counts for metrics."""
    data_dir, out_dir = Path(data_dir), Path(out_dir)
    images = {row["image_id"]: row for row in read_jsonl(data_dir / "images.jsonl")}
    pairs = read_jsonl(data_dir / "pairs.jsonl")
    stats = {"pairs_in": len(pairs), "pairs_kept": 0, "pairs_too_few_objects": 0, "phrases_truncated": 0}
    rows = []
    crops_done: set[tuple[str, int]] = set()
    for pair in tqdm(pairs, desc="detect_objects: annotations", unit="pair"):
        caption = pair["caption"]
        if not caption.strip():
            raise ValueError(f"{data_dir / 'pairs.jsonl'}: pair {pair['pair_id']} has an empty caption")
        image_row = images.get(pair["image_id"])
        if image_row is None:
            raise KeyError(f"{data_dir / 'pairs.jsonl'}: pair {pair['pair_id']} names unknown image")
        enc = tokenizer(caption, truncation=True, max_length=max_seq_len, return_offsets_mapping=True)
        offsets = [tuple(o) for o in enc["offset_mapping"]]
        objects = []
        for phrase in pair["phrases"]:
            span = char_span_to_token_span(offsets, phrase["start"], phrase["end"])
            if span is None:
                stats["phrases_truncated"] += 1
                continue
            k = phrase["object"]
            objects.append(
                {
                    "object": k,
                    "crop": f"crops/{pair['image_id']}-o{k}.png",
                    "box": image_row["objects"][k]["box"],
                    "char_start": phrase["start"],
                    "char_end": phrase["end"],
                    "phrase": caption[phrase["start"] : phrase["end"]],
                    "token_start": span[0],
                    "token_end": span[1],
                }
            )
        if len(objects) < cfg.min_objects:
            stats["pairs_too_few_objects"] += 1
            continue
        for obj in objects:
            key = (pair["image_id"], obj["object"])
            if key in crops_done:
                continue
            image = open_image(data_dir / image_row["file"], "rerun the download stage")
            labels = np.asarray(open_image(data_dir / image_row["mask"], "rerun the download stage"))
            with atomic_path(out_dir / obj["crop"]) as tmp:
                object_crop(image, labels, obj["object"], obj["box"]).save(tmp, format="PNG")
            crops_done.add(key)
        rows.append({"pair_id": pair["pair_id"], "image_id": pair["image_id"], "objects": objects})
        stats["pairs_kept"] += 1
    stats["objects"] = sum(len(r["objects"]) for r in rows)
    stats["crops"] = len(crops_done)
    write_jsonl(out_dir / "objects.jsonl", rows)
    return stats
