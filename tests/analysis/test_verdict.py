"""The verdict of a reproduced cell against the paper's printed one, on made-up numbers whose answer is known
(reproduced, higher, lower, inconclusive with the seeds that would decide), each statistic checked against its direct
formula: the difference two-sided, the equivalence as two one-sided tests (TOST) within ± the metric's tolerance."""

from __future__ import annotations

import math

import pytest
from scipy import stats

from mmcse.analysis.statistics import reproduction_verdict


def _welch(gap: float, own_var: float, own_df: float, paper_var: float, paper_df: float) -> tuple[float, float]:
    """se and Welch–Satterthwaite df of a difference of two means, written out (a known variance: df ∞)."""
    se = math.sqrt(own_var + paper_var)
    parts = [v ** 2 / d for v, d in ((own_var, own_df), (paper_var, paper_df)) if v and math.isfinite(d)]
    return se, (own_var + paper_var) ** 2 / sum(parts) if parts else math.inf


def _p_difference(gap: float, se: float, df: float) -> float:
    return 2 * (stats.norm.sf(abs(gap) / se) if math.isinf(df) else stats.t.sf(abs(gap) / se, df))


def _p_equivalent(gap: float, se: float, df: float, margin: float) -> float:
    """TOST: H0 Δ ≤ −margin rejected by t = (Δ + margin)/se, H0 Δ ≥ margin by t = (margin − Δ)/se; the larger p."""
    dist = stats.norm if math.isinf(df) else stats.t(df)
    return max(dist.sf((gap + margin) / se), dist.sf((margin - gap) / se))


def test_welch_where_the_paper_prints_a_std_over_its_runs_reproduced_and_lower():
    # a printed 76.25 ± 0.3 over 5 runs; 12 seeds at 76.25 ± 0.2: within the margin (2σ = 0.6) by both one-sided tests
    got = reproduction_verdict(76.25, 0.3, 5, 76.25, 0.2, 12, resolution=0.01)
    se, df = _welch(0.0, 0.2 ** 2 / 12, 11, 0.3 ** 2 / 5, 4)
    assert got["test"] == "welch" and got["verdict"] == "reproduced" and got["margin"] == pytest.approx(0.6)
    assert got["p"] == pytest.approx(_p_difference(0.0, se, df))
    assert got["p_equivalent"] == pytest.approx(_p_equivalent(0.0, se, df, 0.6)) and got["p_equivalent"] < 0.05
    # 2.8 lower with tight spreads: a difference
    far = reproduction_verdict(76.25, 0.5, 5, 73.45, 0.4, 5, resolution=0.01)
    se, df = _welch(-2.795, 0.4 ** 2 / 5, 4, 0.5 ** 2 / 5, 4)
    assert far["verdict"] == "lower" and far["p"] == pytest.approx(_p_difference(-2.795, se, df)) and far["p"] < 0.001
    assert reproduction_verdict(76.25, 0.5, 5, 79.0, 0.4, 3)["verdict"] == "higher"


def test_a_papers_mean_of_k_runs_carries_its_noise_over_k_and_mmcses_seeds_a_students_t():
    """No std printed: σ, the metric's tolerance, is the papers' run-to-run noise; the printed number is a mean of the
    table's 5 runs, so its noise is σ²/5 (σ² would call a real 1-point gap noise), and mmcse's 5 seeds a t with 4
    degrees of freedom (a z-test would overstate the evidence)."""
    seeds = [75.0, 75.1, 74.9, 75.05, 74.95]
    mean, std = sum(seeds) / 5, stats.tstd(seeds)
    got = reproduction_verdict(76.0, None, None, mean, std, 5, resolution=0.1, prior_std=1.0, table_runs=5)
    se, df = _welch(-0.95, std ** 2 / 5, 4, 1.0 / 5, math.inf)
    assert got["test"] == "prior" and got["p"] == pytest.approx(_p_difference(-0.95, se, df))
    assert got["verdict"] == "lower" and got["p"] < 0.05
    one_run = reproduction_verdict(76.0, None, None, mean, std, 5, resolution=0.1, prior_std=1.0)  # k = 1
    assert one_run["verdict"] == "inconclusive" and one_run["p"] > got["p"]
    # one seed: the paper's per-run noise stands in for mmcse's (a normal test: both variances known)
    one = reproduction_verdict(76.0, None, None, 75.0, math.nan, 1, resolution=0.1, prior_std=1.0)
    assert one["p"] == pytest.approx(2 * stats.norm.sf(0.95 / math.sqrt(2.0)))
    # a std printed without its runs is the paper's noise of one run
    assert reproduction_verdict(76.0, 0.8, None, mean, std, 5, resolution=0.1)["test"] == "prior"


