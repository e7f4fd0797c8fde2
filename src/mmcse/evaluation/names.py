"""Score names: one key per number, the same in metrics/*.json, MLflow, the ablation CSV and the report.

MLflow's metric names allow letters, digits and ``_ - . / :`` and spaces, not ``@``. So the
conventional recall and NDCG names are keyed without it everywhere (one mapping, used by every
evaluator): ``R@K`` is ``RK`` (``i2t_R1``, ``coco_1k_t2i_R10``) and ``NDCG@k`` is ``NDCGk``
(``NDCG25_rouge_l``). `display_name` puts the ``@`` back for what people read (terminal tables,
the ablation markdown, figure labels); `score_key` is the mapping the other way, for names written
in the conventional form (``ablate.metric: coco_1k_i2t_R@1``).

Only where two numbers are of different data do keys differ: ``dev_`` (the dev split, logged
during training) and ``test_`` (the evaluate stage: metrics/eval.json and MLflow) prefix the same
score name. A single-task average is not a second number: STS with one task reports only ``avg``.
"""

from __future__ import annotations

import re

from mmcse.config.checks import check
from mmcse.config.inputs import TRANSFER_TASKS
from mmcse.data.senteval import STS_TASKS

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
    """The evaluate stage's scores under their one key, ``test_<name>``: metrics/eval.json and the
    training run in MLflow hold exactly these (the dev split's are ``dev_<name>`` in MLflow)."""
    return {f"test_{name}": value for name, value in scores.items()}


def _either(names: tuple[str, ...]) -> str:
    return "|".join(re.escape(n) for n in names)


RETRIEVAL_SETS = ("demo", "flickr30k_1k", "coco_5k", "coco_1k")  # `mmcse.data.prepare.retrieval_set_name`
_SET = f"({_either(RETRIEVAL_SETS)})"

# The registered evaluators (`mmcse.evaluation.evaluators`), by name: the score keys each writes, as regular
# expressions of whole keys. Declared here, with no tensor: `mmcse.analysis.papers` accepts a paper table's
# column only when some evaluator writes it, the parameter check accepts ``evaluate.evaluators`` only when it
# names these, and `run_evaluators` refuses a key its evaluator did not declare.
EVALUATOR_SCORES: dict[str, tuple[str, ...]] = {
    "sts": (_either((*STS_TASKS, "avg")),),
    "mteb": (r"mteb_\w+",),  # mteb_<Task>, mteb_type_<Type>, mteb_avg
    "geometry": ("alignment|uniformity",),
    "transfer": (_either((*TRANSFER_TASKS, "transfer_avg")),),
    "retrieval": (rf"{_SET}_(i2t|t2i)_R(1|5|10)", rf"{_SET}_rsum", rf"{_SET}_((i2t|t2i)_)?NDCG\d+_(rouge_l|spice)"),
}


def evaluator_writes(evaluator: str, key: str) -> bool:
    """Whether ``key`` is a score the evaluator ``evaluator`` declares (`EVALUATOR_SCORES`)."""
    return any(re.fullmatch(p, key) for p in EVALUATOR_SCORES.get(evaluator, ()))


def check_evaluators(names: tuple[str, ...] | list[str], where: str) -> None:
    """``evaluate.evaluators`` names only declared evaluators: anything else is a `ConfigError` listing them."""
    unknown = [n for n in names if n not in EVALUATOR_SCORES]
    check(not unknown, where, "evaluate.evaluators", f"{unknown} is no evaluator; the evaluators: "
          f"{', '.join(EVALUATOR_SCORES)}")
