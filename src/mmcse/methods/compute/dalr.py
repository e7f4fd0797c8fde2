"""DALR's terms (declared in `mmcse.methods.terms.dalr`): L_info (Eq. 4), L_cons (Eq. 5), L_CMA (Eq. 6–8),
L_rank (Eq. 10), L_IMA (Eq. 11–12)."""

from __future__ import annotations

import torch

from mmcse.methods.compute.base import computes, draws
from mmcse.methods.losses import (
    adapacse_loss,
    angular_margin_cosines,
    consistency_loss,
    cosine_matrix,
    cross_modal_alignment_loss,
    info_nce,
    intra_modal_alignment_loss,
    listmle_loss,
    mismatch_permutation,
    teacher_rankings,
    tie_order,
)
from mmcse.methods.terms import Objective, StepEmbeddings
from mmcse.methods.terms.base import need
from mmcse.methods.terms.dalr import projected


def student_cosines(o: Objective, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The student's similarities ``(N, M)`` of rows of ``a`` and ``b`` in DALR's terms (L_text, L_CMA, L_IMA,
    L_rank): the cosines of Eq. 1, 6, 10, 11, or with ``loss.dalr.student_margin`` a constant angular margin on
    every off-diagonal pair, gated as ``loss.kdmcse.margin_gate`` says (the authors' one ArcSimilarity(τ, MARGIN1),
    src/model_modified.py l.513, l.628, l.724, l.745, l.752)."""
    m = o.loss.dalr.student_margin
    if not m:
        return cosine_matrix(a, b)
    flat = a.new_zeros(a.shape[0], b.shape[0])  # α = 0: Δ = 1 on every pair
    return angular_margin_cosines(a, b, m, flat, beyond_margin=o.loss.kdmcse.margin_gate == "beyond_margin")


def dalr_teacher_target_sims(o: Objective, e: StepEmbeddings, term: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The similarities ``(N, N)`` behind DALR's targets Q^{t2t}, Q^{v2v} (Eq. 7) for L_CMA: with
    ``loss.dalr.teacher_space: projected`` those of the projected teachers h^t = g_φt(f_t(t)) and h^v =
    g_φv(f_v(v)) of Eq. 3 (one h^t, also L_IMA's); with ``raw``, the text teachers' own similarity and the raw image
    features' (the authors' src/model_modified.py l.741–744). The equations carry no stop-gradient, so gradients
    reach g_φt and g_φv through Q."""
    if projected(o):
        h_t = need(e.text_teacher, "text_teacher", term)
        h_v = need(e.teacher_image, "teacher_image", term)
        return cosine_matrix(h_t, h_t), cosine_matrix(h_v, h_v)
    v_hat = need(e.joint_image, "joint_image", term)
    return need(e.text_teacher_sim, "text_teacher_sim", term), cosine_matrix(v_hat, v_hat)


def dalr_text_target_similarity(o: Objective, e: StepEmbeddings, term: str) -> torch.Tensor:
    """The cosine matrix ``(N, N)`` behind L_IMA's Q^{t2t} (Eq. 11): cos(h^t, h^t) of the projected
    text teacher (``teacher_space: projected``, the same h^t as L_CMA's) or the text teachers' own
    similarity (``raw``)."""
    if projected(o):
        h_t = need(e.text_teacher, "text_teacher", term)
        return cosine_matrix(h_t, h_t)
    return need(e.text_teacher_sim, "text_teacher_sim", term)


@computes("info")
def dalr_info(o: Objective, e: StepEmbeddings, draw: torch.Tensor | None = None) -> torch.Tensor:
    """DALR L_info, paper Eq. 4: sentence–image InfoNCE of s^z against h^v = g_φv(v̂). As printed
    on the one view s^z (``info_views: one``); ``mean`` of both dropout views as the authors' code,
    ``sum`` as MCSE's Eq. 3. ``info_margin`` adds KDMCSE's adaptive margin of size ``info_margin_size`` with Δ
    from the image–image teacher similarity (the authors' code, gated as ``loss.kdmcse.margin_gate`` says)."""
    d = o.loss.dalr
    views = [need(e.s1, "s1", "info")] + ([] if d.info_views == "one" else [need(e.s2, "s2", "info")])
    h_v = need(e.teacher_image, "teacher_image", "info")  # (N, p)
    tau = o.loss.temperature_img
    if d.info_margin:
        with torch.no_grad():
            v_hat = need(e.joint_image, "joint_image", "info")
            alpha_vv = cosine_matrix(v_hat, v_hat)  # (N, N)
        gate = o.loss.kdmcse.margin_gate == "beyond_margin"
        per_view = [adapacse_loss(s, h_v, tau, d.info_margin_size, alpha_vv, beyond_margin=gate) for s in views]
    else:
        per_view = [info_nce(s, h_v, tau) for s in views]
    total = torch.stack(per_view).sum()
    return total / len(per_view) if d.info_views == "mean" else total


@draws("consistency")
def mismatched_pairs(o: Objective, n: int, generator: torch.Generator) -> torch.Tensor:
    """The batch's mismatched pairs D' (§3.2): image ``mismatch[i]`` with text i, ``(n,)`` (``loss.dalr.mismatch``)."""
    return mismatch_permutation(n, o.loss.dalr.mismatch, generator)


@computes("consistency")
def dalr_consistency(o: Objective, e: StepEmbeddings, mismatch: torch.Tensor | None = None) -> torch.Tensor:
    """L_cons (Eq. 5) with the batch's mismatched pairs (`mismatched_pairs`, drawn from the term's own stream)."""
    d = o.loss.dalr
    mismatch = need(mismatch, "mismatched pairs", "consistency").to(e.z1.device, non_blocking=True)
    return consistency_loss(need(e.shared_text, "shared_text", "consistency"),
                            need(e.shared_image, "shared_image", "consistency"), mismatch, d.consistency_margin)


@computes("cma")
def dalr_cma(o: Objective, e: StepEmbeddings, draw: torch.Tensor | None = None) -> torch.Tensor:
    """L_CMA (Eq. 6–8): the student's sentence–image distributions against the teachers' Q; the student side
    from s^z and h^v (Eq. 6) or, with ``cma_inputs: raw``, the SimCSE space z against the raw image features v̂
    (the authors' code, l.745)."""
    d = o.loss.dalr
    if d.cma_inputs == "projected":
        text, image = need(e.s1, "s1", "cma"), need(e.teacher_image, "teacher_image", "cma")
    else:  # widths checked before training (`mmcse.methods.terms.dalr.cma_width_problem`)
        text, image = e.z1, need(e.joint_image, "joint_image", "cma")
    q_text, q_image = dalr_teacher_target_sims(o, e, "cma")
    return cross_modal_alignment_loss(student_cosines(o, text, image), q_text, q_image, d.cma_student_temperature,
                                      d.cma_teacher_temperature, d.cma_pairing)


@draws("rank")
def ranking_ties(o: Objective, n: int, generator: torch.Generator) -> torch.Tensor:
    """The order ``(n,)`` in which L_rank's teacher ranking breaks ties (`tie_order`)."""
    return tie_order(n, generator)


@computes("rank")
def dalr_rank(o: Objective, e: StepEmbeddings, ties: torch.Tensor | None = None) -> torch.Tensor:
    """L_rank (Eq. 10): ListMLE of the student's similarities against the text teachers' ranking
    (ties broken in `ranking_ties`' order, drawn from the term's own stream); the teachers' list combined as
    ``rank_teacher_weighting`` says."""
    d = o.loss.dalr
    ranking = teacher_rankings(need(e.rank_teacher_sim, "rank_teacher_sim", "rank"),
                               include_diagonal=d.rank_include_diagonal, ties=need(ties, "tie order", "rank"))
    return listmle_loss(student_cosines(o, e.z1, e.z2), ranking.to(e.z1.device), d.rank_temperature, d.rank_eps)


@computes("ima")
def dalr_ima(o: Objective, e: StepEmbeddings, draw: torch.Tensor | None = None) -> torch.Tensor:
    """L_IMA (Eq. 11–12) against Q^{t2t}."""
    d = o.loss.dalr
    return intra_modal_alignment_loss(student_cosines(o, e.z1, e.z2), dalr_text_target_similarity(o, e, "ima"),
                                      d.ima_student_temperature, d.ima_teacher_temperature)
