"""Which loss terms a method adds up, and with which weights (one function, every method).

The equations live in :mod:`mmcse.methods.losses`; this module only wires a configuration's active
terms (:func:`mmcse.config.active_terms`) to the embeddings of one batch. Everything is
a function of tensors, so tests can feed random embeddings and teacher features.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mmcse.config import Config, active_terms
from mmcse.methods.losses import (
    adapacse_loss,
    consistency_loss,
    cosine_matrix,
    cross_modal_alignment_loss,
    info_nce,
    intra_modal_alignment_loss,
    kdmcse_objective,
    kdmcse_soft_labels,
    kdmcse_term,
    listmle_loss,
    mcse_image_loss,
    mcseo_image_caption_loss,
    mismatch_permutation,
    object_phrase_loss,
    simcse_loss,
    teacher_rankings,
    threshold_keep_mask,
)

STAT = "stat/"  # prefix of diagnostics in a step's dict: logged, never added to the loss

# Each random draw (mismatched pairs, ranking ties) gets its own stream, so switching one
# term off leaves every other term's numbers unchanged.
_STREAMS = {"mismatch": 1, "rank": 2}


def term_generator(seed: int, term: str) -> torch.Generator:
    """A CPU generator for one term's draws: the same numbers on every training device."""
    return torch.Generator().manual_seed(seed * 16 + _STREAMS[term])


@dataclass
class StepEmbeddings:
    """One batch of N sentences: student outputs and cached teacher features.

    Only the fields the active terms read need to be set.
    """

    z1: torch.Tensor  # (N, H) SimCSE space, dropout view z
    z2: torch.Tensor  # (N, H) dropout view z'
    pair_batch: bool = False
    s1: torch.Tensor | None = None  # (N, p) g_φ1/g_φg on [CLS], view z
    s2: torch.Tensor | None = None  # (N, p) view z'
    image: torch.Tensor | None = None  # (N, p) g_φ2 of the image-encoder features (MCSE, MCSEO)
    teacher_text: torch.Tensor | None = None  # (N, p) g_φt(t̂) (KDMCSE Eq. 5)
    teacher_image: torch.Tensor | None = None  # (N, p) g_φv(v̂) (KDMCSE Eq. 6, DALR h^v)
    joint_text: torch.Tensor | None = None  # (N, k) t̂: raw cached joint-teacher caption features
    joint_image: torch.Tensor | None = None  # (N, k) v̂: raw cached joint-teacher image features
    shared_text: torch.Tensor | None = None  # (N, p) DALR consistency MLP on the sentence
    shared_image: torch.Tensor | None = None  # (N, p) DALR consistency MLP on the image
    text_teacher_sim: torch.Tensor | None = None  # (N, N) the text teachers' own similarity (L_rank; raw L_IMA)
    text_teacher: torch.Tensor | None = None  # (N, p) DALR h^t = g_φt(Σ_k w_k F_k) (Eq. 3; projected Q^{t2t})
    phrases: torch.Tensor | None = None  # (T, p) projected phrase span means (MCSEO)
    objects: torch.Tensor | None = None  # (T, p) projected object-crop features (MCSEO)
    object_pair: torch.Tensor | None = None  # (T,) row of each object–phrase pair's caption


def _need(x: torch.Tensor | None, name: str, term: str) -> torch.Tensor:
    if x is None:
        raise ValueError(f"loss term '{term}' needs {name}, which this batch does not carry")
    return x


def text_term(cfg: Config, e: StepEmbeddings) -> torch.Tensor:
    """SimCSE (KDMCSE Eq. 1) on every batch; on text-only batches of kdmcse with
    ``text_batches: angular_margin``, a constant angular margin on every negative
    (AdapACSE, Eq. 12, with Δ = 1)."""
    k = cfg.loss.kdmcse
    if cfg.train.method == "kdmcse" and not e.pair_batch and k.text_batches == "angular_margin":
        none_similar = torch.zeros(e.z1.shape[0], e.z1.shape[0], dtype=e.z1.dtype, device=e.z1.device)
        return adapacse_loss(e.z1, e.z2, cfg.loss.temperature, k.text_margin, margin_sim=none_similar)
    return simcse_loss(e.z1, e.z2, cfg.loss.temperature)


