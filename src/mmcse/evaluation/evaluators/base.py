"""The evaluator protocol (as sentence-transformers' ``SentenceEvaluator``): an evaluator is configured
from an `EvaluationInputs`, called on an encoder, and returns ``dict[str, float]`` with a primary
metric. The evaluate stage, ablation jobs and ``mmcse eval`` build their evaluators from the same
registry (`build_evaluators`) and run them with `run_evaluators`; each evaluator is registered once,
by its own module in this package.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from mmcse.config import EvaluateConfig, TransferConfig
from mmcse.data.senteval import SentencePair, TransferExample
from mmcse.evaluation.names import EVALUATOR_SCORES
from mmcse.evaluation.sts import EncodeFn


@dataclass
class EvaluationInputs:
    """What evaluators are configured from: the evaluate stage fills it from the data folder and
    ``params.yaml``, ``mmcse eval`` from a SentEval folder and its flags. An empty field means "not
    asked for": its evaluator is not built."""

    sts: dict[str, list[SentencePair]] = field(default_factory=dict)  # test STS task -> pairs
    dev: list[SentencePair] = field(default_factory=list)  # dev pairs: the alignment/uniformity geometry
    transfer: dict[str, list[TransferExample]] = field(default_factory=dict)  # SentEval transfer tasks
    transfer_probe: TransferConfig = field(default_factory=TransferConfig)
    mteb: Sequence[Any] = ()  # resolved mteb task objects (`mmcse.evaluation.mteb.prepare_tasks`)
    mteb_model_name: str = ""
    mteb_output: Path | None = None  # mteb's results layout goes under it (`mmcse.evaluation.mteb.mteb_scores`)
    mteb_details: dict[str, Any] = field(default_factory=dict)  # model_meta.json's fields (`encoder_details`)
    retrieval: Callable[[EncodeFn], dict[str, float]] | None = None  # image–text retrieval of a student
    data_dir: Path | None = None  # where the data came from (data/raw, or the SentEval folder)
    batch_size: int = 128
    device: str = "cpu"
    # the evaluators the configuration asks for (``evaluate.evaluators``); one not named is not built
    asked: tuple[str, ...] = field(default_factory=lambda: tuple(EvaluateConfig().evaluators))


class Evaluator(Protocol):
    """Called on an encoder, returns its scores; ``primary_metric`` names the one that ranks models."""

    label: str  # what the progress bar shows while it runs
    primary_metric: str
    name: str  # its registered name, set by `build_evaluators`

    def __call__(self, encode: EncodeFn) -> dict[str, float]: ...


Builder = Callable[[EvaluationInputs], "Evaluator | None"]


@dataclass(frozen=True)
class Registered:
    name: str
    order: int  # the order evaluators run in (and their keys are merged)
    build: Builder


REGISTRY: dict[str, Registered] = {}


def register(name: str, order: int) -> Callable[[Builder], Builder]:
    """Register ``build(inputs) -> Evaluator | None`` (None: its inputs are not there) under ``name``, an evaluator
    whose score keys `mmcse.evaluation.names.EVALUATOR_SCORES` declares."""

    def add(build: Builder) -> Builder:
        if name not in EVALUATOR_SCORES:
            raise ValueError(f"evaluator {name!r}: declare the score keys it writes in "
                             "mmcse.evaluation.names.EVALUATOR_SCORES")
        if name in REGISTRY:
            raise ValueError(f"evaluator {name!r} is registered twice")
        if any(r.order == order for r in REGISTRY.values()):
            raise ValueError(f"evaluator {name!r} shares order {order}")
        REGISTRY[name] = Registered(name, order, build)
        return build

    return add
