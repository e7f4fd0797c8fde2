"""DALR (Eq. 5–12) and MCSEO (Eq. 7) losses against direct loop transcriptions.

Each test runs on every device of the ``device`` fixture: the references read the CPU
inputs, the losses their copies on ``device`` (see :func:`tests.methods.test_losses.on`).
Seeded draws (mismatched pairs, ranking ties) come from CPU generators and must not
depend on the device the similarities live on.
"""

import itertools
import math

import pytest
import torch

from mmcse.methods.losses import (
    aggregated_teacher_similarity,
    consistency_loss,
    cosine_matrix,
    cross_modal_alignment_loss,
    intra_modal_alignment_loss,
    listmle_loss,
    mismatch_permutation,
    object_phrase_loss,
    span_mean,
    teacher_rankings,
    text_teacher_similarity,
    weighted_teacher_similarity,
)
from tests.methods.test_losses import assert_on, on


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
    # the authors' code rolls the images by 5: text i meets image i − 5 (by 1 when 5 wraps to 0)
    assert mismatch_permutation(7, "roll").tolist() == [2, 3, 4, 5, 6, 0, 1]
    assert mismatch_permutation(4, "roll").tolist() == [3, 0, 1, 2]
    assert mismatch_permutation(5, "roll").tolist() == [4, 0, 1, 2, 3]
    with pytest.raises(ValueError, match="modes"):
        mismatch_permutation(4, "shuffle")


@pytest.mark.parametrize("mode", ["derangement", "roll"])
@pytest.mark.parametrize("n", [2, 5, 16])
def test_mismatched_pairs_are_device_independent(mode, n, device):
    """The same seed gives the same mismatched pairs, and the same consistency loss, whether
    the shared-space projections live on the CPU or on ``device``."""
    t, v = _rand(21, n, 4), _rand(22, n, 4)
    t_d, v_d = on(device, t, v)
    for seed in range(5):
        perm = mismatch_permutation(n, mode, torch.Generator().manual_seed(seed))
        again = mismatch_permutation(n, mode, torch.Generator().manual_seed(seed))
        assert perm.device.type == "cpu" and torch.equal(perm, again)  # a host draw, moved by the caller
        assert sorted(perm.tolist()) == list(range(n)) and all(int(perm[i]) != i for i in range(n))
        got = consistency_loss(t_d, v_d, perm.to(device), 0.2)
        assert_on(device, got)
        assert float(got.cpu()) == pytest.approx(float(consistency_loss(t, v, perm, 0.2)), abs=1e-12)


def test_consistency_matches_eq5(device):
    t, v = _rand(0, 5, 4), _rand(1, 5, 4)
    perm = torch.tensor([2, 0, 4, 1, 3])
    terms = [1 - _cos(t[i], v[i]) for i in range(5)] + [max(0.0, _cos(t[i], v[perm[i]]) - 0.2) for i in range(5)]
    got = consistency_loss(*on(device, t, v, perm), 0.2)
    assert_on(device, got)
    assert float(got.cpu()) == pytest.approx(sum(terms) / 10, abs=1e-9)


@pytest.mark.parametrize(("ts", "tt"), [(1.0, 1.0), (0.05, 0.1)])
def test_cross_modal_alignment_matches_eq6_to_8(ts, tt, device):
    s, h, ft, fv = _rand(2, 4, 3), _rand(3, 4, 3), _rand(4, 4, 6), _rand(5, 4, 5)
    n = 4
    total = 0.0
    for i in range(n):
        p_t2v = _softmax([_cos(s[j], h[i]) / ts for j in range(n)])  # image i over texts j
        p_v2t = _softmax([_cos(s[i], h[j]) / ts for j in range(n)])  # text i over images j
        q_tt = _softmax([_cos(ft[i], ft[j]) / tt for j in range(n)])
        q_vv = _softmax([_cos(fv[i], fv[j]) / tt for j in range(n)])
        total += 0.5 * (_kl(q_tt, p_t2v) + _kl(q_vv, p_v2t))
    s_d, h_d, ft_d, fv_d = on(device, s, h, ft, fv)
    got = cross_modal_alignment_loss(cosine_matrix(s_d, h_d), cosine_matrix(ft_d, ft_d), cosine_matrix(fv_d, fv_d),
                                     ts, tt)
    assert_on(device, got)
    assert float(got.cpu()) == pytest.approx(total / n, abs=1e-9)


