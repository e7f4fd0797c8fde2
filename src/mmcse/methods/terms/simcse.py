"""The text term every sentence encoder trains on, SimCSE's InfoNCE between two dropout views, and
SimCSE's auxiliary masked-language-modelling term."""

from __future__ import annotations

import torch

from mmcse.config import RETRIEVAL_METHODS
from mmcse.methods.losses import adapacse_loss, masked_lm_loss, simcse_loss
from mmcse.methods.terms.base import LossTerm, Objective, StepEmbeddings, need, register


def text_term(o: Objective, e: StepEmbeddings, generator: torch.Generator | None = None) -> torch.Tensor:
    """SimCSE (KDMCSE Eq. 1) on every batch (but DALR's image–caption batches, as printed); on
    text-only batches of kdmcse with ``text_batches: angular_margin``, a constant angular margin on
    every negative (AdapACSE, Eq. 12, with Δ = 1)."""
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
    # DALR's Eq. 14 trains image–caption batches without it, as printed; its authors' code keeps it
    on_pairs=lambda o: o.method != "dalr" or bool(o.loss.dalr.simcse_on_pairs),
))


def mlm_term(o: Objective, e: StepEmbeddings, generator: torch.Generator | None = None) -> torch.Tensor:
    """SimCSE's auxiliary MLM loss ℓ^mlm (SimCSE App. E) on the tokens the step masked."""
    return masked_lm_loss(need(e.mlm_logits, "mlm_logits", "mlm"), need(e.mlm_labels, "mlm_labels", "mlm"))


def mlm_on(o: Objective) -> bool:
    return o.method not in RETRIEVAL_METHODS and bool(o.loss.simcse.mlm)


# its stream draws the step's masks (mmcse.training.loop), which the term then scores
MLM = LossTerm(
    name="mlm", equation="SimCSE ℓ + λ·ℓ^mlm (SimCSE App. E)", order=5, weight="loss.simcse.mlm_weight",
    active=mlm_on, inputs=lambda o: {"mlm"}, compute=mlm_term, on_text=lambda o: True, stream=3,
    # a short batch may draw no token: nothing to score
    applies=lambda e: e.mlm_labels is None or e.mlm_labels.numel() > 0,
)
register(MLM)