def test_reproduced_within_the_tolerance_and_inconclusive_with_the_seeds_that_would_decide():
    # within the interval, σ 0.7 over the table's 5 runs, 10 tight seeds: equivalent within ± 2σ = 1.4
    got = reproduction_verdict(76.3, None, None, 76.31, 0.3, 10, resolution=0.1, prior_std=0.7, table_runs=5)
    se, df = _welch(0.0, 0.09 / 10, 9, 0.49 / 5, math.inf)
    assert got["verdict"] == "reproduced" and got["p_equivalent"] == pytest.approx(_p_equivalent(0.0, se, df, 1.4))
    # 3 seeds spread 1.5 wide, 0.75 below: neither test decides; the seeds asked for do, one fewer does not
    loose = reproduction_verdict(76.3, None, None, 75.5, 1.5, 3, resolution=0.1, prior_std=0.7, table_runs=5)
    assert loose["verdict"] == "inconclusive" and loose["seeds"] is not None and loose["seeds"] > 3
    enough = reproduction_verdict(76.3, None, None, 75.5, 1.5, loose["seeds"], resolution=0.1, prior_std=0.7,
                                  table_runs=5)
    fewer = reproduction_verdict(76.3, None, None, 75.5, 1.5, loose["seeds"] - 1, resolution=0.1, prior_std=0.7,
                                 table_runs=5)
    assert enough["verdict"] != "inconclusive" and fewer["verdict"] == "inconclusive"
    # no tolerance and no printed std: never "reproduced", and no number of seeds decides a zero distance
    blind = reproduction_verdict(77.0, None, None, 77.0, 0.5, 5, resolution=0.1)
    assert blind["test"] == "one-sample" and blind["verdict"] == "inconclusive" and blind["seeds"] is None
    assert blind["p"] == pytest.approx(1.0)
    # the paper's own noise too wide for any number of seeds: one paper run's σ² alone exceeds what equivalence
    # within 2σ allows at a gap of 0.95σ (and is too wide to call that gap a difference)
    wide = reproduction_verdict(76.3, None, None, 75.6, 0.5, 5, resolution=0.1, prior_std=0.7)
    assert wide["verdict"] == "inconclusive" and wide["seeds"] is None


def test_against_mmcses_own_spread_where_no_noise_is_known_for_the_papers_number():
    seeds = [77.1, 76.4, 78.0, 77.5, 76.9]
    mean, std = sum(seeds) / 5, stats.tstd(seeds)
    direct = stats.ttest_1samp(seeds, 77.0)  # the one-sample t-test of the seeds themselves
    got = reproduction_verdict(77.0, None, None, mean, std, 5)
    assert got["test"] == "one-sample" and got["p"] == pytest.approx(direct.pvalue)
    assert got["verdict"] == "inconclusive"
    assert reproduction_verdict(79.0, None, None, mean, std, 5)["verdict"] == "lower"
    assert reproduction_verdict(75.0, None, None, mean, std, 5)["verdict"] == "higher"


def test_no_verdict_from_one_seed_without_noise_and_identical_runs_decide_by_the_interval():
    assert reproduction_verdict(77.0, None, None, 77.0, math.nan, 1) is None
    assert reproduction_verdict(77.0, None, None, 77.0, 0.0, 3)["verdict"] == "reproduced"
    assert reproduction_verdict(77.0, None, None, 77.5, 0.0, 3)["verdict"] == "higher"
    assert reproduction_verdict(77.0, None, None, math.nan, 0.3, 3) is None


def test_a_printed_number_is_an_interval_and_rounding_alone_is_no_difference():
    """'76.3' stands for [76.25, 76.35]: a deterministic row (no seed changes it: the untrained encoder) at 76.34 is
    the printed number, at 76.36 it is higher."""
    inside = reproduction_verdict(76.3, None, None, 76.34, math.nan, 1, resolution=0.1, deterministic=True)
    assert (inside["verdict"], inside["test"], inside["p"], inside["distance"]) == ("reproduced", "interval", None, 0.0)
    above = reproduction_verdict(76.3, None, None, 76.36, math.nan, 1, resolution=0.1, deterministic=True)
    assert above["verdict"] == "higher" and above["distance"] == pytest.approx(0.01)
    below = reproduction_verdict(76.3, None, None, 76.2, math.nan, 1, resolution=0.1, deterministic=True)
    assert below["verdict"] == "lower" and below["distance"] == pytest.approx(-0.05)
    # a printed std of 0 over 5 runs and five identical seeds: the interval decides, not a p of 0 or 1
    assert reproduction_verdict(80.1, 0.0, 5, 80.12, 0.0, 5, resolution=0.1)["verdict"] == "reproduced"
    assert reproduction_verdict(80.1, 0.0, 5, 80.16, 0.0, 5, resolution=0.1)["verdict"] == "higher"
    # mmcse 75.93 ± 0.02 over 5 seeds against a printed 76.0 ± 0.01 over 5 runs: 76.0 stands for [75.95, 76.05]
    exact = reproduction_verdict(76.0, 0.01, 5, 75.93, 0.02, 5)
    got = reproduction_verdict(76.0, 0.01, 5, 75.93, 0.02, 5, resolution=0.1)
    assert exact["verdict"] == "lower" and got["distance"] == pytest.approx(-0.02) and got["p"] > exact["p"]
