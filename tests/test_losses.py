"""Losses against direct, loop-based transcriptions of KDMCSE paper Eq. 1 and Eq. 3."""

import math

import pytest
import torch

from mmcse.losses import mcse_image_loss, simcse_loss


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


@pytest.mark.parametrize("tau", [0.05, 0.5, 1.0])
def test_simcse_matches_eq1(tau):
    g = torch.Generator().manual_seed(0)
    z1, z2 = torch.randn(5, 7, generator=g, dtype=torch.float64), torch.randn(5, 7, generator=g, dtype=torch.float64)
    assert float(simcse_loss(z1, z2, tau)) == pytest.approx(eq1_loop(z1, z2, tau), abs=1e-6)


@pytest.mark.parametrize("tau", [0.05, 0.3])
def test_mcse_image_term_matches_eq3(tau):
    g = torch.Generator().manual_seed(1)
    s1, s2, v = (torch.randn(6, 4, generator=g, dtype=torch.float64) for _ in range(3))
    assert float(mcse_image_loss(s1, s2, v, tau)) == pytest.approx(eq3_loop(s1, s2, v, tau), abs=1e-6)


def test_gradients_match_finite_differences():
    g = torch.Generator().manual_seed(3)
    args = [torch.randn(4, 3, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(5)]
    assert torch.autograd.gradcheck(lambda a, b: simcse_loss(a, b, 0.1), args[:2])
    assert torch.autograd.gradcheck(lambda a, b, c: mcse_image_loss(a, b, c, 0.2), args[2:])


def test_identical_views_give_finite_gradients():
    z = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    loss = simcse_loss(z, z, 0.05) + mcse_image_loss(z, z, z, 0.05)
    loss.backward()
    assert torch.isfinite(z.grad).all()


def test_perfect_alignment_beats_random():
    eye = torch.eye(4, dtype=torch.float64)
    rand = torch.randn(4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    assert float(simcse_loss(eye, eye, 0.05)) < 1e-6 < float(simcse_loss(eye, rand, 0.05))
