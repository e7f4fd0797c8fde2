"""The torch device named by ``base.device``."""

from __future__ import annotations

import torch


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("params.yaml: base.device=cuda but no CUDA device is available (use cpu or auto)")
    return torch.device(name)