def test_intra_modal_alignment_matches_eq11_12(device):
    s1, s2, ft = _rand(6, 5, 3), _rand(7, 5, 3), _rand(8, 5, 4)
    teacher = torch.tensor([[_cos(ft[i], ft[j]) for j in range(5)] for i in range(5)], dtype=torch.float64)
    total = sum(_kl(_softmax([float(teacher[i, j]) / 0.5 for j in range(5)]),
                    _softmax([_cos(s1[i], s2[j]) / 0.1 for j in range(5)])) for i in range(5))
    s1_d, s2_d, teacher_d = on(device, s1, s2, teacher)
    got = intra_modal_alignment_loss(cosine_matrix(s1_d, s2_d), teacher_d, 0.1, 0.5)
    assert_on(device, got)
    assert float(got.cpu()) == pytest.approx(total / 5, abs=1e-9)


def listmle_loop(scores, order, tau):
    total = 0.0
    for row, perm in zip(scores.tolist(), order.tolist(), strict=True):
        x = [row[k] / tau for k in perm]
        total += -sum(x[j] - math.log(sum(math.exp(v) for v in x[j:])) for j in range(len(x)))
    return total / len(scores)


def test_listmle_matches_eq10(device):
    scores, teacher = _rand(9, 4, 4), _rand(10, 4, 4)
    scores_d, teacher_d = on(device, scores, teacher)
    order = teacher_rankings(teacher_d, torch.Generator().manual_seed(0))
    assert_on(device, order)
    got = listmle_loss(scores_d, order, 0.05)
    assert_on(device, got)
    assert float(got.cpu()) == pytest.approx(listmle_loop(scores, order.cpu(), 0.05), abs=1e-9)
    no_diag = teacher_rankings(teacher_d, torch.Generator().manual_seed(0), include_diagonal=False).cpu()
    assert no_diag.shape == (4, 3) and all(i not in no_diag[i].tolist() for i in range(4))
    got = listmle_loss(scores_d, no_diag.to(device), 1.0)
    assert float(got.cpu()) == pytest.approx(listmle_loop(scores, no_diag, 1.0), abs=1e-9)


def test_listmle_is_minimal_when_teacher_ranking_equals_students(device):
    scores = torch.tensor([[0.9, 0.1, 0.5]], dtype=torch.float64, device=device)
    losses = {perm: float(listmle_loss(scores, torch.tensor([perm], device=device)))
              for perm in itertools.permutations(range(3))}
    assert min(losses, key=losses.get) == (0, 2, 1)  # the student's own descending order


def test_rankings_descend_and_ties_follow_the_seed(device):
    teacher = torch.tensor([[1.0, 0.5, 0.5, 0.5, 0.2]], device=device)
    orders = {tuple(teacher_rankings(teacher, torch.Generator().manual_seed(s))[0].tolist()) for s in range(30)}
    assert all(o[0] == 0 and o[-1] == 4 and set(o[1:4]) == {1, 2, 3} for o in orders)
    assert len(orders) > 1  # tied items are not always in index order
    a = teacher_rankings(teacher, torch.Generator().manual_seed(5))
    assert torch.equal(a, teacher_rankings(teacher, torch.Generator().manual_seed(5)))


