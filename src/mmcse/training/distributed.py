"""One training step over several processes (torch.distributed; torchrun starts them): the same update as one
process at the same global batch.

The contrastive terms compare every sentence of a batch with every other, so a rank cannot compute its loss
from its own rows: on the official SimCSE code, several GPUs silently shrink the in-batch negatives to each
GPU's share (princeton-nlp/SimCSE#34). Here every rank holds the step's whole batch of token ids and cached
features (a few kB a sentence), and

1. runs the encoder (the expensive part) on its own contiguous share of the step's rows only
   (`ShardedTokens`), with the rows' keyed dropout (``train.dropout_rng: per_row``): a row draws the masks it
   draws in one process, whichever rank encodes it;
2. all-gathers the token states in rank order with torch's differentiable all-gather
   (`torch.distributed._functional_collectives.all_gather_single_autograd`), so every rank has the full
   batch's states ``(R, L, H)`` and computes the full-batch loss, every term and its heads over all B
   in-batch negatives;
3. back-propagates: the all-gather's backward sums the N ranks' (identical) gradients of each rank's rows, so
   a rank's encoder gradient is N times its rows' share of the full-batch gradient, and the heads' gradient
   is the full batch's on every rank; `average_gradients` then divides the sum over ranks by N, as DDP does,
   which leaves every parameter with the one-process gradient, and the optimizers take the same step.

With ``train.micro_batch`` a rank encodes its share in micro-batches (`mmcse.training.gradcache`): the
gathered states are the cached leaves, and each rank replays its own micro-batches with the gradient the
all-gather's backward gave its leaf.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as collectives

from mmcse.training.gradcache import TokenEncoder


def world() -> tuple[int, int]:
    """``(rank, world size)`` of this process: ``(0, 1)`` without a process group."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def share(n: int, rank: int, size: int) -> slice:
    """Rank ``rank``'s contiguous share of ``n`` rows (ranks in order: the gather puts them back in order)."""
    if n % size:
        raise ValueError(f"{n} rows do not split evenly over {size} processes (the batch's rows must be a "
                         "multiple of the number of processes)")
    part = n // size
    return slice(rank * part, (rank + 1) * part)


def gathered(local: torch.Tensor) -> torch.Tensor:
    """Every rank's ``local`` ``(r, ...)`` concatenated in rank order ``(N·r, ...)``, differentiable: the
    gradient of a rank's rows is summed over the ranks that used them."""
    # torch's differentiable all-gather (torch.distributed.nn.functional.all_gather's successor): its backward
    # is a reduce-scatter that sums
    return collectives.wait_tensor(collectives.all_gather_single_autograd(local.contiguous(), 0, dist.group.WORLD))


@dataclass
class ShardedTokens:
    """A `TokenEncoder` that runs ``local`` (one pass, or `CachedTokens`' micro-batches) on this rank's share
    of the rows asked for and returns every rank's states, gathered in order: ``(R, L, H)``."""

    local: TokenEncoder
    rank: int
    size: int

    def __call__(self, ids: torch.Tensor, mask: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        mine = share(ids.shape[0], self.rank, self.size)
        return gathered(self.local(ids[mine], mask[mine], rows[mine]))  # (R, L, H)


def average_gradients(parameters: Iterable[torch.nn.Parameter], size: int) -> None:
    """Each gradient replaced by its mean over the ``size`` ranks (one all-reduce of one flat buffer), as
    DDP averages: after `ShardedTokens`, the one-process gradient on every rank."""
    grads = [p.grad for p in parameters if p.grad is not None]
    if size == 1 or not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat /= size
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()
