"""MCSE's sentence–image term (also MCSEO's l_img-cap) and KDMCSE Table 5's "MCSE + CLIP text", with their section
``loss.mcse``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from mmcse.config.declared import SECTION, Bool
from mmcse.methods.terms.base import LossTerm, Objective, StepEmbeddings, always, loss_section, need, never, register

if TYPE_CHECKING:
    import torch


@loss_section("mcse", "train.method mcse: SimCSE + λ·Eq. 3 (images)")
@dataclass(frozen=True)
class MCSELossConfig:
    __pydantic_config__ = SECTION
    # train.method mcse: "MCSE + CLIP text" (KDMCSE Table 5): beside the image term, the same
    # grounding InfoNCE (KDMCSE Eq. 3) against the joint teacher's text embedding g_φt(t̂), weighted λ.
    clip_text: Bool = False
    """+ λ·Eq. 3 against the joint teacher's text g_φt(t̂): KDMCSE Table 5's "MCSE + CLIP text" row"""
    image_views: Literal["sum", "mean"] = "sum"
    """the two dropout views' InfoNCE against the images: sum (KDMCSE Eq. 3, Σ over z, z') | mean (MCSE's released
    src/model.py: (loss(p1) + loss(p2)) / 2)"""


def image_term(o: Objective, e: StepEmbeddings, draw: torch.Tensor | None = None) -> torch.Tensor:
    """MCSE's grounding InfoNCE against g_φ2 of the image features (KDMCSE Eq. 3: both dropout views, summed, or
    their mean with ``loss.mcse.image_views: mean``, MCSE's released code);
    for mcseo, α·l_img-cap on one view (MCSEO Eq. 3) or both with ``loss.mcseo.image_views: 2``."""
    from mmcse.methods.losses import mcse_image_loss, mcseo_image_caption_loss

    v = need(e.image, "image", "image")
    tau = o.loss.temperature_img
    if o.method == "mcseo" and o.loss.mcseo.image_views == 1:
        return mcseo_image_caption_loss(need(e.s1, "s1", "image"), v, tau)
    return mcse_image_loss(need(e.s1, "s1", "image"), need(e.s2, "s2", "image"), v, tau, _views(o))


def clip_text_term(o: Objective, e: StepEmbeddings, draw: torch.Tensor | None = None) -> torch.Tensor:
    """The image term's InfoNCE (KDMCSE Eq. 3) against the joint teacher's text embedding g_φt(t̂)."""
    from mmcse.methods.losses import mcse_image_loss

    return mcse_image_loss(need(e.s1, "s1", "clip_text"), need(e.s2, "s2", "clip_text"),
                           need(e.teacher_text, "teacher_text", "clip_text"), o.loss.temperature_img, _views(o))


def _views(o: Objective) -> str:
    """How the two views' InfoNCE combine: ``loss.mcse.image_views`` for mcse (sum: KDMCSE Eq. 3; mean: MCSE's
    code); MCSEO's two-view reading (``loss.mcseo.image_views: 2``) sums, as KDMCSE Eq. 3."""
    return o.loss.mcse.image_views if o.method == "mcse" else "sum"


register(
    LossTerm(
        name="image", equation="MCSE (KDMCSE Eq. 3); MCSEO Eq. 3", order=10, weight="loss.lambda_img",
        active=lambda o: o.method in ("mcse", "mcseo") and o.loss.image_term,
        inputs=lambda o: {"s", "image"}, on_pairs=always, on_text=never, compute=image_term,
        reads=lambda o: {"loss.temperature_img"} | ({"loss.mcseo.image_views"} if o.method == "mcseo"
                                                    else {"loss.mcse.image_views"}),
        retrieval_head=("image_proj", "retrieval_image"),
    ),
    LossTerm(
        name="clip_text", equation="MCSE + CLIP text (KDMCSE Table 5; Eq. 3 against g_φt(t̂))", order=20,
        weight="loss.lambda_img",
        active=lambda o: o.method == "mcse" and o.loss.image_term and o.loss.mcse.clip_text,
        inputs=lambda o: {"s", "teacher_text"}, on_pairs=always, on_text=never, compute=clip_text_term,
        reads=lambda o: {"loss.temperature_img", "loss.mcse.image_views"},
    ),
)
