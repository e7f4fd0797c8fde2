"""Figures that compare embeddings and runs, each with the numbers it shows.

* t-SNE of sentence embeddings coloured by KMeans cluster (DALR Figure 3), with the
  silhouette of the clusters (and, given known groups, purity / NMI / the groups' silhouette);
* STS predicted cosine vs gold score of several runs side by side (DALR Figure 4), with each
  run's Spearman and its mean cosine on low-gold pairs (the anisotropy the paper points at);
* KDMCSE's threshold statistics (paper §6.2, Figures 5–6): the joint teacher's α of true
  caption–image pairs vs negatives, the share of negatives each candidate threshold would filter
  (Eq. 8: a negative is dropped when α > threshold), and where each image's true captions rank
  among all captions under the teacher.

Every function returns plain ``dict[str, float]`` statistics next to its matplotlib figure, so
the numbers can be logged and tested; figures are saved with :func:`mmcse.evaluation.plots.save_figure`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mmcse.evaluation.names import recall_key
from mmcse.evaluation.plots import plt
from mmcse.evaluation.retrieval import check_text_image, unit_rows

PRIMARY = "silhouette"
DEFAULT_THRESHOLDS = (0.7, 0.75, 0.8, 0.85, 0.9, 0.95)
QUANTILES = (0.05, 0.25, 0.5, 0.75, 0.95)
STSB = "STSBenchmark"
LOW_GOLD = 1.0  # DALR Fig. 4: "low-scoring" pairs, gold ≤ 1 of 5


# --------------------------------------------------------------------------- t-SNE + KMeans


def cluster_purity(labels: Sequence[int], groups: Sequence[Any]) -> float:
    """Share of points whose cluster's most frequent known group is their own group."""
    labels, groups = np.asarray(labels), np.asarray(groups)
    if labels.shape != groups.shape or labels.size == 0:
        raise ValueError(f"cluster_purity: labels {labels.shape} and groups {groups.shape} must match, non-empty")
    _, group_ids = np.unique(groups, return_inverse=True)
    hits = 0
    for cluster in np.unique(labels):
        hits += np.bincount(group_ids[labels == cluster]).max()
    return float(hits / labels.size)


def tsne_clusters(
    emb: np.ndarray,
    n_clusters: int,
    seed: int = 0,
    groups: Sequence[Any] | None = None,
    perplexity: float = 30.0,
) -> tuple[np.ndarray, np.ndarray, dict[str, float]]:
    """KMeans on the L2-normalised embeddings ``emb (N, d)`` and their 2-D t-SNE.

    Returns ``coords (N, 2)``, KMeans ``labels (N,)`` and metrics: ``silhouette`` (the
    clusters, Euclidean on the unit vectors KMeans saw; the primary number), ``tsne_silhouette``
    (the same labels on the 2-D map: how faithfully the picture shows them), ``inertia``; with
    ``groups`` (known labels, e.g. the image a caption describes): ``purity``, ``nmi`` and
    ``group_silhouette`` (the known groups' own silhouette in embedding space).
    """
    from sklearn.cluster import KMeans
    from sklearn.manifold import TSNE
    from sklearn.metrics import normalized_mutual_info_score, silhouette_score

    x = np.asarray(emb, dtype=np.float64)
    if x.ndim != 2 or x.shape[0] < 3:
        raise ValueError(f"tsne_clusters needs an (N, d) array with N ≥ 3, got shape {x.shape}")
    if not 2 <= n_clusters < x.shape[0]:
        raise ValueError(f"n_clusters={n_clusters} must be in [2, N-1] for N={x.shape[0]} points")
    if groups is not None and len(groups) != x.shape[0]:
        raise ValueError(f"groups has {len(groups)} entries for {x.shape[0]} embeddings")
    unit = unit_rows(x)
    kmeans = KMeans(n_clusters=n_clusters, n_init=4, random_state=seed).fit(unit)
    labels = kmeans.labels_.astype(np.int64)
    # perplexity must stay below N (sklearn); a third of N keeps small samples meaningful
    perp = float(min(perplexity, max(1.0, (x.shape[0] - 1) / 3)))
    coords = TSNE(n_components=2, perplexity=perp, init="pca", random_state=seed).fit_transform(unit)
    metrics = {"n_points": float(x.shape[0]), "n_clusters": float(n_clusters), "inertia": float(kmeans.inertia_)}
    distinct = len(np.unique(labels))
    metrics["silhouette"] = float(silhouette_score(unit, labels)) if distinct > 1 else float("nan")
    metrics["tsne_silhouette"] = float(silhouette_score(coords, labels)) if distinct > 1 else float("nan")
    if groups is not None:
        g = np.asarray(groups)
        metrics["purity"] = cluster_purity(labels, g)
        metrics["nmi"] = float(normalized_mutual_info_score(g, labels))
        n_groups = len(np.unique(g))
        metrics["group_silhouette"] = (
            float(silhouette_score(unit, g)) if 1 < n_groups < x.shape[0] else float("nan")
        )
    return coords, labels, metrics


TSNE_POINTS = 2000  # test sentences drawn for the evaluate stage's map (t-SNE is quadratic)
TSNE_CLUSTERS = 50  # KMeans clusters colouring it


