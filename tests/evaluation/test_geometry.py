"""Alignment and uniformity (DALR Eq. 15–16) against loops over pairs and hand-checked values, and
the STS dev geometry built on them (positive pairs gold >= 4, every distinct sentence)."""

import itertools
import math

import numpy as np
import pytest

from mmcse.data.senteval import SentencePair
from mmcse.evaluation.geometry import (
    POSITIVE_GOLD,
    alignment,
    check_sts_geometry,
    geometry_metrics,
    positive_pairs,
    sts_dev_geometry,
    sts_geometry,
    uniformity,
)
from mmcse.evaluation.sts import evaluate_sts


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


# --------------------------------------------------------------------------- STS dev geometry

# four sentences on the unit circle (and one scaled copy): distances are hand-checkable
VEC = {"a": np.array([1.0, 0.0]), "b": np.array([0.0, 3.0]), "c": np.array([-2.0, 0.0]), "d": np.array([0.0, -1.0])}
PAIRS = [
    SentencePair("T", "dev", "a", "b", 5.0),  # positive, ||a − b||² = 2
    SentencePair("T", "dev", "a", "a", 4.0),  # positive (4 is included), distance 0
    SentencePair("T", "dev", "c", "d", 3.99),  # below the threshold
    SentencePair("T", "dev", "a", "c", 0.0),
]


def test_positive_pairs_take_gold_from_four_inclusive():
    assert POSITIVE_GOLD == 4.0
    assert [p.score for p in positive_pairs(PAIRS)] == [5.0, 4.0]
    assert [p.score for p in positive_pairs({"X": PAIRS[:2], "Y": PAIRS[2:]}, threshold=3.5)] == [5.0, 4.0, 3.99]


def test_sts_geometry_by_hand():
    got = sts_geometry(VEC, PAIRS)
    assert got["alignment"] == pytest.approx((2.0 + 0.0) / 2)
    # distinct sentences a, b, c, d: four neighbours at distance² 2, two opposites at distance² 4
    assert got["uniformity"] == pytest.approx(math.log((4 * math.exp(-4) + 2 * math.exp(-8)) / 6))
    # the same numbers from a task -> pairs mapping (training's data.dev)
    assert sts_geometry(VEC, {"X": PAIRS[:1], "Y": PAIRS[1:]}) == got


def _fake_encoder(calls):
    rng = np.random.default_rng(3)
    table = {}

    def encode(sentences):
        calls.extend(sentences)
        return np.stack([table.setdefault(s, rng.normal(size=6)) for s in sentences]).astype(np.float32)

    return encode, table


def test_sts_dev_geometry_encodes_each_sentence_once_and_matches_a_direct_computation():
    words = [f"sentence {i}" for i in range(12)]
    pairs = [SentencePair("T", "dev", words[i], words[(i * 5 + 1) % 12], float(i % 6)) for i in range(12)]
    calls = []
    encode, table = _fake_encoder(calls)
    got = sts_dev_geometry(encode, pairs, threshold=4.0, batch_size=5)
    assert sorted(calls) == sorted(set(calls)) == sorted({s for p in pairs for s in (p.s1, p.s2)})
    vec = {s: v.astype(np.float32).astype(np.float64) for s, v in table.items()}
    pos = [p for p in pairs if p.score >= 4.0]
    assert len(pos) == 4
    want_align = np.mean([np.sum((_unit(vec[p.s1]) - _unit(vec[p.s2])) ** 2) for p in pos])
    distinct = sorted(vec)
    want_unif = math.log(np.mean([math.exp(-2 * np.sum((_unit(vec[x]) - _unit(vec[y])) ** 2))
                                  for x, y in itertools.combinations(distinct, 2)]))
    assert got == {"alignment": pytest.approx(want_align), "uniformity": pytest.approx(want_unif)}


def test_evaluate_sts_keeps_the_vectors_it_scored_with_only_when_asked():
    calls = []
    encode, table = _fake_encoder(calls)
    words = [f"w{i}" for i in range(6)]
    tasks = {"T": [SentencePair("T", "dev", words[i], words[i + 1], float(i)) for i in range(5)]}
    assert evaluate_sts(encode, tasks).vectors == {}
    kept = evaluate_sts(encode, tasks, keep_vectors=True)
    assert kept.vectors.keys() == set(words)
    for s, v in kept.vectors.items():
        np.testing.assert_array_equal(v, table[s].astype(np.float32))
    assert kept.scores == evaluate_sts(encode, tasks).scores


def test_no_positive_pair_or_one_sentence_is_refused_before_encoding():
    def encode(_):
        raise AssertionError("encoded")

    low = [SentencePair("T", "dev", "a", "b", 3.9), SentencePair("T", "dev", "c", "d", 1.0)]
    with pytest.raises(ValueError, match=r"dev.jsonl: no pair with gold score >= 4 \(highest 3.9 in 2 pairs\)"):
        check_sts_geometry(low, 4.0, "dev.jsonl")
    with pytest.raises(ValueError, match="no pair with gold score >= 4"):
        sts_dev_geometry(encode, low)
    with pytest.raises(ValueError, match="no pair with gold score >= 4"):
        sts_geometry(VEC, [])
    with pytest.raises(ValueError, match="fewer than two distinct sentences"):
        sts_dev_geometry(encode, [SentencePair("T", "dev", "a", "a", 5.0)])
