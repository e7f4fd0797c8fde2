"""Alignment and uniformity of the STS dev sentences (DALR Table 6, Appendix D)."""

from __future__ import annotations

from dataclasses import dataclass

from mmcse.data.senteval import SentencePair
from mmcse.evaluation.evaluators.base import EvaluationInputs, register
from mmcse.evaluation.geometry import POSITIVE_GOLD, PRIMARY, sts_dev_geometry
from mmcse.evaluation.sts import EncodeFn


@dataclass
class GeometryEvaluator:
    dev: list[SentencePair]
    batch_size: int = 128
    threshold: float = POSITIVE_GOLD
    label: str = "dev geometry"
    primary_metric: str = PRIMARY

    def __call__(self, encode: EncodeFn) -> dict[str, float]:
        return sts_dev_geometry(encode, self.dev, self.threshold, self.batch_size)


@register("geometry", order=30)
def build(inputs: EvaluationInputs) -> GeometryEvaluator | None:
    return GeometryEvaluator(inputs.dev, inputs.batch_size) if inputs.dev else None
