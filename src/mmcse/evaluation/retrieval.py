"""Cross-modal retrieval: image→text and text→image Recall@K (DALR Table 4, Appendix E.3).

The protocol of VSE++ and the Karpathy splits: every image has several captions; image→text
ranks all captions for each image and counts a hit when any of its captions is within the top
K; text→image ranks all images for each caption and counts a hit when its image is. Scores are
cosine similarities. Ties are counted against the model (an item scoring the same as the ground
truth ranks above it), so a constant embedding scores R@K = K/N at best, never 100.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from mmcse.config import EvaluateConfig
from mmcse.errors import InputError
from mmcse.evaluation.names import RETRIEVAL_PRIMARY, recall_key
from mmcse.evaluation.sts import encode_unique
from mmcse.io import read_jsonl
from mmcse.models.precision import autocast
from mmcse.teachers.cache import FeatureStore

if TYPE_CHECKING:
    from mmcse.evaluation.sts import TextEncoder

log = logging.getLogger(__name__)

PRIMARY = RETRIEVAL_PRIMARY
KS = (1, 5, 10)


BLOCK = 1024  # rows of the similarity matrix held at once: 1024 × 25k captions × 8 B ≈ 200 MB


def unit_rows(x: np.ndarray) -> np.ndarray:
    """Rows L2-normalised in float64 (a zero row stays zero): every evaluator's cosine."""
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
    return check_text_image(text_image, text_emb.shape[0], image_emb.shape[0])


def check_text_image(text_image: Sequence[int], n_txt: int, n_img: int) -> np.ndarray:
    """``text_image`` as ``(N_txt,)`` int64 image indices, or one error: a count that is not the
    captions', a caption naming an image outside ``0..n_img-1``, an image without a caption."""
    owner = np.asarray(text_image, dtype=np.int64)  # (N_txt,)
    if owner.shape != (n_txt,):
        raise ValueError(f"text_image has {owner.shape[0]} entries for {n_txt} captions")
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
    images, texts = unit_rows(image_emb), unit_rows(text_emb)
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
    """``i2t_R1 i2t_R5 i2t_R10 t2i_R1 t2i_R5 t2i_R10 rsum`` (×100; rsum: their sum, the
    primary metric) of images ``(N_img, d)`` and captions ``(N_txt, d)`` (`retrieval_ranks`)."""
    i2t, t2i = retrieval_ranks(image_emb, text_emb, text_image, block)
    scores: dict[str, float] = {}
    for name, ranks in (("i2t", i2t), ("t2i", t2i)):
        for k in KS:
            scores[recall_key(name, k)] = float(100.0 * (ranks < k).mean())
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


# --------------------------------------------------------------------------- the student's heads


