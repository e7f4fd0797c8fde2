"""KDMCSE losses against direct loop transcriptions of paper Eq. 8, 12–14.

Each test runs on every device of the ``device`` fixture: the references read the CPU
inputs, the losses their copies on ``device`` (see :func:`tests.methods.test_losses.on`).
"""

import math

import pytest
import torch

from mmcse.methods.losses import adapacse_loss, info_nce, kdmcse_objective, kdmcse_term, threshold_keep_mask
from tests.methods.test_losses import assert_on, on


def _cos(a, b):
    return float((a @ b) / (a.norm() * b.norm()))


def eq13_loop(s, m_proj, tau, margin, alpha_margin, alpha_filter, threshold, drops="above", gate=False):
    """-log e^{cos θ_ii/τ} / (e^{cos θ_ii/τ} + Σ_{j≠i} φ_ij e^{cos(θ_ij − m|1−α_ij|)/τ}), mean over i.
    ``drops="below"``: Eq. 8 as typeset (φ = 0 if α < threshold); ``gate``: the shift only where θ_ij > m."""
    n = s.shape[0]
    total = 0.0
    for i in range(n):
        pos = math.exp(math.cos(math.acos(_cos(s[i], m_proj[i]))) / tau)
        den = pos
        for j in range(n):
            if j == i:
                continue
            a = float(alpha_filter[i, j])
            dropped = threshold is not None and (a > threshold if drops == "above" else a < threshold)
            phi = 0.0 if dropped else 1.0
            theta = math.acos(_cos(s[i], m_proj[j]))
            delta = abs(1.0 - float(alpha_margin[i, j]))
            shift = 0.0 if (gate and theta <= margin) else margin * delta
            den += phi * math.exp(math.cos(theta - shift) / tau)
        total += -math.log(pos / den)
    return total / n


def _data(seed, n=6, d=5):
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(n, d, generator=g, dtype=torch.float64)
    m = torch.randn(n, d, generator=g, dtype=torch.float64)
    feats = torch.randn(n, 8, generator=g, dtype=torch.float64)
    feats = feats / feats.norm(dim=1, keepdim=True)
    alpha = feats @ feats.T  # teacher cosines, in [-1, 1]
    return s, m, alpha


@pytest.mark.parametrize(("margin", "threshold"), [(0.0, None), (0.125, None), (0.2, 0.3), (0.125, -0.2)])
def test_adapacse_matches_eq13(margin, threshold, device):
    s, m, alpha = _data(0)
    s_d, m_d, alpha_d = on(device, s, m, alpha)
    keep = threshold_keep_mask(alpha_d, threshold, "above")
    assert_on(device, keep)
    got = adapacse_loss(s_d, m_d, 0.05, margin, alpha_d, keep)
    assert_on(device, got)
    assert float(got.cpu()) == pytest.approx(eq13_loop(s, m, 0.05, margin, alpha, alpha, threshold), abs=1e-6)


@pytest.mark.parametrize(("drops", "threshold", "gate", "margin"),
                         [("below", 0.1, False, 0.125), ("below", -0.3, True, 1.2), ("above", 0.2, True, 1.4),
                          ("above", None, True, 1.6)])
def test_adapacse_matches_eq13_typeset_filter_and_the_codes_margin_gate(drops, threshold, gate, margin, device):
    # margins near π/2 make the gate bite: many θ_ij ≤ m on random vectors
    s, m, alpha = _data(3)
    s_d, m_d, alpha_d = on(device, s, m, alpha)
    keep = threshold_keep_mask(alpha_d, threshold, drops)
    got = adapacse_loss(s_d, m_d, 0.05, margin, alpha_d, keep, beyond_margin=gate)
    want = eq13_loop(s, m, 0.05, margin, alpha, alpha, threshold, drops, gate)
    assert float(got.cpu()) == pytest.approx(want, abs=1e-9)
    if gate:  # the gate changes the value where some angle is within the margin
        ungated = adapacse_loss(s_d, m_d, 0.05, margin, alpha_d, keep)
        assert abs(float(ungated) - float(got)) > 1e-6


