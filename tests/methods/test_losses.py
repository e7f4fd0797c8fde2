"""Losses against direct, loop-based transcriptions of KDMCSE paper Eq. 1 and Eq. 3.

Every test runs on each device of the ``device`` fixture: inputs are drawn on the CPU
(the reference loops read those), the loss runs on copies moved to ``device``, and its
result is brought back with ``.cpu()`` for the comparison.
"""

import math

import pytest
import torch

from mmcse.methods.losses import (
    adapacse_loss,
    consistency_loss,
    cosine_matrix,
    cross_modal_alignment_loss,
    info_nce,
    intra_modal_alignment_loss,
    kdmcse_objective,
    kdmcse_term,
    listmle_loss,
    mcse_image_loss,
    mcseo_image_caption_loss,
    mismatch_permutation,
    object_phrase_loss,
    safe_arccos,
    simcse_loss,
    span_mean,
    teacher_rankings,
    threshold_keep_mask,
    weighted_teacher_similarity,
)


def _cos(a, b):
    return float((a @ b) / (a.norm() * b.norm()))


def eq1_loop(h, h_prime, tau):
    """ℓ_i^S = -log e^{sim(h_i, h'_i)/τ} / Σ_j e^{sim(h_i, h'_j)/τ}, averaged over i."""
    n = h.shape[0]
    total = 0.0
    for i in range(n):
        num = math.exp(_cos(h[i], h_prime[i]) / tau)
        den = sum(math.exp(_cos(h[i], h_prime[j]) / tau) for j in range(n))
        total += -math.log(num / den)
    return total / n


def eq3_loop(s, s_prime, v, tau):
    """ℓ_i^M = -Σ_{z∈{z,z'}} log e^{sim(s_i^z, v_i)/τ'} / Σ_j e^{sim(s_i^z, v_j)/τ'}, averaged."""
    n = v.shape[0]
    total = 0.0
    for i in range(n):
        for view in (s, s_prime):
            num = math.exp(_cos(view[i], v[i]) / tau)
            den = sum(math.exp(_cos(view[i], v[j]) / tau) for j in range(n))
            total += -math.log(num / den)
    return total / n


def on(device: torch.device, *tensors: torch.Tensor) -> list[torch.Tensor]:
    """Copies of ``tensors`` on ``device`` (leaves: requires_grad is carried over)."""
    return [t.detach().to(device).requires_grad_(t.requires_grad) for t in tensors]


def assert_on(device: torch.device, t: torch.Tensor) -> None:
    # "cuda" names the current GPU, a tensor says "cuda:0": compare the device type
    assert t.device.type == device.type, f"tensor on {t.device}, inputs on {device}"


@pytest.mark.parametrize("tau", [0.05, 0.5, 1.0])
def test_simcse_matches_eq1(tau, device):
    g = torch.Generator().manual_seed(0)
    z1, z2 = torch.randn(5, 7, generator=g, dtype=torch.float64), torch.randn(5, 7, generator=g, dtype=torch.float64)
    got = simcse_loss(*on(device, z1, z2), tau)
    assert_on(device, got)
    assert float(got.cpu()) == pytest.approx(eq1_loop(z1, z2, tau), abs=1e-6)


@pytest.mark.parametrize("tau", [0.05, 0.3])
def test_mcse_image_term_matches_eq3(tau, device):
    g = torch.Generator().manual_seed(1)
    s1, s2, v = (torch.randn(6, 4, generator=g, dtype=torch.float64) for _ in range(3))
    got = mcse_image_loss(*on(device, s1, s2, v), tau)
    assert_on(device, got)
    assert float(got.cpu()) == pytest.approx(eq3_loop(s1, s2, v, tau), abs=1e-6)


def mcseo_eq3_loop(h_cap, h_img, tau):
    """MCSEO Eq. 3: l_i^img-cap = -log e^{sim(h_i^cap, h_i^img)/τ'} / Σ_j e^{sim(h_i^cap, h_j^img)/τ'}, averaged."""
    n = h_img.shape[0]
    return sum(-math.log(math.exp(_cos(h_cap[i], h_img[i]) / tau)
                         / sum(math.exp(_cos(h_cap[i], h_img[j]) / tau) for j in range(n))) for i in range(n)) / n


@pytest.mark.parametrize("tau", [0.05, 0.3])
def test_mcseo_image_caption_term_matches_its_eq3_with_one_view(tau, device):
    g = torch.Generator().manual_seed(11)
    s1, s2, v = (torch.randn(6, 4, generator=g, dtype=torch.float64) for _ in range(3))
    got = mcseo_image_caption_loss(*on(device, s1, v), tau)
    assert_on(device, got)
    assert float(got.cpu()) == pytest.approx(mcseo_eq3_loop(s1, v, tau), abs=1e-6)
    # KDMCSE's Eq. 3 is both views summed: MCSEO's one view is not half of it in general
    assert float(mcse_image_loss(s1, s2, v, tau)) == pytest.approx(
        mcseo_eq3_loop(s1, v, tau) + mcseo_eq3_loop(s2, v, tau), abs=1e-6)
    args = on(device, *(torch.randn(4, 3, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2)))
    assert torch.autograd.gradcheck(lambda a, b: mcseo_image_caption_loss(a, b, 0.2), args)


