"""Every evaluator, registered once by its own module here with the score keys it writes (:mod:`.base` holds the
protocol).

Importing this package imports each module in it (each light: its evaluation code is imported when it runs): a new
evaluator is a new module here, nothing else in the library names it.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import TYPE_CHECKING

from tqdm.auto import tqdm

from mmcse.errors import InputError
from mmcse.evaluation.evaluators.base import REGISTRY, EvaluationInputs, Evaluator, register

if TYPE_CHECKING:
    from mmcse.evaluation.sts import EncodeFn

for _module in sorted(m.name for m in pkgutil.iter_modules(__path__)):
    if _module != "base":
        _before = set(REGISTRY)
        importlib.import_module(f"{__name__}.{_module}")
        if set(REGISTRY) - _before != {_module}:  # the parameter check knows the evaluators by their modules' names
            raise ImportError(f"mmcse/evaluation/evaluators/{_module}.py registers {sorted(set(REGISTRY) - _before)}: "
                              f"a module registers one evaluator, under its own name ({_module!r})")


def registered() -> list[str]:
    """The registered evaluators' names, in the order they run."""
    return [r.name for r in sorted(REGISTRY.values(), key=lambda r: r.order)]


def asked_evaluators(asked: tuple[str, ...] | list[str] | str) -> tuple[str, ...]:
    """``evaluate.evaluators`` as names: "all" is every registered evaluator."""
    return tuple(registered()) if asked == "all" else tuple(asked)


def evaluator_writes(evaluator: str, key: str) -> bool:
    """Whether ``key`` is a score the evaluator ``evaluator`` declares it writes."""
    return evaluator in REGISTRY and REGISTRY[evaluator].writes(key)


def any_evaluator_writes(key: str) -> bool:
    """Whether some registered evaluator writes the score ``key`` (a paper table's column must be one)."""
    return any(r.writes(key) for r in REGISTRY.values())


def build_evaluators(inputs: EvaluationInputs) -> list[Evaluator]:
    """The evaluators ``inputs.asked`` names whose inputs are there, in their registered order; each evaluator
    keeps its registered name (``name``), so `run_evaluators` holds its keys to its declaration."""
    asked = asked_evaluators(inputs.asked)
    missing = [n for n in asked if n not in REGISTRY]
    if missing:
        raise InputError(f"evaluate.evaluators names {missing}, which no module of mmcse.evaluation.evaluators "
                         f"registers; registered: {', '.join(registered())}")
    built = []
    for r in sorted(REGISTRY.values(), key=lambda r: r.order):
        if r.name in asked and (evaluator := r.build(inputs)) is not None:
            evaluator.name = r.name
            built.append(evaluator)
    return built


class EvaluatorProgress:
    """One bar over an evaluation's steps (stderr), naming the one that runs: the evaluate stage is
    otherwise silent between its start and DVC's "Updating lock file"."""

    def __init__(self, names: list[str], show: bool = True) -> None:
        self.names = names
        self.done = -1
        self.bar = tqdm(total=len(names), desc="evaluate", unit="evaluator", leave=True, disable=not show)

    def next(self) -> None:
        if self.done >= 0:
            self.bar.update()
        self.done += 1
        self.bar.set_postfix_str(self.names[self.done] if self.done < len(self.names) else "")

    def close(self) -> None:
        self.bar.update(len(self.names) - self.bar.n)
        self.bar.set_postfix_str("done")
        self.bar.close()


def run_evaluators(evaluators: list[Evaluator], encode: EncodeFn,
                   progress: EvaluatorProgress | None = None) -> dict[str, float]:
    """Call each evaluator on ``encode`` in order (``progress.next()`` before each) and merge their
    scores; a key two evaluators both write is refused, not overwritten."""
    scores: dict[str, float] = {}
    for evaluator in evaluators:
        if progress is not None:
            progress.next()
        new = evaluator(encode)
        undeclared = sorted(k for k in new if not evaluator_writes(evaluator.name, k))
        if undeclared:
            raise ValueError(f"evaluator {evaluator.name!r} wrote {undeclared}, which its registration's scores do "
                             "not name")
        clash = sorted(scores.keys() & new.keys())
        if clash:
            raise ValueError(f"evaluator {evaluator.label!r} writes keys another already wrote: {clash}")
        scores |= new
    return scores


__all__ = ["REGISTRY", "EvaluationInputs", "Evaluator", "EvaluatorProgress", "any_evaluator_writes",
           "asked_evaluators", "build_evaluators", "evaluator_writes", "register", "registered",
           "run_evaluators"]
