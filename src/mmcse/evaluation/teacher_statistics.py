"""KDMCSE's threshold statistics of the joint teacher (paper §6.2, Figures 5–6): α of true
caption–image pairs against negatives, the share of negatives each candidate threshold would filter
(Eq. 8: a negative is dropped when α > threshold), and where each image's true captions rank among
all captions under the teacher. Each function returns its ``dict[str, float]`` beside its figure."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mmcse.errors import MissingEntry
from mmcse.evaluation.names import recall_key
from mmcse.evaluation.plots import plt, save_figure
from mmcse.evaluation.retrieval import check_text_image, unit_rows
from mmcse.io import read_json, read_jsonl, write_metrics
from mmcse.teachers.cache import FeatureStore

DEFAULT_THRESHOLDS = (0.7, 0.75, 0.8, 0.85, 0.9, 0.95)
QUANTILES = (0.05, 0.25, 0.5, 0.75, 0.95)


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
    teachers_dir, raw_dir = Path(teachers_dir), Path(raw_dir)
    manifest_file = Path(manifest) if manifest is not None else teachers_dir / "manifest.json"
    if not manifest_file.is_file():
        raise FileNotFoundError(f"{manifest_file}: no teacher cache; run the cache_teachers stage first")
    sets = read_json(manifest_file).get("sets", {})
    missing = [k for k in ("joint_text", "joint_image") if k not in sets]
    if missing:
        raise MissingEntry(f"{manifest_file}: no {', '.join(missing)} set listed; rerun the cache_teachers stage")

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
        raise MissingEntry(f"{raw_dir / 'pairs.jsonl'}: no pair {err.args[0]!r} of {text.folder}") from None
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
    stats, fig = threshold_statistics(*cached_joint_teacher(teachers_dir, raw_dir), threshold=threshold,
                                      text_anchors=text_anchors)
    save_figure(fig, plot_path)
    write_metrics(metrics_path, stats)
    return stats, fig
