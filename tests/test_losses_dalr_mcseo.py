"""DALR (Eq. 5–12) and MCSEO (Eq. 7) losses against direct loop transcriptions."""

import itertools
import math

import pytest
import torch

from mmcse.losses import (
    consistency_loss,
    cross_modal_alignment_loss,
    intra_modal_alignment_loss,
    listmle_loss,
    mismatch_permutation,
    object_phrase_loss,
    span_mean,
    teacher_rankings,
    weighted_teacher_similarity,
)


def _cos(a, b):
    return float((a @ b) / (a.norm() * b.norm()))


def _softmax(xs):
    top = max(xs)
    e = [math.exp(x - top) for x in xs]
    return [v / sum(e) for v in e]


def _kl(q, p):
    return sum(qi * math.log(qi / pi) for qi, pi in zip(q, p, strict=True))


def _rand(seed, *shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def test_mismatch_permutations():
    g = torch.Generator().manual_seed(0)
    for n in (2, 3, 7):
        for _ in range(20):
            perm = mismatch_permutation(n, "derangement", g)
            assert sorted(perm.tolist()) == list(range(n)) and all(perm[i] != i for i in range(n))
    assert mismatch_permutation(4, "roll").tolist() == [3, 0, 1, 2]
    with pytest.raises(ValueError, match="modes"):
        mismatch_permutation(4, "shuffle")


def test_consistency_matches_eq5():
    t, v = _rand(0, 5, 4), _rand(1, 5, 4)
    perm = torch.tensor([2, 0, 4, 1, 3])
    terms = [1 - _cos(t[i], v[i]) for i in range(5)] + [max(0.0, _cos(t[i], v[perm[i]]) - 0.2) for i in range(5)]
    assert float(consistency_loss(t, v, perm, 0.2)) == pytest.approx(sum(terms) / 10, abs=1e-9)


@pytest.mark.parametrize(("ts", "tt"), [(1.0, 1.0), (0.05, 0.1)])
def test_cross_modal_alignment_matches_eq6_to_8(ts, tt):
    s, h, ft, fv = _rand(2, 4, 3), _rand(3, 4, 3), _rand(4, 4, 6), _rand(5, 4, 5)
    n = 4
    total = 0.0
    for i in range(n):
        p_t2v = _softmax([_cos(s[j], h[i]) / ts for j in range(n)])  # image i over texts j
        p_v2t = _softmax([_cos(s[i], h[j]) / ts for j in range(n)])  # text i over images j
        q_tt = _softmax([_cos(ft[i], ft[j]) / tt for j in range(n)])
        q_vv = _softmax([_cos(fv[i], fv[j]) / tt for j in range(n)])
        total += 0.5 * (_kl(q_tt, p_t2v) + _kl(q_vv, p_v2t))
    got = cross_modal_alignment_loss(s, h, ft, fv, ts, tt)
    assert float(got) == pytest.approx(total / n, abs=1e-9)


def test_intra_modal_alignment_matches_eq11_12():
    s1, s2, ft = _rand(6, 5, 3), _rand(7, 5, 3), _rand(8, 5, 4)
    teacher = torch.tensor([[_cos(ft[i], ft[j]) for j in range(5)] for i in range(5)], dtype=torch.float64)
    total = sum(_kl(_softmax([float(teacher[i, j]) / 0.5 for j in range(5)]),
                    _softmax([_cos(s1[i], s2[j]) / 0.1 for j in range(5)])) for i in range(5))
    assert float(intra_modal_alignment_loss(s1, s2, teacher, 0.1, 0.5)) == pytest.approx(total / 5, abs=1e-9)


def listmle_loop(scores, order, tau):
    total = 0.0
    for row, perm in zip(scores.tolist(), order.tolist(), strict=True):
        x = [row[k] / tau for k in perm]
        total += -sum(x[j] - math.log(sum(math.exp(v) for v in x[j:])) for j in range(len(x)))
    return total / len(scores)


def test_listmle_matches_eq10():
    scores, teacher = _rand(9, 4, 4), _rand(10, 4, 4)
    order = teacher_rankings(teacher, torch.Generator().manual_seed(0))
    assert float(listmle_loss(scores, order, 0.05)) == pytest.approx(listmle_loop(scores, order, 0.05), abs=1e-9)
    no_diag = teacher_rankings(teacher, torch.Generator().manual_seed(0), include_diagonal=False)
    assert no_diag.shape == (4, 3) and all(i not in no_diag[i].tolist() for i in range(4))
    assert float(listmle_loss(scores, no_diag, 1.0)) == pytest.approx(listmle_loop(scores, no_diag, 1.0), abs=1e-9)


def test_listmle_is_minimal_when_teacher_ranking_equals_students():
    scores = torch.tensor([[0.9, 0.1, 0.5]], dtype=torch.float64)
    losses = {perm: float(listmle_loss(scores, torch.tensor([perm]))) for perm in itertools.permutations(range(3))}
    assert min(losses, key=losses.get) == (0, 2, 1)  # the student's own descending order


def test_rankings_descend_and_ties_follow_the_seed():
    teacher = torch.tensor([[1.0, 0.5, 0.5, 0.5, 0.2]])
    orders = {tuple(teacher_rankings(teacher, torch.Generator().manual_seed(s))[0].tolist()) for s in range(30)}
    assert all(o[0] == 0 and o[-1] == 4 and set(o[1:4]) == {1, 2, 3} for o in orders)
    assert len(orders) > 1  # tied items are not always in index order
    a = teacher_rankings(teacher, torch.Generator().manual_seed(5))
    assert torch.equal(a, teacher_rankings(teacher, torch.Generator().manual_seed(5)))


def test_weighted_teacher_similarity():
    f1, f2 = _rand(11, 3, 4), _rand(12, 3, 6)
    got = weighted_teacher_similarity([f1, f2], [0.33, 0.67])
    assert float(got[0, 2]) == pytest.approx(0.33 * _cos(f1[0], f1[2]) + 0.67 * _cos(f2[0], f2[2]), abs=1e-12)


def test_object_phrase_loss_matches_eq7_within_each_pair():
    phrases, objects = _rand(13, 5, 3), _rand(14, 5, 3)
    pair = torch.tensor([0, 0, 1, 1, 1])
    total = 0.0
    for members in ([0, 1], [2, 3, 4]):
        for k in members:
            den = sum(math.exp(_cos(phrases[k], objects[j]) / 0.1) for j in members)
            total += -math.log(math.exp(_cos(phrases[k], objects[k]) / 0.1) / den)
    assert float(object_phrase_loss(phrases, objects, pair, 0.1)) == pytest.approx(total / 2, abs=1e-9)


def test_span_mean_is_the_mean_over_the_phrase_tokens():
    hidden = _rand(15, 2, 6, 3)
    got = span_mean(hidden, torch.tensor([1, 0]), torch.tensor([2, 1]), torch.tensor([5, 2]))
    torch.testing.assert_close(got[0], hidden[1, 2:5].mean(0))
    torch.testing.assert_close(got[1], hidden[0, 1])
    with pytest.raises(ValueError, match="at least one token"):
        span_mean(hidden, torch.tensor([0]), torch.tensor([3]), torch.tensor([3]))


def test_gradients_are_finite_and_match_finite_differences():
    a, b = _rand(16, 4, 3).requires_grad_(True), _rand(17, 4, 3).requires_grad_(True)
    ft, teacher = _rand(18, 4, 5), _rand(19, 4, 4)
    perm = torch.tensor([1, 2, 3, 0])
    order = teacher_rankings(teacher, torch.Generator().manual_seed(0))
    pair = torch.tensor([0, 0, 1, 1])
    checks = [
        lambda x, y: consistency_loss(x, y, perm, 0.2),
        lambda x, y: cross_modal_alignment_loss(x, y, ft, ft, 0.5, 0.5),
        lambda x, y: intra_modal_alignment_loss(x, y, teacher, 0.5, 1.0),
        lambda x, y: listmle_loss(x @ y.T, order, 0.5),
        lambda x, y: object_phrase_loss(x, y, pair, 0.3),
    ]
    for fn in checks:
        assert torch.autograd.gradcheck(fn, (a, b))
    same = _rand(20, 4, 3).requires_grad_(True)  # identical vectors: cos = 1 everywhere
    (consistency_loss(same, same, perm) + object_phrase_loss(same, same, pair, 0.05)).backward()
    assert torch.isfinite(same.grad).all()
