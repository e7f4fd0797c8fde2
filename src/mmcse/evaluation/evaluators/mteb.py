"""MTEB tasks (DALR Table 5): ``mteb_<Task>``, ``mteb_type_<Type>`` and their mean ``mteb_avg``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mmcse.evaluation.evaluators.base import EvaluationInputs, register
from mmcse.evaluation.mteb import PRIMARY_METRIC, mteb_scores
from mmcse.evaluation.sts import EncodeFn


@dataclass
class MTEBEvaluator:
    tasks: Sequence[Any]
    model_name: str
    batch_size: int = 128
    output_dir: Path | None = None
    details: dict[str, Any] = field(default_factory=dict)
    label: str = "MTEB"
    primary_metric: str = PRIMARY_METRIC

    def __call__(self, encode: EncodeFn) -> dict[str, float]:
        return mteb_scores(encode, self.model_name, self.tasks, self.batch_size, self.output_dir, self.details)


@register("mteb", order=20)
def build(inputs: EvaluationInputs) -> MTEBEvaluator | None:
    if not inputs.mteb:
        return None
    return MTEBEvaluator(inputs.mteb, inputs.mteb_model_name, inputs.batch_size, inputs.mteb_output,
                         inputs.mteb_details)
