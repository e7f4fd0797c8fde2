"""Alignment and uniformity (DALR Eq. 15–16) against loops over pairs and hand-checked values."""

import itertools
import math

import numpy as np
import pytest

from mmcse.evaluation.geometry import alignment, geometry_metrics, uniformity


def _unit(v):
    return v / np.linalg.norm(v)


def test_alignment_is_the_mean_squared_distance_of_normalised_pairs():
    assert alignment(np.array([[3.0, 0.0]]), np.array([[1.0, 0.0]])) == pytest.approx(0.0)  # same direction
    assert alignment(np.array([[1.0, 0.0]]), np.array([[-2.0, 0.0]])) == pytest.approx(4.0)  # opposite
    assert alignment(np.array([[1.0, 0.0], [0.0, 1.0]]), np.array([[0.0, 5.0], [0.0, 1.0]])) == pytest.approx(1.0)
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(7, 5)), rng.normal(size=(7, 5))
    want = np.mean([np.sum((_unit(a) - _unit(b)) ** 2) for a, b in zip(x, y, strict=True)])
    assert alignment(x, y) == pytest.approx(want)


def test_uniformity_is_log_mean_exp_over_distinct_pairs():
    # two orthogonal unit vectors: ||u − v||² = 2, so log e^{−2·2} = −4
    assert uniformity(np.array([[1.0, 0.0], [0.0, 2.0]])) == pytest.approx(-4.0)
    # three identical vectors: every distance 0, log 1 = 0 (the worst value)
    assert uniformity(np.ones((3, 4))) == pytest.approx(0.0)
    rng = np.random.default_rng(1)
    x = rng.normal(size=(9, 4))
    pairs = list(itertools.combinations(range(9), 2))
    want = math.log(np.mean([math.exp(-2 * np.sum((_unit(x[i]) - _unit(x[j])) ** 2)) for i, j in pairs]))
    assert uniformity(x) == pytest.approx(want)
    want_t3 = math.log(np.mean([math.exp(-3 * np.sum((_unit(x[i]) - _unit(x[j])) ** 2)) for i, j in pairs]))
    assert uniformity(x, t=3.0) == pytest.approx(want_t3)


def test_uniformity_stays_finite_where_exp_underflows():
    x = np.array([[1.0, 0.0], [-1.0, 0.0]])  # distance² 4: e^{−400·4} underflows to 0
    assert uniformity(x, t=400.0) == pytest.approx(-1600.0)


def test_geometry_metrics_and_bad_inputs():
    x = np.array([[1.0, 0.0], [0.0, 1.0]])
    assert geometry_metrics(x, x, x) == {"alignment": pytest.approx(0.0), "uniformity": pytest.approx(-4.0)}
    with pytest.raises(ValueError, match="two equal"):
        alignment(x, x[:1])
    with pytest.raises(ValueError, match="at least two"):
        uniformity(x[:1])