def test_eq8_as_typeset_keeps_only_negatives_at_or_above_the_threshold(device):
    alpha = torch.tensor([[1.0, 0.95, 0.2], [0.95, 1.0, 0.91], [0.2, 0.91, 1.0]], device=device)
    keep = threshold_keep_mask(alpha, 0.91, "below")
    assert keep.cpu().tolist() == [[True, True, False], [True, True, True], [False, True, True]]
    with pytest.raises(ValueError, match="threshold_drops: 'sideways'; choose below or above"):
        threshold_keep_mask(alpha, 0.9, "sideways")


def test_threshold_filter_removes_negatives_above_threshold_and_keeps_positive(device):
    alpha = torch.tensor([[1.0, 0.95, 0.2], [0.95, 1.0, 0.91], [0.2, 0.91, 1.0]], device=device)
    keep = threshold_keep_mask(alpha, 0.9, "above")
    assert_on(device, keep)
    assert keep.cpu().tolist() == [[True, False, True], [False, True, False], [True, False, True]]
    assert threshold_keep_mask(alpha, None, "above").all()


def test_threshold_above_every_similarity_equals_unfiltered(device):
    s, m, alpha = on(device, *_data(1))
    filtered = adapacse_loss(s, m, 0.05, 0.1, alpha, threshold_keep_mask(alpha, 1.01, "above"))
    assert float(filtered) == pytest.approx(float(adapacse_loss(s, m, 0.05, 0.1, alpha)), abs=1e-12)


def test_zero_margin_is_infonce(device):
    s, m, alpha = on(device, *_data(2))
    assert float(adapacse_loss(s, m, 0.05, 0.0, alpha)) == pytest.approx(float(info_nce(s, m, 0.05)), abs=1e-6)


def test_margin_raises_the_loss_for_dissimilar_negatives(device):
    s, m, alpha = on(device, *_data(3))
    assert float(adapacse_loss(s, m, 0.05, 0.2, alpha)) > float(adapacse_loss(s, m, 0.05, 0.0, alpha))


def test_finite_gradients_at_theta_zero_and_pi(device):
    base = torch.randn(4, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(8)).to(device)
    for targets in (base.clone(), -base.clone()):  # θ = 0 and θ = π everywhere on the diagonal
        s = base.clone().requires_grad_(True)
        alpha = torch.eye(4, dtype=torch.float64, device=device)
        adapacse_loss(s, targets, 0.05, 0.125, alpha).backward()
        assert_on(device, s.grad)
        assert torch.isfinite(s.grad).all()


def test_gradcheck_away_from_the_clamp(device):
    s, m, alpha = on(device, *_data(4, n=4, d=3))
    s.requires_grad_(True)
    m.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda a, b: adapacse_loss(a, b, 0.1, 0.125, alpha), (s, m))


def test_kdmcse_term_sums_views_and_eq14_averages_modalities(device):
    s1, v, alpha = _data(5)
    s2, t, _ = _data(6)
    s1_d, s2_d, v_d, t_d, alpha_d = on(device, s1, s2, v, t, alpha)
    keep = threshold_keep_mask(alpha_d, 0.5, "above")
    image = kdmcse_term(s1_d, s2_d, v_d, 0.05, 0.125, alpha_d, keep)
    assert_on(device, image)
    expected = eq13_loop(s1, v, 0.05, 0.125, alpha, alpha, 0.5) + eq13_loop(s2, v, 0.05, 0.125, alpha, alpha, 0.5)
    assert float(image.cpu()) == pytest.approx(expected, abs=1e-6)
    text = kdmcse_term(s1_d, s2_d, t_d, 0.05, 0.0, None, None)
    assert_on(device, kdmcse_objective(image, text))
    assert float(kdmcse_objective(image, text)) == pytest.approx((float(image) + float(text)) / 2, abs=1e-12)


def test_margin_without_teacher_similarities_is_an_error(device):
    s, m, _ = on(device, *_data(7))
    with pytest.raises(ValueError, match="margin_sim"):
        adapacse_loss(s, m, 0.05, 0.1)
