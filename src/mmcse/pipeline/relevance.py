"""Stage ``relevance``: the caption-to-image relevance matrices of graded NDCG (TERAN's protocol), keyed by
the retrieval test set's captions and their images (computed once)."""

from __future__ import annotations

from typing import Any

from mmcse.config import Config
from mmcse.errors import InputError
from mmcse.evaluation.ndcg import relevance_key, relevance_matrix
from mmcse.io import read_jsonl
from mmcse.pipeline.paths import Paths


def test_captions(paths: Paths) -> tuple[list[str], list[int]]:
    """The retrieval test set's captions and each one's image (its row in ``retrieval/images.jsonl``)."""
    table = paths.raw / "retrieval" / "captions.jsonl"
    if not table.is_file():
        return [], []
    rows = read_jsonl(table)
    index = {row["image_id"]: i for i, row in enumerate(read_jsonl(paths.raw / "retrieval" / "images.jsonl"))}
    missing = sorted({r["image_id"] for r in rows} - set(index))
    if missing:
        raise InputError(f"{table}: captions of images {missing[:5]} that retrieval/images.jsonl does not list")
    return [row["caption"] for row in rows], [index[row["image_id"]] for row in rows]


def run_relevance(cfg: Config, paths: Paths) -> dict[str, Any]:
    """Relevance of the retrieval test set's captions to its images for each ``evaluate.ndcg.relevance``
    kind (`mmcse.evaluation.ndcg.relevance_matrix`) into ``paths.relevance``, computed once per set of
    captions; files of other caption sets are removed (the folder is this stage's DVC output)."""

    paths.relevance.mkdir(parents=True, exist_ok=True)
    captions, text_image = test_captions(paths)
    kinds = list(cfg.evaluate.ndcg.relevance) if captions else []
    keep = {f"{kind}-{relevance_key(captions, text_image, kind)}.npy" for kind in kinds}
    for stale in paths.relevance.glob("*.npy"):
        if stale.name not in keep:
            stale.unlink()
    for kind in kinds:
        relevance_matrix(captions, text_image, kind, paths.relevance)
    return {"captions": len(captions), "kinds": kinds}


def relevance_for(paths: Paths, captions: list[str], text_image: Any, kind: str) -> Any:
    """The relevance matrix of ``captions`` to their images (``text_image``): the relevance stage's file when
    it has them, else computed (once, cached) under ``<data>/upstream/relevance`` (an ablation job whose data
    differ)."""

    top = paths.relevance / f"{kind}-{relevance_key(captions, text_image, kind)}.npy"
    return relevance_matrix(captions, text_image, kind, paths.relevance if top.is_file() else
                            paths.raw.parent / "upstream" / "relevance")
