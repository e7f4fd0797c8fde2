"""A step's loss, derived from the registered loss terms (:mod:`mmcse.methods.terms`): which terms a
configuration trains, which student outputs and cached features a batch needs, and their weighted sum.

Nothing here names a term: each `LossTerm` owns its switch, weight, inputs and function. Everything is
a function of tensors and an `Objective` (the method and the ``loss`` section, ``Objective.of(cfg)``),
so tests can feed random embeddings and teacher features.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import torch

from mmcse.config.checks import fail
from mmcse.methods.terms import STAT, TERMS, LossTerm, Objective, StepEmbeddings
from mmcse.methods.terms.base import INPUT_FEATURES, INPUT_SETTINGS, setting

__all__ = ["STAT", "Objective", "StepEmbeddings", "active_terms", "check_sweep_space", "image_head", "needed_features",
           "needed_inputs", "objective_keys", "step_objective"]


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
        unknown = inputs - INPUT_FEATURES.keys()
        if unknown:
            raise ValueError(f"loss term {term.name!r} reads {sorted(unknown)}, which a step does not make; "
                             f"it may read: {', '.join(INPUT_FEATURES)}")
        found |= inputs
    return found


def needed_features(o: Objective, pair_batch: bool, on: dict[str, bool] | None = None) -> set[str]:
    """Which cached feature groups a batch must load: image, joint, text_teachers, objects."""
    groups = (INPUT_FEATURES[name] for name in needed_inputs(o, pair_batch, on))
    return {g for g in groups if g is not None}


def step_objective(
    o: Objective, e: StepEmbeddings, seed: int = 0, on: dict[str, bool] | None = None
) -> dict[str, torch.Tensor]:
    """All active terms of one batch and their weighted sum ``loss`` (plus ``stat/…`` diagnostics,
    never summed), in the terms' fixed order. Each term is weighted by its ``weight`` parameter
    (mcse: SimCSE + λ_img·image [+ λ_img·clip_text]; kdmcse: Eq. 14 alone on pair batches as
    Algorithm 1, or SimCSE + λ_img·Eq. 14; dalr: Eq. 14, w_info·L_info + λ·(c·L_cons + L_CMA) +
    μ·(L_rank + L_IMA), with SimCSE on text-only batches (and on pair batches with
    ``loss.dalr.simcse_on_pairs``, the authors' code); mcseo: SimCSE + α·l_img-cap + β·l_obj-phra).
    ``seed`` seeds each term's random stream (mismatched pairs, ranking ties); ``on`` is :func:`active_terms` of ``o``,
    worked out once per run by callers that step many times.
    """
    on = on if on is not None else active_terms(o)
    running = _running(o, e.pair_batch, on)
    # a term that trains a pair batch alone (KDMCSE Algorithm 1) replaces the text term, unweighted
    alone = e.pair_batch and any(t.alone(o) for t in running)
    terms: dict[str, torch.Tensor] = {}
    loss = e.z1.new_zeros(())
    for term in running:
        if (alone and term.yields_to_alone) or not term.applies(e):
            continue
        value = term.compute(o, e, term.generator(seed))
        terms |= value if isinstance(value, dict) else {term.name: value}
        if term.weight is None or (alone and term.alone(o)):
            loss = loss + terms[term.name]
        else:
            weight = setting(o, term.weight) * (setting(o, term.scale) if term.scale else 1.0)
            loss = loss + weight * terms[term.name]
    terms["loss"] = loss
    return terms


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


def _probe_batch(pair_batch: bool) -> StepEmbeddings:
    """A small batch carrying every input a term may read (`INPUT_FEATURES`), for `objective_keys`."""
    g = torch.Generator().manual_seed(0)
    n, p, k, h, t, v = 4, 3, 3, 5, 6, 7

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g)

    teacher = torch.nn.functional.normalize(r(n, k), dim=-1)
    return StepEmbeddings(
        z1=r(n, h), z2=r(n, h), pair_batch=pair_batch, s1=r(n, p), s2=r(n, p), image=r(n, p),
        teacher_text=r(n, p), teacher_image=r(n, p), joint_text=r(n, k), joint_image=r(n, k), shared_text=r(n, p),
        shared_image=r(n, p), text_teacher_sim=teacher @ teacher.T, text_teacher=r(n, p), phrases=r(t, p),
        objects=r(t, p), object_pair=torch.tensor([0, 0, 1, 2, 3, 3]), mlm_logits=r(5, v),
        mlm_labels=torch.tensor([0, 1, 2, 3, 4]))


def objective_keys(o: Objective) -> set[str]:
    """Every ``loss.*`` parameter a sentence encoder's step reads under ``o``: the terms' switches and
    batch rules, then the weights, functions and input settings (`INPUT_SETTINGS`) of the terms that
    run, on image–caption and text-only batches alike. Recorded while the step runs on a small probe
    batch, so a new term's parameters count without being listed anywhere. A parameter outside this set
    changes nothing the method trains (an ablation job's identity leaves it out)."""
    seen: set[str] = set()
    recorded = Objective(o.method, _Recorded(o.loss, "loss", seen))  # type: ignore[arg-type]
    on = active_terms(recorded)
    for pair_batch in (True, False):
        for name in needed_inputs(recorded, pair_batch, on):
            seen.update(INPUT_SETTINGS.get(name, ()))
        with torch.no_grad():
            step_objective(recorded, _probe_batch(pair_batch), 0, on)
    return seen
