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

REPRODUCED, LOWER, HIGHER, INCONCLUSIVE = "reproduced", "lower", "higher", "inconclusive"
VERDICTS = (REPRODUCED, LOWER, HIGHER, INCONCLUSIVE)
MAX_SEEDS = 200  # the most seeds an inconclusive cell's estimate looks at; beyond it: no number of seeds decides
# The equivalence margin, in the metric's tolerance σ (one paper run's noise): two runs of the paper's own differ by
# more than 2σ about 16 % of the time (their difference has std √2·σ), so a gap within ± 2σ is one the paper's own
# seeds make. With a margin of 1σ a paper number from one run (noise σ) could never be shown equivalent.
EQUIVALENCE_SIGMAS = 2.0
VERDICT_TESTS = {
    "welch": "the paper prints a std over its number of runs k: Welch's t (mmcse's s²/n beside the paper's σ²/k, "
             "Welch–Satterthwaite degrees of freedom)",
    "prior": "the paper prints no std: its number is a mean of k runs (the table's, else 1) with the papers' own "
             "run-to-run noise σ of the metric (the root mean square of their printed stds), σ²/k beside mmcse's "
             "s²/n, Student's t with mmcse's n − 1 degrees of freedom",
    "one-sample": "no noise known for the paper's number: Student's t of mmcse's seeds alone (n − 1 degrees of "
                  "freedom)",
    "interval": "a result no seed changes (a deterministic row, or both sides without spread) against the paper's "
                "printed interval: reproduced inside it, lower or higher outside",
}


def printed_interval(paper_mean: float, resolution: float) -> tuple[float, float]:
    """What a printed number stands for: ``paper_mean`` ± half its last digit's unit (``resolution``: 0.1 for
    '76.3', 0.01 for '76.25'), the numbers that round to it."""
    half = resolution / 2
    return paper_mean - half, paper_mean + half


def distance_to_interval(value: float, low: float, high: float) -> float:
    """``value`` minus the nearest point of ``[low, high]``: 0 inside (a difference rounding alone can make)."""
    return value - high if value > high else (value - low if value < low else 0.0)


def _welch_df(own: float, own_df: float, theirs: float, theirs_df: float) -> float:
    """Welch–Satterthwaite degrees of freedom of a sum of two variance estimates (an infinite df: a known variance,
    which adds nothing to the denominator); infinite when both are known."""
    denominator = (own ** 2 / own_df if own and math.isfinite(own_df) else 0.0) + (
        theirs ** 2 / theirs_df if theirs and math.isfinite(theirs_df) else 0.0)
    return (own + theirs) ** 2 / denominator if denominator > 0 else math.inf


def _sf(t: float, df: float) -> float:
    return float(stats.norm.sf(t) if math.isinf(df) else stats.t.sf(t, df))


def _tests(gap: float, own_var: float, own_df: float, paper_var: float, paper_df: float,
           margin: float | None) -> tuple[float, float | None, float]:
    """``(p of a difference, p of equivalence within ± margin or None, se)`` of a distance ``gap`` whose noise is
    ``own_var`` (mmcse's s²/n) + ``paper_var`` (the paper's σ²/k): the difference two-sided, the equivalence as two
    one-sided tests (TOST: Δ > −margin and Δ < margin, each at α; its p is the larger)."""
    se = math.sqrt(own_var + paper_var)
    df = _welch_df(own_var, own_df, paper_var, paper_df)
    p_diff = 2 * _sf(abs(gap) / se, df)
    if margin is None or margin <= 0:
        return p_diff, None, se
    p_equivalent = max(_sf((gap + margin) / se, df), _sf((margin - gap) / se, df))
    return p_diff, p_equivalent, se


def _decide(gap: float, p_diff: float, p_equivalent: float | None) -> str:
    if p_diff < ALPHA:
        return LOWER if gap < 0 else HIGHER
    return REPRODUCED if p_equivalent is not None and p_equivalent < ALPHA else INCONCLUSIVE


def seeds_to_decide(gap: float, std: float, n: int, paper_var: float, paper_df: float,
                    margin: float | None) -> int | None:
    """How many seeds of mmcse's, at its observed spread ``std`` and with the same observed distance ``gap``, would
    give a verdict other than inconclusive (a difference, or equivalence within ``margin``); None where none up to
    `MAX_SEEDS` would (the paper's own noise σ²/k alone is too wide, or the gap sits on the margin)."""
    for seeds in range(n + 1, MAX_SEEDS + 1):
        p_diff, p_equivalent, _ = _tests(gap, std ** 2 / seeds, seeds - 1, paper_var, paper_df, margin)
        if _decide(gap, p_diff, p_equivalent) != INCONCLUSIVE:
            return seeds
    return None


