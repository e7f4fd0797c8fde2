"""KDMCSE's image–caption term, Eq. 9–13 per modality and their mean (Eq. 14), with its section ``loss.kdmcse``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import BeforeValidator

from mmcse.config.checks import check
from mmcse.config.declared import SECTION, Angle, number_or_off
from mmcse.methods.terms.base import (
    STAT,
    LossTerm,
    Objective,
    StepEmbeddings,
    always,
    loss_section,
    need,
    never,
    register,
)

if TYPE_CHECKING:
    import torch


@loss_section("kdmcse", "train.method kdmcse: (ℓ^v' + ℓ^t')/2 (Eq. 14) on image–caption batches")
@dataclass(frozen=True)
class KDMCSELossConfig:
    __pydantic_config__ = SECTION
    # train.method kdmcse: λ·(ℓ^v' + ℓ^t')/2 (Eq. 14) replaces MCSE's image term on pair batches.
    # Eq. 8: a threshold on the teacher's α; off (YAML 1.1 reads it as false): no filtering
    threshold: Annotated[float | Literal["off"], BeforeValidator(number_or_off)] = 0.9
    """Eq. 8's threshold (kdmcse.txt §6.2: about 0.85–0.9); off: no filter (the authors' scripts: their
    --using_threshhold is never passed)"""
    threshold_drops: Literal["above", "below"] = "above"
    """which negatives Eq. 8 removes: above = those with α > threshold, the likely false negatives (§3.2 "remove noisy
    negative samples", §6.2; the authors' train_mix.py) | below = those with α < threshold (Eq. 8 as typeset: φ = 0
    if α < threshold, which contradicts the prose; `--reading printed`)"""
    text_filter: Literal["tt", "vt"] = "tt"
    """the α that filters the text term's negatives: tt = caption–caption φ^{t,t} (Eq. 9) | vt = image i against
    caption j (the authors' vc_slabels, src/train_mix.py)"""
    margin: Angle = 0.125
    """AdapACSE m (Eq. 12); 0 = InfoNCE with threshold filtering"""
    margin_gate: Literal["every", "beyond_margin"] = "every"
    """which negatives the angular margin shifts: every = each j ≠ i (Eq. 12) | beyond_margin = only those whose angle
    θ_ij exceeds m (the authors' ArcSimilarity, src/model.py)"""
    margin_similarity: Literal["within", "cross"] = "cross"
    """Δ of the margin (Eq. 12) from the teacher's cross-modal α^{t,v} for the image term and α^{t,t} for the text
    term (cross: the paper's "exclusively text-text and text-visual pairings") | within: the image term's from
    image–image α^{v,v} (the authors' src/model.py: slabels=vv_scores)"""
    text_batches: Literal["simcse", "angular_margin"] = "simcse"
    """SimCSE's text term: simcse (Eq. 1) | angular_margin: a constant angular margin text_margin on every negative,
    wherever the term runs (text batches, and pair batches under simcse_plus_kdmcse: the authors' code)"""
    text_margin: Angle = 0.1
    """the constant angular margin of text_batches: angular_margin (not printed; the authors' --margin1 default 0.1,
    their scripts 0.15)"""
    pair_objective: Literal["kdmcse", "simcse_plus_kdmcse"] = "kdmcse"
    """pair batches: kdmcse = ℓ^KDMCSE alone (Algorithm 1, App. D) | simcse_plus_kdmcse = SimCSE + λ·ℓ^KDMCSE (the
    authors' train_mix.py)"""
    soft_labels: Literal["projections", "clip"] = "clip"
    """the soft labels α (threshold filtering, Eq. 8; margin Δ): clip = Eq. 7 as printed in both copies ("m, n ∈ {v̂,
    t̂}": the CLIP features; the authors' train_mix.py too) | projections = from g_φt(t̂), g_φv(v̂), as one line of
    kdmcse.txt's Algorithm 1 reads (kdmcse-2.txt's does not)"""

    @property
    def threshold_value(self) -> float | None:
        off = self.threshold is False or self.threshold == "off"  # not `in`: 0.0 == False
        return None if off else float(self.threshold)

    def validate(self, where: str) -> None:
        p = "loss.kdmcse."
        if self.threshold_value is not None:
            check(-1 <= self.threshold_value <= 1, where, p + "threshold", "must be in [-1, 1] or off")


def kdmcse_terms(o: Objective, e: StepEmbeddings, draw: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """ℓ^{v'}, ℓ^{t'} (Eq. 9–13) and their mean (Eq. 14). Threshold filtering uses α^{t,v}
    (image term) and α^{t,t} (text term; ``text_filter: vt``: the image–caption α, as the authors' code),
    dropping below or above the threshold (``threshold_drops``); the margin's Δ uses image–image and caption–caption
    α (``within``, the authors' code) or the same cross-modal α^{t,m} (``cross``). The α are
    `kdmcse_soft_labels` of the raw CLIP features t̂, v̂ (``soft_labels: clip``: Eq. 7, kdmcse-2.txt's
    Algorithm 1) or, with ``soft_labels: projections``, of g_φt(t̂), g_φv(v̂)."""
    import torch

    from mmcse.methods.losses import kdmcse_objective, kdmcse_soft_labels, kdmcse_term, threshold_keep_mask

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


def _inputs(o: Objective) -> set[str]:
    raw = {"joint_text", "joint_image"} if o.loss.kdmcse.soft_labels == "clip" else set()
    return {"s", "teacher_text", "teacher_image"} | raw


register(LossTerm(
    name="kdmcse", equation="KDMCSE Eq. 14 (Eq. 9–13)", order=30, weight="loss.lambda_img",
    active=lambda o: o.method == "kdmcse" and o.loss.image_term,
    inputs=_inputs, on_pairs=always, on_text=never, compute=kdmcse_terms,
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
