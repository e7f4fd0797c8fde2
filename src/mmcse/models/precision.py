"""Numeric precision of training and evaluation: autocast, gradient scaling, matmul kernels.

``train.precision`` names the dtype the student's forward pass runs in under autocast
(``fp32`` runs without autocast). The loss terms' similarity matrices are always computed
in fp32 (:func:`mmcse.methods.losses.cosine_matrix` leaves autocast): with τ = 0.05 a cosine's
bf16 rounding error (~4e-3) becomes ~0.08 in a logit. fp16 needs a gradient scaler, bf16
does not (it has fp32's exponent range).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from mmcse.errors import PrecisionError

PRECISIONS = ("fp32", "bf16", "fp16")
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def check_precision(precision: str, device: torch.device) -> None:
    """Fail before compute when ``device`` cannot run ``precision``."""
    if precision not in PRECISIONS:
        raise PrecisionError(f"train.precision={precision!r} is not one of {', '.join(PRECISIONS)}")
    if device.type == "cuda" and precision == "bf16" and torch.cuda.get_device_capability(device)[0] < 8:
        name = torch.cuda.get_device_name(device)
        raise PrecisionError(
            f"train.precision=bf16 but {name} has no bfloat16 support (compute capability < 8.0): "
            "use fp16 (with loss scaling) or fp32"
        )


@contextlib.contextmanager
def autocast(precision: str, device: torch.device) -> Iterator[None]:
    """Autocast to ``precision`` on ``device``'s type; ``fp32`` changes nothing."""
    if precision == "fp32":
        yield
        return
    with torch.autocast(device_type=device.type, dtype=_DTYPES[precision]):
        yield


@contextlib.contextmanager
def full_precision(device: torch.device) -> Iterator[None]:
    """Leave autocast and TF32 for the ops inside: they run in their inputs' dtype at full
    precision (the loss terms' similarity matrices)."""
    if device.type != "cuda":
        with torch.autocast(device_type=device.type, enabled=False):
            yield
        return
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        with torch.autocast(device_type="cuda", enabled=False):
            yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32


def grad_scaler(precision: str, device: torch.device) -> torch.amp.GradScaler:
    """A loss scaler, enabled for fp16 only (a disabled one passes ``step``/``backward`` through)."""
    return torch.amp.GradScaler(device.type, enabled=precision == "fp16")


def configure_kernels(device: torch.device) -> None:
    """TF32 tensor cores for fp32 matmuls and convolutions on CUDA (Ampere and newer).

    TF32 keeps fp32's range with a 10-bit mantissa; the similarity matrices of the losses
    opt out (:func:`mmcse.methods.losses.cosine_matrix` runs them at full fp32 precision)."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True


def deterministic_kernels() -> None:
    """Deterministic algorithms for training (a resumed run is bit-identical to an uninterrupted one),
    without torch's fill of every newly allocated tensor: ``use_deterministic_algorithms(True)`` also
    sets ``torch.utils.deterministic.fill_uninitialized_memory``, which writes NaN into each
    ``torch.empty`` (about 1,100 extra fill kernels per BERT-base step, measured on an H100:
    docs/benchmarks.md). The fill only matters to a kernel that reads memory it never wrote, which
    no training step does; the CUDA resume test compares weights bit for bit with it off."""
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = False


def fused_adamw_supported(device: torch.device) -> bool:
    """Fused AdamW (one kernel per parameter group instead of several per tensor) runs on CUDA."""
    return device.type == "cuda"