def _tied_teacher(n: int, seed: int) -> torch.Tensor:
    """A symmetric ``(n, n)`` teacher matrix with 1 on the diagonal and many ties: every
    off-diagonal score is one of five values."""
    x = (torch.rand(n, n, generator=torch.Generator().manual_seed(seed)) * 5).floor() / 5  # in {0, .2, …, .8}
    sim = torch.triu(x, 1) + torch.triu(x, 1).T
    return sim.fill_diagonal_(1.0)


@pytest.mark.parametrize("include_diagonal", [True, False])
def test_rankings_are_device_independent(include_diagonal, device):
    """``teacher_rankings(sim.to(device), generator)`` is the CPU ranking for the same seed:
    ties break by the generator's draw, not by the device's sort."""
    for n, seed in ((5, 0), (8, 1), (16, 2), (33, 3)):
        teacher = _tied_teacher(n, seed)
        for s in range(4):
            want = teacher_rankings(teacher, torch.Generator().manual_seed(s), include_diagonal)
            got = teacher_rankings(teacher.to(device), torch.Generator().manual_seed(s), include_diagonal)
            assert_on(device, got)
            assert got.dtype == torch.long and got.shape == (n, n if include_diagonal else n - 1)
            assert torch.equal(got.cpu(), want), (n, seed, s)
            # a ranking: descending teacher scores, each row a permutation of its columns
            scores = teacher.gather(1, want)
            assert (scores[:, :-1] >= scores[:, 1:]).all()
            for i, row in enumerate(want.tolist()):
                assert sorted(row) == [j for j in range(n) if include_diagonal or j != i]
        # the seed matters where there are ties
        draws = {tuple(teacher_rankings(teacher.to(device), torch.Generator().manual_seed(s),
                                        include_diagonal).cpu().flatten().tolist()) for s in range(6)}
        assert len(draws) > 1


def test_weighted_teacher_similarity(device):
    f1, f2 = _rand(11, 3, 4), _rand(12, 3, 6)
    got = weighted_teacher_similarity(on(device, f1, f2), [0.33, 0.67])
    assert_on(device, got)
    want = 0.33 * _cos(f1[0], f1[2]) + 0.67 * _cos(f2[0], f2[2])
    assert float(got.cpu()[0, 2]) == pytest.approx(want, abs=1e-12)


def test_aggregated_teacher_similarity_sums_the_embeddings_first(device):
    """DALR App. B: t_i = Σ_k w_k F_k[i], then cos(t_i, t_j); not Σ_k w_k cos(F_k[i], F_k[j])."""
    f1, f2 = _rand(21, 4, 5), _rand(22, 4, 5)
    got = aggregated_teacher_similarity(on(device, f1, f2), [0.33, 0.67])
    assert_on(device, got)
    for i in range(4):
        for j in range(4):
            t_i = [0.33 * f1[i, d] + 0.67 * f2[i, d] for d in range(5)]
            t_j = [0.33 * f1[j, d] + 0.67 * f2[j, d] for d in range(5)]
            dot = sum(a * b for a, b in zip(t_i, t_j, strict=True))
            want = float(dot / (math.sqrt(sum(a * a for a in t_i)) * math.sqrt(sum(b * b for b in t_j))))
            assert float(got.cpu()[i, j]) == pytest.approx(want, abs=1e-12)
    similarities = weighted_teacher_similarity([f1, f2], [0.33, 0.67])
    assert not torch.allclose(got.cpu(), similarities)  # the two readings differ
    assert torch.equal(text_teacher_similarity([f1, f2], [0.33, 0.67], "embeddings"), got.cpu())
    assert torch.equal(text_teacher_similarity([f1, f2], [0.33, 0.67], "similarities"), similarities)
    a, b = (t.detach().clone().requires_grad_(True) for t in (f1, f2))
    assert torch.autograd.gradcheck(lambda x, y: aggregated_teacher_similarity([x, y], [0.33, 0.67]), (a, b))
    with pytest.raises(ValueError, match=r"widths \[4, 5\] cannot be aggregated.*teacher_weighting: similarities"):
        aggregated_teacher_similarity([f1[:, :4], f2], [0.5, 0.5])


