"""Alignment and uniformity of the STS dev sentences (DALR Table 6, Appendix D): ``dev_alignment``,
``dev_uniformity`` (named by the split they are computed on)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from mmcse.data.senteval import SentencePair
from mmcse.evaluation.evaluators.base import EvaluationInputs, register
from mmcse.evaluation.names import GEOMETRY_PRIMARY

if TYPE_CHECKING:
    from mmcse.evaluation.sts import EncodeFn


@dataclass
class GeometryEvaluator:
    dev: list[SentencePair]
    batch_size: int = 128
    label: str = "dev geometry"
    primary_metric: str = GEOMETRY_PRIMARY

    def __call__(self, encode: EncodeFn) -> dict[str, float]:
        from mmcse.evaluation.geometry import POSITIVE_GOLD, sts_dev_geometry

        return {f"dev_{k}": v for k, v in sts_dev_geometry(encode, self.dev, POSITIVE_GOLD, self.batch_size).items()}


@register("geometry", order=30, scores=("dev_alignment|dev_uniformity",))
def build(inputs: EvaluationInputs) -> GeometryEvaluator | None:
    return GeometryEvaluator(inputs.dev, inputs.batch_size) if inputs.dev else None
