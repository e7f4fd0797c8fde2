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
    "welch": "Welch's t-test from summary statistics (unequal variances): the distance from mmcse's mean ± std over "
             "its seeds to the paper's printed interval, against the paper's printed std over its printed number of "
             "runs, two-sided",
    "prior": "a z-test of the distance from mmcse's mean to the paper's printed interval, against the paper's "
             "run-to-run noise where it prints none (the reproduction tolerance σ: the root mean square of the "
             "papers' printed stds of that metric) and mmcse's own spread over its seeds, two-sided",
    "one-sample": "one-sample t-test of mmcse's seeds against the paper's printed interval (no printed std and no "
                  "tolerance for the metric): t = distance / (std / √n), n − 1 degrees of freedom, two-sided",
    "interval": "a result no seed changes (a deterministic row, or both sides without spread) against the paper's "
                "printed interval: consistent inside it, lower or higher outside",
}


def printed_interval(paper_mean: float, resolution: float) -> tuple[float, float]:
    """What a printed number stands for: ``paper_mean`` ± half its last digit's unit (``resolution``: 0.1 for
    '76.3', 0.01 for '76.25'), the numbers that round to it."""
    half = resolution / 2
    return paper_mean - half, paper_mean + half


def distance_to_interval(value: float, low: float, high: float) -> float:
    """``value`` minus the nearest point of ``[low, high]``: 0 inside (a difference rounding alone can make)."""
    return value - high if value > high else (value - low if value < low else 0.0)


def reproduction_verdict(paper_mean: float, paper_std: float | None, paper_runs: int | None,
                         mean: float, std: float, n: int, *, resolution: float = 0.0,
                         prior_std: float | None = None, deterministic: bool = False) -> dict[str, Any] | None:
    """Whether mmcse's cell (``mean`` ± ``std`` over ``n`` seeds) reproduces the paper's printed one: ``{"verdict":
    consistent | lower | higher, "test": welch | prior | one-sample | interval, "p", "distance"}``.

    The printed number stands for an interval (`printed_interval`: ± half of ``resolution``), and every test
    measures mmcse's distance to it (`distance_to_interval`), so rounding alone never reads as a difference:

    - ``interval``: a ``deterministic`` row (no seed changes it: it runs once) or two sides without spread: consistent
      inside the interval, else lower / higher (``p`` None);
    - ``welch``: the paper prints a std over ``paper_runs`` ≥ 2 runs: Welch's t-test of the distance;
    - ``prior``: it prints none, and the metric has a reproduction tolerance ``prior_std`` (the papers' own
      run-to-run noise; a std printed without its number of runs counts as one): a z-test of the distance against
      √(σ² + s²/n), s mmcse's std over its seeds (σ again where it has one seed);
    - ``one-sample``: neither, the distance against mmcse's own spread (≥ 2 seeds).

    ``consistent`` when p ≥ `ALPHA`, else ``lower`` / ``higher`` by the distance's sign. None where no test can be
    made (a single seed with no tolerance, a non-finite mean). Each side's runs are assumed a normal sample."""
    if not math.isfinite(mean):
        return None
    low, high = printed_interval(paper_mean, resolution)
    gap = distance_to_interval(mean, low, high)
    has_spread = n >= 2 and math.isfinite(std) and std > 0
    paper_spread = paper_std is not None and paper_std > 0

    def verdict(p: float | None, test: str) -> dict[str, Any]:
        consistent = gap == 0 if p is None else p >= ALPHA
        word = "consistent" if consistent else ("lower" if gap < 0 else "higher")
        return {"verdict": word, "test": test, "p": p, "distance": gap}

    if deterministic or (n >= 2 and std == 0 and not paper_spread):
        return verdict(None, "interval")
    if paper_spread and paper_runs is not None and paper_runs >= 2:
        if not has_spread and n < 2:
            return None
        own = std ** 2 / n if has_spread else 0.0
        theirs = paper_std ** 2 / paper_runs
        se = math.sqrt(own + theirs)
        t = gap / se
        df = (own + theirs) ** 2 / ((own ** 2 / (n - 1) if own else 0.0) + theirs ** 2 / (paper_runs - 1))
        return verdict(float(2 * stats.t.sf(abs(t), df)), "welch")
    sigma = paper_std if paper_spread else prior_std
    if sigma is not None and sigma > 0:
        s = std if has_spread else sigma
        z = gap / math.sqrt(sigma ** 2 + s ** 2 / max(n, 1))
        return verdict(float(2 * stats.norm.sf(abs(z))), "prior")
    if not has_spread:
        return None
    t = gap / (std / math.sqrt(n))
    return verdict(float(2 * stats.t.sf(abs(t), n - 1)), "one-sample")
