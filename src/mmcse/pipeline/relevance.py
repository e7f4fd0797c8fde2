"""Stage ``relevance``: the caption–caption relevance matrices of graded NDCG, keyed by the captions
(computed once)."""

from __future__ import annotations

from typing import Any

from mmcse.config import Config
from mmcse.evaluation.ndcg import relevance_key, relevance_matrix
from mmcse.io import read_jsonl
from mmcse.pipeline.paths import Paths


def run_relevance(cfg: Config, paths: Paths) -> dict[str, Any]:
    """Caption relevance of the retrieval test set for each ``evaluate.ndcg.relevance`` kind
    (`mmcse.evaluation.ndcg.relevance_matrix`) into ``paths.relevance``, computed once per set of
    captions; files of other caption sets are removed (the folder is this stage's DVC output)."""

    paths.relevance.mkdir(parents=True, exist_ok=True)
    table = paths.raw / "retrieval" / "captions.jsonl"
    captions = [row["caption"] for row in read_jsonl(table)] if table.is_file() else []
    kinds = list(cfg.evaluate.ndcg.relevance) if captions else []
    keep = {f"{kind}-{relevance_key(captions, kind)}.npy" for kind in kinds}
    for stale in paths.relevance.glob("*.npy"):
        if stale.name not in keep:
            stale.unlink()
    for kind in kinds:
        relevance_matrix(captions, kind, paths.relevance)
    return {"captions": len(captions), "kinds": kinds}


def relevance_for(paths: Paths, captions: list[str], kind: str) -> Any:
    """The relevance matrix of ``captions``: the relevance stage's file when it has them, else
    computed (once, cached) under ``<data>/upstream/relevance`` (an ablation job whose data differ)."""

    top = paths.relevance / f"{kind}-{relevance_key(captions, kind)}.npy"
    return relevance_matrix(captions, kind, paths.relevance if top.is_file() else
                            paths.raw.parent / "upstream" / "relevance")