def sample_sentences(sentences: Sequence[str], n: int, seed: int = 0) -> list[str]:
    """At most ``n`` distinct sentences, a seeded sample in a fixed order (sorted first, so the
    sample does not depend on the input order): what to encode for `tsne_figure`."""
    unique = sorted(set(sentences))
    if len(unique) <= n:
        return unique
    keep = np.sort(np.random.default_rng(seed).choice(len(unique), n, replace=False))
    return [unique[i] for i in keep]


def tsne_figure(
    emb: np.ndarray,
    n_clusters: int = 50,
    seed: int = 0,
    groups: Sequence[Any] | None = None,
    max_points: int = 2000,
    title: str = "",
) -> tuple[plt.Figure, dict[str, float]]:
    """DALR Figure 3: the t-SNE map of ``emb (N, d)`` coloured by KMeans cluster, with the
    silhouette (and purity against ``groups``) in the title. More than ``max_points`` rows are
    subsampled (seeded) first; ``n_clusters`` is capped at N-1. Returns the figure and
    `tsne_clusters`' metrics."""
    x = np.asarray(emb)
    g = None if groups is None else np.asarray(groups)
    if g is not None and len(g) != len(x):
        raise ValueError(f"groups has {len(g)} entries for {len(x)} embeddings")
    if len(x) > max_points:
        keep = np.sort(np.random.default_rng(seed).choice(len(x), max_points, replace=False))
        x = x[keep]
        g = None if g is None else g[keep]
    k = min(n_clusters, len(x) - 1)
    coords, labels, metrics = tsne_clusters(x, k, seed, g)
    fig, ax = plt.subplots(figsize=(6, 5.4))
    ax.scatter(coords[:, 0], coords[:, 1], c=labels, cmap="nipy_spectral", s=6, alpha=0.8)
    quality = f"silhouette={metrics['silhouette']:.3f}"
    if "purity" in metrics:
        quality += f", purity={metrics['purity']:.3f}"
    ax.set_title(f"{title + ': ' if title else ''}t-SNE, {k} KMeans clusters ({quality})", fontsize=9)
    ax.set_xticks([])
    ax.set_yticks([])
    return fig, metrics


def tsne_panels(
    embeddings: Mapping[str, np.ndarray],
    n_clusters: int = TSNE_CLUSTERS,
    seed: int = 0,
    groups: Sequence[Any] | None = None,
) -> tuple[plt.Figure, dict[str, dict[str, float]]]:
    """DALR Figure 3 for several models in one picture: the t-SNE map of each model's embeddings
    ``(N, d)`` of the same N sentences (the mapping's order, one panel each), coloured by that
    model's own KMeans clusters, titled with its silhouette (and purity against ``groups``).
    Returns the figure and `tsne_clusters`' metrics per model."""
    if not embeddings:
        raise ValueError("tsne_panels needs at least one model's embeddings")
    sizes = {name: len(e) for name, e in embeddings.items()}
    if len(set(sizes.values())) != 1:
        raise ValueError(f"tsne_panels: every model must embed the same sentences, got {sizes}")
    n = len(embeddings)
    cols = min(4, n)
    rows = int(np.ceil(n / cols))
    fig, axes = plt.subplots(rows, cols, figsize=(3.6 * cols, 3.4 * rows), squeeze=False)
    metrics = {}
    for ax, (name, emb) in zip(axes.flat, embeddings.items(), strict=False):
        k = min(n_clusters, len(emb) - 1)
        coords, labels, metrics[name] = tsne_clusters(np.asarray(emb), k, seed, groups)
        ax.scatter(coords[:, 0], coords[:, 1], c=labels, cmap="nipy_spectral", s=4, alpha=0.8)
        quality = f"silhouette={metrics[name]['silhouette']:.3f}"
        if "purity" in metrics[name]:
            quality += f", purity={metrics[name]['purity']:.3f}"
        ax.set_title(f"{name}\n{k} clusters, {quality}", fontsize=8)
        ax.set_xticks([])
        ax.set_yticks([])
    for ax in axes.flat[n:]:
        fig.delaxes(ax)
    fig.tight_layout()
    return fig, metrics


# --------------------------------------------------------------------------- dropout-mask views

DROPOUT_MASKS = 100  # KDMCSE App. E encodes each sentence "repeatedly"; the count is not printed
SENTENCE_COLOURS = ("tab:orange", "tab:blue", "tab:green")  # KDMCSE Figs. 8-12: two close captions, one far


def dropout_views(
    encode: Callable[[list[str]], np.ndarray], model: Any, sentences: Sequence[str], masks: int = DROPOUT_MASKS,
    batch_size: int = 64, seed: int = 0,
) -> np.ndarray:
    """Each sentence encoded ``masks`` times with dropout on: ``(S, masks, d)``.

    ``model`` is the torch module whose dropout layers ``encode`` runs through (a
    `mmcse.evaluation.sts.TextEncoder`'s ``model``); it is put in train mode for the call and
    back in eval mode after. Each row of a batch draws its own mask, so a sentence repeated in
    one batch gets ``masks`` different views; ``seed`` fixes the masks."""
    import torch

    if masks < 2:
        raise ValueError(f"dropout_views needs at least 2 masks per sentence, got {masks}")
    repeated = [s for s in sentences for _ in range(masks)]
    torch.manual_seed(seed)
    model.train()
    try:
        chunks = [np.asarray(encode(repeated[i : i + batch_size]), dtype=np.float64)
                  for i in range(0, len(repeated), batch_size)]
    finally:
        model.eval()
    views = np.concatenate(chunks)
    return views.reshape(len(sentences), masks, views.shape[-1])


