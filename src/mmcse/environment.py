"""The software environment a run computed in, for the record: versions, device, the lock.

`requirements.lock` (made by ``uv pip compile``, installed as pip's constraints) pins every package
of the base install and its extras. A number is reproducible only under the environment it was made
in, so every MLflow run carries `environment_tags` (``env.*``): the versions that move numerics
(Python, torch, CUDA/cuDNN, transformers, numpy), the device, the lock file's SHA-256, whether the
installed packages are the lock's (``env.locked``), and ``env.hash``, one hash of all of it and of
every installed distribution's version: two runs with the same ``env.hash`` ran on the same software.
"""

from __future__ import annotations

import functools
import platform
import re
from importlib import metadata
from pathlib import Path

import numpy
from packaging.requirements import InvalidRequirement, Requirement

from mmcse.errors import InputError
from mmcse.io import sha256_file, sha256_json

LOCK_NAME = "requirements.lock"
# The versions that name an environment in a table note (the rest count in env.hash).
HEADLINE_PACKAGES = ("torch", "transformers", "numpy")
TAG_PREFIX = "env."


def normalize(name: str) -> str:
    """A distribution name as PEP 503 compares them (``Open_CLIP.torch`` → ``open-clip-torch``)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def lock_path() -> Path | None:
    """The lock of the checkout mmcse runs from: beside the source tree of an editable install,
    else in the working directory; None when neither has one (a wheel install outside a checkout)."""
    for root in (Path(__file__).resolve().parents[2], Path.cwd()):
        if (root / LOCK_NAME).is_file():
            return root / LOCK_NAME
    return None


def locked_versions(path: Path) -> dict[str, str]:
    """``{normalized name: version}`` that ``path`` (pip requirements, each ``name==version``,
    optionally ``; marker``) pins for this interpreter and platform: lines whose marker does not
    hold here (another Python's fork of a universal lock) are left out. Raises naming the file and
    line on anything but an exact pin."""

    pins: dict[str, str] = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        text = line.split(" #", 1)[0].strip().rstrip("\\").strip()
        if not text or text.startswith(("#", "--")):
            continue
        try:
            req = Requirement(text)
        except InvalidRequirement as err:
            raise InputError(f"{path}:{number}: not a requirement: {text!r} ({err})") from None
        specs = list(req.specifier)
        if len(specs) != 1 or specs[0].operator != "==":
            raise InputError(f"{path}:{number}: {text!r} is not an exact pin (name==version): re-make the lock")
        if req.marker is None or req.marker.evaluate():
            pins[normalize(req.name)] = specs[0].version
    return pins


def installed_versions() -> dict[str, str]:
    """``{normalized name: version}`` of every distribution this interpreter imports from, mmcse
    itself left out (its own code is not part of the environment)."""
    found: dict[str, str] = {}
    for dist in metadata.distributions():
        name = dist.metadata["Name"]
        if name and normalize(name) != "mmcse":
            found.setdefault(normalize(name), dist.version)
    return found


def lock_differences(pins: dict[str, str], installed: dict[str, str]) -> list[str]:
    """``name installed≠locked`` for every locked package installed at another version (packages of
    extras that are not installed are no difference; a local build tag such as ``+cu130`` is)."""
    return [f"{name} {installed[name]}≠{version}" for name, version in sorted(pins.items())
            if name in installed and installed[name] != version]


def _on_cuda(device: str) -> bool:
    """Whether ``device`` (``base.device``: auto, cpu, cuda, cuda:N) computes on a GPU here. A
    process that names cuda where none is (an orchestrator's parent run) computes nothing: cpu."""
    import torch

    return device.startswith(("cuda", "auto")) and torch.cuda.is_available()


def cpu_name() -> str:
    """The processor's model name (``/proc/cpuinfo``; elsewhere the platform's word for it): CPU
    kernels, and so the last digits of a number, depend on its instruction set."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_name(device: str = "cpu") -> str:
    """The hardware ``device`` names, without its index (``NVIDIA H100 80GB HBM3``, ``cpu AMD EPYC
    7B13``): workers with one GPU each of the same model share it."""
    import torch

    if _on_cuda(device):
        index = int(device.split(":", 1)[1]) if ":" in device else torch.cuda.current_device()
        return torch.cuda.get_device_name(index)
    return f"cpu {cpu_name()}"


@functools.lru_cache(maxsize=8)
def environment(device: str = "cpu") -> dict[str, str]:
    """This process's environment for a run on ``device`` (``base.device``):
    ``python torch cuda cudnn transformers numpy device platform lock_sha256 locked hash``.
    ``cuda``/``cudnn`` are the versions torch runs with on a CUDA device, else ``cpu``;
    ``locked`` is ``yes``, ``no lock file``, or ``no: <package installed≠locked, …>``."""
    import torch
    import transformers

    on_cuda = _on_cuda(device)
    lock = lock_path()
    installed = installed_versions()
    if lock is None:
        locked = "no lock file"
    else:
        differences = lock_differences(locked_versions(lock), installed)
        locked = "yes" if not differences else "no: " + ", ".join(differences)
    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": (torch.version.cuda or "cpu") if on_cuda else "cpu",
        "cudnn": str(torch.backends.cudnn.version()) if on_cuda else "cpu",
        "transformers": transformers.__version__,
        "numpy": numpy.__version__,
        "device": device_name(device),
        "platform": f"{platform.system()}-{platform.machine()}",
        "lock_sha256": sha256_file(lock) if lock is not None else "none",
        "locked": locked[:480],
    }
    # the software and hardware a number came from: the lock file itself is not (relocking an extra
    # that is not installed changes no number), what is installed from it is
    identity = {k: v for k, v in env.items() if k not in ("locked", "lock_sha256")}
    env["hash"] = sha256_json({**identity, "installed": installed})[:16]
    return env


def environment_tags(device: str = "cpu") -> dict[str, str]:
    """`environment` as MLflow run tags ``env.<key>``."""
    return {f"{TAG_PREFIX}{key}": value for key, value in environment(device).items()}


def describe(env: dict[str, str]) -> str:
    """One line naming an environment: ``Python 3.11.7, torch 2.15.0 (CUDA 13.0, cuDNN 91002 | cpu),
    transformers 5.24.0, numpy 2.4.6 on <device>; lock <sha256[:12]> (installed as locked | …)``."""
    compute = "cpu" if env.get("cuda", "cpu") == "cpu" else f"CUDA {env['cuda']}, cuDNN {env.get('cudnn', '?')}"
    lock = env.get("lock_sha256", "none")
    lock_text = "no lock file" if lock == "none" else f"lock {lock[:12]}"
    locked = env.get("locked", "")
    state = "installed as locked" if locked == "yes" else locked or "lock state unknown"
    return (f"Python {env.get('python', '?')}, torch {env.get('torch', '?')} ({compute}), "
            f"transformers {env.get('transformers', '?')}, numpy {env.get('numpy', '?')} on "
            f"{env.get('device', '?')}; {lock_text} ({state}); env {env.get('hash', '?')}")