def reproduction_verdict(paper_mean: float, paper_std: float | None, paper_runs: int | None,
                         mean: float, std: float, n: int, *, resolution: float = 0.0,
                         prior_std: float | None = None, deterministic: bool = False,
                         table_runs: int | None = None) -> dict[str, Any] | None:
    """Whether mmcse's cell (``mean`` ± ``std`` over ``n`` seeds) reproduces the paper's printed one: ``{"verdict":
    reproduced | lower | higher | inconclusive, "test": welch | prior | one-sample | interval, "p", "p_equivalent",
    "margin", "distance", "seeds"}``.

    The printed number stands for an interval (`printed_interval`: ± half of ``resolution``) and every test measures
    mmcse's distance to it (`distance_to_interval`), so rounding alone never reads as a difference. The distance's
    noise is mmcse's s²/n (s its std over its seeds; with one seed, the paper's per-run σ stands in for it) plus the
    paper's σ²/k, its number being a mean of k runs:

    - ``welch``: the paper prints σ = ``paper_std`` over k = ``paper_runs`` ≥ 2 runs (Welch–Satterthwaite df);
    - ``prior``: σ = ``prior_std``, the metric's reproduction tolerance (the papers' own run-to-run noise, taken as
      known), k = ``table_runs`` (the table's stated runs; else 1), Student's t with mmcse's n − 1 df (a printed std
      without its runs counts as this σ with k = 1);
    - ``one-sample``: no noise known for the paper's number (σ²/k = 0), Student's t of mmcse's seeds;
    - ``interval``: a ``deterministic`` row, or no spread on either side: inside the interval or not.

    Each cell gets two tests at `ALPHA`: a two-sided one for a difference (``p``: **lower** / **higher**), and two
    one-sided ones for equivalence within ± the margin (``p_equivalent``; the margin is `EQUIVALENCE_SIGMAS` times
    the metric's tolerance σ, else the printed std: a gap the paper's own seeds make): **reproduced**. Neither:
    **inconclusive**, with ``seeds``, how many of mmcse's seeds at the observed spread would decide (None: no number
    would). None where no test can be made (a single seed and no paper noise, a non-finite mean). Each side's runs are
    assumed a normal sample."""
    if not math.isfinite(mean):
        return None
    low, high = printed_interval(paper_mean, resolution)
    gap = distance_to_interval(mean, low, high)
    has_spread = n >= 2 and math.isfinite(std) and std > 0
    paper_spread = paper_std is not None and paper_std > 0
    sigma_run = prior_std if prior_std is not None and prior_std > 0 else (paper_std if paper_spread else None)
    margin = EQUIVALENCE_SIGMAS * sigma_run if sigma_run is not None else None
    out = {"distance": gap, "margin": margin, "p_equivalent": None, "seeds": None}
    if deterministic or (n >= 2 and std == 0 and not paper_spread):
        return out | {"verdict": REPRODUCED if gap == 0 else (LOWER if gap < 0 else HIGHER), "test": "interval",
                      "p": None}
    if paper_spread and paper_runs is not None and paper_runs >= 2:
        test, sigma, runs, paper_df = "welch", paper_std, paper_runs, paper_runs - 1
    elif paper_spread or (prior_std is not None and prior_std > 0):
        test, sigma = "prior", paper_std if paper_spread else prior_std
        runs, paper_df = (1 if paper_spread else max(table_runs or 1, 1)), math.inf
    else:
        test, sigma, runs, paper_df = "one-sample", 0.0, 1, math.inf
    if not has_spread and (n < 1 or sigma == 0):
        return None
    s = std if has_spread else sigma  # one seed: the paper's per-run noise stands in for mmcse's
    own_df = n - 1 if has_spread else math.inf
    paper_var = sigma ** 2 / runs
    p_diff, p_equivalent, _ = _tests(gap, s ** 2 / max(n, 1), own_df, paper_var, paper_df, margin)
    verdict = _decide(gap, p_diff, p_equivalent)
    seeds = seeds_to_decide(gap, s, max(n, 1), paper_var, paper_df, margin) if verdict == INCONCLUSIVE else None
    return out | {"verdict": verdict, "test": test, "p": p_diff, "p_equivalent": p_equivalent, "seeds": seeds}
