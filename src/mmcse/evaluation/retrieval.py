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


BLOCK = 1024  # rows of the similarity matrix held at once: 1024 × 25k captions × 8 B ≈ 200 MB


def _unit(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    return x / np.linalg.norm(x, axis=1, keepdims=True).clip(1e-12)


def check_inputs(image_emb: np.ndarray, text_emb: np.ndarray, text_image: Sequence[int]) -> np.ndarray:
    """One clear error before any scoring: shapes, NaN/inf, captions naming a missing image,
    images without a caption. Returns ``text_image`` as an int array ``(N_txt,)``."""
    image_emb, text_emb = np.asarray(image_emb), np.asarray(text_emb)
    if image_emb.ndim != 2 or text_emb.ndim != 2 or image_emb.shape[1] != text_emb.shape[1]:
        raise ValueError(f"retrieval needs (N_img, d) and (N_txt, d) embeddings: got {image_emb.shape}, "
                         f"{text_emb.shape}")
    for name, emb in (("image", image_emb), ("caption", text_emb)):
        bad = ~np.isfinite(emb).all(axis=1)
        if bad.any():
            raise ValueError(f"{bad.sum()} {name} embeddings hold NaN or inf (first rows: "
                             f"{np.flatnonzero(bad)[:5].tolist()})")
    owner = np.asarray(text_image, dtype=np.int64)  # (N_txt,)
    n_img = image_emb.shape[0]
    if owner.shape != (text_emb.shape[0],):
        raise ValueError(f"text_image has {owner.shape[0]} entries for {text_emb.shape[0]} captions")
    if owner.size and (owner.min() < 0 or owner.max() >= n_img):
        missing = np.flatnonzero((owner < 0) | (owner >= n_img))
        raise ValueError(f"captions {missing[:5].tolist()} name images outside 0..{n_img - 1}")
    captioned = np.bincount(owner, minlength=n_img) > 0
    if not captioned.all():
        raise ValueError(f"images without a caption: {np.flatnonzero(~captioned)[:5].tolist()}")
    return owner


def retrieval_ranks(
    image_emb: np.ndarray, text_emb: np.ndarray, text_image: Sequence[int], block: int = BLOCK
) -> tuple[np.ndarray, np.ndarray]:
    """0-based rank of the best ground truth for each image ``(N_img,)`` (among all captions)
    and of its image for each caption ``(N_txt,)`` (among all images), ties counted against.

    ``image_emb (N_img, d)``, ``text_emb (N_txt, d)``; ``text_image[j]``: the image of caption j.
    Works through ``block`` rows of the similarity matrix at a time (COCO 5K: 5k × 25k would be
    1 GB at once): image→text over blocks of images, text→image over blocks of captions, so each
    rank compares numbers from the same matrix product and exact ties stay exact.
    """
    owner = check_inputs(image_emb, text_emb, text_image)
    images, texts = _unit(image_emb), _unit(text_emb)
    n_img, n_txt = images.shape[0], texts.shape[0]
    i2t = np.empty(n_img, dtype=np.int64)
    for start in range(0, n_img, block):
        rows = np.arange(start, min(start + block, n_img))
        sim = images[rows] @ texts.T  # (b, N_txt) cosine
        gt = owner[None, :] == rows[:, None]  # (b, N_txt): caption j belongs to image i
        best_gt = np.where(gt, sim, -np.inf).max(axis=1)  # (b,) its best-scoring own caption
        # captions of other images scoring at least as high rank above it
        i2t[rows] = (np.where(gt, -np.inf, sim) >= best_gt[:, None]).sum(axis=1)
    t2i = np.empty(n_txt, dtype=np.int64)
    for start in range(0, n_txt, block):
        rows = np.arange(start, min(start + block, n_txt))
        sim = texts[rows] @ images.T  # (b, N_img)
        own = sim[np.arange(rows.size), owner[rows]]  # (b,) caption with its own image
        t2i[rows] = (sim >= own[:, None]).sum(axis=1) - 1  # other images scoring at least as high
    return i2t, t2i


def retrieval_metrics(image_emb: np.ndarray, text_emb: np.ndarray, text_image: Sequence[int],
                      block: int = BLOCK) -> dict[str, float]:
    """``i2t_R@1 i2t_R@5 i2t_R@10 t2i_R@1 t2i_R@5 t2i_R@10 rsum`` (×100; rsum: their sum, the
    primary metric) of images ``(N_img, d)`` and captions ``(N_txt, d)`` (`retrieval_ranks`)."""
    i2t, t2i = retrieval_ranks(image_emb, text_emb, text_image, block)
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
    owner = check_inputs(image_emb, text_emb, text_image)
    per_fold = []
    for images in folds:
        keep = (owner >= images.start) & (owner < images.stop)
        per_fold.append(retrieval_metrics(image_emb[images.start:images.stop], text_emb[keep],
                                          owner[keep] - images.start))
    return {k: float(np.mean([f[k] for f in per_fold])) for k in per_fold[0]}
