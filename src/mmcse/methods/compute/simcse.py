"""SimCSE's text term and its auxiliary MLM term (declared in `mmcse.methods.terms.simcse`)."""

from __future__ import annotations

import torch

from mmcse.methods.compute.base import computes
from mmcse.methods.losses import adapacse_loss, masked_lm_loss, simcse_loss
from mmcse.methods.terms import Objective, StepEmbeddings
from mmcse.methods.terms.base import need


@computes("simcse")
def text_term(o: Objective, e: StepEmbeddings, draw: torch.Tensor | None = None) -> torch.Tensor:
    """SimCSE (KDMCSE Eq. 1) on every batch (but DALR's image–caption batches, as printed); for kdmcse
    with ``text_batches: angular_margin``, a constant angular margin on every negative (AdapACSE, Eq. 12,
    with Δ = 1) wherever the term runs: the authors' MCSE.compute_loss scores every batch's SimCSE
    term with the same ArcSimilarity (text batches, and pair batches under ``simcse_plus_kdmcse``), gated as
    ``margin_gate`` says; for dalr, ``loss.dalr.student_margin`` (the authors' ArcSimilarity(τ, MARGIN1))."""
    k = o.loss.kdmcse
    margin = (k.text_margin if o.method == "kdmcse" and k.text_batches == "angular_margin"
              else o.loss.dalr.student_margin if o.method == "dalr" else 0.0)
    if margin:
        none_similar = torch.zeros(e.z1.shape[0], e.z1.shape[0], dtype=e.z1.dtype, device=e.z1.device)
        return adapacse_loss(e.z1, e.z2, o.loss.temperature, margin, margin_sim=none_similar,
                             beyond_margin=k.margin_gate == "beyond_margin")
    return simcse_loss(e.z1, e.z2, o.loss.temperature)


@computes("mlm")
def mlm_term(o: Objective, e: StepEmbeddings, draw: torch.Tensor | None = None) -> torch.Tensor:
    """SimCSE's auxiliary MLM loss ℓ^mlm (SimCSE App. E) on the tokens the step masked."""
    return masked_lm_loss(need(e.mlm_logits, "mlm_logits", "mlm"), need(e.mlm_labels, "mlm_labels", "mlm"))
