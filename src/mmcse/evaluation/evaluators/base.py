"""The evaluator protocol (as sentence-transformers' ``SentenceEvaluator``): an evaluator is configured
from an `EvaluationInputs`, called on an encoder, and returns ``dict[str, float]`` with a primary
metric. The evaluate stage, ablation jobs and ``mmcse eval`` build their evaluators from the same
registry (`build_evaluators`) and run them with `run_evaluators`; each evaluator is registered once,
by its own module in this package, with the score keys it writes.

An evaluator module imports its evaluation code (torch, transformers, mteb) inside the functions that run it:
importing the registry reads every declaration in a fraction of a second (the parameter check accepts
``evaluate.evaluators`` and `mmcse.analysis.papers` a paper table's column only by them).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from mmcse.config import TransferConfig
from mmcse.data.senteval import SentencePair, TransferExample

if TYPE_CHECKING:
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
    # the evaluators the configuration asks for (``evaluate.evaluators``, "all": every registered one); one not
    # named is not built
    asked: tuple[str, ...] | str = "all"


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
    scores: tuple[str, ...]  # the score keys it writes, as regular expressions of whole keys

    def writes(self, key: str) -> bool:
        return any(re.fullmatch(p, key) for p in self.scores)


REGISTRY: dict[str, Registered] = {}


def register(name: str, order: int, scores: tuple[str, ...]) -> Callable[[Builder], Builder]:
    """Register ``build(inputs) -> Evaluator | None`` (None: its inputs are not there) under ``name``: the evaluator
    that writes the score keys ``scores`` (regular expressions of whole keys; a paper table may use them as columns,
    and a key it did not declare is refused when it runs)."""

    def add(build: Builder) -> Builder:
        if not scores:
            raise ValueError(f"evaluator {name!r}: declare the score keys it writes (scores=...)")
        if name in REGISTRY:
            raise ValueError(f"evaluator {name!r} is registered twice")
        if any(r.order == order for r in REGISTRY.values()):
            raise ValueError(f"evaluator {name!r} shares order {order}")
        REGISTRY[name] = Registered(name, order, build, tuple(scores))
        return build

    return add
