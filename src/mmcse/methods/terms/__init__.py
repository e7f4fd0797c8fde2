"""The loss terms of the sentence encoders, one `LossTerm` object each (:mod:`.base`), each module holding its
terms, their functions and draws, and the ``loss.<section>`` it adds (`loss_section`).

Importing this package imports every module in it, and each module registers its terms: a new term
is a new module here, nothing else in the library names it (`mmcse generate` copies its section into the
configuration).
"""

from __future__ import annotations

import importlib
import pkgutil

from mmcse.methods.terms.base import REGISTRY, STAT, LossTerm, Objective, StepEmbeddings, loss_section, register

for _module in sorted(m.name for m in pkgutil.iter_modules(__path__)):
    if _module != "base":
        importlib.import_module(f"{__name__}.{_module}")

TERMS: tuple[LossTerm, ...] = tuple(sorted(REGISTRY.values(), key=lambda t: t.order))

__all__ = ["REGISTRY", "STAT", "TERMS", "LossTerm", "Objective", "StepEmbeddings", "loss_section", "register"]
