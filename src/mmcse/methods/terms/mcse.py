"""MCSE's sentence–image term (also MCSEO's l_img-cap) and KDMCSE Table 5's "MCSE + CLIP text"."""

from __future__ import annotations

import torch

from mmcse.methods.losses import mcse_image_loss, mcseo_image_caption_loss
from mmcse.methods.terms.base import LossTerm, Objective, StepEmbeddings, need, register


def image_term(o: Objective, e: StepEmbeddings, generator: torch.Generator | None = None) -> torch.Tensor:
    """MCSE's grounding InfoNCE against g_φ2 of the image features (KDMCSE Eq. 3: both dropout views);
    for mcseo, α·l_img-cap on one view (MCSEO Eq. 3) or both with ``loss.mcseo.image_views: 2``."""
    v = need(e.image, "image", "image")
    tau = o.loss.temperature_img
    if o.method == "mcseo" and o.loss.mcseo.image_views == 1:
        return mcseo_image_caption_loss(need(e.s1, "s1", "image"), v, tau)
    return mcse_image_loss(need(e.s1, "s1", "image"), need(e.s2, "s2", "image"), v, tau)


def clip_text_term(o: Objective, e: StepEmbeddings, generator: torch.Generator | None = None) -> torch.Tensor:
    """The image term's InfoNCE (KDMCSE Eq. 3) against the joint teacher's text embedding g_φt(t̂)."""
    return mcse_image_loss(need(e.s1, "s1", "clip_text"), need(e.s2, "s2", "clip_text"),
                           need(e.teacher_text, "teacher_text", "clip_text"), o.loss.temperature_img)


register(
    LossTerm(
        name="image", equation="MCSE (KDMCSE Eq. 3); MCSEO Eq. 3", order=10, weight="loss.lambda_img",
        active=lambda o: o.method in ("mcse", "mcseo") and o.loss.image_term,
        inputs=lambda o: {"s", "image"}, compute=image_term,
        retrieval_head=("image_proj", "retrieval_image"),
    ),
    LossTerm(
        name="clip_text", equation="MCSE + CLIP text (KDMCSE Table 5; Eq. 3 against g_φt(t̂))", order=20,
        weight="loss.lambda_img",
        active=lambda o: o.method == "mcse" and o.loss.image_term and o.loss.mcse.clip_text,
        inputs=lambda o: {"s", "teacher_text"}, compute=clip_text_term,
    ),
)
