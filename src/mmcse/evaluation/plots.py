"""Figures a reader would rather look at: training curves, dev geometry, STS scatter, ablation bars."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from mmcse.io import atomic_path  # noqa: E402

FIGURE_DPI = 110
MAX_WIDTH_PX = 1400  # a figure fits a 1,400 px page (dvc plots show, the report) without cutting a panel


def save_figure(fig: plt.Figure, path: str | Path) -> Path:
    """``fig`` to ``path`` (atomically), at ``FIGURE_DPI`` or, for a wide figure, the resolution that
    keeps its drawn area at most ``MAX_WIDTH_PX`` wide."""
    path = Path(path)
    width_in = fig.get_tightbbox(fig.canvas.get_renderer()).width + 0.2  # + bbox_inches="tight"'s padding
    dpi = min(FIGURE_DPI, MAX_WIDTH_PX / width_in)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format=path.suffix.lstrip(".") or "png", dpi=dpi, bbox_inches="tight")
    plt.close(fig)
    return path


def training_curves(history: Sequence[Mapping[str, float]], title: str, dev_label: str = "dev STS") -> plt.Figure:
    """Loss per logged step (left axis) and the dev score (right axis: dev STS Spearman × 100, or
    what ``dev_label`` names, e.g. DUET's val rsum)."""
    fig, ax = plt.subplots(figsize=(7, 4))
    loss = [(h["step"], h["loss"]) for h in history if "loss" in h]
    dev = [(h["step"], h["dev"]) for h in history if "dev" in h]
    if loss:
        ax.plot(*zip(*loss, strict=True), color="tab:blue", label="training loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss", color="tab:blue")
    ax2 = ax.twinx()
    if dev:
        ax2.plot(*zip(*dev, strict=True), "o-", color="tab:orange", label=dev_label)
    ax2.set_ylabel("dev Spearman × 100" if dev_label == "dev STS" else dev_label, color="tab:orange")
    ax.set_title(title)
    return fig


def geometry_trajectory(
    history: Sequence[Mapping[str, float]], title: str, best_step: int | None = None
) -> plt.Figure:
    """Dev alignment (x) against dev uniformity (y) at each dev evaluation, joined in step order
    (SimCSE's Fig. 2 view of the numbers DALR Table 6 reports; lower-left is better on both), the
    first evaluation and the best checkpoint marked. ``best_step`` defaults to the first step of
    the highest dev STS (the checkpoint training keeps); evaluations without geometry are left out."""
    points = [(h["step"], h["dev_alignment"], h["dev_uniformity"])
              for h in history if "dev_alignment" in h and "dev_uniformity" in h]
    fig, ax = plt.subplots(figsize=(5.6, 4.4))
    ax.set_xlabel("alignment (lower is better)")
    ax.set_ylabel("uniformity (lower is better)")
    ax.set_title(title)
    if not points:
        ax.text(0.5, 0.5, "no dev geometry logged", ha="center", va="center", transform=ax.transAxes)
        return fig
    steps, align, unif = (np.array(v) for v in zip(*sorted(points), strict=True))
    ax.plot(align, unif, "-", color="0.6", linewidth=1, zorder=1)
    dots = ax.scatter(align, unif, c=steps, cmap="viridis", s=28, zorder=2)
    fig.colorbar(dots, ax=ax, label="step")
    ax.scatter(align[0], unif[0], marker="s", s=90, facecolors="none", edgecolors="tab:blue", linewidths=1.8,
               zorder=3, label=f"start (step {steps[0]})")
    if best_step is None:
        dev = [(h["dev"], -h["step"]) for h in history if "dev" in h]
        best_step = -max(dev)[1] if dev else None
    at_best = np.flatnonzero(steps == best_step) if best_step is not None else []
    if len(at_best):
        i = at_best[0]
        ax.scatter(align[i], unif[i], marker="*", s=220, color="tab:red", edgecolors="black", linewidths=0.6,
                   zorder=4, label=f"best (step {steps[i]})")
    ax.legend(loc="best", fontsize=8)
    return fig


def sts_scatter(predictions: Mapping[str, tuple[np.ndarray, np.ndarray]], scores: Mapping[str, float]) -> plt.Figure:
    """Gold score vs cosine similarity, one panel per task."""
    tasks = list(predictions)
    cols = min(4, len(tasks))
    rows = int(np.ceil(len(tasks) / cols))
    fig, axes = plt.subplots(rows, cols, figsize=(3.4 * cols, 3.0 * rows), squeeze=False)
    for ax, task in zip(axes.flat, tasks, strict=False):
        cos, gold = predictions[task]
        ax.scatter(gold, cos, s=4, alpha=0.4)
        ax.set_title(f"{task}: ρ={scores[task]:.1f}", fontsize=9)
        ax.set_xlabel("gold")
        ax.set_ylabel("cosine")
    for ax in axes.flat[len(tasks) :]:
        ax.axis("off")
    fig.tight_layout()
    return fig


def ablation_bars(names: Sequence[str], panels: Sequence[tuple[str, Sequence[float], Sequence[float]]],
                  title: str = "") -> plt.Figure:
    """The variants side by side: one panel per ``(metric label, means, stds)`` (the table's
    headline scores, its primary metric first), a bar per variant with its ± std over seeds and
    the mean printed on it; a variant without a score (failed, or a method without that head: SimCSE's retrieval)
    gets no bar and the words "no score". The bars stand on 0 (a bar's length is its value: an axis cut at 65 made
    a 0.06 gap look large)."""
    fig, axes = plt.subplots(1, len(panels), figsize=(min(14.0, max(4.0, 1.0 * len(names)) * len(panels)), 3.8),
                             squeeze=False)
    x = np.arange(len(names))
    for ax, (metric, means, stds) in zip(axes[0], panels, strict=True):
        m, s = np.asarray(means, dtype=float), np.nan_to_num(np.asarray(stds, dtype=float))
        bars = ax.bar(x, np.nan_to_num(m), yerr=s, capsize=4, color="tab:green")
        for bar, value, spread in zip(bars, m, s, strict=True):
            centre = bar.get_x() + bar.get_width() / 2
            if np.isfinite(value):  # above the error bar; scores below 10 (NDCG in [0, 1]) with 3 decimals
                ax.annotate(f"{value:.2f}" if abs(value) >= 10 else f"{value:.3f}",
                            (centre, value + spread if value >= 0 else value - spread),
                            xytext=(0, 2 if value >= 0 else -2), textcoords="offset points", ha="center",
                            va="bottom" if value >= 0 else "top", fontsize=8)
            else:
                ax.annotate("no score", (centre, 0), xytext=(0, 2), textcoords="offset points", ha="center",
                            va="bottom", fontsize=8, color="grey")
        ax.set_xticks(x, names, rotation=30, ha="right")
        ax.set_title(f"{metric} (mean ± std)", fontsize=10)
        finite = np.isfinite(m)
        if finite.any():  # from 0 (or below it, for negative scores) to the longest bar with its std and label
            lo, hi = min(0.0, float((m - s)[finite].min())), max(0.0, float((m + s)[finite].max()))
            pad = max(0.12 * (hi - lo), 1e-3)
            ax.set_ylim(lo - (pad if lo < 0 else 0.0), hi + (pad if hi > 0 else 0.0))
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    return fig


def ablation_line(
    xs: Sequence[float], means: Sequence[float], stds: Sequence[float], metric: str, x_label: str
) -> plt.Figure:
    """A swept parameter against the metric: mean with a ± std band (e.g. KDMCSE Fig. 7)."""
    order = np.argsort(xs)
    x = np.asarray(xs, dtype=float)[order]
    m = np.asarray(means, dtype=float)[order]
    s = np.nan_to_num(np.asarray(stds, dtype=float)[order])
    fig, ax = plt.subplots(figsize=(6, 3.8))
    ax.plot(x, m, "o-", color="tab:purple")
    ax.fill_between(x, m - s, m + s, color="tab:purple", alpha=0.2)
    if np.isfinite(m).any():
        best = int(np.nanargmax(m))
        ax.annotate(f"best {x[best]:g}", (x[best], m[best]), textcoords="offset points", xytext=(0, 8), ha="center")
    ax.set_xlabel(x_label)
    ax.set_ylabel(metric)
    ax.set_title(f"{x_label} sweep: {metric} (mean ± std over seeds)")
    return fig
