"""What a configuration's step is, derived from the declared loss terms (:mod:`mmcse.methods.terms`): which
terms it trains, which of them a batch kind runs and how each is weighted (`running_terms`, the one control flow
`mmcse.methods.step.step_objective` sums), which student outputs and cached features a batch needs, and which
``loss`` parameters it reads (`objective_keys`). No tensor here: a plan, a job's identity and the parameter
check read it without torch.

Nothing here names a term: each `LossTerm` owns its switch, weight, inputs and the parameters its function
reads. Everything is a function of an `Objective` (the method and the ``loss`` section, ``Objective.of(cfg)``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

from mmcse.config.checks import fail
from mmcse.methods.terms import STAT, TERMS, LossTerm, Objective, StepEmbeddings
from mmcse.methods.terms.base import INPUT_FEATURES, INPUT_SETTINGS

__all__ = ["STAT", "Objective", "StepEmbeddings", "active_terms", "check_sweep_space", "image_head", "needed_features",
           "needed_inputs", "objective_keys", "running_terms"]


def active_terms(o: Objective) -> dict[str, bool]:
    """Which loss terms an objective trains with, by term name (every one has its own switch)."""
    return {t.name: bool(t.active(o)) for t in TERMS}


def _running(o: Objective, pair_batch: bool, on: dict[str, bool]) -> list[LossTerm]:
    return [t for t in TERMS if on[t.name] and t.runs_on(o, pair_batch)]


def needed_inputs(o: Objective, pair_batch: bool, on: dict[str, bool] | None = None) -> set[str]:
    """The `StepEmbeddings` fields the active terms of a batch kind read (names of ``INPUT_FEATURES``)."""
    on = on if on is not None else active_terms(o)
    found: set[str] = set()
    for term in _running(o, pair_batch, on):
        inputs = term.inputs(o)
        # a comprehension, not `set - dict.keys()`: the step's compiled forward traces this, and torch 2.11's dynamo
        # cannot trace set arithmetic with a dict view ("Observed exception", every method's step, on an H200)
        unknown = {name for name in inputs if name not in INPUT_FEATURES}
        if unknown:
            raise ValueError(f"loss term {term.name!r} reads {sorted(unknown)}, which a step does not make; "
                             f"it may read: {', '.join(INPUT_FEATURES)}")
        found |= inputs
    return found


def needed_features(o: Objective, pair_batch: bool, on: dict[str, bool] | None = None) -> set[str]:
    """Which cached feature groups a batch must load: image, joint, text_teachers, objects."""
    groups = (INPUT_FEATURES[name] for name in needed_inputs(o, pair_batch, on))
    return {g for g in groups if g is not None}


def running_terms(o: Objective, pair_batch: bool, on: dict[str, bool]) -> list[tuple[LossTerm, bool]]:
    """The terms one batch kind runs, in their fixed order, each with whether its ``weight`` (and ``scale``)
    multiply it: a term that trains a pair batch alone (KDMCSE Algorithm 1) replaces the text term and is
    summed unweighted. ``on``: `active_terms` of ``o``."""
    running = _running(o, pair_batch, on)
    alone = pair_batch and any(t.alone(o) for t in running)
    return [(term, term.weight is not None and not (alone and term.alone(o)))
            for term in running if not (alone and term.yields_to_alone)]


def image_head(o: Objective) -> tuple[str, str] | None:
    """The trained image head an objective's retrieval uses and the cached test features it reads
    (the first active term with an image side, `LossTerm.retrieval_head`), or None."""
    on = active_terms(o)
    heads = [t.retrieval_head for t in TERMS if on[t.name] and t.retrieval_head is not None]
    return heads[0] if heads else None


def check_sweep_space(o: Objective, swept: Iterable[str], where: str = "params.yaml") -> None:
    """A sweep must move something its trials train with: a swept weight (a term's ``weight`` or
    ``scale`` parameter, e.g. ``loss.lambda_img``) must weigh an active term. Checked when a sweep starts, not
    at every load: the default sweep space must not stop the other stages of a configuration."""
    on = active_terms(o)
    weights = {w for t in TERMS for w in (t.weight, t.scale) if w is not None}
    for key in swept:
        if key not in weights:
            continue
        users = [t for t in TERMS if on[t.name] and key in (t.weight, t.scale)]
        if any(not t.alone(o) for t in users):
            continue
        why = users[0].alone_reason if users else "has no term it weighs: drop it from sweep.space"
        fail(f"{where} (sweep.space)", key, f"is swept, but train.method {o.method!r} {why}")


def objective_keys(o: Objective) -> set[str]:
    """Every ``loss.*`` parameter a sentence encoder's step reads under ``o``: the terms' switches and batch
    rules, then the weights, the parameters their functions read (`LossTerm.reads`) and the input settings
    (`INPUT_SETTINGS`) of the terms that run, on image–caption and text-only batches alike. The switches and
    rules are recorded as they are read, so a new term's count without being listed anywhere. A parameter
    outside this set changes nothing the method trains (an ablation job's identity leaves it out)."""
    seen: set[str] = set()
    recorded = Objective(o.method, _Recorded(o.loss, "loss", seen))  # type: ignore[arg-type]
    on = active_terms(recorded)
    for pair_batch in (True, False):
        for name in needed_inputs(recorded, pair_batch, on):
            seen.update(INPUT_SETTINGS.get(name, ()))
        for term, weighted in running_terms(recorded, pair_batch, on):
            seen |= term.reads(recorded)
            if weighted:
                seen |= {w for w in (term.weight, term.scale) if w is not None}
    return seen


class _Recorded:
    """A config section that records the dotted path of every parameter read through it."""

    def __init__(self, section: Any, path: str, seen: set[str]) -> None:
        self._section, self._path, self._seen = section, path, seen

    def __getattr__(self, name: str) -> Any:
        derived = getattr(type(self._section), name, None)
        if isinstance(derived, property):  # a value computed from fields (threshold_value): record those
            return derived.fget(self)
        value = getattr(self._section, name)
        path = f"{self._path}.{name}"
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            return _Recorded(value, path, self._seen)
        if not callable(value):
            self._seen.add(path)
        return value
