"""The torch device named by ``base.device``."""

from __future__ import annotations

import os
import socket

import torch


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("params.yaml: base.device=cuda but no CUDA device is available (use cpu or auto)")
    return torch.device(name)


def describe_device(device: torch.device) -> str:
    """Where work runs, for the record: ``cpu`` or ``cuda:<index> <GPU name>`` (the index is
    within this process's ``CUDA_VISIBLE_DEVICES``)."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return f"cuda:{index} {torch.cuda.get_device_name(index)}"
    return str(device)


def device_tags(name: str) -> dict[str, str]:
    """MLflow tags naming the device ``base.device`` resolves to in this process, the
    ``CUDA_VISIBLE_DEVICES`` it was started with (one GPU per worker) and the host."""

    return {
        "device": describe_device(resolve_device(name)),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES", "unset"),
        "host": socket.gethostname(),
    }
