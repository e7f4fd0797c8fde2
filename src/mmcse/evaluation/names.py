"""Score names: one key per number, the same in metrics/*.json, MLflow, the ablation CSV and the report.

MLflow's metric names allow letters, digits and ``_ - . / :`` and spaces, not ``@``. So the
conventional recall and NDCG names are keyed without it everywhere (one mapping, used by every
evaluator): ``R@K`` is ``RK`` (``i2t_R1``, ``coco_1k_t2i_R10``) and ``NDCG@k`` is ``NDCGk``
(``NDCG25_rouge_l``). `display_name` puts the ``@`` back for what people read (terminal tables,
the ablation markdown, figure labels); `score_key` is the mapping the other way, for names written
in the conventional form (``ablate.metric: coco_1k_i2t_R@1``).

A key says the split its number is computed on: ``dev_`` (the dev split: logged during training, and the
evaluated model's dev geometry) and ``test_`` (the evaluate stage's test scores: metrics/eval.json and MLflow)
prefix the score name. A single-task average is not a second number: STS with one task reports only ``avg``.
"""

from __future__ import annotations

import re
from pathlib import Path

from mmcse.config.checks import check

DEV, TEST = "dev_", "test_"  # the splits a score's name says it is computed on

# "R1", "NDCG25" as a whole name part (after start or "_", before "_" or the end)
_AT_SCORE = re.compile(r"(?<![A-Za-z0-9])(R|NDCG)(\d+)(?=_|$)")


# The scores a comparison shows at a glance (the MLflow runs table's headline view, the ablation
# figure and run description, `mmcse runs`): the STS / transfer / MTEB averages, each test set's
# rsum and its NDCG means over both directions (never the per-direction R@K or NDCG).
HEADLINE = re.compile(r"avg|transfer_avg|mteb_avg|\w+_rsum|\w*(?<!i2t_)(?<!t2i_)NDCG\d+_\w+")


def is_headline(key: str) -> bool:
    """Whether score ``key`` (bare, or as the evaluate stage logs it, ``test_<name>``) is a
    headline score (`HEADLINE`)."""
    return HEADLINE.fullmatch(key.removeprefix("test_")) is not None


def score_key(name: str) -> str:
    """The key of a score written the conventional way: ``i2t_R@1`` → ``i2t_R1``,
    ``NDCG@25_rouge_l`` → ``NDCG25_rouge_l``; a key is returned unchanged."""
    return name.replace("@", "")


def recall_key(direction: str, k: int) -> str:
    """``i2t_R1``: recall at ``k`` (×100) of ``direction`` (``i2t`` or ``t2i``)."""
    return f"{direction}_R{k}"


def ndcg_key(k: int, kind: str, direction: str | None = None) -> str:
    """``NDCG25_rouge_l`` (the mean of both directions) or ``i2t_NDCG25_rouge_l``."""
    return f"{direction + '_' if direction else ''}NDCG{k}_{kind}"


def display_name(key: str) -> str:
    """A key as people write it: ``demo_i2t_R1`` → ``demo_i2t_R@1``, ``NDCG25_rouge_l`` →
    ``NDCG@25_rouge_l``; every other name is returned unchanged."""
    return "/".join(_AT_SCORE.sub(r"\1@\2", part) for part in key.split("/"))


def test_metrics(scores: dict[str, float]) -> dict[str, float]:
    """The evaluate stage's scores under their one key, each named by the split it is computed on: ``test_<name>``,
    and a score of the dev split (the dev geometry: ``dev_alignment``, ``dev_uniformity``) as its evaluator names it.
    metrics/eval.json and the training run in MLflow hold exactly these (training logs the same ``dev_`` names at
    each dev evaluation)."""
    return {name if name.startswith(DEV) else f"{TEST}{name}": value for name, value in scores.items()}


def either(names: tuple[str, ...] | list[str]) -> str:
    """A regular expression matching exactly one of ``names``."""
    return "|".join(re.escape(n) for n in names)


RETRIEVAL_SETS = ("demo", "flickr30k_1k", "coco_5k", "coco_1k")  # `mmcse.data.prepare.retrieval_set_name`
RETRIEVAL_SET = f"({either(RETRIEVAL_SETS)})"  # a retrieval test set's name in a score key

# The score each evaluator ranks models by (its ``primary_metric``)
STS_PRIMARY = "avg"
MTEB_PRIMARY = "mteb_avg"
GEOMETRY_PRIMARY = "dev_uniformity"
TRANSFER_PRIMARY = "transfer_avg"
RETRIEVAL_PRIMARY = "rsum"

EVALUATORS_DIR = Path(__file__).parent / "evaluators"  # `mmcse.evaluation.evaluators`: one module per evaluator


def evaluator_names() -> list[str]:
    """The evaluators there are, by name: each module of `mmcse.evaluation.evaluators` registers one, under its own
    name (the registry checks it), so the parameter check reads the folder, not the modules."""
    return sorted(p.stem for p in EVALUATORS_DIR.glob("*.py") if p.stem not in ("__init__", "base"))


def check_evaluators(asked: tuple[str, ...] | list[str] | str, where: str) -> None:
    """``evaluate.evaluators`` is "all" or names one or more evaluators there are (`evaluator_names`): anything else
    (an empty list included) is a `ConfigError` listing them."""
    there = evaluator_names()
    check(asked == "all" or len(asked) > 0, where, "evaluate.evaluators",
          f"names no evaluator, so the stage would score nothing; the evaluators: {', '.join(there)} (or all)")
    unknown = [] if asked == "all" else [n for n in asked if n not in there]
    check(not unknown, where, "evaluate.evaluators", f"{unknown} is no evaluator; the evaluators: "
          f"{', '.join(there)} (or all)")
