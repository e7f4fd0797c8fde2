"""Issue 75.1: the kernels' instruction set is pinned, so a stage writes the same bytes whatever vector units the CPU
offers: a training run started with torch's kernels forced to another instruction set than the machine's best writes
the same checkpoint bytes as one left alone, and (the control) does not once the pin is turned off."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from mmcse.cpu_isa import KEEP_IF_SET, OPT_OUT, PINNED, has_avx2, pin_cpu_isa


def test_the_pin_sets_each_librarys_switch_and_keeps_a_machines_own_openblas_core_type():
    env: dict[str, str] = {"ATEN_CPU_CAPABILITY": "default"}
    assert pin_cpu_isa(env, avx2=True) == PINNED | KEEP_IF_SET
    assert env["ATEN_CPU_CAPABILITY"] == "avx2" and env["MKL_CBWR"] == "AVX2" and env["OPENBLAS_CORETYPE"] == "Haswell"
    machine = {"OPENBLAS_CORETYPE": "Zen"}  # set by the workplace for its processor: kept
    assert "OPENBLAS_CORETYPE" not in pin_cpu_isa(machine, avx2=True) and machine["OPENBLAS_CORETYPE"] == "Zen"
    assert pin_cpu_isa(off := {OPT_OUT: "native"}, avx2=True) == {} and off == {OPT_OUT: "native"}
    assert pin_cpu_isa(old := {}, avx2=False) == {} and old == {}  # no AVX2: the machine's own kernels


def test_this_process_runs_pinned():
    if not has_avx2() or os.environ.get(OPT_OUT) == "native":
        pytest.skip("no AVX2 here, or the pin is turned off")
    import torch

    assert torch.backends.cpu.get_cpu_capability() == "AVX2"
    assert all(os.environ[k] == v for k, v in PINNED.items())


TRAIN = """
import hashlib, sys
from mmcse.config import with_overrides
from mmcse.experiments.params import load_config
from mmcse.training.engine import Hooks
from mmcse.training.loop import train
import torch
cfg = with_overrides(load_config("params.yaml"), {"train.max_steps": 4, "train.eval_steps": 4,
                                                    "train.checkpoint_steps": 4})
result = train(cfg, "data/raw", "data/teachers", sys.argv[1], hooks=Hooks(progress=False))
print(torch.backends.cpu.get_cpu_capability())
print(hashlib.sha256((result.best_dir / "model.safetensors").read_bytes()).hexdigest())
"""


def _trained(project, out: str, **env: str) -> tuple[str, str]:
    done = subprocess.run([sys.executable, "-c", TRAIN, str(project / out)], cwd=project, capture_output=True,
                          text=True, env={**os.environ, **env}, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    capability, digest = done.stdout.split()[-2:]
    return capability, digest


@pytest.mark.slow
def test_a_run_forced_to_another_instruction_set_writes_the_same_bytes(project):
    if not has_avx2():
        pytest.skip("no AVX2: nothing is pinned on this CPU")
    base = {OPT_OUT: "avx2"}
    capability, left_alone = _trained(project, "a", **base)
    assert capability == "AVX2"
    capability, forced = _trained(project, "b", **base, ATEN_CPU_CAPABILITY="default")
    assert capability == "AVX2" and forced == left_alone
    # the control: unpinned, the scalar kernels round otherwise
    native_capability, native = _trained(project, "c", **{OPT_OUT: "native", "ATEN_CPU_CAPABILITY": "default"})
    assert native_capability == "DEFAULT" and native != forced


def test_a_feature_cache_is_keyed_by_the_kernels_in_force(monkeypatch):
    """A set computed unpinned is not taken for a pinned one (MKL's AVX2 reproducibility path changes the text teacher's
    bytes even on an AVX2 CPU: measured), nor the other way round."""
    from mmcse.cpu_isa import kernels_in_force
    from mmcse.teachers.cache import cache_key

    pinned = dict(PINNED)
    assert kernels_in_force(pinned) == "avx2" and kernels_in_force({**pinned, OPT_OUT: "native"}) == "native"
    assert kernels_in_force({}) == "native"
    for name, value in PINNED.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv(OPT_OUT, raising=False)
    key = cache_key({"model": "m"}, "data")
    monkeypatch.setenv("MKL_CBWR", "AUTO")
    assert cache_key({"model": "m"}, "data") != key
