"""Image–text retrieval of a student through its trained image head: R@K, rsum and graded NDCG."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mmcse.evaluation.evaluators.base import EvaluationInputs, register
from mmcse.evaluation.names import RETRIEVAL_PRIMARY, RETRIEVAL_SET

if TYPE_CHECKING:
    from mmcse.evaluation.sts import EncodeFn


@dataclass
class RetrievalEvaluator:
    score: Callable[[EncodeFn], dict[str, float]]  # the test set, heads and features, bound by the caller
    label: str = "image-text retrieval"
    primary_metric: str = RETRIEVAL_PRIMARY

    def __call__(self, encode: EncodeFn) -> dict[str, float]:
        return self.score(encode)


@register("retrieval", order=50, scores=(
    rf"{RETRIEVAL_SET}_(i2t|t2i)_R(1|5|10)", rf"{RETRIEVAL_SET}_{RETRIEVAL_PRIMARY}",
    rf"{RETRIEVAL_SET}_((i2t|t2i)_)?NDCG\d+_(rouge_l|spice)"))
def build(inputs: EvaluationInputs) -> RetrievalEvaluator | None:
    return RetrievalEvaluator(inputs.retrieval) if inputs.retrieval is not None else None