def dropout_statistics(views: np.ndarray) -> dict[str, float]:
    """How tight each sentence's dropout views are and how far apart the sentences lie, on the
    unit vectors of ``views (S, M, d)``: ``spread`` = mean cosine distance of a view to its own
    sentence's mean direction; ``separation_<i>_<j>`` = cosine distance between the mean
    directions of sentences i and j (1-based); ``silhouette`` of the sentences as clusters
    (cosine)."""
    from sklearn.metrics import silhouette_score

    x = unit_rows(np.asarray(views, dtype=np.float64).reshape(-1, views.shape[-1])).reshape(views.shape)
    centres = unit_rows(x.mean(axis=1))  # (S, d)
    out = {"spread": float((1.0 - np.einsum("smd,sd->sm", x, centres)).mean())}
    for i in range(len(centres)):
        for j in range(i + 1, len(centres)):
            out[f"separation_{i + 1}_{j + 1}"] = float(1.0 - centres[i] @ centres[j])
    labels = np.repeat(np.arange(views.shape[0]), views.shape[1])
    out["silhouette"] = float(silhouette_score(x.reshape(-1, x.shape[-1]), labels, metric="cosine"))
    return out


def dropout_tsne_panels(
    views_by_model: Mapping[str, np.ndarray], sentences: Sequence[str], seed: int = 0,
) -> tuple[plt.Figure, dict[str, dict[str, float]]]:
    """KDMCSE Figures 8-12 for several models in one picture: each model's dropout views
    ``(S, M, d)`` of the same ``sentences``, L2-normalised and mapped by t-SNE, one panel per
    model, one colour per sentence (the paper's orange / blue / green), the sentences printed
    under the panels. Returns the figure and `dropout_statistics` per model."""
    from sklearn.manifold import TSNE

    if not views_by_model:
        raise ValueError("dropout_tsne_panels needs at least one model's views")
    shapes = {name: np.shape(v)[:2] for name, v in views_by_model.items()}
    if set(shapes.values()) != {(len(sentences), next(iter(shapes.values()))[1])}:
        raise ValueError(f"dropout_tsne_panels: every model must give (S={len(sentences)}, M) views, got {shapes}")
    n = len(views_by_model)
    fig, axes = plt.subplots(1, n, figsize=(4.2 * n, 4.6), squeeze=False)
    colours = [SENTENCE_COLOURS[i % len(SENTENCE_COLOURS)] for i in range(len(sentences))]
    metrics = {}
    for ax, (name, views) in zip(axes[0], views_by_model.items(), strict=True):
        views = np.asarray(views, dtype=np.float64)
        x = unit_rows(views.reshape(-1, views.shape[-1]))
        perplexity = float(min(30.0, (len(x) - 1) / 3))
        coords = TSNE(2, perplexity=perplexity, init="pca", random_state=seed).fit_transform(x)
        coords = coords.reshape(views.shape[0], views.shape[1], 2)
        metrics[name] = dropout_statistics(views)
        for i, colour in enumerate(colours):
            ax.scatter(coords[i, :, 0], coords[i, :, 1], s=8, color=colour, alpha=0.8, label=f"sentence {i + 1}")
        ax.set_title(f"{name}\nspread={metrics[name]['spread']:.3f}, silhouette={metrics[name]['silhouette']:.3f}",
                     fontsize=8)
        ax.set_xticks([])
        ax.set_yticks([])
    axes[0][0].legend(fontsize=7, loc="best")
    caption = "\n".join(f"{i + 1}: {s[:110]}" for i, s in enumerate(sentences))
    fig.text(0.01, 0.01, caption, fontsize=7, va="bottom", ha="left")
    fig.tight_layout(rect=(0, 0.04 * len(sentences), 1, 1))
    return fig, metrics


# --------------------------------------------------------------------------- nearest neighbours

NEIGHBOURS = 3  # DALR Table 10: top-3 sentences per query


def nearest_sentences(
    queries: np.ndarray, pool: np.ndarray, pool_sentences: Sequence[str], query_sentences: Sequence[str],
    k: int = NEIGHBOURS,
) -> list[list[tuple[str, float]]]:
    """For each query ``(Q, d)`` the ``k`` pool sentences ``(P, d)`` of highest cosine, best
    first, as ``(sentence, cosine)``; the query's own sentence is never its neighbour (DALR
    Table 10 retrieves other captions). Ties keep the pool's order."""
    q, p = unit_rows(np.asarray(queries, dtype=np.float64)), unit_rows(np.asarray(pool, dtype=np.float64))
    if len(pool_sentences) != len(p) or len(query_sentences) != len(q):
        raise ValueError(f"nearest_sentences: {len(p)} pool vectors for {len(pool_sentences)} sentences, "
                         f"{len(q)} query vectors for {len(query_sentences)} sentences")
    sim = q @ p.T  # (Q, P)
    out = []
    for row, query in zip(sim, query_sentences, strict=True):
        order = np.argsort(-row, kind="stable")
        hits = [(pool_sentences[j], float(row[j])) for j in order if pool_sentences[j] != query][:k]
        out.append(hits)
    return out


