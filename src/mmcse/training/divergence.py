"""A diverged training stops at once: the first step whose loss or gradient norm is not finite.

Reading the loss back every step would wait for the GPU each time (the loops read logged values in
batches, `mmcse.training.engine.FLUSH_EVERY`), so the watch keeps the first bad step on the device and is
read at every flush, dev evaluation and checkpoint: training stops there, before a weight is saved, with
one line naming the step, the value and the likely cause (`TrainingDiverged`).
"""

from __future__ import annotations

import math

import torch

from mmcse.config import Config
from mmcse.errors import TrainingDiverged


def likely_cause(cfg: Config) -> str:
    """The usual reasons a run of ``cfg`` diverges, the most likely first."""
    causes = []
    if cfg.train.learning_rate > 1e-3:
        causes.append(f"train.learning_rate {cfg.train.learning_rate:g} is far above the recipes' 1e-5 to 2e-4")
    if cfg.train.precision == "fp16":
        causes.append("fp16 overflow (train.precision: bf16 where the device has it)")
    if cfg.train.max_grad_norm <= 0:
        causes.append("no gradient clipping (train.max_grad_norm: 1.0 bounds each update)")
    causes.append("a too-high learning rate or non-finite input features")
    return "; ".join(causes[:2])


class DivergenceWatch:
    """The first training step whose loss or gradient norm was not finite, kept on ``device``."""

    def __init__(self, device: torch.device) -> None:
        self.first_step = torch.full((), -1, dtype=torch.long, device=device)
        self.loss = torch.zeros((), device=device)
        self.grad_norm = torch.zeros((), device=device)

    def observe(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor | None) -> None:
        """Note step ``step``'s loss and gradient norm (None: not checked, e.g. under fp16's loss scaler,
        whose overflowing steps are skipped by design). No host sync."""
        loss = loss.detach().float()
        bad = ~torch.isfinite(loss)
        norm = grad_norm.detach().float() if grad_norm is not None else torch.zeros_like(loss)
        bad = bad | ~torch.isfinite(norm)
        first = bad & (self.first_step < 0)
        self.first_step = torch.where(first, torch.full_like(self.first_step, step), self.first_step)
        self.loss = torch.where(first, loss, self.loss)
        self.grad_norm = torch.where(first, norm, self.grad_norm)

    def check(self, cfg: Config) -> None:
        """Raise `TrainingDiverged` if a step was not finite (one host sync)."""
        step = int(self.first_step.item())
        if step < 0:
            return
        loss, norm = float(self.loss.item()), float(self.grad_norm.item())
        what = f"loss = {loss}" if not math.isfinite(loss) else f"gradient norm = {norm} (loss {loss:.4g})"
        raise TrainingDiverged(f"training diverged at step {step}: {what}; likely cause: {likely_cause(cfg)}; "
                               "no weights of the diverged run were saved")
