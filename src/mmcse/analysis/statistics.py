"""Significance of an ablation table's rows: each variant against the reference, per metric."""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
from scipy import stats

# KDMCSE Table 1: "*: difference between MCSE and KDMCSE is significant at α = 0.05" (they used an
# independent t-test; here runs are paired by seed, as every row trains on the same seeds).
ALPHA = 0.05


MARKER = "*"


FEW_SEEDS = "n<2"  # fewer than two seeds paired with the reference: no test, no marker


def paired_significance(
    results: Sequence[dict[str, Any]], reference: str, metrics: Sequence[str]
) -> dict[str, dict[str, dict[str, Any]]]:
    """Paired t-test of every variant against ``reference``, per metric.

    Runs are paired by seed: a seed counts when both the variant's and the reference's job
    finished (status ok) and both scored the metric. Returns ``{variant: {metric: {"t", "p",
    "n", "mean_diff", "note"}}}`` for every variant but the reference (``scipy.stats.ttest_rel``,
    two-sided; t = mean(d) / (sd(d)/√n), d = variant − reference, n − 1 degrees of freedom).
    With n < 2 pairs, or identical scores on every pair, t and p are NaN and ``note`` says why
    (``"n<2"``, ``"identical"``); otherwise ``note`` is ``""``.
    """
    by_seed: dict[str, dict[int, dict[str, float]]] = {}
    for r in results:
        if r.get("status") == "ok":
            by_seed.setdefault(r["variant"], {})[r["seed"]] = r["scores"]
    ref = by_seed.get(reference, {})
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for variant in dict.fromkeys(r["variant"] for r in results):
        if variant == reference:
            continue
        runs = by_seed.get(variant, {})
        out[variant] = {}
        for m in metrics:
            seeds = sorted(s for s in runs if s in ref and m in runs[s] and m in ref[s])
            a = np.array([runs[s][m] for s in seeds], dtype=float)  # (n,) the variant, by seed
            b = np.array([ref[s][m] for s in seeds], dtype=float)  # (n,) the reference, same seeds
            cell: dict[str, Any] = {"t": math.nan, "p": math.nan, "n": len(seeds),
                                    "mean_diff": float((a - b).mean()) if len(seeds) else math.nan, "note": ""}
            if len(seeds) < 2:
                cell["note"] = FEW_SEEDS
            elif np.all(a == b):
                cell["note"] = "identical"
            else:
                with np.errstate(all="ignore"), warnings.catch_warnings():
                    warnings.simplefilter("ignore", RuntimeWarning)  # constant differences: t = ±inf, p = 0
                    test = stats.ttest_rel(a, b)
                cell["t"], cell["p"] = float(test.statistic), float(test.pvalue)
            out[variant][m] = cell
    return out
