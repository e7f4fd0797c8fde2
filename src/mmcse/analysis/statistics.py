"""Significance of an ablation table's rows: each variant against the reference, per metric."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from scipy import stats

# KDMCSE Table 1: "*: difference between MCSE and KDMCSE is significant at α = 0.05 according to an
# independent t-test". mmcse's default pairs runs by seed (every row trains on the same seeds); a table
# of KDMCSE's sets `test: independent` (its preset) to use the paper's test.
ALPHA = 0.05
MARKER = "*"
FEW_SEEDS = "n<2"  # fewer than two runs to test: no test, no marker
TESTS = {
    "paired": "paired t-test (scipy.stats.ttest_rel), runs paired by seed, two-sided",
    "independent": "independent two-sample t-test (Student's, scipy.stats.ttest_ind), two-sided",
}


def significance(
    results: Sequence[dict[str, Any]], reference: str, metrics: Sequence[str], test: str = "paired"
) -> dict[str, dict[str, dict[str, Any]]]:
    """Every variant against ``reference`` per metric, by ``test`` (`TESTS`): `paired_significance`
    or `independent_significance`."""
    if test not in TESTS:
        raise ValueError(f"ablate.test: {test!r}; choose one of {list(TESTS)}")
    return (paired_significance if test == "paired" else independent_significance)(results, reference, metrics)


def _finished(results: Sequence[dict[str, Any]]) -> dict[str, dict[int, dict[str, float]]]:
    by_seed: dict[str, dict[int, dict[str, float]]] = {}
    for r in results:
        if r.get("status") == "ok":
            by_seed.setdefault(r["variant"], {})[r["seed"]] = r["scores"]
    return by_seed


def _ttest(a: np.ndarray, b: np.ndarray, paired: bool) -> tuple[float, float]:
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # constant differences: t = ±inf, p = 0
        result = stats.ttest_rel(a, b) if paired else stats.ttest_ind(a, b)
    return float(result.statistic), float(result.pvalue)


Scores = dict[int, dict[str, float]]  # seed -> {metric: score} of one variant's finished runs
Cell = dict[str, Any]


def _against_reference(results: Sequence[dict[str, Any]], reference: str, metrics: Sequence[str],
                       cell: Callable[[Scores, Scores, str], Cell]) -> dict[str, dict[str, Cell]]:
    """``{variant: {metric: cell(variant's runs, reference's runs, metric)}}`` for every variant but
    the reference, in the order the results name them."""
    by_seed = _finished(results)
    ref = by_seed.get(reference, {})
    return {variant: {m: cell(by_seed.get(variant, {}), ref, m) for m in metrics}
            for variant in dict.fromkeys(r["variant"] for r in results) if variant != reference}


def independent_significance(
    results: Sequence[dict[str, Any]], reference: str, metrics: Sequence[str]
) -> dict[str, dict[str, Cell]]:
    """Independent two-sample t-test (Student's: pooled variance) of every variant against
    ``reference``, per metric, over every finished run of each (KDMCSE Table 1's test): t = (ā − b̄) /
    (s_p·√(1/n_a + 1/n_b)), s_p² = ((n_a − 1)s_a² + (n_b − 1)s_b²) / (n_a + n_b − 2), n_a + n_b − 2
    degrees of freedom, two-sided. Cells as `paired_significance`'s (``n``: the variant's runs, and
    ``n_reference``); fewer than 2 runs on either side: ``n<2``; all scores equal: ``identical``."""

    def cell(runs: Scores, ref: Scores, m: str) -> Cell:
        a = np.array([v[m] for v in runs.values() if m in v], dtype=float)  # (n_a,) the variant's runs
        b = np.array([v[m] for v in ref.values() if m in v], dtype=float)  # (n_b,) the reference's
        out: Cell = {"t": math.nan, "p": math.nan, "n": len(a), "n_reference": len(b),
                     "mean_diff": float(a.mean() - b.mean()) if len(a) and len(b) else math.nan, "note": ""}
        if len(a) < 2 or len(b) < 2:
            out["note"] = FEW_SEEDS
        elif np.all(np.concatenate([a, b]) == a[0]):
            out["note"] = "identical"
        else:
            out["t"], out["p"] = _ttest(a, b, paired=False)
        return out

    return _against_reference(results, reference, metrics, cell)


def paired_significance(
    results: Sequence[dict[str, Any]], reference: str, metrics: Sequence[str]
) -> dict[str, dict[str, Cell]]:
    """Paired t-test of every variant against ``reference``, per metric.

    Runs are paired by seed: a seed counts when both the variant's and the reference's job
    finished (status ok) and both scored the metric. Returns ``{variant: {metric: {"t", "p",
    "n", "mean_diff", "note"}}}`` for every variant but the reference (``scipy.stats.ttest_rel``,
    two-sided; t = mean(d) / (sd(d)/√n), d = variant − reference, n − 1 degrees of freedom).
    With n < 2 pairs, or identical scores on every pair, t and p are NaN and ``note`` says why
    (``"n<2"``, ``"identical"``); otherwise ``note`` is ``""``.
    """

    def cell(runs: Scores, ref: Scores, m: str) -> Cell:
        seeds = sorted(s for s in runs if s in ref and m in runs[s] and m in ref[s])
        a = np.array([runs[s][m] for s in seeds], dtype=float)  # (n,) the variant, by seed
        b = np.array([ref[s][m] for s in seeds], dtype=float)  # (n,) the reference, same seeds
        out: Cell = {"t": math.nan, "p": math.nan, "n": len(seeds),
                     "mean_diff": float((a - b).mean()) if len(seeds) else math.nan, "note": ""}
        if len(seeds) < 2:
            out["note"] = FEW_SEEDS
        elif np.all(a == b):
            out["note"] = "identical"
        else:
            out["t"], out["p"] = _ttest(a, b, paired=True)
        return out

    return _against_reference(results, reference, metrics, cell)


# --------------------------------------------------------------------------- reproduced or not

VERDICTS = ("consistent", "lower", "higher")
VERDICT_TESTS = {
    "welch": "Welch's t-test from summary statistics (scipy.stats.ttest_ind_from_stats, unequal variances): "
             "mmcse's mean ± std over its seeds against the paper's printed mean ± std over its printed number of "
             "runs, two-sided",
    "one-sample": "one-sample t-test of mmcse's seeds against the paper's printed mean (the paper prints no std, "
                  "or not over how many runs): t = (mean − paper) / (std / √n), n − 1 degrees of freedom, two-sided",
}


def reproduction_verdict(paper_mean: float, paper_std: float | None, paper_runs: int | None,
                         mean: float, std: float, n: int, alpha: float = ALPHA) -> dict[str, Any] | None:
    """Whether mmcse's cell (``mean`` ± ``std`` over ``n`` seeds) reproduces the paper's: ``{"verdict":
    consistent | lower | higher, "test": welch | one-sample, "p"}``. Welch's test where the paper prints a std
    and its number of runs (`VERDICT_TESTS`), else a one-sample test against the spread of mmcse's own seeds;
    ``consistent`` when p ≥ ``alpha``, else ``lower`` / ``higher`` by the sign of mean − paper. None where no
    test can be made (fewer than 2 seeds). Both assume each side's runs are a normal sample."""
    if n < 2 or not math.isfinite(mean) or not math.isfinite(std):
        return None
    if paper_std is not None and paper_runs is not None and paper_runs >= 2:
        test = "welch"
        if std == 0 and paper_std == 0:
            p = 1.0 if mean == paper_mean else 0.0
        else:
            p = float(stats.ttest_ind_from_stats(mean, std, n, paper_mean, paper_std, paper_runs,
                                                 equal_var=False).pvalue)
    else:
        test = "one-sample"
        if std == 0:
            p = 1.0 if mean == paper_mean else 0.0
        else:
            t = (mean - paper_mean) / (std / math.sqrt(n))
            p = float(2 * stats.t.sf(abs(t), n - 1))
    verdict = "consistent" if p >= alpha else ("lower" if mean < paper_mean else "higher")
    return {"verdict": verdict, "test": test, "p": p}
