"""SimCSE's auxiliary MLM objective (SimCSE App. E): the masking of its train.py ``mask_tokens``
and the cross-entropy at the chosen tokens, each against a direct transcription on small inputs."""

from __future__ import annotations

import math

import pytest
import torch

from mmcse.methods.losses import IGNORED, masked_lm_loss, mlm_masking
from tests.methods.test_losses import assert_on, on

MASK, VOCAB = 103, 500
SPECIAL = torch.tensor([0, 101, 102, 103])  # [PAD], [CLS], [SEP], [MASK]


def _ids(seed: int, rows: int = 4, length: int = 9) -> torch.Tensor:
    """[CLS] words [SEP] then padding, words in [1000, 2000) (never special)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1000, 2000, (rows, length), generator=g)
    for i in range(rows):
        n = length - (i % 3)
        ids[i, 0], ids[i, n - 1], ids[i, n:] = 101, 102, 0
    return ids


def masking_loop(ids, special, mask_id, vocab, p, generator):
    """mask_tokens, token by token: draw u_choose, u_replace, u_random for every position and a word,
    in the order the function documents (three uniform fields, then the words)."""
    shape = tuple(ids.shape)
    u_choose, u_replace, u_random = (torch.rand(shape, generator=generator) for _ in range(3))
    words = torch.randint(vocab, shape, generator=generator)
    masked, labels = ids.clone(), torch.full_like(ids, -100)
    for i in range(shape[0]):
        for j in range(shape[1]):
            token = int(ids[i, j])
            if token in special.tolist() or not u_choose[i, j] < p:
                continue
            labels[i, j] = token
            if u_replace[i, j] < 0.8:
                masked[i, j] = mask_id
            elif u_random[i, j] < 0.5:
                masked[i, j] = int(words[i, j])
    return masked, labels


def test_masking_is_simcse_mask_tokens(device):
    ids = _ids(0)
    want = masking_loop(ids, SPECIAL, MASK, VOCAB, 0.3, torch.Generator().manual_seed(5))
    (ids_d, special_d) = on(device, ids, SPECIAL)
    got = mlm_masking(ids_d, special_d, MASK, VOCAB, 0.3, torch.Generator().manual_seed(5))
    for g, w in zip(got, want, strict=True):
        assert_on(device, g)
        assert torch.equal(g.cpu(), w)
    assert IGNORED == -100  # what cross-entropy skips, and what SimCSE's labels use


def test_masking_shares_and_specials():
    """Over many tokens: 15 % chosen, of those 80 % [MASK], 10 % a random id, 10 % kept; never a
    special token (padding, [CLS], [SEP]); labels carry the original id exactly where chosen."""
    ids = _ids(1, rows=400, length=64)
    masked, labels = mlm_masking(ids, SPECIAL, MASK, VOCAB, 0.15, torch.Generator().manual_seed(0))
    special = torch.isin(ids, SPECIAL)
    chosen = labels != IGNORED
    assert not (chosen & special).any() and torch.equal(masked[special], ids[special])
    assert torch.equal(labels[chosen], ids[chosen]) and torch.equal(masked[~chosen], ids[~chosen])
    share = chosen.sum() / (~special).sum()
    assert abs(float(share) - 0.15) < 0.01
    n = int(chosen.sum())
    to_mask = int((masked[chosen] == MASK).sum())
    kept = int((masked[chosen] == ids[chosen]).sum())
    randomised = n - to_mask - kept
    assert abs(to_mask / n - 0.8) < 0.03 and abs(kept / n - 0.1) < 0.03 and abs(randomised / n - 0.1) < 0.03
    assert int(masked[chosen & (masked != MASK) & (masked != ids)].max()) < VOCAB


def test_masking_follows_the_generator_only():
    ids = _ids(2)
    a = mlm_masking(ids, SPECIAL, MASK, VOCAB, 0.5, torch.Generator().manual_seed(3))
    b = mlm_masking(ids, SPECIAL, MASK, VOCAB, 0.5, torch.Generator().manual_seed(3))
    c = mlm_masking(ids, SPECIAL, MASK, VOCAB, 0.5, torch.Generator().manual_seed(4))
    assert torch.equal(a[1], b[1]) and not torch.equal(a[1], c[1])


def mlm_loss_loop(logits, labels):
    """ℓ^mlm = −(1/M) Σ_m log softmax(logits_m)[label_m]."""
    total = 0.0
    for m in range(logits.shape[0]):
        row = [float(x) for x in logits[m]]
        top = max(row)
        log_z = top + math.log(sum(math.exp(x - top) for x in row))
        total += -(row[int(labels[m])] - log_z)
    return total / logits.shape[0]


def test_masked_lm_loss_and_its_gradient(device):
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(5, 11, generator=g, dtype=torch.float64)
    labels = torch.tensor([3, 0, 10, 3, 7])
    (x,) = on(device, logits.requires_grad_(True))
    got = masked_lm_loss(x, labels.to(device))
    assert_on(device, got)
    assert float(got.detach()) == pytest.approx(mlm_loss_loop(logits.detach(), labels), abs=1e-9)
    got.backward()
    # d/dlogits of the mean cross-entropy: (softmax − one-hot) / M
    want = (torch.softmax(logits.detach(), 1) - torch.nn.functional.one_hot(labels, 11)) / 5
    assert torch.allclose(x.grad.cpu().double(), want, atol=1e-6)
