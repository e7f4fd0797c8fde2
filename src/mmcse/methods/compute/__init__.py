"""The functions of the loss terms (:mod:`mmcse.methods.terms` declares them), one module per paper, each
function registered under its term's name (:mod:`.base`), with what a term draws at random. Importing this package
imports every module in it; a declared term without a function, a function without a declared term, or a draw of
a term without a random ``stream`` is refused here."""

from __future__ import annotations

import importlib
import pkgutil

from mmcse.methods.compute.base import COMPUTE, DRAWS, Compute, Draw, computes, draws
from mmcse.methods.terms import REGISTRY

for _module in sorted(m.name for m in pkgutil.iter_modules(__path__)):
    if _module != "base":
        importlib.import_module(f"{__name__}.{_module}")

if COMPUTE.keys() != REGISTRY.keys():
    raise ImportError(f"loss terms without a function: {sorted(REGISTRY.keys() - COMPUTE.keys())}; functions "
                      f"without a declared term: {sorted(COMPUTE.keys() - REGISTRY.keys())}")

if unstreamed := sorted(name for name in DRAWS if REGISTRY.get(name) is None or REGISTRY[name].stream is None):
    raise ImportError(f"loss terms that draw without a random stream (LossTerm.stream): {unstreamed}")

__all__ = ["COMPUTE", "DRAWS", "Compute", "Draw", "computes", "draws"]