def neighbours_figure(
    queries: Sequence[str], neighbours_by_model: Mapping[str, Sequence[Sequence[tuple[str, float]]]],
    wrap: int = 48,
) -> plt.Figure:
    """DALR Table 10 as one picture: a block per query, one column per model, its top-k
    neighbours with their cosines (the paper prints KDMCSE beside DALR)."""
    import textwrap

    models = list(neighbours_by_model)
    if not models:
        raise ValueError("neighbours_figure needs at least one model")
    for name, lists in neighbours_by_model.items():
        if len(lists) != len(queries):
            raise ValueError(f"neighbours_figure: {name} has {len(lists)} neighbour lists for {len(queries)} queries")

    def cell(text: str) -> str:
        return "\n".join(textwrap.wrap(text, wrap)) or " "

    lines_per_query = [1 + max(sum(cell(s).count("\n") + 1 for s, _ in neighbours_by_model[m][q]) for m in models)
                       for q in range(len(queries))]
    total = sum(lines_per_query) + len(queries) + 1
    fig = plt.figure(figsize=(min(13.5, 1.2 + 4.1 * len(models)), max(2.0, 0.16 * total + 0.6)))
    y, step = 1.0, 1.0 / total
    for m, name in enumerate(models):
        fig.text(0.09 + m * 0.9 / len(models), y - step, name, fontsize=9, weight="bold", va="top")
    y -= 1.6 * step
    for q, query in enumerate(queries):
        fig.text(0.01, y, f"Query: {query}", fontsize=8, style="italic", va="top")
        y -= step
        for m, name in enumerate(models):
            yy = y
            x = 0.09 + m * 0.9 / len(models)
            for rank, (sentence, cos) in enumerate(neighbours_by_model[name][q], start=1):
                text = cell(f"{sentence} ({cos:.3f})")
                fig.text(x - 0.03, yy, f"#{rank}", fontsize=7, va="top")
                fig.text(x, yy, text, fontsize=7, va="top")
                yy -= step * (text.count("\n") + 1)
        y -= step * (lines_per_query[q] - 1) + step * 0.6
    return fig


# --------------------------------------------------------------------------- STS scatter of runs

Predictions = Mapping[str, tuple[Sequence[float], Sequence[float]]]  # task -> (cosine, gold)


def default_task(predictions_by_run: Mapping[str, Predictions]) -> str:
    """STS-B when every run has it (DALR Fig. 4), else the first task every run has."""
    runs = list(predictions_by_run.values())
    common = [t for t in runs[0] if all(t in r for r in runs[1:])] if runs else []
    if not common:
        raise KeyError("the runs share no STS task: " + "; ".join(
            f"{label}: {', '.join(p) or 'none'}" for label, p in predictions_by_run.items()))
    return STSB if STSB in common else common[0]


def sts_run_statistics(predictions_by_run: Mapping[str, Predictions], task: str | None = None) -> dict[str, float]:
    """Per run (label): ``<label>/spearman`` (×100) of cosine vs gold on ``task`` (default
    `default_task`), ``<label>/mean_cos_low_gold`` (mean cosine of pairs with gold ≤ 1, DALR
    Fig. 4's point: lower is better) and ``<label>/mean_cos`` (all pairs)."""
    from mmcse.evaluation.sts import spearman_x100

    task = task or default_task(predictions_by_run)
    stats: dict[str, float] = {}
    for label, preds in predictions_by_run.items():
        cos, gold = _task_of(label, preds, task)
        stats[f"{label}/spearman"] = spearman_x100(cos, gold)
        low = gold <= LOW_GOLD
        stats[f"{label}/mean_cos_low_gold"] = float(cos[low].mean()) if low.any() else float("nan")
        stats[f"{label}/mean_cos"] = float(cos.mean())
    return stats


def _task_of(label: str, preds: Predictions, task: str) -> tuple[np.ndarray, np.ndarray]:
    if task not in preds:
        raise KeyError(f"run {label}: no predictions for STS task {task!r} (has: {', '.join(preds) or 'none'})")
    cos, gold = (np.asarray(v, dtype=np.float64) for v in preds[task])
    if cos.shape != gold.shape or cos.ndim != 1 or cos.size < 2:
        raise ValueError(f"run {label}, task {task}: cos {cos.shape} and gold {gold.shape} must be equal 1-D (≥ 2)")
    return cos, gold


