"""The text term every sentence encoder trains on: SimCSE's InfoNCE between two dropout views."""

from __future__ import annotations

import torch

from mmcse.config import RETRIEVAL_METHODS
from mmcse.methods.losses import adapacse_loss, simcse_loss
from mmcse.methods.terms.base import LossTerm, Objective, StepEmbeddings, register


def text_term(o: Objective, e: StepEmbeddings, generator: torch.Generator | None = None) -> torch.Tensor:
    """SimCSE (KDMCSE Eq. 1) on every batch; on text-only batches of kdmcse with
    ``text_batches: angular_margin``, a constant angular margin on every negative
    (AdapACSE, Eq. 12, with Δ = 1)."""
    k = o.loss.kdmcse
    if o.method == "kdmcse" and not e.pair_batch and k.text_batches == "angular_margin":
        none_similar = torch.zeros(e.z1.shape[0], e.z1.shape[0], dtype=e.z1.dtype, device=e.z1.device)
        return adapacse_loss(e.z1, e.z2, o.loss.temperature, k.text_margin, margin_sim=none_similar)
    return simcse_loss(e.z1, e.z2, o.loss.temperature)


register(LossTerm(
    name="simcse", equation="SimCSE (KDMCSE Eq. 1)", order=0,
    # DUET and VSE++ are retrieval models: their losses are loss.duet's (Eq. 33) / loss.vsepp's
    active=lambda o: o.method not in RETRIEVAL_METHODS,
    inputs=lambda o: {"z"}, compute=text_term, on_text=lambda o: True, yields_to_alone=True,
))
