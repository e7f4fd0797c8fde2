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
