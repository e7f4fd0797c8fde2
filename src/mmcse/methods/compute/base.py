"""Where a loss term's function is registered: ``@computes("<name>")`` on ``compute(o, e, generator)``, the term
declared under that name in :mod:`mmcse.methods.terms` (the declaration is torch-free; this side runs on
tensors)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from mmcse.methods.terms import Objective, StepEmbeddings

Compute = Callable[[Objective, StepEmbeddings, "torch.Generator | None"], "torch.Tensor | dict[str, torch.Tensor]"]

COMPUTE: dict[str, Compute] = {}


def computes(name: str) -> Callable[[Compute], Compute]:
    """Register ``compute`` as the function of the loss term ``name``; a second one is refused."""

    def add(compute: Compute) -> Compute:
        if name in COMPUTE:
            raise ValueError(f"loss term {name!r} has two functions: {COMPUTE[name].__qualname__} and "
                             f"{compute.__qualname__}")
        COMPUTE[name] = compute
        return compute

    return add
