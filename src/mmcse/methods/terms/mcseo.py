"""MCSEO's object–phrase term (l_obj-phra, Eq. 7), weighted β."""

from __future__ import annotations

import torch

from mmcse.methods.losses import object_phrase_loss
from mmcse.methods.terms.base import LossTerm, Objective, StepEmbeddings, need, register


def object_term(o: Objective, e: StepEmbeddings, generator: torch.Generator | None = None) -> torch.Tensor:
    """l_obj-phra between the projected phrase spans and their object crops."""
    return object_phrase_loss(need(e.phrases, "phrases", "object"), need(e.objects, "objects", "object"),
                              need(e.object_pair, "object_pair", "object"), o.loss.mcseo.temperature)


register(LossTerm(
    name="object", equation="MCSEO l_obj-phra (Eq. 7)", order=70, weight="loss.mcseo.beta",
    active=lambda o: o.method == "mcseo" and o.loss.mcseo.object_phrase,
    inputs=lambda o: {"phrases", "objects", "object_pair"}, compute=object_term,
    # a batch whose captions have no detected object–phrase pair has no term
    applies=lambda e: e.phrases is not None and e.phrases.shape[0] > 0,
))
