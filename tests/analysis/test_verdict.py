"""The verdict of a reproduced cell against the paper's printed one, on made-up numbers whose answer is known,
each test statistic checked against its direct formula."""

from __future__ import annotations

import math

import pytest
from scipy import stats

from mmcse.analysis.statistics import reproduction_verdict


def _welch_p(m1: float, s1: float, n1: int, m2: float, s2: float, n2: int) -> float:
    """Welch's t-test written out: t = (m1 − m2) / √(s1²/n1 + s2²/n2), Welch–Satterthwaite degrees of freedom."""
    v1, v2 = s1 ** 2 / n1, s2 ** 2 / n2
    t = (m1 - m2) / math.sqrt(v1 + v2)
    df = (v1 + v2) ** 2 / (v1 ** 2 / (n1 - 1) + v2 ** 2 / (n2 - 1))
    return 2 * stats.t.sf(abs(t), df)


def test_welch_where_the_paper_prints_a_std_over_a_known_number_of_runs():
    # SimCSE's printed 76.25 ± 0.8 over 5 runs; a re-run 0.6 lower with the same spread is noise
    got = reproduction_verdict(76.25, 0.8, 5, 75.65, 0.8, 5)
    assert got["test"] == "welch" and got["verdict"] == "consistent"
    assert got["p"] == pytest.approx(_welch_p(75.65, 0.8, 5, 76.25, 0.8, 5)) and got["p"] > 0.05
    # 2.8 lower with a tight spread is not
    far = reproduction_verdict(76.25, 0.5, 5, 73.45, 0.4, 5)
    assert far["verdict"] == "lower" and far["p"] == pytest.approx(_welch_p(73.45, 0.4, 5, 76.25, 0.5, 5))
    assert far["p"] < 0.001
    assert reproduction_verdict(76.25, 0.5, 5, 79.0, 0.4, 3)["verdict"] == "higher"


def test_against_mmcses_own_spread_where_the_paper_prints_no_std_and_the_metric_has_no_tolerance():
    seeds = [77.1, 76.4, 78.0, 77.5, 76.9]
    mean, std = sum(seeds) / 5, stats.tstd(seeds)
    direct = stats.ttest_1samp(seeds, 77.0)  # the one-sample t-test of the seeds themselves
    got = reproduction_verdict(77.0, None, None, mean, std, 5)
    assert got["test"] == "one-sample" and got["p"] == pytest.approx(direct.pvalue)
    assert got["verdict"] == "consistent"
    assert reproduction_verdict(79.0, None, None, mean, std, 5)["verdict"] == "lower"
    assert reproduction_verdict(75.0, None, None, mean, std, 5)["verdict"] == "higher"


def test_no_verdict_from_one_seed_and_identical_runs_decide_by_equality():
    assert reproduction_verdict(77.0, None, None, 77.0, math.nan, 1) is None
    assert reproduction_verdict(77.0, 0.5, 5, 77.0, 0.3, 1) is None
    assert reproduction_verdict(77.0, None, None, 77.0, 0.0, 3)["verdict"] == "consistent"
    assert reproduction_verdict(77.0, None, None, 77.5, 0.0, 3)["verdict"] == "higher"



def test_a_printed_number_is_an_interval_and_rounding_alone_is_no_difference():
    """'76.3' stands for [76.25, 76.35]: a deterministic row (no seed changes it: the untrained encoder) at 76.34 is
    the printed number, at 76.36 it is higher; the old reading of the printed number as exact called 76.34 higher."""
    assert reproduction_verdict(76.3, None, None, 76.34, math.nan, 1, resolution=0.1, deterministic=True) == {
        "verdict": "consistent", "test": "interval", "p": None, "distance": 0.0}
    above = reproduction_verdict(76.3, None, None, 76.36, math.nan, 1, resolution=0.1, deterministic=True)
    assert above["verdict"] == "higher" and above["distance"] == pytest.approx(0.01)
    below = reproduction_verdict(76.3, None, None, 76.2, math.nan, 1, resolution=0.1, deterministic=True)
    assert below["verdict"] == "lower" and below["distance"] == pytest.approx(-0.05)
    # a printed std of 0 over 5 runs and five identical seeds (no spread on either side): the interval decides, not
    # a p of 0 or 1 from equality
    assert reproduction_verdict(80.1, 0.0, 5, 80.12, 0.0, 5, resolution=0.1)["verdict"] == "consistent"
    assert reproduction_verdict(80.1, 0.0, 5, 80.16, 0.0, 5, resolution=0.1)["verdict"] == "higher"


def test_welch_measures_the_distance_to_the_printed_interval():
    # mmcse 75.93 ± 0.02 over 5 seeds against a printed 76.0 ± 0.01 over 5 runs: exact numbers would call it lower
    # (p ~ 1e-4), but 76.0 stands for [75.95, 76.05] and the distance is 0.02, which the spreads explain
    exact = reproduction_verdict(76.0, 0.01, 5, 75.93, 0.02, 5)
    assert exact["verdict"] == "lower"
    got = reproduction_verdict(76.0, 0.01, 5, 75.93, 0.02, 5, resolution=0.1)
    assert got["distance"] == pytest.approx(-0.02)
    v1, v2 = 0.02 ** 2 / 5, 0.01 ** 2 / 5
    t = -0.02 / math.sqrt(v1 + v2)
    df = (v1 + v2) ** 2 / (v1 ** 2 / 4 + v2 ** 2 / 4)
    assert got["test"] == "welch" and got["p"] == pytest.approx(2 * stats.t.sf(abs(t), df))
    assert got["p"] > exact["p"]


def test_a_papers_number_without_a_std_carries_the_declared_tolerance():
    """No std printed: the paper's own run-to-run noise (the tolerance σ, e.g. 1.0 point of STS) joins mmcse's spread;
    mmcse's tight seeds alone would call a 1-point gap a failure."""
    seeds = [75.0, 75.1, 74.9, 75.05, 74.95]
    mean, std = sum(seeds) / 5, stats.tstd(seeds)
    assert reproduction_verdict(76.0, None, None, mean, std, 5, resolution=0.1)["verdict"] == "lower"  # one-sample
    got = reproduction_verdict(76.0, None, None, mean, std, 5, resolution=0.1, prior_std=1.0)
    z = -0.95 / math.sqrt(1.0 + std ** 2 / 5)
    assert got["test"] == "prior" and got["verdict"] == "consistent"
    assert got["p"] == pytest.approx(2 * stats.norm.sf(abs(z)))
    far = reproduction_verdict(80.0, None, None, mean, std, 5, resolution=0.1, prior_std=1.0)
    assert far["verdict"] == "lower" and far["p"] < 0.001
    # one seed: its own noise taken as the tolerance too; a std printed without its runs is the paper's noise
    one = reproduction_verdict(76.0, None, None, 75.0, math.nan, 1, resolution=0.1, prior_std=1.0)
    assert one["p"] == pytest.approx(2 * stats.norm.sf(0.95 / math.sqrt(2.0)))
    assert reproduction_verdict(76.0, 0.8, None, mean, std, 5, resolution=0.1)["test"] == "prior"
