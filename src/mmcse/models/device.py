"""The torch device named by ``base.device`` and the CPU threads ``base.threads`` fixes."""

from __future__ import annotations

import contextlib
import functools
import os
import socket
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch
from threadpoolctl import threadpool_limits

F = TypeVar("F", bound=Callable[..., Any])


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


def blas_threads(threads: int) -> threadpool_limits:
    """numpy's BLAS and LAPACK (OpenBLAS here) at ``threads`` inside a ``with`` block, back after it; torch's own
    threads are not touched."""
    return threadpool_limits(limits=threads, user_api="blas")


@contextlib.contextmanager
def fixed_threads(threads: int) -> Iterator[None]:
    """torch's intra-op threads and numpy's BLAS threads at ``threads`` while the block runs (0: as they are), then
    back. A CPU kernel splits its sums by its thread count, so a checkpoint trained with 1 and with 2 threads
    differs in its last bits (measured): fixed by ``base.threads``, the machine's core count, ``OMP_NUM_THREADS``
    and its load no longer change a stage's bytes."""
    if threads == 0:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with blas_threads(threads):
            yield
    finally:
        torch.set_num_threads(before)


def with_base_threads(stage: F) -> F:
    """``stage(cfg, ...)`` run under `fixed_threads` ``(cfg.base.threads)``: a stage's library function."""

    @functools.wraps(stage)
    def run(cfg: Any, *args: Any, **kwargs: Any) -> Any:
        with fixed_threads(cfg.base.threads):
            return stage(cfg, *args, **kwargs)

    return run  # type: ignore[return-value]
