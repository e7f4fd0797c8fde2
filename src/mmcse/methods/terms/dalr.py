"""DALR's terms (Eq. 14: L_info + λ·L_CML + μ·L_IML on image–caption batches; SimCSE's L_text joins
them with ``loss.dalr.simcse_on_pairs``, the authors' code): L_info (Eq. 4), L_CML = L_cons (Eq. 5) +
L_CMA (Eq. 6–8), L_IML = L_rank (Eq. 10) + L_IMA (Eq. 11–12), with their section ``loss.dalr``. ``loss.dalr.cml`` and
``iml`` switch each pair on for any sentence encoder (DALR Tables 4–5: KDMCSE + CML, KDMCSE + IML)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import Field

from mmcse.config.checks import check
from mmcse.config.declared import SECTION, Angle, Bool, NonNegative, Positive, Switch
from mmcse.methods.terms.base import (
    LossTerm,
    Objective,
    StepEmbeddings,
    always,
    loss_section,
    need,
    never,
    register,
    switch,
)

if TYPE_CHECKING:
    import torch


@loss_section("dalr", "DALR Eq. 14: L_info + λ·L_CML + μ·L_IML on image–caption batches")
@dataclass(frozen=True)
class DALRLossConfig:
    __pydantic_config__ = SECTION
    # DALR Eq. 14: L_info + λ·L_CML + μ·L_IML on image–caption batches. cml/iml may also be switched on
    # for kdmcse (DALR Tables 4–5: KDMCSE + CML, KDMCSE + IML) or any other method.
    # Eq. 14 as printed trains a pair batch on L_total alone (SimCSE's L_text, Eq. 1, on text-only
    # batches); the authors' src/train_mix.py l.542 adds SimCSE's loss to it: true
    simcse_on_pairs: Bool = False
    """SimCSE's L_text on image–caption batches too (authors' code; printed: text batches only)"""
    info: Bool = True
    """L_info (Eq. 4), method dalr"""
    info_weight: NonNegative = 1.0
    """the weight of L_info in Eq. 14 (printed: 1; the authors' code: 0.1)"""
    info_views: Literal["one", "mean", "sum"] = "one"
    """Eq. 4 on the one view s^z (printed) | mean: of both dropout views (authors' src/model_modified.py l.764) | sum:
    both views summed (MCSE's Eq. 3, mmcse's earlier reading)"""
    info_margin: Bool = False
    """KDMCSE's adaptive angular margin on L_info (authors' code), of size info_margin_size"""
    info_margin_size: Angle = 0.125
    """m of L_info's adaptive margin (not printed: KDMCSE's m; the authors' scripts MARGIN2=0.18)"""
    student_margin: Angle = 0.0
    """a constant angular margin on the student's off-diagonal similarities of L_text, L_CMA, L_IMA and L_rank
    (0: the plain cosines of Eq. 1, 6, 10, 11 | the authors' ArcSimilarity(τ, MARGIN1 = 0.18), gated as
    loss.kdmcse.margin_gate says)"""
    consistency_text: Literal["encoder", "pooler"] = "encoder"
    """the sentence side of L_cons (Eq. 5): encoder = f_θ's [CLS] (§3.2: "using f_v and f_θ") | pooler = the SimCSE
    space z (the authors' self.consistency(z1, …))"""
    cml: Switch = "auto"
    """L_CML = L_cons + L_CMA (Eq. 9); auto: on for dalr; true with kdmcse = KDMCSE + CML"""
    lambda_cml: NonNegative = 0.1
    """λ"""
    consistency: Bool = True
    """L_cons (Eq. 5): cosine-embedding loss on aligned / mismatched pairs"""
    consistency_scale: NonNegative = 1.0
    """L_cons's factor inside L_CML: 1 (Eq. 9) | 0.01 (authors' src/model_modified.py l.765)"""
    consistency_margin: Annotated[float, Field(ge=0, le=1)] = 0.2
    """m"""
    mismatch: Literal["derangement", "roll"] = "derangement"
    """derangement: random, no fixed point | roll: cyclic shift by 5 (authors' code)"""
    alignment: Bool = True
    """L_CMA (Eq. 6–8)"""
    cma_student_temperature: Positive = 1.0
    """Eq. 6 divides by none (1.0); the authors' code by 0.05 · 0.45 = 0.0225"""
    cma_teacher_temperature: Positive = 1.0
    """the teacher side's temperature in L_CMA (Eq. 7: none, 1.0; the authors' code 0.5)"""
    cma_inputs: Literal["projected", "raw"] = "projected"
    """P^{t2v} of L_CMA from s^z and h^v (Eq. 6) | raw: the SimCSE space z against the raw image features v̂ (the
    authors' code; their widths must agree, as BERT-base's 768 and CLIP ViT-L/14's)"""
    cma_pairing: Literal["eq8", "by_rows"] = "eq8"
    """which target each distribution meets: eq8 = Q^{t2t} with P^{t2v} (each image over the texts) and Q^{v2v} with
    its transpose (Eq. 8) | by_rows = Q^{t2t} with each text's distribution over the images, Q^{v2v} with each
    image's over the texts (the authors' code)"""
    iml: Switch = "auto"
    """L_IML = L_rank + L_IMA (Eq. 13); auto: on for dalr; true with kdmcse = KDMCSE + IML"""
    mu_iml: NonNegative = 0.2
    """μ"""
    rank: Bool = True
    """L_rank (Eq. 10): ListMLE against the text teachers' ranking"""
    rank_temperature: Positive = 0.05
    """the temperature of the student's scores in L_rank's ListMLE (Eq. 10; RankCSE: 0.05)"""
    rank_include_diagonal: Bool = True
    """RankCSE includes the sentence itself; false drops it"""
    rank_teacher_weighting: Literal["embeddings", "similarities"] = "embeddings"
    """the text teachers' ranking of L_rank: embeddings = the cosines of their weighted [CLS] embeddings (§3.3) |
    similarities = the weighted sum of each teacher's similarity lists (the authors' code)"""
    rank_eps: NonNegative = 0.0
    """ε inside ListMLE's log, log(Σ_{k≥j} exp(S_k − max S) + ε) (Eq. 10: 0; the authors' ListMLE: 1e-7)"""
    ima: Bool = True
    """L_IMA (Eq. 11–12)"""
    ima_student_temperature: Positive = 1.0
    """Eq. 11 divides by none (1.0); the authors' code by 0.05 · 0.45 = 0.0225"""
    ima_teacher_temperature: Positive = 1.0
    """the teacher side's temperature in L_IMA (Eq. 11-12: none, 1.0; the authors' code 0.5)"""
    text_batches: Bool = False
    """also μ·L_IML on text-only batches (text teachers cover every sentence)"""
    teacher_weighting: Literal["embeddings", "similarities"] = "embeddings"
    """the text teachers combined as DALR App. B says (their [CLS] embeddings summed with their weights, then one
    cosine matrix) or as a weighted sum of each teacher's cosine matrix"""
    teacher_space: Literal["projected", "raw"] = "projected"
    """Q^{t2t} / Q^{v2v} of L_CMA and L_IMA: projected = one h^t = g_φt(aggregated text teacher) and h^v = g_φv(v̂)
    for both (Eq. 3, 7, 11) | raw = the unprojected teachers: the text teachers' own similarity (their aggregated
    embedding's, under teacher_weighting: embeddings) and the raw image features' (the authors' code)"""

    def validate(self, where: str) -> None:
        p = "loss.dalr."
        check(self.teacher_space == "raw" or self.teacher_weighting == "embeddings", where, p + "teacher_space",
              "projected projects one aggregated text-teacher embedding, which needs "
              "loss.dalr.teacher_weighting: embeddings (or set teacher_space: raw)")


def cml_on(o: Objective) -> bool:
    """L_CML's switch: ``auto`` is on for dalr; never for simcse, which trains on text alone."""
    return switch(o.loss.dalr.cml, o.method == "dalr") and o.method != "simcse"


def iml_on(o: Objective) -> bool:
    return switch(o.loss.dalr.iml, o.method == "dalr")


def projected(o: Objective) -> bool:
    return o.loss.dalr.teacher_space == "projected"


def info_reads(o: Objective) -> set[str]:
    """L_info's parameters: its views, τ_img, its margin switch and, with the margin, its size and gate."""
    margin = {"loss.dalr.info_margin_size", "loss.kdmcse.margin_gate"} if o.loss.dalr.info_margin else set()
    return {"loss.dalr.info_views", "loss.temperature_img", "loss.dalr.info_margin"} | margin


def student_reads(o: Objective) -> set[str]:
    """What `student_cosines` reads: the student margin and, with one, its gate."""
    return {"loss.dalr.student_margin"} | ({"loss.kdmcse.margin_gate"} if o.loss.dalr.student_margin else set())


def cma_inputs(o: Objective) -> set[str]:
    """L_CMA's student side (s^z and h^v, or z and v̂) and its targets (projected or the raw teachers')."""
    student = {"s", "teacher_image"} if o.loss.dalr.cma_inputs == "projected" else {"z", "joint_image"}
    targets = {"text_teacher", "teacher_image"} if projected(o) else {"text_teacher_sim", "joint_image"}
    return student | targets


def cma_width_problem(o: Objective, on: dict[str, bool], hidden: int, image_dim: int) -> str | None:
    """Why L_CMA cannot run as configured, or None: ``cma_inputs: raw`` compares the student's SimCSE space with the raw
    image features directly, which needs one width (BERT-base's 768 and CLIP ViT-L/14's in the authors' code)."""
    if not on["cma"] or o.loss.dalr.cma_inputs != "raw" or hidden == image_dim:
        return None
    return (f"loss.dalr.cma_inputs: raw compares the student's SimCSE space (width {hidden}) with the raw image "
            f"features (width {image_dim}) directly, as the authors' code does with BERT-base and CLIP ViT-L/14 (768 "
            "each); here they differ: set loss.dalr.cma_inputs: projected")


def student_cosines(o: Objective, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The student's similarities ``(N, M)`` of rows of ``a`` and ``b`` in DALR's terms (L_text, L_CMA, L_IMA,
    L_rank): the cosines of Eq. 1, 6, 10, 11, or with ``loss.dalr.student_margin`` a constant angular margin on
    every off-diagonal pair, gated as ``loss.kdmcse.margin_gate`` says (the authors' one ArcSimilarity(τ, MARGIN1),
    src/model_modified.py l.513, l.628, l.724, l.745, l.752)."""
    from mmcse.methods.losses import angular_margin_cosines, cosine_matrix

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
    from mmcse.methods.losses import cosine_matrix

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
    from mmcse.methods.losses import cosine_matrix

    if projected(o):
        h_t = need(e.text_teacher, "text_teacher", term)
        return cosine_matrix(h_t, h_t)
    return need(e.text_teacher_sim, "text_teacher_sim", term)


def dalr_info(o: Objective, e: StepEmbeddings, draw: torch.Tensor | None = None) -> torch.Tensor:
    """DALR L_info, paper Eq. 4: sentence–image InfoNCE of s^z against h^v = g_φv(v̂). As printed
    on the one view s^z (``info_views: one``); ``mean`` of both dropout views as the authors' code,
    ``sum`` as MCSE's Eq. 3. ``info_margin`` adds KDMCSE's adaptive margin of size ``info_margin_size`` with Δ
    from the image–image teacher similarity (the authors' code, gated as ``loss.kdmcse.margin_gate`` says)."""
    import torch

    from mmcse.methods.losses import adapacse_loss, cosine_matrix, info_nce

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


def mismatched_pairs(o: Objective, n: int, generator: torch.Generator) -> torch.Tensor:
    """The batch's mismatched pairs D' (§3.2): image ``mismatch[i]`` with text i, ``(n,)`` (``loss.dalr.mismatch``)."""
    from mmcse.methods.losses import mismatch_permutation

    return mismatch_permutation(n, o.loss.dalr.mismatch, generator)


def dalr_consistency(o: Objective, e: StepEmbeddings, mismatch: torch.Tensor | None = None) -> torch.Tensor:
    """L_cons (Eq. 5) with the batch's mismatched pairs (`mismatched_pairs`, drawn from the term's own stream)."""
    from mmcse.methods.losses import consistency_loss

    d = o.loss.dalr
    mismatch = need(mismatch, "mismatched pairs", "consistency").to(e.z1.device, non_blocking=True)
    return consistency_loss(need(e.shared_text, "shared_text", "consistency"),
                            need(e.shared_image, "shared_image", "consistency"), mismatch, d.consistency_margin)


def dalr_cma(o: Objective, e: StepEmbeddings, draw: torch.Tensor | None = None) -> torch.Tensor:
    """L_CMA (Eq. 6–8): the student's sentence–image distributions against the teachers' Q; the student side
    from s^z and h^v (Eq. 6) or, with ``cma_inputs: raw``, the SimCSE space z against the raw image features v̂
    (the authors' code, l.745)."""
    from mmcse.methods.losses import cross_modal_alignment_loss

    d = o.loss.dalr
    if d.cma_inputs == "projected":
        text, image = need(e.s1, "s1", "cma"), need(e.teacher_image, "teacher_image", "cma")
    else:  # widths checked before training (`cma_width_problem`)
        text, image = e.z1, need(e.joint_image, "joint_image", "cma")
    q_text, q_image = dalr_teacher_target_sims(o, e, "cma")
    return cross_modal_alignment_loss(student_cosines(o, text, image), q_text, q_image, d.cma_student_temperature,
                                      d.cma_teacher_temperature, d.cma_pairing)


def ranking_ties(o: Objective, n: int, generator: torch.Generator) -> torch.Tensor:
    """The order ``(n,)`` in which L_rank's teacher ranking breaks ties (`tie_order`)."""
    from mmcse.methods.losses import tie_order

    return tie_order(n, generator)


def dalr_rank(o: Objective, e: StepEmbeddings, ties: torch.Tensor | None = None) -> torch.Tensor:
    """L_rank (Eq. 10): ListMLE of the student's similarities against the text teachers' ranking
    (ties broken in `ranking_ties`' order, drawn from the term's own stream); the teachers' list combined as
    ``rank_teacher_weighting`` says."""
    from mmcse.methods.losses import listmle_loss, teacher_rankings

    d = o.loss.dalr
    ranking = teacher_rankings(need(e.rank_teacher_sim, "rank_teacher_sim", "rank"),
                               include_diagonal=d.rank_include_diagonal, ties=need(ties, "tie order", "rank"))
    return listmle_loss(student_cosines(o, e.z1, e.z2), ranking.to(e.z1.device), d.rank_temperature, d.rank_eps)


def dalr_ima(o: Objective, e: StepEmbeddings, draw: torch.Tensor | None = None) -> torch.Tensor:
    """L_IMA (Eq. 11–12) against Q^{t2t}."""
    from mmcse.methods.losses import intra_modal_alignment_loss

    d = o.loss.dalr
    return intra_modal_alignment_loss(student_cosines(o, e.z1, e.z2), dalr_text_target_similarity(o, e, "ima"),
                                      d.ima_student_temperature, d.ima_teacher_temperature)


def _text_batches(o: Objective) -> bool:
    return o.loss.dalr.text_batches  # μ·L_IML also on text-only batches


register(
    LossTerm(
        name="info", equation="DALR L_info (Eq. 4)", order=40, weight="loss.dalr.info_weight",
        active=lambda o: o.method == "dalr" and o.loss.dalr.info,
        inputs=lambda o: {"s", "teacher_image"} | ({"joint_image"} if o.loss.dalr.info_margin else set()),
        on_pairs=always, on_text=never, compute=dalr_info,
        reads=info_reads, retrieval_head=("teacher_image_proj", "retrieval_joint_image"),
    ),
    LossTerm(
        name="consistency", equation="DALR L_cons (Eq. 5)", order=50, weight="loss.dalr.lambda_cml",
        scale="loss.dalr.consistency_scale",
        active=lambda o: cml_on(o) and o.loss.dalr.consistency,
        inputs=lambda o: {"shared_text", "shared_image"}, on_pairs=always, on_text=never,
        compute=dalr_consistency, stream=1, draw=mismatched_pairs,
        reads=lambda o: {"loss.dalr.mismatch", "loss.dalr.consistency_margin"},
    ),
    LossTerm(
        name="cma", equation="DALR L_CMA (Eq. 6–8)", order=60, weight="loss.dalr.lambda_cml",
        active=lambda o: cml_on(o) and o.loss.dalr.alignment,
        inputs=cma_inputs, on_pairs=always, on_text=never, compute=dalr_cma,
        reads=lambda o: {"loss.dalr.teacher_space", "loss.dalr.cma_student_temperature",
                         "loss.dalr.cma_teacher_temperature", "loss.dalr.cma_inputs", "loss.dalr.cma_pairing"}
        | student_reads(o),
    ),
    LossTerm(
        name="rank", equation="DALR L_rank (Eq. 10)", order=80, weight="loss.dalr.mu_iml",
        active=lambda o: iml_on(o) and o.loss.dalr.rank,
        inputs=lambda o: {"z", "rank_teacher_sim"}, on_pairs=always, on_text=_text_batches, compute=dalr_rank,
        stream=2, draw=ranking_ties,
        reads=lambda o: {"loss.dalr.rank_include_diagonal", "loss.dalr.rank_temperature", "loss.dalr.rank_eps"}
        | student_reads(o),
    ),
    LossTerm(
        name="ima", equation="DALR L_IMA (Eq. 11–12)", order=90, weight="loss.dalr.mu_iml",
        active=lambda o: iml_on(o) and o.loss.dalr.ima,
        inputs=lambda o: {"z", "text_teacher" if projected(o) else "text_teacher_sim"},
        on_pairs=always, on_text=_text_batches, compute=dalr_ima,
        reads=lambda o: {"loss.dalr.teacher_space", "loss.dalr.ima_student_temperature",
                         "loss.dalr.ima_teacher_temperature"} | student_reads(o),
    ),
)
