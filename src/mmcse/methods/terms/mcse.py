"""MCSE's sentence–image term (also MCSEO's l_img-cap) and KDMCSE Table 5's "MCSE + CLIP text" (their
functions: `mmcse.methods.compute.mcse`)."""

from __future__ import annotations

from mmcse.methods.terms.base import LossTerm, register

register(
    LossTerm(
        name="image", equation="MCSE (KDMCSE Eq. 3); MCSEO Eq. 3", order=10, weight="loss.lambda_img",
        active=lambda o: o.method in ("mcse", "mcseo") and o.loss.image_term,
        inputs=lambda o: {"s", "image"},
        reads=lambda o: {"loss.temperature_img"} | ({"loss.mcseo.image_views"} if o.method == "mcseo"
                                                    else {"loss.mcse.image_views"}),
        retrieval_head=("image_proj", "retrieval_image"),
    ),
    LossTerm(
        name="clip_text", equation="MCSE + CLIP text (KDMCSE Table 5; Eq. 3 against g_φt(t̂))", order=20,
        weight="loss.lambda_img",
        active=lambda o: o.method == "mcse" and o.loss.image_term and o.loss.mcse.clip_text,
        inputs=lambda o: {"s", "teacher_text"}, reads=lambda o: {"loss.temperature_img", "loss.mcse.image_views"},
    ),
)
