"""The benchmarks' peer loss (benchmarks/peers.py): sentence-transformers' MultipleNegativesRankingLoss at scale 1/τ is
SimCSE's objective, so a step-time ratio against it compares equal work. Apart from tests/methods/test_losses.py:
importing sentence-transformers takes ~5 s, which the equation tests need not pay."""

import torch

from mmcse.methods.losses import simcse_loss


def test_the_benchmarks_peer_trains_simcses_objective(device):
    """benchmarks/step_time.py and micro_batch.py time sentence-transformers' MultipleNegativesRankingLoss as
    the peer of the SimCSE step (issue 55): at scale 1/τ, on the same two views, it is KDMCSE Eq. 1 — the same
    loss and the same gradients as `simcse_loss`, so the benchmark compares equal work."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from sentence_transformers import losses

    torch.manual_seed(0)
    z1, z2 = torch.randn(8, 16, dtype=torch.float64), torch.randn(8, 16, dtype=torch.float64)
    ours = [t.to(device).requires_grad_() for t in (z1, z2)]
    peers = [t.to(device).requires_grad_() for t in (z1, z2)]
    loss = simcse_loss(*ours, 0.05)
    peer = losses.MultipleNegativesRankingLoss(None, scale=1 / 0.05).compute_loss_from_embeddings(peers, None)
    loss.backward()
    peer.backward()
    assert abs(loss.item() - peer.item()) < 1e-12 and loss.item() > 1.0
    for mine, theirs in zip(ours, peers, strict=True):
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=0, atol=1e-12)
