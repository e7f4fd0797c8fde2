"""Cross-modal retrieval: image→text and text→image Recall@K (DALR Table 4, Appendix E.3).

The protocol of VSE++ and the Karpathy splits: every image has several captions; image→text
ranks all captions for each image and counts a hit when any of its captions is within the top
K; text→image ranks all images for each caption and counts a hit when its image is. Scores are
cosine similarities. Ties are counted against the model (an item scoring the same as the ground
truth ranks above it), so a constant embedding scores R@K = K/N at best, never 100.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

PRIMARY = "rsum"
KS = (1, 5, 10)


def _unit(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    return x / np.linalg.norm(x, axis=1, keepdims=True).clip(1e-12)


def retrieval_ranks(
    image_emb: np.ndarray, text_emb: np.ndarray, text_image: Sequence[int]
) -> tuple[np.ndarray, np.ndarray]:
    """0-based rank of the best ground truth for each image ``(N_img,)`` (among all captions)
    and of its image for each caption ``(N_txt,)`` (among all images), ties counted against.

    ``image_emb (N_img, d)``, ``text_emb (N_txt, d)``; ``text_image[j]``: the image of caption j.
    """
    owner = np.asarray(text_image, dtype=np.int64)  # (N_txt,)
    n_img = image_emb.shape[0]
    if owner.shape != (text_emb.shape[0],):
        raise ValueError(f"text_image has {owner.shape[0]} entries for {text_emb.shape[0]} captions")
    if owner.size and (owner.min() < 0 or owner.max() >= n_img):
        raise ValueError(f"text_image names images outside 0..{n_img - 1}")
    sim = _unit(image_emb) @ _unit(text_emb).T  # (N_img, N_txt) cosine
    gt = owner[None, :] == np.arange(n_img)[:, None]  # (N_img, N_txt): caption j belongs to image i
    if not gt.any(axis=1).all():
        raise ValueError(f"images without a caption: {np.flatnonzero(~gt.any(axis=1))[:5].tolist()}")
    best_gt = np.where(gt, sim, -np.inf).max(axis=1)  # (N_img,) its best-scoring own caption
    # captions of other images scoring at least as high rank above it
    i2t = (np.where(gt, -np.inf, sim) >= best_gt[:, None]).sum(axis=1)
    own = sim[owner, np.arange(owner.size)]  # (N_txt,) caption j with its own image
    t2i = (sim >= own[None, :]).sum(axis=0) - 1  # other images scoring at least as high (itself excluded)
    return i2t, t2i


def retrieval_metrics(image_emb: np.ndarray, text_emb: np.ndarray, text_image: Sequence[int]) -> dict[str, float]:
    """``i2t_R@1 i2t_R@5 i2t_R@10 t2i_R@1 t2i_R@5 t2i_R@10 rsum`` (×100; rsum: their sum, the
    primary metric) of images ``(N_img, d)`` and captions ``(N_txt, d)`` (`retrieval_ranks`)."""
    i2t, t2i = retrieval_ranks(image_emb, text_emb, text_image)
    scores: dict[str, float] = {}
    for name, ranks in (("i2t", i2t), ("t2i", t2i)):
        for k in KS:
            scores[f"{name}_R@{k}"] = float(100.0 * (ranks < k).mean())
    scores[PRIMARY] = sum(scores.values())
    return scores


def coco_1k_folds(n_images: int, fold: int = 1000) -> list[range]:
    """COCO 1K: the 5K test images split into consecutive folds of 1000 (scores are averaged)."""
    if n_images % fold:
        raise ValueError(f"{n_images} images do not split into folds of {fold}")
    return [range(start, start + fold) for start in range(0, n_images, fold)]


def fold_mean(image_emb: np.ndarray, text_emb: np.ndarray, text_image: Sequence[int],
              folds: Sequence[range]) -> dict[str, float]:
    """Mean of `retrieval_metrics` over image folds, each with its own images' captions."""
    owner = np.asarray(text_image, dtype=np.int64)
    per_fold = []
    for images in folds:
        keep = (owner >= images.start) & (owner < images.stop)
        per_fold.append(retrieval_metrics(image_emb[images.start:images.stop], text_emb[keep],
                                          owner[keep] - images.start))
    return {k: float(np.mean([f[k] for f in per_fold])) for k in per_fold[0]}
