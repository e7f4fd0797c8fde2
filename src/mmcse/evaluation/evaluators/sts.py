"""SentEval STS: Spearman × 100 per task and their mean ``avg`` (the headline of every STS table)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from mmcse.data.senteval import STS_TASKS, SentencePair
from mmcse.evaluation.evaluators.base import EvaluationInputs, register
from mmcse.evaluation.names import STS_PRIMARY, either

if TYPE_CHECKING:
    from mmcse.evaluation.sts import EncodeFn, STSResult


@dataclass
class STSEvaluator:
    tasks: dict[str, list[SentencePair]]
    batch_size: int = 128
    primary_metric: str = STS_PRIMARY
    result: STSResult | None = field(default=None, init=False)  # the last call's predictions (the scatter)

    @property
    def label(self) -> str:
        return f"STS test ({len(self.tasks)} task{'s' if len(self.tasks) > 1 else ''})"

    def __call__(self, encode: EncodeFn) -> dict[str, float]:
        from mmcse.evaluation.sts import evaluate_sts

        self.result = evaluate_sts(encode, self.tasks, self.batch_size)
        return dict(self.result.scores)


@register("sts", order=10, scores=(either((*STS_TASKS, STS_PRIMARY)),))
def build(inputs: EvaluationInputs) -> STSEvaluator | None:
    return STSEvaluator(inputs.sts, inputs.batch_size) if inputs.sts else None
