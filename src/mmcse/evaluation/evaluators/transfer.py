"""SentEval's transfer tasks through its logistic-regression probe: accuracy per task, ``transfer_avg``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from mmcse.config import TRANSFER_TASKS, TransferConfig
from mmcse.data.senteval import TransferExample
from mmcse.evaluation.evaluators.base import EvaluationInputs, register
from mmcse.evaluation.names import TRANSFER_PRIMARY, either

if TYPE_CHECKING:
    from mmcse.evaluation.sts import EncodeFn


@dataclass
class TransferEvaluator:
    tasks: dict[str, list[TransferExample]]
    probe: TransferConfig
    batch_size: int = 128
    device: str = "cpu"
    primary_metric: str = TRANSFER_PRIMARY

    @property
    def label(self) -> str:
        return f"transfer ({len(self.tasks)} task{'s' if len(self.tasks) > 1 else ''})"

    def __call__(self, encode: EncodeFn) -> dict[str, float]:
        from mmcse.evaluation.transfer import evaluate_transfer

        return evaluate_transfer(encode, self.tasks, self.probe, self.batch_size, self.device).scores


@register("transfer", order=40, scores=(either((*TRANSFER_TASKS, TRANSFER_PRIMARY)),))
def build(inputs: EvaluationInputs) -> TransferEvaluator | None:
    if not inputs.transfer:
        return None
    return TransferEvaluator(inputs.transfer, inputs.transfer_probe, inputs.batch_size, inputs.device)
