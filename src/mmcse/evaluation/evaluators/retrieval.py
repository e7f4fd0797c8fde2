"""Image–text retrieval of a student through its trained image head: R@K, rsum and graded NDCG."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from mmcse.evaluation.evaluators.base import EvaluationInputs, register
from mmcse.evaluation.retrieval import PRIMARY
from mmcse.evaluation.sts import EncodeFn


@dataclass
class RetrievalEvaluator:
    score: Callable[[EncodeFn], dict[str, float]]  # the test set, heads and features, bound by the caller
    label: str = "image-text retrieval"
    primary_metric: str = PRIMARY

    def __call__(self, encode: EncodeFn) -> dict[str, float]:
        return self.score(encode)


@register("retrieval", order=50)
def build(inputs: EvaluationInputs) -> RetrievalEvaluator | None:
    return RetrievalEvaluator(inputs.retrieval) if inputs.retrieval is not None else None
