"""A step's loss on tensors: every term `mmcse.methods.objectives.running_terms` runs for the batch, computed by
its function (`LossTerm.compute`) and summed with its weight; the terms' random draws (`term_draws`) are made on the
host before, from each term's own stream."""

from __future__ import annotations

import torch

from mmcse.methods.objectives import active_terms, running_terms
from mmcse.methods.terms import LossTerm, Objective, StepEmbeddings
from mmcse.methods.terms.base import setting


def term_generator(term: LossTerm, seed: int) -> torch.Generator | None:
    """A CPU generator for a term's draws (its ``stream``): the same numbers on every training device, and
    switching one term off leaves every other term's draws unchanged."""
    return None if term.stream is None else torch.Generator().manual_seed(seed * 16 + term.stream)


def term_draws(o: Objective, n: int, pair_batch: bool, seed: int,
               on: dict[str, bool] | None = None) -> dict[str, torch.Tensor]:
    """What each term that runs on a batch of ``n`` pairs draws at random (`LossTerm.draw`: DALR's mismatched pairs and
    ranking ties), on the CPU, each from its own stream seeded by the step's ``seed``: made ahead of the step's
    tensor code, so that code reads no random state (a compiled step takes them as inputs)."""
    on = on if on is not None else active_terms(o)
    return {term.name: term.draw(o, n, term_generator(term, seed))
            for term, _ in running_terms(o, pair_batch, on) if term.draw is not None}


def step_objective(
    o: Objective, e: StepEmbeddings, seed: int = 0, on: dict[str, bool] | None = None,
    draws: dict[str, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """All active terms of one batch and their weighted sum ``loss`` (plus ``stat/…`` diagnostics,
    never summed), in the terms' fixed order. Each term is weighted by its ``weight`` parameter
    (mcse: SimCSE + λ_img·image [+ λ_img·clip_text]; kdmcse: Eq. 14 alone on pair batches as
    Algorithm 1, or SimCSE + λ_img·Eq. 14; dalr: Eq. 14, w_info·L_info + λ·(c·L_cons + L_CMA) +
    μ·(L_rank + L_IMA), with SimCSE on text-only batches (and on pair batches with
    ``loss.dalr.simcse_on_pairs``, the authors' code); mcseo: SimCSE + α·l_img-cap + β·l_obj-phra).
    ``draws`` are the terms' random draws (`term_draws`; made here from ``seed`` when not given); ``on`` is
    `active_terms` of ``o``, worked out once per run by callers that step many times.
    """
    on = on if on is not None else active_terms(o)
    draws = draws if draws is not None else term_draws(o, e.z1.shape[0], e.pair_batch, seed, on)
    terms: dict[str, torch.Tensor] = {}
    loss = e.z1.new_zeros(())
    for term, weighted in running_terms(o, e.pair_batch, on):
        if not term.applies(e):
            continue
        value = term.compute(o, e, draws.get(term.name))
        terms |= value if isinstance(value, dict) else {term.name: value}
        if weighted:
            weight = setting(o, term.weight) * (setting(o, term.scale) if term.scale else 1.0)
            loss = loss + weight * terms[term.name]
        else:
            loss = loss + terms[term.name]
    terms["loss"] = loss
    return terms