def test_object_phrase_loss_matches_eq7_within_each_pair(device):
    phrases, objects = _rand(13, 5, 3), _rand(14, 5, 3)
    pair = torch.tensor([0, 0, 1, 1, 1])
    total = 0.0
    for members in ([0, 1], [2, 3, 4]):
        for k in members:
            den = sum(math.exp(_cos(phrases[k], objects[j]) / 0.1) for j in members)
            total += -math.log(math.exp(_cos(phrases[k], objects[k]) / 0.1) / den)
    got = object_phrase_loss(*on(device, phrases, objects, pair), 0.1)
    assert_on(device, got)
    assert float(got.cpu()) == pytest.approx(total / 2, abs=1e-9)
    # pair ids need not be contiguous or sorted: the mean runs over the pairs present
    regrouped = torch.tensor([0, 3, 1, 2, 4])  # the same rows interleaved: pairs A B A B B
    shuffled = torch.tensor([7, 3, 7, 3, 3])  # A = 7, B = 3
    got = object_phrase_loss(*on(device, phrases[regrouped], objects[regrouped], shuffled), 0.1)
    assert float(got.cpu()) == pytest.approx(total / 2, abs=1e-9)


def test_span_mean_is_the_mean_over_the_phrase_tokens(device):
    hidden = _rand(15, 2, 6, 3)
    got = span_mean(*on(device, hidden, torch.tensor([1, 0]), torch.tensor([2, 1]), torch.tensor([5, 2])))
    assert_on(device, got)
    torch.testing.assert_close(got.cpu()[0], hidden[1, 2:5].mean(0))
    torch.testing.assert_close(got.cpu()[1], hidden[0, 1])


def test_empty_span_is_an_error_for_host_spans():
    # spans on the host are checked here; spans already on a GPU are checked when training
    # loads objects.jsonl (a check here would be a device sync every step)
    hidden = _rand(15, 2, 6, 3)
    with pytest.raises(ValueError, match="at least one token"):
        span_mean(hidden, torch.tensor([0]), torch.tensor([3]), torch.tensor([3]))
    with pytest.raises(ValueError, match="at least one token"):
        span_mean(hidden, torch.tensor([0]), torch.tensor([6]), torch.tensor([8]))  # starts past the end


def test_gradients_are_finite_and_match_finite_differences(device):
    a, b = on(device, _rand(16, 4, 3).requires_grad_(True), _rand(17, 4, 3).requires_grad_(True))
    ft, teacher = on(device, _rand(18, 4, 5), _rand(19, 4, 4))
    perm = torch.tensor([1, 2, 3, 0], device=device)
    order = teacher_rankings(teacher, torch.Generator().manual_seed(0))
    pair = torch.tensor([0, 0, 1, 1], device=device)
    checks = [
        lambda x, y: consistency_loss(x, y, perm, 0.2),
        lambda x, y: cross_modal_alignment_loss(cosine_matrix(x, y), cosine_matrix(ft, ft), cosine_matrix(ft, ft),
                                                0.5, 0.5),
        lambda x, y: intra_modal_alignment_loss(cosine_matrix(x, y), teacher, 0.5, 1.0),
        lambda x, y: listmle_loss(x @ y.T, order, 0.5),
        lambda x, y: object_phrase_loss(x, y, pair, 0.3),
    ]
    for fn in checks:
        assert torch.autograd.gradcheck(fn, (a, b))
    (same,) = on(device, _rand(20, 4, 3).requires_grad_(True))  # identical vectors: cos = 1 everywhere
    (consistency_loss(same, same, perm) + object_phrase_loss(same, same, pair, 0.05)).backward()
    assert_on(device, same.grad)
    assert torch.isfinite(same.grad).all()
