"""KDMCSE's image–caption term: Eq. 9–13 per modality and their mean, Eq. 14 (its function:
`mmcse.methods.compute.kdmcse`)."""

from __future__ import annotations

from mmcse.methods.terms.base import LossTerm, Objective, register


def _inputs(o: Objective) -> set[str]:
    raw = {"joint_text", "joint_image"} if o.loss.kdmcse.soft_labels == "clip" else set()
    return {"s", "teacher_text", "teacher_image"} | raw


register(LossTerm(
    name="kdmcse", equation="KDMCSE Eq. 14 (Eq. 9–13)", order=30, weight="loss.lambda_img",
    active=lambda o: o.method == "kdmcse" and o.loss.image_term,
    inputs=_inputs,
    reads=lambda o: {"loss.temperature_img", "loss.kdmcse.soft_labels", "loss.kdmcse.margin_similarity",
                     "loss.kdmcse.threshold", "loss.kdmcse.margin", "loss.kdmcse.margin_gate"}
    | ({"loss.kdmcse.threshold_drops", "loss.kdmcse.text_filter"}
       if o.loss.kdmcse.threshold_value is not None else set()),
    # KDMCSE Algorithm 1 (App. D): an image–caption batch trains on ℓ^KDMCSE alone, without SimCSE or λ
    alone=lambda o: o.loss.kdmcse.pair_objective == "kdmcse",
    alone_reason="trains image–caption batches on ℓ^KDMCSE alone (loss.kdmcse.pair_objective: kdmcse, "
                 "Algorithm 1), without λ: drop it from sweep.space, or set loss.kdmcse.pair_objective: "
                 "simcse_plus_kdmcse",
    retrieval_head=("teacher_image_proj", "retrieval_joint_image"),
))
