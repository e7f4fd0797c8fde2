"""KDMCSE's image–caption term: Eq. 9–13 per modality and their mean, Eq. 14 (declared in
`mmcse.methods.terms.kdmcse`)."""

from __future__ import annotations

import torch

from mmcse.methods.compute.base import computes
from mmcse.methods.losses import kdmcse_objective, kdmcse_soft_labels, kdmcse_term, threshold_keep_mask
from mmcse.methods.terms import STAT, Objective, StepEmbeddings
from mmcse.methods.terms.base import need


@computes("kdmcse")
def kdmcse_terms(o: Objective, e: StepEmbeddings, draw: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """ℓ^{v'}, ℓ^{t'} (Eq. 9–13) and their mean (Eq. 14). Threshold filtering uses α^{t,v}
    (image term) and α^{t,t} (text term; ``text_filter: vt``: the image–caption α, as the authors' code),
    dropping below or above the threshold (``threshold_drops``); the margin's Δ uses image–image and caption–caption
    α (``within``, the authors' code) or the same cross-modal α^{t,m} (``cross``). The α are
    `kdmcse_soft_labels` of the raw CLIP features t̂, v̂ (``soft_labels: clip``: Eq. 7, kdmcse-2.txt's
    Algorithm 1) or, with ``soft_labels: projections``, of g_φt(t̂), g_φv(v̂)."""
    k, tau = o.loss.kdmcse, o.loss.temperature_img
    s1, s2 = need(e.s1, "s1", "kdmcse"), need(e.s2, "s2", "kdmcse")
    g_t = need(e.teacher_text, "teacher_text", "kdmcse")  # (N, p) g_φt(t̂)
    g_v = need(e.teacher_image, "teacher_image", "kdmcse")  # (N, p) g_φv(v̂)
    if k.soft_labels == "projections":
        alpha = kdmcse_soft_labels(g_t, g_v)
    else:
        alpha = kdmcse_soft_labels(need(e.joint_text, "joint_text", "kdmcse"),
                                   need(e.joint_image, "joint_image", "kdmcse"))
    margin_v = alpha["vv"] if k.margin_similarity == "within" else alpha["tv"]
    if k.threshold_value is None:  # no filter: its direction and scores are not read
        keep_v = keep_t = torch.ones_like(alpha["tv"], dtype=torch.bool)
    else:
        # the text term's filter: φ^{t,t} (Eq. 9) or, as the authors' vc_slabels, image i against caption j
        text_scores = alpha["tt"] if k.text_filter == "tt" else alpha["tv"].T  # (N, N)
        keep_v = threshold_keep_mask(alpha["tv"], k.threshold_value, k.threshold_drops)
        keep_t = threshold_keep_mask(text_scores, k.threshold_value, k.threshold_drops)
    gate = k.margin_gate == "beyond_margin"
    image = kdmcse_term(s1, s2, g_v, tau, k.margin, margin_v, keep_v, gate)
    text = kdmcse_term(s1, s2, g_t, tau, k.margin, alpha["tt"], keep_t, gate)
    n = s1.shape[0]
    return {
        "kdmcse_image": image, "kdmcse_text": text, "kdmcse": kdmcse_objective(image, text),
        # diagnostics (not summed): the share of negatives the threshold removed
        f"{STAT}kdmcse_filtered_image": (~keep_v).sum() / (n * (n - 1)),
        f"{STAT}kdmcse_filtered_text": (~keep_t).sum() / (n * (n - 1)),
    }