def test_gradients_match_finite_differences(device):
    g = torch.Generator().manual_seed(3)
    args = on(device, *(torch.randn(4, 3, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(5)))
    assert torch.autograd.gradcheck(lambda a, b: simcse_loss(a, b, 0.1), args[:2])
    assert torch.autograd.gradcheck(lambda a, b, c: mcse_image_loss(a, b, c, 0.2), args[2:])


def test_identical_views_give_finite_gradients(device):
    (z,) = on(device, torch.randn(4, 3, dtype=torch.float64, requires_grad=True))
    loss = simcse_loss(z, z, 0.05) + mcse_image_loss(z, z, z, 0.05)
    loss.backward()
    assert_on(device, z.grad)
    assert torch.isfinite(z.grad).all()


def test_perfect_alignment_beats_random(device):
    eye = torch.eye(4, dtype=torch.float64, device=device)
    rand = torch.randn(4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0)).to(device)
    assert float(simcse_loss(eye, eye, 0.05)) < 1e-6 < float(simcse_loss(eye, rand, 0.05))


def test_every_loss_returns_tensors_on_the_input_device(device):
    """No loss creates a tensor on the default device: each result (and each gradient)
    lives where its inputs do."""
    g = torch.Generator().manual_seed(4)

    def r(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float32).to(device).requires_grad_(True)

    a, b, c = r(6, 5), r(6, 5), r(6, 5)
    feats = r(6, 8).detach()
    alpha = cosine_matrix(feats, feats)  # (6, 6) teacher cosines
    keep = threshold_keep_mask(alpha, 0.3, "above")
    ranking = teacher_rankings(alpha, torch.Generator().manual_seed(0))
    ranking_no_diag = teacher_rankings(alpha, torch.Generator().manual_seed(0), include_diagonal=False)
    mismatch = mismatch_permutation(6, "derangement", torch.Generator().manual_seed(0)).to(device)
    pair = torch.tensor([0, 0, 2, 2, 2, 5], device=device)
    hidden = r(3, 7, 5)
    rows, starts, ends = (torch.tensor(x, device=device) for x in ([0, 2, 1], [1, 2, 3], [3, 6, 4]))
    image = kdmcse_term(a, b, c, 0.05, 0.1, alpha, keep)
    results = {
        "cosine_matrix": cosine_matrix(a, b),
        "safe_arccos": safe_arccos(cosine_matrix(a, b)),
        "info_nce": info_nce(a, b, 0.05),
        "simcse": simcse_loss(a, b, 0.05),
        "mcse_image": mcse_image_loss(a, b, c, 0.05),
        "threshold_keep_mask": keep,
        "threshold_keep_mask_off": threshold_keep_mask(alpha, None, "above"),
        "adapacse": adapacse_loss(a, c, 0.05, 0.1, alpha, keep),
        "adapacse_plain": adapacse_loss(a, c, 0.05),
        "kdmcse_term": image,
        "kdmcse_objective": kdmcse_objective(image, kdmcse_term(a, b, c, 0.05, 0.0, None, None)),
        "consistency": consistency_loss(a, b, mismatch),
        "cma": cross_modal_alignment_loss(cosine_matrix(a, b), cosine_matrix(feats, feats),
                                          cosine_matrix(feats, feats), 0.5, 0.5),
        "ima": intra_modal_alignment_loss(cosine_matrix(a, b), alpha, 0.1, 0.5),
        "teacher_rankings": ranking,
        "teacher_rankings_no_diagonal": ranking_no_diag,
        "listmle": listmle_loss(cosine_matrix(a, b), ranking, 0.05),
        "listmle_no_diagonal": listmle_loss(cosine_matrix(a, b), ranking_no_diag, 0.05),
        "weighted_teacher_similarity": weighted_teacher_similarity([feats, feats[:, :3]], [0.33, 0.67]),
        "object_phrase": object_phrase_loss(a, b, pair, 0.1),
        "span_mean": span_mean(hidden, rows, starts, ends),
    }
    for name, t in results.items():
        assert t.device.type == device.type, f"{name} returned a tensor on {t.device}, inputs on {device}"
    total = sum(t.sum() for name, t in results.items() if t.requires_grad)
    total.backward()
    for x in (a, b, c, hidden):
        assert_on(device, x.grad)
        assert torch.isfinite(x.grad).all()
