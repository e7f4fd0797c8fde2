"""MCSEO's object–phrase term (l_obj-phra, Eq. 7), weighted β, with its section ``loss.mcseo`` (MCSEO's l_img-cap is
MCSE's image term, `mmcse.methods.terms.mcse`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from mmcse.config.declared import SECTION, Bool, NonNegative, Positive
from mmcse.methods.terms.base import LossTerm, Objective, StepEmbeddings, always, loss_section, need, never, register

if TYPE_CHECKING:
    import torch


@loss_section("mcseo", "train.method mcseo: l_text + α·l_img-cap + β·l_obj-phra (Eq. 8)")
@dataclass(frozen=True)
class MCSEOLossConfig:
    __pydantic_config__ = SECTION
    # train.method mcseo: l_text + α·l_img-cap + β·l_obj-phra (Eq. 8); α is loss.lambda_img.
    object_phrase: Bool = True
    """l_obj-phra (Eq. 7)"""
    beta: NonNegative = 0.005
    """β"""
    temperature: Positive = 0.05
    """τ of l_obj-phra (Eq. 7)"""
    image_views: Literal[1, 2] = 1
    """l_img-cap on 1 dropout view (mcseo.txt Eq. 3) or on 2, summed (KDMCSE Eq. 3, MCSE's term)"""


def object_term(o: Objective, e: StepEmbeddings, draw: torch.Tensor | None = None) -> torch.Tensor:
    """l_obj-phra (MCSEO Eq. 7) between the projected phrase spans and their object crops."""
    from mmcse.methods.losses import object_phrase_loss

    return object_phrase_loss(need(e.phrases, "phrases", "object"), need(e.objects, "objects", "object"),
                              need(e.object_pair, "object_pair", "object"), o.loss.mcseo.temperature)


register(LossTerm(
    name="object", equation="MCSEO l_obj-phra (Eq. 7)", order=70, weight="loss.mcseo.beta",
    active=lambda o: o.method == "mcseo" and o.loss.mcseo.object_phrase,
    inputs=lambda o: {"phrases", "objects", "object_pair"}, on_pairs=always, on_text=never, compute=object_term,
    reads=lambda o: {"loss.mcseo.temperature"},
    # a batch whose captions have no detected object–phrase pair has no term
    applies=lambda e: e.phrases is not None and e.phrases.shape[0] > 0,
))
