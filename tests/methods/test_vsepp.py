"""VSE++ (Faghri et al. 2018; DUET Table 1's baseline): the encoders against step-by-step
transcriptions (a GRU cell unrolled by hand over each caption's own tokens, the image projection
of the mean region), the objective against VSE++ Eq. 5 written as loops, and its gradients.

Every test runs on each device of the ``device`` fixture; references are computed on the CPU.
"""

from __future__ import annotations

import pytest
import torch

from mmcse.methods.vsepp import vsepp_objective
from mmcse.models.vsepp import VseppModel


def _model(device: torch.device, **kwargs) -> VseppModel:
    torch.manual_seed(0)
    args = {"vocab_size": 11, "region_dim": 6, "word_dim": 5, "joint_dim": 4, "gru_layers": 1, "pad_id": 0} | kwargs
    return VseppModel(**args).to(device).double()


def gru_last_state(model: VseppModel, ids: list[int]) -> torch.Tensor:
    """h_T of a one-layer GRU over the word vectors of ``ids`` (no padding), written from its equations:
    r = σ(W_ir x + b_ir + W_hr h + b_hr), z = σ(W_iz x + b_iz + W_hz h + b_hz),
    n = tanh(W_in x + b_in + r ⊙ (W_hn h + b_hn)), h' = (1 - z) ⊙ n + z ⊙ h."""
    g = model.gru
    W_i, W_h = g.weight_ih_l0.detach().cpu(), g.weight_hh_l0.detach().cpu()
    b_i, b_h = g.bias_ih_l0.detach().cpu(), g.bias_hh_l0.detach().cpu()
    H = model.joint_dim
    h = torch.zeros(H, dtype=W_i.dtype)
    for token in ids:
        x = model.embed.weight.detach().cpu()[token]
        gi, gh = W_i @ x + b_i, W_h @ h + b_h
        r = torch.sigmoid(gi[:H] + gh[:H])
        z = torch.sigmoid(gi[H:2 * H] + gh[H:2 * H])
        n = torch.tanh(gi[2 * H:] + r * gh[2 * H:])
        h = (1 - z) * n + z * h
    return h / h.norm()


def test_caption_embedding_is_the_gru_state_at_its_own_last_token(device):
    """Captions of different lengths in one padded batch: each is the unit GRU state after its last
    real token; the padding after it never enters the recurrence."""
    model = _model(device)
    captions = [[1, 5, 7, 2], [1, 4, 2], [1, 9, 3, 8, 6, 2]]
    width = max(map(len, captions))
    ids = torch.tensor([c + [0] * (width - len(c)) for c in captions], device=device)
    mask = torch.tensor([[1] * len(c) + [0] * (width - len(c)) for c in captions], device=device)
    out = model.encode_text(ids, mask).cpu()
    for row, caption in zip(out, captions, strict=True):
        torch.testing.assert_close(row, gru_last_state(model, caption))
    # other tokens in the padding change nothing
    noisy = ids.masked_fill(mask == 0, 10)
    torch.testing.assert_close(model.encode_text(noisy, mask).cpu(), out)


def test_image_embedding_is_the_unit_projection_of_the_mean_real_region(device):
    model = _model(device)
    torch.manual_seed(1)
    regions = torch.randn(3, 4, 6, dtype=torch.float64, device=device)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]], dtype=torch.bool, device=device)
    v, none = model.encode_image(regions, None, mask)
    assert none is None
    W, b = model.image_fc.weight.detach().cpu(), model.image_fc.bias.detach().cpu()
    for i in range(3):
        real = [regions[i, j].cpu() for j in range(4) if mask[i, j]]
        feature = sum(real) / len(real)
        expected = W @ feature + b
        torch.testing.assert_close(v[i].cpu(), expected / expected.norm())


def hinge_eq5(v_img: torch.Tensor, v_txt: torch.Tensor, margin: float) -> float:
    """VSE++ Eq. 5 summed over the batch: max_c' [α - s(i,c) + s(i,c')]_+ + max_i' [α - s(i,c) + s(i',c)]_+."""
    B = len(v_img)
    s = [[float(v_img[i] @ v_txt[j]) for j in range(B)] for i in range(B)]
    total = 0.0
    for i in range(B):
        total += max(max(0.0, margin - s[i][i] + s[i][k]) for k in range(B) if k != i)
        total += max(max(0.0, margin - s[i][i] + s[j][i]) for j in range(B) if j != i)
    return total


@pytest.mark.parametrize("margin", [0.0, 0.2, 0.5])
def test_objective_is_vsepp_eq5_summed(device, margin):
    torch.manual_seed(2)
    v_img = torch.nn.functional.normalize(torch.randn(5, 4, dtype=torch.float64), dim=-1)
    v_txt = torch.nn.functional.normalize(torch.randn(5, 4, dtype=torch.float64), dim=-1)
    terms = vsepp_objective(v_img.to(device), v_txt.to(device), margin)
    assert set(terms) == {"hinge", "loss"}
    assert float(terms["loss"]) == pytest.approx(hinge_eq5(v_img, v_txt, margin), abs=1e-12)


def test_gradients_reach_both_encoders_and_match_finite_differences(device):
    model = _model(device)
    ids = torch.tensor([[1, 5, 7, 2], [1, 4, 2, 0], [1, 3, 8, 2]], device=device)
    mask = (ids != 0).long()
    torch.manual_seed(3)
    regions = torch.randn(3, 2, 6, dtype=torch.float64, device=device)
    out = model(ids, mask, regions)
    assert out.box_pred.shape == (3, 2, 5) and not out.box_pred.any()  # no box head: nothing to regress
    vsepp_objective(out.v_img, out.v_txt, 0.5)["loss"].backward()
    for name in ("embed.weight", "gru.weight_ih_l0", "gru.weight_hh_l0", "image_fc.weight"):
        grad = dict(model.named_parameters())[name].grad
        assert grad is not None and grad.abs().sum() > 0, name

    # d loss / d regions by central differences (float64)
    def loss_of(r: torch.Tensor) -> torch.Tensor:
        o = model(ids, mask, r)
        return vsepp_objective(o.v_img, o.v_txt, 0.5)["loss"]

    assert torch.autograd.gradcheck(loss_of, (regions.clone().requires_grad_(),), eps=1e-6, atol=1e-5)


def test_an_empty_caption_is_refused(device):
    model = _model(device)
    with pytest.raises(ValueError, match="empty caption"):
        model.encode_text(torch.zeros(2, 3, dtype=torch.long, device=device),
                          torch.tensor([[1, 1, 0], [0, 0, 0]], device=device))
