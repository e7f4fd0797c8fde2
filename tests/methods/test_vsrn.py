"""VSRN's objective (Li et al. 2019, §3.4: L_M + L_G): the caption targets against a transcription of
the authors' ``data.py`` (``PrecompDataset.__getitem__``'s gts and mask, cut to the decoder's
max_len − 1 steps), the generation loss against ``LanguageModelCriterion`` written as loops, the
hinge against VSE++ Eq. 5, and gradients.

Every test runs on each device of the ``device`` fixture; references are computed on the CPU.
"""

from __future__ import annotations

import math

import pytest
import torch

from mmcse.methods.vsrn import caption_loss, caption_targets, vsrn_objective
from tests.methods.test_vsepp import hinge_eq5

START, END = 1, 2


def code_labels(caption: list[int], max_len: int) -> tuple[list[int], list[float]]:
    """data.py: gts and mask (max_len + 1 each) of one caption ``<start> … <end>``, then the criterion's
    view: labels[1:], mask[1:], cut to the max_len - 1 decoding steps; inputs are gts[:max_len - 1]."""
    mask, gts = [0.0] * (max_len + 1), [0] * (max_len + 1)
    cap = list(caption)
    if len(cap) > max_len - 1:
        cap = cap[:max_len]
        cap[-1] = END
    for j, w in enumerate(cap):
        gts[j] = w
    first_zero = gts.index(0)
    for j in range(first_zero + 1):
        mask[j] = 1.0
    return gts, mask


@pytest.mark.parametrize("max_len", [4, 6, 60])
def test_caption_targets_are_the_authors_gts_and_mask(device, max_len):
    captions = [[START, 5, 6, 7, END], [START, 8, END], [START, 4, 5, 6, 9, 10, 11, END]]
    width = max(map(len, captions))
    ids = torch.tensor([c + [0] * (width - len(c)) for c in captions], device=device)
    attention = torch.tensor([[1] * len(c) + [0] * (width - len(c)) for c in captions], device=device)
    inputs, targets, mask = caption_targets(ids, attention, max_len, END)
    T = inputs.shape[1]
    assert T <= max_len - 1
    for row, caption in enumerate(captions):
        gts, code_mask = code_labels(caption, max_len)
        steps = code_mask[1:max_len]  # the max_len - 1 steps the code decodes
        assert mask[row].tolist() + [0.0] * (max_len - 1 - T) == steps  # the same targets count...
        for t in range(T):
            if steps[t]:  # ...with the same words, read from the same inputs
                assert (int(targets[row, t]), int(inputs[row, t])) == (gts[t + 1], gts[t])
    # the <pad> after <end> is a target where the caption is shorter than the decoder's reach
    assert int(targets[1, 2]) == 0 and float(mask[1, 2]) == 1.0


def test_caption_loss_is_the_masked_nll_summed_over_the_batch(device):
    torch.manual_seed(0)
    logits = torch.randn(3, 4, 7, dtype=torch.float64)
    targets = torch.randint(0, 7, (3, 4))
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0]], dtype=torch.float64)
    expected = 0.0
    for b in range(3):
        for t in range(4):
            if mask[b, t]:
                row = logits[b, t]
                expected -= float(row[targets[b, t]]) - math.log(float(torch.exp(row).sum()))
    expected /= 3
    got = caption_loss(logits.to(device), targets.to(device), mask.to(device))
    assert float(got) == pytest.approx(expected, abs=1e-12)
    assert torch.autograd.gradcheck(lambda x: caption_loss(x, targets.to(device), mask.to(device)),
                                    (logits.to(device).requires_grad_(),))


@pytest.mark.parametrize("caption_weight", [0.0, 1.0, 0.3])
def test_objective_is_hinge_plus_weighted_caption_loss(device, caption_weight):
    torch.manual_seed(1)
    v_img = torch.nn.functional.normalize(torch.randn(4, 5, dtype=torch.float64), dim=-1)
    v_txt = torch.nn.functional.normalize(torch.randn(4, 5, dtype=torch.float64), dim=-1)
    logits = torch.randn(4, 3, 6, dtype=torch.float64)
    targets, mask = torch.randint(0, 6, (4, 3)), torch.ones(4, 3, dtype=torch.float64)
    terms = vsrn_objective(*(x.to(device) for x in (v_img, v_txt, logits, targets, mask)), margin=0.2,
                           caption_weight=caption_weight)
    assert set(terms) == {"hinge", "caption", "loss"}
    assert float(terms["hinge"]) == pytest.approx(hinge_eq5(v_img, v_txt, 0.2), abs=1e-12)
    assert float(terms["loss"]) == pytest.approx(
        hinge_eq5(v_img, v_txt, 0.2) + caption_weight * float(caption_loss(logits, targets, mask)), abs=1e-12)