def sts_scatter_runs(predictions_by_run: Mapping[str, Predictions], task: str | None = None) -> plt.Figure:
    """DALR Figure 4: gold score (x) vs cosine (y) on ``task`` (default `default_task`), one
    panel per run (in the mapping's order, titled with its label and Spearman), shared axes."""
    if not predictions_by_run:
        raise ValueError("sts_scatter_runs needs at least one run")
    task = task or default_task(predictions_by_run)
    stats = sts_run_statistics(predictions_by_run, task)
    n = len(predictions_by_run)
    cols = min(4, n)
    rows = int(np.ceil(n / cols))
    fig, axes = plt.subplots(rows, cols, figsize=(3.4 * cols, 3.2 * rows), squeeze=False, sharex=True, sharey=True)
    for ax, (label, preds) in zip(axes.flat, predictions_by_run.items(), strict=False):
        cos, gold = _task_of(label, preds, task)
        ax.scatter(gold, cos, s=4, alpha=0.4)
        ax.set_title(f"{label}\n{task}: ρ={stats[f'{label}/spearman']:.1f}", fontsize=8)
        ax.set_xlabel("gold")
        ax.set_ylabel("cosine")
    for ax in axes.flat[n:]:
        fig.delaxes(ax)
    fig.tight_layout()
    return fig


# --------------------------------------------------------------------------- KDMCSE threshold


@dataclass
class ThresholdSummary:
    """What `threshold_summary` measured; ``thresholds`` in ascending order."""

    positive_alpha: np.ndarray  # (N_txt,) α^{t,v} of each caption with its own image
    edges: np.ndarray  # (B+1,) histogram bin edges on [-1, 1]
    negative_hist: np.ndarray  # (B,) counts of α^{t,v} over (caption, other image) pairs
    negative_above: np.ndarray  # (T,) counts of those negatives with α > thresholds[t]
    n_negative: int
    negative_sum: float  # Σ α over the negatives (their exact mean, without the bins)
    text_negative_hist: np.ndarray  # (B,) α^{t,t} over (anchor caption, caption of another image)
    text_negative_above: np.ndarray  # (T,)
    n_text_negative: int
    text_same_alpha: np.ndarray  # (M,) α^{t,t} of anchor captions with the other captions of their image
    best_rank: np.ndarray  # (N_img,) 1-based rank of the best true caption among other images' captions
    worst_rank: np.ndarray  # (N_img,) 1-based position of the worst true caption among all captions
    thresholds: tuple[float, ...]
    text_anchors: int


