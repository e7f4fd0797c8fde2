"""Object crops and phrase spans, shared by both detect backends (`mmcse.detection.objects`,
`mmcse.detection.sam2`): an object cut out on a transparent background, a phrase's character
span as token positions, and the ``objects.jsonl`` table both write.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image
from transformers import PreTrainedTokenizerBase

from mmcse.io import write_jsonl


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


def masked_crop(image: Image.Image, mask: np.ndarray, box: Sequence[int]) -> Image.Image:
    """``box`` (x0, y0, x1, y1, end exclusive) of ``image`` as RGBA: alpha 255 where the
    ``(H, W)`` boolean ``mask`` is set, fully transparent everywhere else."""
    x0, y0, x1, y1 = box
    rgb = np.asarray(image.convert("RGB"))[y0:y1, x0:x1]  # (h, w, 3)
    alpha = np.asarray(mask, dtype=bool)[y0:y1, x0:x1].astype(np.uint8) * 255  # (h, w)
    return Image.fromarray(np.dstack([rgb, alpha]), "RGBA")


def object_crop(image: Image.Image, labels: np.ndarray, object_index: int, box: list[int]) -> Image.Image:
    """The object's box as RGBA with every non-object pixel fully transparent (``labels``:
    the ``(H, W)`` label map, 0 = background, k + 1 = object k)."""
    return masked_crop(image, labels == object_index + 1, box)


def caption_offsets(tokenizer: PreTrainedTokenizerBase, caption: str, max_seq_len: int) -> list[tuple[int, int]]:
    """Character offsets of the caption's tokens as the student sees them (truncated to
    ``max_seq_len``, special tokens (0, 0)), for :func:`char_span_to_token_span`."""
    enc = tokenizer(caption, truncation=True, max_length=max_seq_len, return_offsets_mapping=True)
    return [tuple(o) for o in enc["offset_mapping"]]


def object_record(
    object_id: int, crop: str, box: Sequence[int], caption: str, start: int, end: int, span: tuple[int, int]
) -> dict[str, Any]:
    """One object of an ``objects.jsonl`` row: what training reads, whatever the backend."""
    return {
        "object": object_id,
        "crop": crop,
        "box": [int(v) for v in box],
        "char_start": start,
        "char_end": end,
        "phrase": caption[start:end],
        "token_start": span[0],
        "token_end": span[1],
    }


def write_objects(out_dir: Path, rows: list[dict[str, Any]]) -> None:
    """Write ``objects.jsonl`` and delete crops no row names (``data/objects`` persists
    between runs, so a changed config or backend must not leave stale crops behind)."""
    write_jsonl(out_dir / "objects.jsonl", rows)
    named = {o["crop"] for row in rows for o in row["objects"]}
    crops = out_dir / "crops"
    if crops.is_dir():
        for path in crops.iterdir():
            if path.is_file() and f"crops/{path.name}" not in named:
                path.unlink()
