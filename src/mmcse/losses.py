"""Contrastive objectives as functions of embeddings (so cached features plug in).

Equation numbers refer to the background section of the KDMCSE paper
(``shared/papers/kdmcse.txt`` §3.1), which restates SimCSE and MCSE.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def cosine_matrix(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Pairwise cosine similarities ``(N, M)`` of rows of ``a (N, d)`` and ``b (M, d)``."""
    return F.normalize(a, dim=-1) @ F.normalize(b, dim=-1).T


def info_nce(anchors: torch.Tensor, candidates: torch.Tensor, temperature: float) -> torch.Tensor:
    """Mean over i of -log softmax_j(sim(a_i, c_j)/τ)[i]: candidate i is the positive of anchor i."""
    logits = cosine_matrix(anchors, candidates) / temperature  # (N, N)
    targets = torch.arange(anchors.shape[0], device=anchors.device)
    return F.cross_entropy(logits, targets)


def simcse_loss(z1: torch.Tensor, z2: torch.Tensor, temperature: float) -> torch.Tensor:
    """Unsupervised SimCSE, KDMCSE paper Eq. 1.

    ``z1, z2 (N, d)`` are the two dropout views h^z, h^z' of the same N sentences;
    the other sentences' second views are the negatives.
    """
    return info_nce(z1, z2, temperature)


def mcse_image_loss(
    s1: torch.Tensor, s2: torch.Tensor, v: torch.Tensor, temperature: float
) -> torch.Tensor:
    """MCSE's sentence–image objective, KDMCSE paper Eq. 3 (mean over the batch).

    ``s1, s2 (N, p)``: the projected dropout views s^z, s^z' (Eq. 2); ``v (N, p)``: the
    projected images. Eq. 3 sums the InfoNCE of both views against the images.
    """
    return info_nce(s1, v, temperature) + info_nce(s2, v, temperature)


def mcse_objective(
    z1: torch.Tensor,
    z2: torch.Tensor,
    temperature: float,
    s1: torch.Tensor | None = None,
    s2: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    temperature_img: float = 0.05,
    lambda_img: float = 0.0,
) -> dict[str, torch.Tensor]:
    """SimCSE (+ λ · MCSE image term when projected sentence/image features are given).

    Returns named terms: ``simcse``, ``image`` (when computed) and their weighted sum ``loss``.
    """
    terms = {"simcse": simcse_loss(z1, z2, temperature)}
    loss = terms["simcse"]
    if v is not None:
        if s1 is None or s2 is None:
            raise ValueError("the image term needs both projected sentence views s1 and s2")
        terms["image"] = mcse_image_loss(s1, s2, v, temperature_img)
        loss = loss + lambda_img * terms["image"]
    terms["loss"] = loss
    return terms


# --------------------------------------------------------------------------- KDMCSE


def safe_arccos(cos: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """arccos with the input clamped inside (-1, 1): the derivative -1/sqrt(1-x²) is
    infinite at ±1, so identical (θ = 0) or opposite (θ = π) vectors would give NaN gradients."""
    return torch.arccos(cos.clamp(-1.0 + eps, 1.0 - eps))


def threshold_keep_mask(teacher_sim: torch.Tensor, threshold: float | None) -> torch.Tensor:
    """KDMCSE Threshold Filtering, paper Eq. 8 (as the text and the authors' code intend).

    ``teacher_sim (N, N)`` holds α_ij; negative j of anchor i is dropped from the
    denominator when α_ij is *above* ``threshold`` (a likely false negative). The
    positive (diagonal) is always kept; ``threshold=None`` keeps everything.
    Returns a bool ``(N, N)`` mask of the kept terms.
    """
    keep = torch.ones_like(teacher_sim, dtype=torch.bool)
    if threshold is not None:
        keep = teacher_sim <= threshold
    return keep | torch.eye(teacher_sim.shape[0], dtype=torch.bool, device=teacher_sim.device)


def adapacse_loss(
    anchors: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    margin: float = 0.0,
    margin_sim: torch.Tensor | None = None,
    keep: torch.Tensor | None = None,
) -> torch.Tensor:
    """AdapACSE with Threshold Filtering, KDMCSE paper Eq. 12–13 (mean over anchors).

    ``anchors, targets (N, p)``: target i is the positive of anchor i. The positive
    logit is cos(θ_ii)/τ; negative j gets cos(θ_ij − m·Δ_ij)/τ with Δ_ij = |1 − α_ij|
    from ``margin_sim (N, N)`` (α); ``keep (N, N)`` removes filtered negatives (Eq. 13's φ).
    With ``margin=0`` and no filtering this is InfoNCE.
    """
    theta = safe_arccos(cosine_matrix(anchors, targets))  # (N, N)
    n = anchors.shape[0]
    eye = torch.eye(n, dtype=torch.bool, device=anchors.device)
    if margin and margin_sim is None:
        raise ValueError("an adaptive margin needs the teacher similarities margin_sim")
    delta = (1.0 - margin_sim).abs() if margin_sim is not None else torch.zeros_like(theta)  # (N, N)
    shifted = torch.where(eye, theta, theta - margin * delta)
    logits = torch.cos(shifted) / temperature  # (N, N)
    if keep is not None:
        logits = logits.masked_fill(~keep, float("-inf"))
    return (torch.logsumexp(logits, dim=1) - logits.diagonal()).mean()


def kdmcse_term(
    s1: torch.Tensor,
    s2: torch.Tensor,
    teacher_proj: torch.Tensor,
    temperature: float,
    margin: float,
    margin_sim: torch.Tensor | None,
    keep: torch.Tensor | None,
) -> torch.Tensor:
    """ℓ^{m'} of one modality m: Eq. 13 applied to both dropout views s^z, s^z' and summed,
    as Eq. 9 sums over z (``teacher_proj (N, p)`` = g_φm of the cached CLIP features)."""
    return sum(adapacse_loss(s, teacher_proj, temperature, margin, margin_sim, keep) for s in (s1, s2))


def kdmcse_objective(image_term: torch.Tensor, text_term: torch.Tensor) -> torch.Tensor:
    """KDMCSE paper Eq. 14: the mean of the visual and textual AdapACSE terms."""
    return (image_term + text_term) / 2.0
