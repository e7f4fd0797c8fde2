"""The optimizers a student trains with (``train.optimizer``): PyTorch's AdamW (``adamw``, mmcse's default), or
`ReleasedAdamW` (``transformers_adamw``), the AdamW of transformers 4.x that the MCSE, KDMCSE and DALR training loops
import (uds-lsv/MCSE @ 3031426 src/train_mix.py l.25 and l.328, ``AdamW(optimizer_grouped_parameters,
lr=args.learning_rate)``: eps, betas and bias correction at that class's defaults).

The two differ in three places: transformers' eps is 1e-6 (PyTorch's 1e-8); it is added to √v before the second
moment's bias correction, which then scales the step (``lr·√(1−β₂ᵗ)/(1−β₁ᵗ) · m / (√v + ε)``, where PyTorch
divides by ``√v/√(1−β₂ᵗ) + ε``); and the decoupled weight decay is applied after the update, to the updated
weights (PyTorch: before). With the scripts' weight decay of 0 the last one changes nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

TORCH_ADAMW, TRANSFORMERS_ADAMW = "adamw", "transformers_adamw"
OPTIMIZERS = (TORCH_ADAMW, TRANSFORMERS_ADAMW)


class ReleasedAdamW(torch.optim.Optimizer):
    """transformers 4.x's ``AdamW`` (``correct_bias=True``), its update step by step; ``lr`` may be a 0-d tensor
    (a compiled step's schedule updates it in place, `mmcse.training.compiled.tensor_lr`). The step count is a 0-d
    tensor in double precision, so a compiled update reads it as data rather than compiling once per step."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-6, weight_decay: float = 0.0) -> None:
        if not eps >= 0.0:
            raise ValueError(f"invalid epsilon {eps}")
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, eps, decay = group["lr"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    # the bias corrections in double, as theirs; on the parameter's device (no copy per step on a GPU)
                    state["step"] = torch.tensor(0.0, dtype=torch.float64, device=p.device)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                exp_avg, exp_avg_sq, step = state["exp_avg"], state["exp_avg_sq"], state["step"]
                step += 1
                grad = p.grad
                exp_avg.mul_(beta1).add_(grad, alpha=1.0 - beta1)  # m_t
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)  # v_t
                denom = exp_avg_sq.sqrt().add_(eps)  # √v_t + ε: ε before the bias correction
                # lr · √(1 − β₂ᵗ) / (1 − β₁ᵗ), as a tensor: the step count and a compiled step's rate are tensors
                step_size = lr * torch.sqrt(1.0 - beta2 ** step) / (1.0 - beta1 ** step)
                p.add_((exp_avg / denom) * -step_size.to(p.device, p.dtype))  # their addcdiv_(m, denom, -step_size)
                if decay > 0.0:  # after the update, on the updated weights
                    p.sub_(p * (lr * decay))
        return loss


def make_optimizer(name: str, groups: list[dict[str, Any]], lr: float, fused: bool) -> torch.optim.Optimizer:
    """``train.optimizer`` ``name`` over the parameter ``groups`` (each with its weight decay); ``fused``: PyTorch's
    AdamW as one kernel (CUDA)."""
    if name == TORCH_ADAMW:
        return torch.optim.AdamW(groups, lr=lr, fused=fused or None)
    if name == TRANSFORMERS_ADAMW:
        return ReleasedAdamW(groups, lr=lr)
    raise ValueError(f"unknown train.optimizer {name!r}; optimizers: {', '.join(OPTIMIZERS)}")
