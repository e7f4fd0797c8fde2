"""Phrase grounding output → object–phrase pairs with character spans (MCSEO §3.3).

Florence-2's ``<CAPTION_TO_PHRASE_GROUNDING>`` task, after the processor's
``post_process_generation``, returns ``{"<CAPTION_TO_PHRASE_GROUNDING>": {"bboxes":
[[x0, y0, x1, y1], ...], "labels": ["a green car", ...]}}`` in pixel coordinates; a label
may repeat (one box per instance) and may differ from the caption in case, spacing or
punctuation. This module maps each label back to its character span in the caption (so
detect_objects can turn it into a token span) and cleans the boxes; the model call itself
belongs to the ``sam2`` detect backend.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

TASK = "<CAPTION_TO_PHRASE_GROUNDING>"
_WORD = re.compile(r"[0-9A-Za-z]+")


@dataclass(frozen=True)
class GroundedPhrase:
    phrase: str  # the caption's own text of the span
    start: int  # character span [start, end) in the caption
    end: int
    box: tuple[int, int, int, int]  # x0, y0, x1, y1 in pixels, clipped to the image


def _words(text: str) -> list[tuple[str, int, int]]:
    return [(m.group().lower(), m.start(), m.end()) for m in _WORD.finditer(text)]


def find_span(caption: str, label: str, taken: list[tuple[int, int]]) -> tuple[int, int] | None:
    """The first span of ``caption`` whose words equal ``label``'s words (case, spacing and
    punctuation ignored) and that overlaps no span in ``taken``; None when there is none."""
    target = [w for w, _, _ in _words(label)]
    if not target:
        return None
    words = _words(caption)
    for i in range(len(words) - len(target) + 1):
        if [w for w, _, _ in words[i : i + len(target)]] == target:
            start, end = words[i][1], words[i + len(target) - 1][2]
            if all(end <= a or start >= b for a, b in taken):
                return start, end
    return None


def clip_box(box: Any, width: int, height: int) -> tuple[int, int, int, int] | None:
    """A box covering whole pixels, clipped to the image; None if malformed or empty."""
    try:
        x0, y0, x1, y1 = (float(v) for v in box)
    except (TypeError, ValueError):
        return None
    if not all(math.isfinite(v) for v in (x0, y0, x1, y1)):
        return None
    x0, x1 = sorted((x0, x1))
    y0, y1 = sorted((y0, y1))
    px = (max(math.floor(x0), 0), max(math.floor(y0), 0), min(math.ceil(x1), width), min(math.ceil(y1), height))
    return px if px[2] > px[0] and px[3] > px[1] else None


def parse_grounding(
    output: dict[str, Any], caption: str, width: int, height: int
) -> tuple[list[GroundedPhrase], dict[str, int]]:
    """Object–phrase pairs from a post-processed grounding ``output`` for ``caption``.

    Repeated labels take successive occurrences in the caption; when a label occurs fewer
    times than it has boxes, the extra boxes are further instances of the same phrase and
    are dropped (one object per phrase, as MCSEO pairs them). Returns the pairs in caption
    order and counts of what was dropped (``unmatched`` labels, ``bad_boxes``, ``repeats``).
    """
    result = output.get(TASK, output)
    boxes, labels = result.get("bboxes", []), result.get("labels", [])
    if len(boxes) != len(labels):
        raise ValueError(f"grounding output has {len(boxes)} boxes but {len(labels)} labels")
    taken: list[tuple[int, int]] = []
    pairs: list[GroundedPhrase] = []
    dropped = {"unmatched": 0, "bad_boxes": 0, "repeats": 0}
    matched: set[str] = set()  # labels (as words) that already took a span
    for raw_box, label in zip(boxes, labels, strict=True):
        box = clip_box(raw_box, width, height)
        if box is None:
            dropped["bad_boxes"] += 1
            continue
        key = " ".join(w for w, _, _ in _words(label))
        span = find_span(caption, label, taken)
        if span is None:
            dropped["repeats" if key in matched else "unmatched"] += 1
            continue
        matched.add(key)
        taken.append(span)
        pairs.append(GroundedPhrase(caption[span[0] : span[1]], span[0], span[1], box))
    return sorted(pairs, key=lambda p: p.start), dropped
