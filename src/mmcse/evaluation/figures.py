"""Figures that compare embeddings and runs, each with the numbers it shows.

* t-SNE of sentence embeddings coloured by KMeans cluster (DALR Figure 3), with the
  silhouette of the clusters (and, given known groups, purity / NMI / the groups' silhouette);
* STS predicted cosine vs gold score of several runs side by side (DALR Figure 4), with each
  run's Spearman and its mean cosine on low-gold pairs (the anisotropy the paper points at);
* nearest sentences of a query (DALR Table 10) and dropout-mask views (KDMCSE Figs. 8–12).

KDMCSE's teacher statistics are in :mod:`mmcse.evaluation.teacher_statistics`, runs read back
from MLflow in :mod:`mmcse.tracking.reading`.

Every function returns plain ``dict[str, float]`` statistics next to its matplotlib figure, so
the numbers can be logged and tested; figures are saved with :func:`mmcse.evaluation.plots.save_figure`.
"""

from __future__ import annotations

import textwrap
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
from sklearn.cluster import KMeans
from sklearn.manifold import TSNE
from sklearn.metrics import normalized_mutual_info_score, silhouette_score

from mmcse.errors import InputError, MissingEntry
from mmcse.evaluation.plots import plt
from mmcse.evaluation.retrieval import unit_rows
from mmcse.evaluation.sts import spearman_x100

PRIMARY = "silhouette"
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
        raise MissingEntry("the runs share no STS task: " + "; ".join(
            f"{label}: {', '.join(p) or 'none'}" for label, p in predictions_by_run.items()))
    return STSB if STSB in common else common[0]


def sts_run_statistics(predictions_by_run: Mapping[str, Predictions], task: str | None = None) -> dict[str, float]:
    """Per run (label): ``<label>/spearman`` (×100) of cosine vs gold on ``task`` (default
    `default_task`), ``<label>/mean_cos_low_gold`` (mean cosine of pairs with gold ≤ 1, DALR
    Fig. 4's point: lower is better) and ``<label>/mean_cos`` (all pairs)."""

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
        raise MissingEntry(f"run {label}: no predictions for STS task {task!r} (has: {', '.join(preds) or 'none'})")
    cos, gold = (np.asarray(v, dtype=np.float64) for v in preds[task])
    if cos.shape != gold.shape or cos.ndim != 1 or cos.size < 2:
        raise InputError(f"run {label}, task {task}: cos {cos.shape} and gold {gold.shape} must be equal 1-D (≥ 2)")
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
