"""MCSE's sentence–image term (also MCSEO's l_img-cap) and KDMCSE Table 5's "MCSE + CLIP text" (declared in
`mmcse.methods.terms.mcse`)."""

from __future__ import annotations

import torch

from mmcse.methods.compute.base import computes
from mmcse.methods.losses import mcse_image_loss, mcseo_image_caption_loss
from mmcse.methods.terms import Objective, StepEmbeddings
from mmcse.methods.terms.base import need


@computes("image")
def image_term(o: Objective, e: StepEmbeddings, draw: torch.Tensor | None = None) -> torch.Tensor:
    """MCSE's grounding InfoNCE against g_φ2 of the image features (KDMCSE Eq. 3: both dropout views, summed, or
    their mean with ``loss.mcse.image_views: mean``, MCSE's released code);
    for mcseo, α·l_img-cap on one view (MCSEO Eq. 3) or both with ``loss.mcseo.image_views: 2``."""
    v = need(e.image, "image", "image")
    tau = o.loss.temperature_img
    if o.method == "mcseo" and o.loss.mcseo.image_views == 1:
        return mcseo_image_caption_loss(need(e.s1, "s1", "image"), v, tau)
    return mcse_image_loss(need(e.s1, "s1", "image"), need(e.s2, "s2", "image"), v, tau, _views(o))


@computes("clip_text")
def clip_text_term(o: Objective, e: StepEmbeddings, draw: torch.Tensor | None = None) -> torch.Tensor:
    """The image term's InfoNCE (KDMCSE Eq. 3) against the joint teacher's text embedding g_φt(t̂)."""
    return mcse_image_loss(need(e.s1, "s1", "clip_text"), need(e.s2, "s2", "clip_text"),
                           need(e.teacher_text, "teacher_text", "clip_text"), o.loss.temperature_img, _views(o))


def _views(o: Objective) -> str:
    """How the two views' InfoNCE combine: ``loss.mcse.image_views`` for mcse (sum: KDMCSE Eq. 3; mean: MCSE's
    code); MCSEO's two-view reading (``loss.mcseo.image_views: 2``) sums, as KDMCSE Eq. 3."""
    return o.loss.mcse.image_views if o.method == "mcse" else "sum"
