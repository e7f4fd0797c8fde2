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


def test_against_mmcses_own_spread_where_the_paper_prints_no_std_or_no_runs():
    seeds = [77.1, 76.4, 78.0, 77.5, 76.9]
    mean, std = sum(seeds) / 5, stats.tstd(seeds)
    direct = stats.ttest_1samp(seeds, 77.0)  # the one-sample t-test of the seeds themselves
    for paper_std, runs in ((None, None), (0.5, None)):
        got = reproduction_verdict(77.0, paper_std, runs, mean, std, 5)
        assert got["test"] == "one-sample" and got["p"] == pytest.approx(direct.pvalue)
        assert got["verdict"] == "consistent"
    assert reproduction_verdict(79.0, None, None, mean, std, 5)["verdict"] == "lower"
    assert reproduction_verdict(75.0, None, None, mean, std, 5)["verdict"] == "higher"


def test_no_verdict_from_one_seed_and_identical_runs_decide_by_equality():
    assert reproduction_verdict(77.0, None, None, 77.0, math.nan, 1) is None
    assert reproduction_verdict(77.0, 0.5, 5, 77.0, 0.3, 1) is None
    assert reproduction_verdict(77.0, None, None, 77.0, 0.0, 3)["verdict"] == "consistent"
    assert reproduction_verdict(77.0, None, None, 77.5, 0.0, 3)["verdict"] == "higher"
