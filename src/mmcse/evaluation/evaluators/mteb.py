"""MTEB tasks (DALR Table 5): ``mteb_<Task>``, ``mteb_type_<Type>`` and their mean ``mteb_avg``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mmcse.evaluation.evaluators.base import EvaluationInputs, register
from mmcse.evaluation.names import MTEB_PRIMARY

if TYPE_CHECKING:
    from mmcse.evaluation.sts import EncodeFn


@dataclass
class MTEBEvaluator:
    tasks: Sequence[Any]
    model_name: str
    batch_size: int = 128
    output_dir: Path | None = None
    details: dict[str, Any] = field(default_factory=dict)
    label: str = "MTEB"
    primary_metric: str = MTEB_PRIMARY

    def __call__(self, encode: EncodeFn) -> dict[str, float]:
        from mmcse.evaluation.mteb import mteb_scores

        return mteb_scores(encode, self.model_name, self.tasks, self.batch_size, self.output_dir, self.details)


@register("mteb", order=20, scores=(r"mteb_\w+",))  # mteb_<Task>, mteb_type_<Type>, mteb_avg
def build(inputs: EvaluationInputs) -> MTEBEvaluator | None:
    if not inputs.mteb:
        return None
    return MTEBEvaluator(inputs.mteb, inputs.mteb_model_name, inputs.batch_size, inputs.mteb_output,
                         inputs.mteb_details)
