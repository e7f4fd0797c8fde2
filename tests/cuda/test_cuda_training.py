"""Training on a CUDA GPU: CPU agreement in fp32, bf16 autocast, full runs and resuming.

The whole module is marked ``cuda`` and skipped where ``torch.cuda.is_available()`` is
false (CI). On a GPU machine: ``python -m pytest tests/cuda -q``.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from safetensors.torch import load_file

from mmcse.config import with_overrides
from mmcse.experiments.params import load_config
from mmcse.training.engine import Hooks
from tests.training.test_step_devices import (
    METHODS,
    fp32_matmuls,
    head_grads,
    run_step,
    step_inputs,
    tiny_config,
    tiny_student,
)

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is false)"),
]

CUDA = torch.device("cuda")
CPU = torch.device("cpu")


@pytest.mark.parametrize("method", METHODS)
def test_fp32_step_on_cuda_matches_the_cpu(method):
    """(a) The same weights, batch, features and step seed: every term and gradient of an fp32
    step on the GPU is the CPU's within 1e-3 (dropout off: the two devices' dropout masks
    come from different generators)."""
    cfg = tiny_config(method)
    cpu_student = tiny_student(cfg, seed=5, dropout=0.0).train()
    gpu_student = copy.deepcopy(cpu_student).to(CUDA)
    batch, feats = step_inputs(cfg, cpu_student.backbone.config.vocab_size, seed=5)
    with fp32_matmuls():
        want = run_step(cpu_student, cfg, batch, feats, CPU, seed=17)
        got = run_step(gpu_student, cfg, batch, feats, CUDA, seed=17)
        assert set(got) == set(want)
        for name in want:
            assert got[name].is_cuda, name
            torch.testing.assert_close(got[name].detach().cpu(), want[name].detach(), rtol=1e-3, atol=1e-3, msg=name)
        want["loss"].backward()
        got["loss"].backward()
    want_g, got_g = head_grads(cpu_student), head_grads(gpu_student)
    assert set(got_g) == set(want_g)
    for name in want_g:
        torch.testing.assert_close(got_g[name].cpu(), want_g[name], rtol=1e-3, atol=1e-3, msg=name)


@pytest.mark.parametrize("method", METHODS)
def test_bf16_autocast_step_is_finite_fp32_valued_and_close_to_fp32(method):
    """(b) The student's forward pass in bf16: every term finite and float32 (the similarity
    matrices and log-sum-exps stay fp32), the loss within 5% of the fp32 step's, fp32
    gradients on the fp32 weights."""
    from mmcse.models.precision import autocast

    cfg = tiny_config(method)
    student = tiny_student(cfg, seed=6, dropout=0.0).to(CUDA).train()
    batch, feats = step_inputs(cfg, student.backbone.config.vocab_size, seed=6)
    with fp32_matmuls(), torch.no_grad():
        fp32 = run_step(student, cfg, batch, feats, CUDA, seed=19)
    with autocast("bf16", CUDA):
        bf16 = run_step(student, cfg, batch, feats, CUDA, seed=19)
    assert set(bf16) == set(fp32)
    for name, t in bf16.items():
        assert t.is_cuda and torch.isfinite(t), (name, t)
        assert t.dtype == torch.float32, (name, t.dtype)
    assert float(bf16["loss"]) == pytest.approx(float(fp32["loss"]), rel=0.05)
    bf16["loss"].backward()
    grads = head_grads(student)
    assert grads and all(g.dtype == torch.float32 and torch.isfinite(g).all() for g in grads.values())


def test_similarity_matrices_stay_fp32_under_bf16_autocast():
    """(b) ``cosine_matrix`` on bf16 inputs under autocast is float32 and as exact as fp32
    arithmetic on those bf16 values (a bf16 or TF32 matmul would be off by ~1e-3)."""
    from mmcse.methods.losses import cosine_matrix, info_nce
    from mmcse.models.precision import autocast

    g = torch.Generator().manual_seed(0)
    a = torch.randn(64, 256, generator=g).to(CUDA, torch.bfloat16)
    b = torch.randn(48, 256, generator=g).to(CUDA, torch.bfloat16)
    with autocast("bf16", CUDA):
        assert (a @ b.T).dtype == torch.bfloat16  # autocast is on: a plain matmul is bf16
        sim = cosine_matrix(a, b)
        loss = info_nce(a, a.flip(0), 0.05)
    assert sim.dtype == torch.float32 and sim.shape == (64, 48)
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    exact = cosine_matrix(a.double(), b.double())  # float64 on the same bf16 values
    torch.testing.assert_close(sim.double(), exact, rtol=0, atol=1e-5)


@pytest.mark.parametrize("method", ["dalr", "mcseo"])
def test_bf16_training_run_on_cuda(project, method):
    """(c) A full ``train`` run on the GPU in bf16 for the two methods with per-step draws
    (dalr: mismatched pairs, ranking ties) and object spans (mcseo): every dev score and
    logged loss finite, fp32 weights saved."""
    from mmcse.training.loop import train

    cfg = with_overrides(load_config("params.yaml"),
                         {"base.device": "cuda", "train.precision": "bf16", "train.method": method})
    result = train(cfg, "data/raw", "data/teachers", project / "m", hooks=Hooks(progress=False))
    assert result.steps == cfg.train.max_steps
    devs = [h["dev"] for h in result.history if "dev" in h]
    assert [h["step"] for h in result.history if "dev" in h] == [0, 4, 8]
    assert all(math.isfinite(d) for d in devs), devs
    assert all(math.isfinite(h["loss"]) for h in result.history if "loss" in h)
    assert math.isfinite(result.best_score)
    weights = load_file(str(project / "m" / "last" / "student.safetensors"))
    assert all(w.dtype == torch.float32 and torch.isfinite(w).all() for w in weights.values() if w.is_floating_point())


def test_killed_run_on_cuda_resumes_to_the_same_weights(project):
    """(d) Killed after its step-4 checkpoint and resumed, an fp32 GPU run ends with the
    weights of an uninterrupted one. The resume point must carry the CUDA generator's state
    (dropout masks are drawn on the GPU). Tolerance 1e-5 rather than exact: some CUDA
    backward kernels (index/scatter adds) accumulate in a run-dependent order."""
    from tests.training.test_loop import killed_and_resumed

    cfg = with_overrides(load_config("params.yaml"), {
        "base.device": "cuda", "train.precision": "fp32", "train.method": "dalr",
        "train.max_steps": 8, "train.eval_steps": 4, "train.checkpoint_steps": 4,
    })
    full, resumed, a, b = killed_and_resumed(cfg, project)
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-5, msg=k)
    assert [sorted(h) for h in full.history] == [sorted(h) for h in resumed.history]
    for h_full, h_resumed in zip(full.history, resumed.history, strict=True):
        assert h_full["step"] == h_resumed["step"]
        for key in set(h_full) - {"step"}:
            assert h_resumed[key] == pytest.approx(h_full[key], abs=1e-4), (h_full["step"], key)