def kdmcse_terms(cfg: Config, e: StepEmbeddings) -> dict[str, torch.Tensor]:
    """ℓ^{v'}, ℓ^{t'} (Eq. 9–13) and their mean (Eq. 14). Threshold filtering uses α^{t,v}
    (image term) and α^{t,t} (text term); the margin's Δ uses image–image and caption–caption
    α (``within``, the authors' code) or the same cross-modal α^{t,m} (``cross``). The α are
    `kdmcse_soft_labels` of the projections g_φt(t̂), g_φv(v̂) (Algorithm 1) or, with
    ``soft_labels: clip``, of the raw CLIP features."""
    k, tau = cfg.loss.kdmcse, cfg.loss.temperature_img
    s1, s2 = _need(e.s1, "s1", "kdmcse"), _need(e.s2, "s2", "kdmcse")
    g_t = _need(e.teacher_text, "teacher_text", "kdmcse")  # (N, p) g_φt(t̂)
    g_v = _need(e.teacher_image, "teacher_image", "kdmcse")  # (N, p) g_φv(v̂)
    if k.soft_labels == "projections":
        alpha = kdmcse_soft_labels(g_t, g_v)
    else:
        alpha = kdmcse_soft_labels(_need(e.joint_text, "joint_text", "kdmcse"),
                                   _need(e.joint_image, "joint_image", "kdmcse"))
    margin_v = alpha["vv"] if k.margin_similarity == "within" else alpha["tv"]
    keep_v = threshold_keep_mask(alpha["tv"], k.threshold_value)
    keep_t = threshold_keep_mask(alpha["tt"], k.threshold_value)
    image = kdmcse_term(s1, s2, g_v, tau, k.margin, margin_v, keep_v)
    text = kdmcse_term(s1, s2, g_t, tau, k.margin, alpha["tt"], keep_t)
    n = s1.shape[0]
    return {
        "kdmcse_image": image, "kdmcse_text": text, "kdmcse": kdmcse_objective(image, text),
        # diagnostics (not summed): the share of negatives the threshold removed
        f"{STAT}kdmcse_filtered_image": (~keep_v).sum() / (n * (n - 1)),
        f"{STAT}kdmcse_filtered_text": (~keep_t).sum() / (n * (n - 1)),
    }


