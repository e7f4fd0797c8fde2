"""The CPU kernels' instruction set, pinned: the same bytes on every x86-64 CPU with AVX2, AVX-512 or not.

torch's own kernels (ATen's vectorised paths), MKL (torch's BLAS on x86-64), oneDNN and OpenBLAS (numpy's BLAS) each
pick their kernels by the CPU's vector units, and each kernel rounds in its own order: a checkpoint or a feature cache
made on an AVX-512 machine differs in its last bits from one made on an AVX2-only machine (issue 75: `dvc.lock` was
never the same on both). `pin_cpu_isa` sets each library's own switch to AVX2 before the library loads, so every
x86-64 CPU with AVX2 takes the same kernels:

- ``ATEN_CPU_CAPABILITY=avx2`` (torch's vectorised kernels; read at their first dispatch),
- ``MKL_CBWR=AVX2`` and ``MKL_ENABLE_INSTRUCTIONS=AVX2`` (MKL's conditional numerical reproducibility: its AVX2 code
  path on any newer CPU; read when MKL starts),
- ``ONEDNN_MAX_CPU_ISA=AVX2`` (oneDNN's kernels; read at its first primitive),
- ``OPENBLAS_CORETYPE=Haswell`` (OpenBLAS's AVX2 kernels; read when numpy loads it) — unless the environment already
  sets a core type, which some machines need (an older OpenBLAS miscomputes on their processor).

mmcse's package import calls it (`mmcse/__init__.py`), so every process that imports mmcse before torch and numpy —
each DVC stage, ablation job, Prefect worker and sweep trial — runs pinned, and the processes it starts inherit the
pins. ``MMCSE_CPU_ISA=native`` leaves every library to its own choice (faster on AVX-512, other bytes). Nothing is
pinned on a CPU without AVX2 or off x86-64 (aarch64 has its own kernels: its bytes are its own). The cost is measured
by benchmarks/cpu_isa.py; docs/environment.md says what stays equal.
"""

from __future__ import annotations

import os
import platform
from collections.abc import MutableMapping
from pathlib import Path

OPT_OUT = "MMCSE_CPU_ISA"  # "native": no pin
PINNED = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2",
          "ONEDNN_MAX_CPU_ISA": "AVX2"}
KEEP_IF_SET = {"OPENBLAS_CORETYPE": "Haswell"}  # a machine's own setting wins (see the module docstring)


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> list[str]:
    """The CPU's feature flags from ``/proc/cpuinfo`` (Linux); empty where it cannot be read."""
    try:
        return next((line.split(":", 1)[1].split() for line in cpuinfo.read_text().splitlines()
                     if line.startswith("flags")), [])
    except OSError:
        return []


def has_avx2(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """Whether this x86-64 CPU has AVX2 (and FMA, which AVX2 kernels use); False off x86-64 or where the flags cannot
    be read."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    flags = cpu_flags(cpuinfo)
    return "avx2" in flags and "fma" in flags


def pin_cpu_isa(environ: MutableMapping[str, str] = os.environ, avx2: bool | None = None) -> dict[str, str]:
    """Pin the kernels' instruction set in ``environ`` (see the module docstring); returns what it set. Nothing with
    ``MMCSE_CPU_ISA=native``, or without AVX2 (``avx2``: known, else read from the CPU)."""
    if environ.get(OPT_OUT, "").lower() == "native":
        return {}
    if not (has_avx2() if avx2 is None else avx2):
        return {}
    chosen = dict(PINNED) | {k: v for k, v in KEEP_IF_SET.items() if not environ.get(k)}
    environ.update(chosen)
    return chosen


def kernels_in_force(environ: MutableMapping[str, str] = os.environ) -> str:
    """What decides a computed feature's last bits here: ``avx2`` where this process runs pinned, else ``native`` (the
    machine's own kernels). Part of a feature cache's key (`mmcse.teachers.cache.cache_key`,
    `mmcse.detection.regions.region_cache_key`): a set computed under other kernels is computed again, not reused."""
    pinned = all(environ.get(k) == v for k, v in PINNED.items())
    return "avx2" if pinned and environ.get(OPT_OUT, "").lower() != "native" else "native"
