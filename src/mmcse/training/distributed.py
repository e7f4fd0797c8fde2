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

import contextlib
import functools
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as collectives

from mmcse.processes import launched
from mmcse.training.gradcache import TokenEncoder

# A collective that waits longer than this fails the job with an error instead of hanging it (torchrun also
# stops every process once one fails): longer than rank 0's longest lone work, a dev evaluation or a save
COLLECTIVE_TIMEOUT = timedelta(minutes=30)


@contextlib.contextmanager
def joined(device_name: str) -> Iterator[None]:
    """Inside, a process torchrun started is in the job's process group: NCCL between GPUs (this process on
    ``cuda:LOCAL_RANK``), gloo between CPU processes, collectives timing out after `COLLECTIVE_TIMEOUT`. A
    process torchrun did not start, or already in a group, is left as it is."""
    if not launched() or dist.is_initialized():
        yield
        return
    gpu = device_name != "cpu" and torch.cuda.is_available()
    if gpu:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))  # "cuda" is this process's GPU from here on
    # torchrun's environment (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE) is the rendezvous
    dist.init_process_group("nccl" if gpu else "gloo", timeout=COLLECTIVE_TIMEOUT)
    try:
        yield
    finally:
        control_group.cache_clear()
        dist.destroy_process_group()


@functools.cache
def control_group() -> dist.ProcessGroup:
    """The group the ranks agree in (stop flags, rank 0's dev score): gloo on CPU tensors, so agreeing on a
    flag each step never waits for the GPU's queue."""
    return dist.group.WORLD if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")


def any_rank(flag: bool) -> bool:
    """Whether ``flag`` is true on any rank (every rank must ask): a stop one rank was asked for is every
    rank's, at the same step."""
    if world()[1] == 1:
        return flag
    value = torch.tensor([int(flag)])
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=control_group())
    return bool(value.item())


def from_lead(values: Sequence[float]) -> list[float]:
    """Rank 0's ``values`` on every rank (the others' are ignored; every rank must ask, with as many)."""
    if world()[1] == 1:
        return list(values)
    tensor = torch.tensor(list(values), dtype=torch.float64)
    dist.broadcast(tensor, src=0, group=control_group())
    return tensor.tolist()


def from_lead_object(obj: Any) -> Any:
    """Rank 0's ``obj`` (any picklable value, tensors on the CPU) on every rank; every rank must ask."""
    if world()[1] == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=control_group())
    return box[0]


def wait_for_lead() -> None:
    """Every rank waits here until rank 0 arrives (after it has written what the others read next)."""
    if world()[1] > 1:
        dist.barrier(group=control_group())


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
