"""DUET's objective (``shared/papers/duet.txt`` §4.3–4.5): the max-violation hinge (Eq. 28–29), box
regression (Eq. 30–31), the norm regularizer (Eq. 32) and their sum (Eq. 33). The model (Eq. 23–27)
is :mod:`mmcse.models.duet`, whose docstring gives the choices where the paper is silent.

Each paper equation lives in one function whose docstring names it ("DUET Eq. N"). The losses are
functions of embeddings (cached features plug in); :func:`duet_objective` returns a dict of named
terms ``hinge``, ``box``, ``norm`` and their weighted sum ``loss`` (Eq. 33).
"""

from __future__ import annotations

import torch

from mmcse.methods.losses import cosine_matrix

REDUCTIONS = ("mean", "sum", "none")


def _reduce(per_item: torch.Tensor, reduction: str) -> torch.Tensor:
    if reduction == "mean":
        return per_item.mean()
    if reduction == "sum":
        return per_item.sum()
    if reduction == "none":
        return per_item
    raise ValueError(f"reduction={reduction!r} is not one of {', '.join(REDUCTIONS)}")


def _check_reduction(reduction: str) -> None:
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction={reduction!r} is not one of {', '.join(REDUCTIONS)}")


# --------------------------------------------------------------------------- losses (§4.3–4.5)


def max_violation_hinge(
    v_img: torch.Tensor,
    v_txt: torch.Tensor,
    margin: float = 0.2,
    reduction: str = "mean",
    ignore: torch.Tensor | None = None,
) -> torch.Tensor:
    """DUET Eq. 28–29: L_match(i, c) = max_c' [α + S(i,c') - S(i,c)]_+ + max_i' [α + S(i',c) - S(i,c)]_+.

    ``v_img, v_txt (B, d)``: pair i is (v_img[i], v_txt[i]); S is the cosine. The hard negatives
    (Eq. 29) are the most similar other caption of image i and the most similar other image of
    caption i in the batch, j != i; ``ignore (B, B)`` bool (row: image, column: caption) removes
    further pairs from the negatives. No negative (batch of 1) -> that term is 0.
    Returns the per-pair losses (B,) reduced by ``reduction``.
    """
    _check_reduction(reduction)
    if v_img.ndim != 2 or v_img.shape != v_txt.shape:
        raise ValueError(f"v_img and v_txt must both be (B, d), got {tuple(v_img.shape)} and {tuple(v_txt.shape)}")
    B = v_img.shape[0]
    S = cosine_matrix(v_img, v_txt)  # (B, B): S[i, k] = S(image i, caption k)
    positive = S.diagonal()  # (B,) S(i, c_i)
    excluded = torch.eye(B, dtype=torch.bool, device=S.device)
    if ignore is not None:
        if ignore.shape != (B, B):
            raise ValueError(f"ignore must be a (B, B) = {(B, B)} bool mask, got {tuple(ignore.shape)}")
        excluded = excluded | ignore.to(device=S.device, dtype=torch.bool)
    # -inf never wins a max, and the hinge of -inf is 0 (with zero gradient): no negatives -> 0.
    negatives = S.masked_fill(excluded, float("-inf"))  # (B, B)
    hardest_caption = negatives.amax(dim=1)  # (B,) S(i, c'): over captions k != i (amax splits ties' gradient)
    hardest_image = negatives.amax(dim=0)  # (B,) S(i', c): over images j != i
    per_pair = (margin + hardest_caption - positive).clamp(min=0) + (margin + hardest_image - positive).clamp(min=0)
    return _reduce(per_pair, reduction)


def box_regression_loss(
    box_pred: torch.Tensor,
    boxes: torch.Tensor,
    region_mask: torch.Tensor | None = None,
    reduction: str = "mean",
) -> torch.Tensor:
    """DUET Eq. 31: L_bbox = (1/n) Σ_i ||b̂_i - b_i||², per image, over its real regions only.

    ``box_pred, boxes (B, n, 5)`` (b̂ from Eq. 30, b from Eq. 23); ``region_mask (B, n)`` True for
    a real region. An image with no real region contributes 0. Returns (B,) reduced by ``reduction``.
    """
    _check_reduction(reduction)
    if box_pred.shape != boxes.shape or box_pred.ndim != 3:
        raise ValueError(
            f"box_pred and boxes must both be (B, n, 5), got {tuple(box_pred.shape)} and {tuple(boxes.shape)}"
        )
    sq = (box_pred - boxes.to(box_pred.dtype)).pow(2).sum(-1)  # (B, n): ||b̂_i - b_i||²
    if region_mask is None:
        return _reduce(sq.mean(1), reduction)
    if region_mask.shape != sq.shape:
        raise ValueError(f"region_mask must have shape {tuple(sq.shape)}, got {tuple(region_mask.shape)}")
    m = region_mask.to(sq.dtype)  # (B, n)
    per_image = (sq * m).sum(1) / m.sum(1).clamp(min=1)  # (B,)
    return _reduce(per_image, reduction)


def norm_regularizer(v_img: torch.Tensor, v_txt: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """DUET Eq. 32: L_norm = | ||v_I||_2 - 1 | + | ||v_C||_2 - 1 |, per pair, on the raw embeddings.

    ``v_img, v_txt (B, d)``; returns (B,) reduced by ``reduction``."""
    _check_reduction(reduction)
    if v_img.ndim != 2 or v_img.shape != v_txt.shape:
        raise ValueError(f"v_img and v_txt must both be (B, d), got {tuple(v_img.shape)} and {tuple(v_txt.shape)}")
    per_pair = (v_img.norm(dim=-1) - 1).abs() + (v_txt.norm(dim=-1) - 1).abs()  # (B,)
    return _reduce(per_pair, reduction)


def duet_objective(
    v_img: torch.Tensor,
    v_txt: torch.Tensor,
    box_pred: torch.Tensor,
    boxes: torch.Tensor,
    region_mask: torch.Tensor | None = None,
    *,
    margin: float = 0.2,
    lambdas: tuple[float, float] = (1.0, 1.0),
    reduction: str = "mean",
    ignore: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """DUET Eq. 33: L_total = L_match + λ1 L_bbox + λ2 L_norm.

    Returns ``{"hinge": L_match (Eq. 28–29), "box": L_bbox (Eq. 31), "norm": L_norm (Eq. 32),
    "loss": L_total}``, each reduced over the batch by the same ``reduction``. The weights
    (λ1, λ2) = ``lambdas`` multiply only ``loss``; the other entries are unweighted.
    """
    lambda_box, lambda_norm = lambdas
    hinge = max_violation_hinge(v_img, v_txt, margin=margin, reduction=reduction, ignore=ignore)
    box = box_regression_loss(box_pred, boxes, region_mask, reduction=reduction)
    norm = norm_regularizer(v_img, v_txt, reduction=reduction)
    return {"hinge": hinge, "box": box, "norm": norm, "loss": hinge + lambda_box * box + lambda_norm * norm}
