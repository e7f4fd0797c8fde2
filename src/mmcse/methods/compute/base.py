"""Where a loss term's function is registered: ``@computes("<name>")`` on ``compute(o, e, draw)``, the term
declared under that name in :mod:`mmcse.methods.terms` (the declaration is torch-free; this side runs on
tensors); and a term with a random ``stream`` registers what it draws with ``@draws("<name>")`` on
``draw(o, n, generator)``.

The draws are made on the host from the term's own CPU generator, ahead of the step's tensor code, and handed to
``compute`` as ``draw`` (a tensor, or None for a term that draws nothing): the same numbers on every device, and a
step whose tensor code reads no random state and no Python value of a tensor, so it compiles to one graph
(``train.compile: step``)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from mmcse.methods.terms import Objective, StepEmbeddings

Compute = Callable[[Objective, StepEmbeddings, "torch.Tensor | None"], "torch.Tensor | dict[str, torch.Tensor]"]
# (objective, pairs in the batch, the term's CPU generator) -> its draw for the step, on the CPU
Draw = Callable[[Objective, int, torch.Generator], torch.Tensor]

COMPUTE: dict[str, Compute] = {}
DRAWS: dict[str, Draw] = {}


def computes(name: str) -> Callable[[Compute], Compute]:
    """Register ``compute`` as the function of the loss term ``name``; a second one is refused."""

    def add(compute: Compute) -> Compute:
        if name in COMPUTE:
            raise ValueError(f"loss term {name!r} has two functions: {COMPUTE[name].__qualname__} and "
                             f"{compute.__qualname__}")
        COMPUTE[name] = compute
        return compute

    return add


def draws(name: str) -> Callable[[Draw], Draw]:
    """Register ``draw`` as what the loss term ``name`` draws per step (its ``stream``'s numbers); a second one is
    refused."""

    def add(draw: Draw) -> Draw:
        if name in DRAWS:
            raise ValueError(f"loss term {name!r} has two draws: {DRAWS[name].__qualname__} and {draw.__qualname__}")
        DRAWS[name] = draw
        return draw

    return add
