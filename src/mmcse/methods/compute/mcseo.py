"""MCSEO's object–phrase term (declared in `mmcse.methods.terms.mcseo`)."""

from __future__ import annotations

import torch

from mmcse.methods.compute.base import computes
from mmcse.methods.losses import object_phrase_loss
from mmcse.methods.terms import Objective, StepEmbeddings
from mmcse.methods.terms.base import need


@computes("object")
def object_term(o: Objective, e: StepEmbeddings, draw: torch.Tensor | None = None) -> torch.Tensor:
    """l_obj-phra (MCSEO Eq. 7) between the projected phrase spans and their object crops."""
    return object_phrase_loss(need(e.phrases, "phrases", "object"), need(e.objects, "objects", "object"),
                              need(e.object_pair, "object_pair", "object"), o.loss.mcseo.temperature)
