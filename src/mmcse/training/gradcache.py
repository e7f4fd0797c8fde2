"""Gradient-cached batches (``train.micro_batch``): a batch of B sentences through the encoder in
micro-batches, its loss over all B at once.

Gao et al. 2021, "Scaling Deep Contrastive Learning Batch Size under Memory Limited Setup" (GradCache):
the loss of a contrastive batch is a function of its embeddings, so

1. each micro-batch's token states are computed without a graph and concatenated into one leaf
   tensor ``(R, L, H)`` (the only activations kept for the whole batch);
2. the step's loss (every term, in-batch negatives over all B, the heads) runs on that leaf and is
   back-propagated: the heads get their gradients and the leaf its ``∂loss/∂states``;
3. each micro-batch runs through the encoder again, now with its graph, and back-propagates the
   leaf's gradient rows of its own rows; the encoder's gradients add up to the full batch's.

Step 3 equals step 1 only if the second pass draws the same dropout masks: the encoder's dropout is
keyed by row (``train.dropout_rng: per_row``, `mmcse.models.dropout`), so a row's masks are the same
in its micro-batch, in its replay and in the full batch. Peak activation memory is then that of one
micro-batch plus the ``(R, L, H)`` leaf, whatever B is.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from mmcse.models.dropout import row_keys
from mmcse.models.student import Student

# (input_ids (R, L), attention_mask (R, L), row keys (R,)) -> last-layer token states (R, L, H)
TokenEncoder = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def keyed_states(student: Student, ids: torch.Tensor, mask: torch.Tensor, rows: torch.Tensor,
                 seed: int | torch.Tensor) -> torch.Tensor:
    """The encoder's token states ``(R, L, H)`` of ``ids``, each row's dropout keyed by (``seed``, its row key)
    where the backbone has keyed dropout; ``seed`` an int, or a 0-d tensor in a compiled pass."""
    with row_keys(student.backbone, seed, rows):
        return student.token_states(ids, mask)


def direct_tokens(student: Student, seed: int) -> TokenEncoder:
    """One pass with its graph (no caching): the rows' keyed dropout, where the backbone has it."""

    def encode(ids: torch.Tensor, mask: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        return keyed_states(student, ids, mask, rows, seed)

    return encode


def passes_note(batch_size: int, micro_batch: int, processes: int = 1) -> str | None:
    """How a batch is cut when ``micro_batch`` does not divide the sentences a process encodes per batch
    (``batch_size`` over ``processes``): full passes and a smaller last one (`CachedTokens` cuts in
    order), so a reader of the log knows the last pass is not the size asked for; None when it divides."""
    share = batch_size // processes
    if not micro_batch or share % micro_batch == 0:
        return None
    full, last = divmod(share, micro_batch)
    over = f" over {processes} processes" if processes > 1 else ""
    return (f"train.micro_batch {micro_batch} does not divide the {share} sentences each process encodes per batch "
            f"(train.batch_size {batch_size}{over}): each batch in {full} pass{'es' if full > 1 else ''} of "
            f"{micro_batch} and a last one of {last}")


@dataclass
class CachedTokens:
    """A `TokenEncoder` that runs the rows ``rows_per_pass`` at a time without a graph (step 1) and
    returns a leaf; after the loss's backward, `backward` replays each pass with its graph (step 3).
    ``forward_context`` is the step's autocast, entered again for the replays."""

    student: Student
    seed: int
    rows_per_pass: int
    forward_context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    passes: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=list)
    # the encoder pass (default `direct_tokens`); ``train.compile: step`` gives a compiled one
    # (`mmcse.training.loop.StudentStep`'s passes), run for the cached forward and for the replay alike
    encoder: TokenEncoder | None = None

    def _chunks(self, n: int) -> list[slice]:
        return [slice(i, min(i + self.rows_per_pass, n)) for i in range(0, n, self.rows_per_pass)]

    def _encode(self) -> TokenEncoder:
        return self.encoder or direct_tokens(self.student, self.seed)

    def __call__(self, ids: torch.Tensor, mask: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        encode = self._encode()
        states: torch.Tensor | None = None
        with torch.no_grad():
            for c in self._chunks(ids.shape[0]):
                part = encode(ids[c], mask[c], rows[c])  # (r, L, H)
                if states is None:
                    states = part.new_empty((ids.shape[0], *part.shape[1:]))  # (R, L, H)
                states[c] = part  # copied now: a CUDA graph's next replay reuses its output's memory
        leaf = states.detach().requires_grad_(True)
        self.passes.append((ids, mask, rows, leaf))
        return leaf

    def backward(self) -> None:
        """Back-propagate each cached pass's leaf gradient through the encoder, one micro-batch at a time
        (call after the loss's backward; a pass whose states no term used has no gradient to carry)."""
        encode = self._encode()
        for ids, mask, rows, leaf in self.passes:
            if leaf.grad is None:
                continue
            for c in self._chunks(ids.shape[0]):
                with self.forward_context():
                    states = encode(ids[c], mask[c], rows[c])  # (r, L, H), the same masks as step 1
                states.backward(leaf.grad[c].to(states.dtype))
        self.passes.clear()