@torch.inference_mode()
def project(encoder: TextEncoder, captions: Sequence[str], image_features: np.ndarray, head: str,
            batch_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Captions and images in the student's joint space: ``text_proj([CLS])`` ``(N_txt, p)`` and
    ``<head>(features)`` ``(N_img, p)``, with the evaluation's precision; ``encoder`` must hold
    an mmcse student (its heads beside the backbone)."""

    student = encoder.student
    if student is None:
        raise InputError("retrieval needs an mmcse student checkpoint (heads.safetensors beside the model)")
    texts = []
    for start in range(0, len(captions), batch_size):
        batch = encoder.tokenizer(list(captions[start:start + batch_size]), padding=True, truncation=True,
                                  max_length=encoder.max_length, return_tensors="pt").to(encoder.device)
        with autocast(encoder.precision, encoder.device):
            cls = student.cls(batch["input_ids"], batch["attention_mask"])  # (b, H)
            texts.append(student.text_proj(cls).float().cpu().numpy())  # (b, p)
    features = torch.as_tensor(np.asarray(image_features, dtype=np.float32), device=encoder.device)
    images = [getattr(student, head)(features[start:start + batch_size]).float().cpu().numpy()
              for start in range(0, features.shape[0], batch_size)]
    return np.concatenate(images), np.concatenate(texts)


def test_set_metrics(set_name: str, image_emb: np.ndarray, text_emb: np.ndarray, text_image: Sequence[int],
                     block: int = BLOCK) -> dict[str, float]:
    """The scores a test set is reported with, keys prefixed by the set: Flickr30k 1K and the
    demo set over all their images; COCO over all 5K images (``coco_5k_*``) and as the mean of
    five 1K folds (``coco_1k_*``, when the split has its 5,000 images)."""
    scores = {f"{set_name}_{k}": v for k, v in retrieval_metrics(image_emb, text_emb, text_image, block).items()}
    if set_name == "coco_5k":
        n = image_emb.shape[0]
        if n % 1000 == 0:
            folds = fold_mean(image_emb, text_emb, text_image, coco_1k_folds(n))
            scores |= {f"coco_1k_{k}": v for k, v in folds.items()}
        else:
            log.warning("COCO 1K needs the 5,000 test images in folds of 1,000; %d are present: only 5K reported", n)
    return scores


def chance_recalls(text_image: Sequence[int], n_images: int) -> dict[str, float]:
    """`retrieval_metrics`' keys as a random ranking scores them in expectation (×100): a caption's image is in the
    top K of ``n_images`` with probability K / N_img; an image with c of the M captions has one of them in the top
    K with probability 1 − C(M − c, K) / C(M, K) (`retrieval_ranks` ranks an image by its best caption). The
    reference a trained model's R@K is read against."""
    owner = check_text_image(text_image, len(text_image), n_images)
    m = owner.size
    per_image = np.bincount(owner, minlength=n_images)  # (N_img,) c of each image
    scores: dict[str, float] = {}
    for k in KS:
        # C(M − c, K) / C(M, K) = Π_{j<K} (M − c − j) / (M − j): no huge binomials
        j = np.arange(min(k, m))
        miss = np.prod(np.clip(m - per_image[:, None] - j[None, :], 0, None) / (m - j[None, :]), axis=1)
        scores[recall_key("i2t", k)] = float(100.0 * (1.0 - miss).mean())
    for k in KS:
        scores[recall_key("t2i", k)] = float(100.0 * min(k, n_images) / n_images)
    scores[PRIMARY] = sum(scores.values())
    return scores


def chance_metrics(set_name: str, text_image: Sequence[int], n_images: int) -> dict[str, float]:
    """`chance_recalls` of a test set under the keys `test_set_metrics` reports it with (COCO's 1K folds: their
    mean)."""
    scores = {f"{set_name}_{k}": v for k, v in chance_recalls(text_image, n_images).items()}
    if set_name == "coco_5k" and n_images % 1000 == 0:
        owner = np.asarray(text_image)
        folds = [chance_recalls(owner[(owner >= f.start) & (owner < f.stop)] - f.start, len(f))
                 for f in coco_1k_folds(n_images)]
        scores |= {f"coco_1k_{k}": float(np.mean([f[k] for f in folds])) for k in folds[0]}
    return scores


def sentence_neighbours(captions: Sequence[str], embeddings: np.ndarray, text_image: Sequence[int],
                        queries: int, k: int) -> list[dict[str, object]]:
    """DALR Table 10: for ``queries`` captions spread evenly over the test set, the ``k`` most
    similar other test captions (cosine of the evaluated sentence embeddings ``(N, d)``), each
    with its similarity and whether it describes the query's image."""
    if queries == 0 or len(captions) < 2:
        return []
    unit = unit_rows(embeddings)
    picks = np.unique(np.linspace(0, len(captions) - 1, min(queries, len(captions))).round().astype(int))
    owner = np.asarray(text_image)
    rows = []
    for q in picks:
        sim = unit @ unit[q]  # (N,)
        sim[q] = -np.inf  # not the query itself
        top = np.argsort(-sim, kind="stable")[: min(k, len(captions) - 1)]
        rows.append({"query": captions[q], "neighbours": [
            {"caption": captions[j], "cosine": float(sim[j]), "same_image": bool(owner[j] == owner[q])} for j in top]})
    return rows


def neighbours_markdown(rows: list[dict[str, object]], title: str) -> str:
    """The examples as a Markdown table: query, rank, retrieved caption, cosine, same image."""
    lines = [f"# {title}", "", "| query | rank | retrieved | cosine | same image |", "|---|---|---|---|---|"]
    for row in rows:
        for rank, n in enumerate(row["neighbours"], 1):
            query = str(row["query"]).replace("|", "\\|") if rank == 1 else ""
            caption = str(n["caption"]).replace("|", "\\|")
            lines.append(f"| {query} | {rank} | {caption} | {n['cosine']:.3f} | {'yes' if n['same_image'] else 'no'} |")
    return "\n".join(lines) + "\n"


@dataclass
class TestSetResult:
    """What the evaluate stage reports on the retrieval test set: R@K (none without an image
    head), the Table 10 examples, and the embeddings (NDCG ranks the same ones)."""

    set_name: str
    scores: dict[str, float]
    examples: list[dict[str, object]]
    captions: list[str]
    text_image: np.ndarray  # (N_txt,) image index of each caption
    image_emb: np.ndarray | None = None  # (N_img, p) projected, None without an image head
    text_emb: np.ndarray | None = None  # (N_txt, p)


def evaluate_test_set(evaluate: EvaluateConfig, encoder: TextEncoder, data_dir: Path, feature_sets: dict[str, Path],
                      set_name: str, head: tuple[str, str] | None) -> TestSetResult:
    """R@K of the student on ``<data_dir>/retrieval`` through the image head ``head`` (the
    configuration's `mmcse.methods.objectives.image_head`, or as the checkpoint recorded it; image features from
    ``feature_sets[<set>]``, the cache_teachers folders) and DALR Table 10's
    sentence neighbours with the evaluated pooler. Every caption's image must be in the test
    images and the cached features must cover them, or one error names the file first."""

    r = evaluate.retrieval
    images = read_jsonl(data_dir / "retrieval" / "images.jsonl")
    rows = read_jsonl(data_dir / "retrieval" / "captions.jsonl")
    index = {row["image_id"]: i for i, row in enumerate(images)}
    unknown = sorted({row["image_id"] for row in rows} - index.keys())
    if unknown:
        raise InputError(f"{data_dir / 'retrieval' / 'captions.jsonl'}: captions of images not in the test set "
                         f"{unknown[:5]}; rerun the download stage (dvc repro download)")
    captions = [row["caption"] for row in rows]
    text_image = np.array([index[row["image_id"]] for row in rows], dtype=np.int64)
    result = TestSetResult(set_name, {}, [], captions, text_image)
    if r.examples:
        vectors = encode_unique(encoder, captions, evaluate.batch_size, desc="encode test captions")
        sentence_emb = np.stack([vectors[c] for c in captions])  # (N_txt, H) the evaluated pooler
        result.examples = sentence_neighbours(captions, sentence_emb, text_image, r.examples, r.examples_k)
    if head is None:
        log.info("the model has no trained image head: no image–text retrieval")
        return result
    head_name, feature_set = head
    if head_name not in ("image_proj", "teacher_image_proj") or not feature_set.startswith("retrieval_"):
        raise InputError(f"unknown image head {head!r}")
    if feature_set not in feature_sets:
        raise FileNotFoundError(f"no cached {feature_set} features for the retrieval test set: rerun "
                                "cache_teachers (dvc repro cache_teachers)")
    store = FeatureStore.open(feature_sets[feature_set])
    features = store.rows([row["image_id"] for row in images])  # (N_img, d_v); a missing id is named
    result.image_emb, result.text_emb = project(encoder, captions, features, head_name, evaluate.batch_size)
    result.scores = test_set_metrics(set_name, result.image_emb, result.text_emb, text_image, r.block_size)
    return result