def threshold_summary(
    joint_text: np.ndarray,
    joint_image: np.ndarray,
    text_image: Sequence[int],
    thresholds: Sequence[float] = DEFAULT_THRESHOLDS,
    bins: int = 200,
    text_anchors: int | None = 2000,
    seed: int = 0,
    chunk_elements: int = 4_000_000,
) -> ThresholdSummary:
    """KDMCSE §6.2 statistics of the joint teacher, α = cosine (Eq. 7) of the cached features.

    ``joint_text (N_txt, k)`` t̂ of every caption, ``joint_image (N_img, k)`` v̂ of every image,
    ``text_image[j]`` the image row of caption j. α^{t,v} is computed for every (caption, image)
    pair, image rows in chunks of ``chunk_elements`` similarities (memory stays bounded on
    Flickr's 155k × 31k); α^{t,t} for ``text_anchors`` seeded random anchor captions (all when
    None or fewer) against every caption. Ties rank against the teacher (as
    :mod:`mmcse.evaluation.retrieval`).
    """
    t, v = unit_rows(joint_text), unit_rows(joint_image)
    if t.ndim != 2 or v.ndim != 2 or t.shape[1] != v.shape[1]:
        raise ValueError(f"joint_text {t.shape} and joint_image {v.shape} must be (N, k) with the same k")
    owner = check_text_image(text_image, t.shape[0], v.shape[0])
    ths = tuple(sorted(float(x) for x in thresholds))
    th = np.asarray(ths)
    edges = np.linspace(-1.0, 1.0, bins + 1)
    n_txt, n_img = t.shape[0], v.shape[0]
    positive = np.einsum("jk,jk->j", t, v[owner])  # (N_txt,) caption j with its image

    neg_hist = np.zeros(bins, np.int64)
    neg_above = np.zeros(len(th), np.int64)
    neg_sum = 0.0
    best_rank = np.zeros(n_img, np.int64)
    worst_rank = np.zeros(n_img, np.int64)
    step = max(1, chunk_elements // max(n_txt, 1))
    for start in range(0, n_img, step):
        rows = np.arange(start, min(start + step, n_img))
        sim = v[rows] @ t.T  # (B, N_txt) α^{t,v}, image-major
        gt = owner[None, :] == rows[:, None]  # (B, N_txt): caption j describes image i
        neg = sim[~gt]
        neg_hist += np.histogram(np.clip(neg, -1, 1), edges)[0]
        neg_sum += float(neg.sum())
        neg_above += np.array([(neg > x).sum() for x in th], dtype=np.int64)
        best = np.where(gt, sim, -np.inf).max(1)  # (B,) best true caption
        worst = np.where(gt, sim, np.inf).min(1)  # (B,) worst true caption
        best_rank[rows] = 1 + (np.where(gt, -np.inf, sim) >= best[:, None]).sum(1)
        worst_rank[rows] = (sim >= worst[:, None]).sum(1)  # itself included: 1-based position

    anchors = np.arange(n_txt)
    if text_anchors is not None and text_anchors < n_txt:
        anchors = np.sort(np.random.default_rng(seed).choice(n_txt, text_anchors, replace=False))
    text_hist = np.zeros(bins, np.int64)
    text_above = np.zeros(len(th), np.int64)
    same: list[np.ndarray] = []
    n_text_neg = 0
    step = max(1, chunk_elements // max(n_txt, 1))
    for start in range(0, anchors.size, step):
        rows = anchors[start : start + step]
        sim = t[rows] @ t.T  # (B, N_txt) α^{t,t}
        same_image = owner[None, :] == owner[rows][:, None]  # includes the anchor itself
        neg = sim[~same_image]
        n_text_neg += neg.size
        text_hist += np.histogram(np.clip(neg, -1, 1), edges)[0]
        text_above += np.array([(neg > x).sum() for x in th], dtype=np.int64)
        same_image[np.arange(rows.size), rows] = False  # the anchor with itself is no pair
        same.append(sim[same_image])

    return ThresholdSummary(
        positive_alpha=positive, edges=edges, negative_hist=neg_hist, negative_above=neg_above,
        n_negative=int(n_txt * (n_img - 1)), negative_sum=neg_sum,
        text_negative_hist=text_hist, text_negative_above=text_above,
        n_text_negative=int(n_text_neg), text_same_alpha=np.concatenate(same) if same else np.zeros(0),
        best_rank=best_rank, worst_rank=worst_rank, thresholds=ths, text_anchors=int(anchors.size),
    )


def _fraction(count: float, total: int) -> float:
    return float(count / total) if total else float("nan")


def threshold_metrics(s: ThresholdSummary) -> dict[str, float]:
    """Flat numbers of a `ThresholdSummary` (fractions in [0, 1], ranks 1-based, R@K × 100):

    ``tv_neg_above_<t>`` / ``tt_neg_above_<t>``: share of caption–image / caption–caption
    negatives (other image) a threshold t would filter (α > t); ``tt_same_above_<t>``: share of
    pairs of captions of the same image above t (true "false negatives" it would catch);
    ``tv_pos_q<q>``: quantiles of the positives' α, ``tv_pos_mean``, ``tv_neg_mean``;
    ``teacher_i2t_R{1,5,10}`` and ``rank_mean``/``rank_median`` of each image's best true caption;
    ``worst_rank_mean``/``_median``/``_max`` and ``worst_rank_over_100`` (KDMCSE Fig. 5).
    """
    out: dict[str, float] = {
        "n_captions": float(s.positive_alpha.size), "n_images": float(s.best_rank.size),
        "n_negative": float(s.n_negative), "text_anchors": float(s.text_anchors),
    }
    for x, c, ct in zip(s.thresholds, s.negative_above, s.text_negative_above, strict=True):
        out[f"tv_neg_above_{x:g}"] = _fraction(c, s.n_negative)
        out[f"tt_neg_above_{x:g}"] = _fraction(ct, s.n_text_negative)
        out[f"tt_same_above_{x:g}"] = _fraction((s.text_same_alpha > x).sum(), s.text_same_alpha.size)
    for q in QUANTILES:
        out[f"tv_pos_q{round(q * 100):02d}"] = float(np.quantile(s.positive_alpha, q))
    out["tv_pos_mean"] = float(s.positive_alpha.mean())
    out["tv_neg_mean"] = _fraction(s.negative_sum, s.n_negative)
    for k in (1, 5, 10):
        out[f"teacher_{recall_key('i2t', k)}"] = float(100.0 * (s.best_rank <= k).mean())
    out["rank_mean"] = float(s.best_rank.mean())
    out["rank_median"] = float(np.median(s.best_rank))
    out["worst_rank_mean"] = float(s.worst_rank.mean())
    out["worst_rank_median"] = float(np.median(s.worst_rank))
    out["worst_rank_max"] = float(s.worst_rank.max())
    out["worst_rank_over_100"] = float((s.worst_rank > 100).mean())
    return out


def _similarity_panels(axes: Sequence[Any], s: ThresholdSummary, threshold: float | None) -> None:
    """α^{t,v} of negatives vs true pairs (KDMCSE Fig. 6) and α^{t,t} of other-image vs
    same-image captions, candidate thresholds dotted and the configured ``threshold`` solid."""
    width = s.edges[1] - s.edges[0]
    centres = (s.edges[:-1] + s.edges[1:]) / 2

    def density(counts: np.ndarray) -> np.ndarray:
        return counts / max(int(counts.sum()), 1) / width

    ax = axes[0]
    ax.plot(centres, density(s.negative_hist), color="tab:gray", label=f"negatives ({s.n_negative:,})")
    ax.hist(s.positive_alpha, bins=s.edges, density=True, alpha=0.5, color="tab:blue",
            label=f"true pairs ({s.positive_alpha.size:,})")
    ax.set_yscale("log")
    ax.set_xlabel("teacher α (caption–image)")
    ax.set_ylabel("density")
    ax.set_title(r"$\alpha^{t,v}$: true caption–image pairs vs negatives", fontsize=9)

    ax = axes[1]
    ax.plot(centres, density(s.text_negative_hist), color="tab:gray", label="captions of other images")
    if s.text_same_alpha.size:
        ax.hist(s.text_same_alpha, bins=s.edges, density=True, alpha=0.5, color="tab:green",
                label="captions of the same image")
    ax.set_yscale("log")
    ax.set_xlabel("teacher α (caption–caption)")
    ax.set_title(rf"$\alpha^{{t,t}}$ ({s.text_anchors:,} anchor captions)", fontsize=9)
    for a in axes[:2]:
        for x in s.thresholds:
            a.axvline(x, color="tab:red", linestyle=":", linewidth=0.8)
        if threshold is not None:
            a.axvline(threshold, color="tab:red", linewidth=1.2, label=f"threshold {threshold:g}")
        a.legend(fontsize=7, loc="upper left")


def _rank_panel(ax: Any, s: ThresholdSummary) -> None:
    """Where each image's best and worst true caption ranks among all captions (KDMCSE Fig. 5)."""
    top = max(int(s.worst_rank.max()), 1)
    if top <= 50:  # one bar per rank
        rank_edges = np.arange(1, top + 2) - 0.5
    else:  # ranks spread over orders of magnitude (Flickr: 1 .. 150k): log bins
        rank_edges = np.unique(np.geomspace(1, top + 1, 40).round()).astype(float)
    ax.hist([s.best_rank, s.worst_rank], bins=rank_edges, color=["tab:blue", "tab:orange"],
            label=["best true caption", "worst true caption"])
    if top > 50:
        ax.set_xscale("log")
    ax.set_xlabel(f"rank among {s.positive_alpha.size:,} captions (1 = top)")
    ax.set_ylabel("images")
    r1 = 100.0 * (s.best_rank <= 1).mean()
    ax.set_title(f"teacher image→text rank (R@1={r1:.1f}, mean={s.best_rank.mean():.1f})", fontsize=9)
    ax.legend(fontsize=7)


def threshold_figure(s: ThresholdSummary, threshold: float | None = None) -> plt.Figure:
    """Three panels: α^{t,v} of negatives vs true pairs (KDMCSE Fig. 6), α^{t,t} of other-image
    vs same-image captions, and the rank of each image's best / worst true caption (Fig. 5);
    candidate thresholds as dotted lines, the configured ``threshold`` solid."""
    fig, axes = plt.subplots(1, 3, figsize=(15, 3.8))
    _similarity_panels(axes[:2], s, threshold)
    _rank_panel(axes[2], s)
    fig.tight_layout()
    return fig


def teacher_similarity_figure(s: ThresholdSummary, threshold: float | None = None) -> plt.Figure:
    """KDMCSE Figure 6 alone: the teacher's caption–image and caption–caption similarities."""
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    _similarity_panels(axes, s, threshold)
    fig.tight_layout()
    return fig


def teacher_rank_figure(s: ThresholdSummary) -> plt.Figure:
    """KDMCSE Figure 5 alone: the rank of each image's true captions under the teacher."""
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    _rank_panel(ax, s)
    fig.tight_layout()
    return fig


def threshold_statistics(
    joint_text: np.ndarray,
    joint_image: np.ndarray,
    text_image: Sequence[int],
    thresholds: Sequence[float] = DEFAULT_THRESHOLDS,
    threshold: float | None = None,
    text_anchors: int | None = 2000,
    seed: int = 0,
) -> tuple[dict[str, float], plt.Figure]:
    """`threshold_metrics` and `threshold_figure` of `threshold_summary` (``threshold``, the
    configured ``loss.kdmcse.threshold``, is added to the candidates when given)."""
    candidates = tuple(thresholds) + (() if threshold is None or threshold in thresholds else (threshold,))
    s = threshold_summary(joint_text, joint_image, text_image, candidates, text_anchors=text_anchors, seed=seed)
    return threshold_metrics(s), threshold_figure(s, threshold)


def cached_joint_teacher(
    teachers_dir: str | Path, raw_dir: str | Path, manifest: str | Path | None = None,
    set_dirs: Sequence[str | Path] = (),
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The joint teacher's cached ``t̂ (N_txt, k)``, ``v̂ (N_img, k)`` and the image row of each
    caption ``(N_txt,)``, from the manifest (default ``<teachers_dir>/manifest.json``; an
    ablation job's own manifest, `mmcse.integrity.keys.Upstream`) and ``<raw_dir>/pairs.jsonl``.
    A set is looked up in ``teachers_dir``, then in ``set_dirs`` in order."""
    from mmcse.io import read_json, read_jsonl
    from mmcse.teachers.cache import FeatureStore

    teachers_dir, raw_dir = Path(teachers_dir), Path(raw_dir)
    manifest_file = Path(manifest) if manifest is not None else teachers_dir / "manifest.json"
    if not manifest_file.is_file():
        raise FileNotFoundError(f"{manifest_file}: no teacher cache; run the cache_teachers stage first")
    sets = read_json(manifest_file).get("sets", {})
    missing = [k for k in ("joint_text", "joint_image") if k not in sets]
    if missing:
        raise KeyError(f"{manifest_file}: no {', '.join(missing)} set listed; rerun the cache_teachers stage")

    def store(name: str) -> FeatureStore:
        for folder in (teachers_dir, *map(Path, set_dirs)):
            if (folder / sets[name]).is_dir():
                return FeatureStore.open(folder / sets[name])
        raise FileNotFoundError(f"{manifest_file}: set {sets[name]} ({name}) is in none of "
                                f"{', '.join(str(f) for f in (teachers_dir, *set_dirs))}")

    text, image = store("joint_text"), store("joint_image")
    pairs = {p["pair_id"]: p["image_id"] for p in read_jsonl(raw_dir / "pairs.jsonl")}
    try:
        owners = [pairs[i] for i in text.ids]
    except KeyError as err:
        raise KeyError(f"{raw_dir / 'pairs.jsonl'}: no pair {err.args[0]!r} of {text.folder}") from None
    return np.asarray(text.features), np.asarray(image.features), image.row_indices(owners)


def save_threshold_statistics(
    teachers_dir: str | Path,
    raw_dir: str | Path,
    plot_path: str | Path,
    metrics_path: str | Path,
    threshold: float | None = None,
    text_anchors: int | None = 2000,
) -> tuple[dict[str, float], plt.Figure]:
    """`threshold_statistics` of the cached joint teacher, the figure saved to ``plot_path``
    (PNG) and the numbers to ``metrics_path`` (JSON); returns both (the figure re-openable
    for MLflow's ``log_figure``: saving closes only pyplot's handle)."""
    from mmcse.evaluation.plots import save_figure
    from mmcse.io import write_json

    stats, fig = threshold_statistics(*cached_joint_teacher(teachers_dir, raw_dir), threshold=threshold,
                                      text_anchors=text_anchors)
    save_figure(fig, plot_path)
    write_json(metrics_path, stats)
    return stats, fig


# --------------------------------------------------------------------------- runs in MLflow

PREDICTIONS_ARTIFACT = "evaluation/sts_predictions.json"  # logged by pipeline.run_evaluate


def load_sts_predictions(run_id: str) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """``{task: (cos, gold)}`` of a run's ``evaluation/sts_predictions.json`` (current tracking URI)."""
    import mlflow
    from mlflow.exceptions import MlflowException

    try:
        raw = mlflow.artifacts.load_dict(f"runs:/{run_id}/{PREDICTIONS_ARTIFACT}")
    except (MlflowException, OSError) as err:
        raise FileNotFoundError(f"run {run_id}: no artifact {PREDICTIONS_ARTIFACT} (is it an evaluated run?): "
                                f"{str(err).splitlines()[0][:200]}") from None
    out: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for task, entry in raw.items():
        if not isinstance(entry, dict) or not {"cos", "gold"} <= set(entry):
            raise ValueError(f"run {run_id}: {PREDICTIONS_ARTIFACT} task {task!r} lacks 'cos'/'gold' lists")
        out[task] = (np.asarray(entry["cos"], dtype=np.float64), np.asarray(entry["gold"], dtype=np.float64))
    return out


def run_labels(run_ids: Sequence[str]) -> dict[str, str]:
    """``{"<run name> [<id[:8]>]": run_id}`` in the given order; an unknown id is a clear error."""
    import mlflow
    from mlflow.exceptions import MlflowException

    client = mlflow.MlflowClient()
    labels: dict[str, str] = {}
    for run_id in run_ids:
        try:
            name = client.get_run(run_id).info.run_name or "run"
        except MlflowException:
            raise KeyError(f"--run {run_id}: no such MLflow run in {mlflow.get_tracking_uri()}") from None
        labels[f"{name} [{run_id[:8]}]"] = run_id
    return labels


def ablation_job_runs(parent_run_id: str, variants: Sequence[str], seed: int | None = None) -> dict[str, str]:
    """``{"<variant> seed=<s>": run_id}``: for each variant, its job run under the ablation parent
    run (``jobs.json``, logged by `mmcse.experiments.ablation_record.log_ablation`) with ``seed``, or its lowest
    seed that has a finished run."""
    import mlflow
    from mlflow.exceptions import MlflowException

    try:
        jobs = mlflow.artifacts.load_dict(f"runs:/{parent_run_id}/jobs.json")["jobs"]
    except (MlflowException, OSError, KeyError):
        raise FileNotFoundError(f"ablation parent run {parent_run_id}: no jobs.json artifact "
                                "(has the ablation finished its table?)") from None
    done = [j for j in jobs if j.get("run_id") and j.get("status", "ok") == "ok"]
    known = sorted({j["variant"] for j in jobs})
    out: dict[str, str] = {}
    for variant in variants:
        if variant not in known:
            raise KeyError(f"--ablation {variant}: not a variant of run {parent_run_id} (has: {', '.join(known)})")
        mine = sorted((j for j in done if j["variant"] == variant), key=lambda j: j["seed"])
        if seed is not None:
            mine = [j for j in mine if j["seed"] == seed]
        if not mine:
            which = f" with seed {seed}" if seed is not None else ""
            raise KeyError(f"--ablation {variant}: no finished job run{which} under run {parent_run_id}")
        out[f"{variant} seed={mine[0]['seed']}"] = mine[0]["run_id"]
    return out