def dalr_teacher_targets(cfg: Config, e: StepEmbeddings, term: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The features of DALR's target distributions Q^{t2t}, Q^{v2v} (Eq. 7) for L_CMA: with
    ``loss.dalr.teacher_space: projected`` the projected teachers h^t = g_φt(f_t(t)) and h^v =
    g_φv(f_v(v)) of Eq. 3 (one h^t, also L_IMA's); with ``raw``, the cached CLIP caption and image
    features. The equations carry no stop-gradient, so gradients reach g_φt and g_φv through Q."""
    if cfg.loss.dalr.teacher_space == "projected":
        return _need(e.text_teacher, "text_teacher", term), _need(e.teacher_image, "teacher_image", term)
    return _need(e.joint_text, "joint_text", term), _need(e.joint_image, "joint_image", term)


def dalr_text_target_similarity(cfg: Config, e: StepEmbeddings, term: str) -> torch.Tensor:
    """The cosine matrix ``(N, N)`` behind L_IMA's Q^{t2t} (Eq. 11): cos(h^t, h^t) of the projected
    text teacher (``teacher_space: projected``, the same h^t as L_CMA's) or the text teachers' own
    similarity (``raw``)."""
    if cfg.loss.dalr.teacher_space == "projected":
        h_t = _need(e.text_teacher, "text_teacher", term)
        return cosine_matrix(h_t, h_t)
    return _need(e.text_teacher_sim, "text_teacher_sim", term)


def dalr_info(cfg: Config, e: StepEmbeddings) -> torch.Tensor:
    """DALR L_info, paper Eq. 4: sentence–image InfoNCE against h^v = g_φv(v̂), summed over
    both dropout views (as MCSE Eq. 3); ``info_margin`` adds KDMCSE's adaptive margin with
    Δ from the image–image teacher similarity."""
    s1, s2 = _need(e.s1, "s1", "info"), _need(e.s2, "s2", "info")
    h_v = _need(e.teacher_image, "teacher_image", "info")
    tau = cfg.loss.temperature_img
    if not cfg.loss.dalr.info_margin:
        return info_nce(s1, h_v, tau) + info_nce(s2, h_v, tau)
    v_hat = _need(e.joint_image, "joint_image", "info")
    with torch.no_grad():
        alpha_vv = cosine_matrix(v_hat, v_hat)
    m = cfg.loss.kdmcse.margin
    return adapacse_loss(s1, h_v, tau, m, alpha_vv) + adapacse_loss(s2, h_v, tau, m, alpha_vv)


def step_objective(
    cfg: Config, e: StepEmbeddings, seed: int = 0, on: dict[str, bool] | None = None
) -> dict[str, torch.Tensor]:
    """All active terms of one batch and their weighted sum ``loss`` (plus ``stat/…``
    diagnostics, never summed):

    SimCSE + [pair batches] λ_img·MCSE image term (mcse: both views; α·l_img-cap for mcseo, MCSEO Eq. 3:
    one view, or both with ``loss.mcseo.image_views: 2``)
    + λ_img·the same term against g_φt(t̂) (mcse with ``loss.mcse.clip_text``: KDMCSE Table 5's "MCSE + CLIP text")
    + λ_img·KDMCSE Eq. 14 (kdmcse with ``pair_objective: simcse_plus_kdmcse``; by default, as
    Algorithm 1, an image–caption batch's KDMCSE loss is Eq. 14 alone, unweighted and without SimCSE)
    + w_info·L_info (dalr) + λ·(L_cons + L_CMA)
    + μ·(L_rank + L_IMA) + β·l_obj-phra (mcseo); μ·L_IML also on text batches with
    ``loss.dalr.text_batches``. ``seed`` seeds the mismatched pairs and ranking ties;
    ``on`` is :func:`mmcse.config.active_terms` of ``cfg``, worked out once per run by callers
    that step many times.
    """
    on = on if on is not None else active_terms(cfg)
    loss_cfg, d = cfg.loss, cfg.loss.dalr
    # KDMCSE Algorithm 1 (App. D): an image–caption batch trains on ℓ^KDMCSE alone, without SimCSE or λ
    kdmcse_alone = e.pair_batch and on["kdmcse"] and loss_cfg.kdmcse.pair_objective == "kdmcse"
    terms: dict[str, torch.Tensor] = {}
    loss = e.z1.new_zeros(())
    if not kdmcse_alone:
        terms["simcse"] = text_term(cfg, e)
        loss = loss + terms["simcse"]
    if e.pair_batch:
        if on["image"]:
            v = _need(e.image, "image", "image")
            if cfg.train.method == "mcseo" and loss_cfg.mcseo.image_views == 1:  # MCSEO Eq. 3: one view
                terms["image"] = mcseo_image_caption_loss(_need(e.s1, "s1", "image"), v, loss_cfg.temperature_img)
            else:  # KDMCSE Eq. 3 (MCSE): both dropout views
                terms["image"] = mcse_image_loss(_need(e.s1, "s1", "image"), _need(e.s2, "s2", "image"), v,
                                                 loss_cfg.temperature_img)
            loss = loss + loss_cfg.lambda_img * terms["image"]
        if on["clip_text"]:  # MCSE + CLIP text (KDMCSE Table 5): the image term's InfoNCE against g_φt(t̂)
            terms["clip_text"] = mcse_image_loss(_need(e.s1, "s1", "clip_text"), _need(e.s2, "s2", "clip_text"),
                                                 _need(e.teacher_text, "teacher_text", "clip_text"),
                                                 loss_cfg.temperature_img)
            loss = loss + loss_cfg.lambda_img * terms["clip_text"]
        if on["kdmcse"]:
            terms |= kdmcse_terms(cfg, e)
            loss = loss + (terms["kdmcse"] if kdmcse_alone else loss_cfg.lambda_img * terms["kdmcse"])
        if on["info"]:
            terms["info"] = dalr_info(cfg, e)
            loss = loss + d.info_weight * terms["info"]
        if on["consistency"]:
            n = e.z1.shape[0]
            mismatch = mismatch_permutation(n, d.mismatch, term_generator(seed, "mismatch")).to(
                e.z1.device, non_blocking=True)
            terms["consistency"] = consistency_loss(
                _need(e.shared_text, "shared_text", "consistency"),
                _need(e.shared_image, "shared_image", "consistency"), mismatch, d.consistency_margin,
            )
            loss = loss + d.lambda_cml * terms["consistency"]
        if on["cma"]:
            q_text, q_image = dalr_teacher_targets(cfg, e, "cma")
            terms["cma"] = cross_modal_alignment_loss(
                _need(e.s1, "s1", "cma"), _need(e.teacher_image, "teacher_image", "cma"), q_text, q_image,
                d.cma_student_temperature, d.cma_teacher_temperature,
            )
            loss = loss + d.lambda_cml * terms["cma"]
        if on["object"] and e.phrases is not None and e.phrases.shape[0] > 0:
            terms["object"] = object_phrase_loss(
                e.phrases, _need(e.objects, "objects", "object"), _need(e.object_pair, "object_pair", "object"),
                loss_cfg.mcseo.temperature,
            )
            loss = loss + loss_cfg.mcseo.beta * terms["object"]
    if e.pair_batch or d.text_batches:
        if on["rank"]:
            teacher = _need(e.text_teacher_sim, "text_teacher_sim", "rank")
            ranking = teacher_rankings(teacher, term_generator(seed, "rank"), d.rank_include_diagonal)
            terms["rank"] = listmle_loss(cosine_matrix(e.z1, e.z2), ranking.to(e.z1.device), d.rank_temperature)
            loss = loss + d.mu_iml * terms["rank"]
        if on["ima"]:
            terms["ima"] = intra_modal_alignment_loss(
                e.z1, e.z2, dalr_text_target_similarity(cfg, e, "ima"),
                d.ima_student_temperature, d.ima_teacher_temperature,
            )
            loss = loss + d.mu_iml * terms["ima"]
    terms["loss"] = loss
    return terms


def needed_features(cfg: Config, pair_batch: bool) -> set[str]:
    """Which cached feature groups a batch must load: image, joint, text_teachers, objects."""
    on = active_terms(cfg)
    need: set[str] = set()
    if pair_batch:
        if on["image"]:
            need.add("image")
        if on["kdmcse"] or on["info"] or on["consistency"] or on["cma"] or on["clip_text"]:
            need.add("joint")
        if on["object"]:
            need.add("objects")
    if (pair_batch or cfg.loss.dalr.text_batches) and (on["rank"] or on["ima"]):
        need.add("text_teachers")
    if pair_batch and on["cma"] and cfg.loss.dalr.teacher_space == "projected":  # Q^{t2t} from h^t
        need.add("text_teachers")
    return need
