"""train.precision / train.compile: autocast, loss scaling, fp32 similarities, clear errors."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from mmcse.config import ConfigError, with_overrides
from mmcse.errors import PrecisionError, TrainingOutOfMemory
from mmcse.experiments.params import load_config
from mmcse.methods.losses import cosine_matrix
from mmcse.models import precision
from mmcse.training.engine import Hooks
from mmcse.training.loop import train


def _fake_gpu(monkeypatch, capability: tuple[int, int], name: str = "Tesla T4") -> None:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)


def test_check_precision_rejects_bf16_on_a_gpu_without_it(monkeypatch):
    _fake_gpu(monkeypatch, (7, 5))
    with pytest.raises(PrecisionError, match=r"Tesla T4 has no bfloat16 support.*use fp16"):
        precision.check_precision("bf16", torch.device("cuda"))
    precision.check_precision("fp16", torch.device("cuda"))  # fp16 and fp32 run there
    precision.check_precision("fp32", torch.device("cuda"))
    _fake_gpu(monkeypatch, (8, 0), "A100")
    precision.check_precision("bf16", torch.device("cuda"))
    for p in precision.PRECISIONS:
        precision.check_precision(p, torch.device("cpu"))
    with pytest.raises(PrecisionError, match="fp32, bf16, fp16"):
        precision.check_precision("int8", torch.device("cpu"))


def test_unknown_precision_in_params_lists_the_choices(tmp_path):
    with pytest.raises(ConfigError, match="precision"):
        with_overrides(load_config("params.yaml"), {"train.precision": "fp8"})


def test_bf16_on_a_pre_ampere_gpu_fails_before_any_compute(project, monkeypatch):
    """train() stops at the precision check: no model is loaded, no MLflow run is started."""
    import mmcse.training.batches
    import mmcse.training.engine
    import mmcse.training.loop
    from mmcse import tracking
    from mmcse.pipeline.paths import Paths
    from mmcse.pipeline.train import run_train

    _fake_gpu(monkeypatch, (7, 0), "Tesla V100")
    monkeypatch.setattr(mmcse.training.engine, "resolve_device", lambda name: torch.device("cuda"))
    monkeypatch.setattr("mmcse.models.device.resolve_device", lambda name: torch.device("cuda"))
    monkeypatch.setattr("mmcse.pipeline.train.resolve_device", lambda name: torch.device("cuda"))

    def must_not_run(*args, **kwargs):
        raise AssertionError("computation started before the precision check")

    monkeypatch.setattr(mmcse.training.loop, "load_backbone", must_not_run)
    monkeypatch.setattr(mmcse.training.batches.TrainData, "load", must_not_run)
    monkeypatch.setattr(tracking, "run", must_not_run)
    cfg = with_overrides(load_config("params.yaml"), {"train.precision": "bf16"})
    with pytest.raises(PrecisionError, match="Tesla V100"):
        train(cfg, "data/raw", "data/teachers", project / "m", hooks=Hooks(progress=False))
    with pytest.raises(PrecisionError, match="Tesla V100"):
        run_train(cfg, Paths.of(cfg), out_dir=project / "m", hooks=Hooks(progress=False))


@pytest.mark.parametrize("name", ["bf16", "fp16"])
def test_autocast_lowers_matmuls_but_similarities_stay_fp32(device, name):
    if device.type == "cpu" and name == "fp16":
        with torch.autocast("cpu", dtype=torch.float16):
            if (torch.ones(2, 2) @ torch.ones(2, 2)).dtype != torch.float16:
                pytest.skip("this torch build has no fp16 autocast on the CPU")
    g = torch.Generator().manual_seed(0)
    a = torch.randn(16, 32, generator=g).to(device)
    b = torch.randn(12, 32, generator=g).to(device)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[name]
    with precision.autocast(name, device):
        assert (a @ b.T).dtype == dtype  # autocast is on
        sim = cosine_matrix(a, b)
    with precision.autocast("fp32", device):
        assert (a @ b.T).dtype == torch.float32
    assert sim.dtype == torch.float32 and sim.device.type == device.type
    exact = torch.nn.functional.normalize(a.double(), dim=-1) @ torch.nn.functional.normalize(b.double(), dim=-1).T
    torch.testing.assert_close(sim.double().cpu(), exact.cpu(), rtol=0, atol=1e-6)


def test_grad_scaler_is_on_for_fp16_only():
    cpu = torch.device("cpu")
    assert precision.grad_scaler("fp16", cpu).is_enabled()
    assert not precision.grad_scaler("bf16", cpu).is_enabled()
    assert not precision.grad_scaler("fp32", cpu).is_enabled()


def _config(**train):
    return with_overrides(load_config("params.yaml"), {f"train.{k}": v for k, v in train.items()})


@pytest.mark.slow  # end to end: the full suite runs it (fast tier under 5 min)
@pytest.mark.parametrize("name", ["bf16", "fp16"])
def test_mixed_precision_training_keeps_fp32_weights_and_resumes(project, name):
    """A run in bf16/fp16 autocast: finite losses and dev scores, fp32 weights on disk, the
    loss scaler's state in the resume point (fp16), and a killed run resumes to the same weights."""
    cfg = _config(precision=name, method="mcseo", max_steps=8, eval_steps=4, checkpoint_steps=4)
    full = train(cfg, "data/raw", "data/teachers", project / "full", hooks=Hooks(progress=False))
    assert full.steps == 8
    assert all(math.isfinite(h.get("loss", 0.0)) and math.isfinite(h.get("dev", 0.0)) for h in full.history)
    weights = load_file(str(project / "full/last/student.safetensors"))
    assert {w.dtype for w in weights.values() if w.is_floating_point()} == {torch.float32}
    trainer = torch.load(project / "full/last/trainer.pt", weights_only=True)
    scaler_state = trainer.get("scaler") or {}
    assert bool(scaler_state) == (name == "fp16"), scaler_state  # a disabled scaler has no state

    class Killed(Exception):
        pass

    def kill_at_8(step, score):
        if step == 8:
            raise Killed

    with pytest.raises(Killed):
        train(cfg, "data/raw", "data/teachers", project / "resumed", hooks=Hooks(on_eval=kill_at_8, progress=False))
    resumed = train(cfg, "data/raw", "data/teachers", project / "resumed", hooks=Hooks(progress=False))
    assert resumed.history == full.history
    again = load_file(str(project / "resumed/last/student.safetensors"))
    for k in weights:
        torch.testing.assert_close(again[k], weights[k], rtol=0, atol=1e-6, msg=k)


def test_bf16_encoding_scores_track_fp32(project):
    """Dev evaluation (the student being trained) and the evaluate stage (`TextEncoder`) encode
    under the precision's autocast: with real weights (the packaged MiniLM) the bf16 scores are
    within half a point of fp32's (~41 on the demo dev set) and the vectors come back as fp32.
    (A random tiny student is no use here: its cosines all sit near 1, so bf16 rounding
    reorders them.)"""
    from mmcse.config import ModelConfig
    from mmcse.evaluation.sts import TextEncoder, evaluate_sts, student_encoder
    from mmcse.models.student import Student, load_backbone, load_tokenizer
    from mmcse.training.batches import TrainData

    dev = TrainData.load(project / "data/raw", project / "data/teachers").dev
    cpu = torch.device("cpu")
    student = Student(load_backbone(ModelConfig()), 8, 8).eval()
    tokenizer = load_tokenizer(ModelConfig().name_or_path)
    encoders = {p: student_encoder(student, tokenizer, "avg", 32, cpu, p) for p in ("fp32", "bf16")}
    stage = {p: TextEncoder("packaged:all-MiniLM-L6-v2", "avg", "cpu", 32, precision=p) for p in ("fp32", "bf16")}
    for encode in (encoders, stage):
        scores = {p: evaluate_sts(e, dev, 16).primary for p, e in encode.items()}
        assert scores["fp32"] > 30 and abs(scores["bf16"] - scores["fp32"]) < 0.5, scores
        emb32, emb16 = (encode[p](["a dog runs on grass", "two cats sleep"]) for p in ("fp32", "bf16"))
        assert emb16.dtype == np.float32 and not np.array_equal(emb16, emb32)  # autocast did run
        cos = (emb16 * emb32).sum(1) / np.linalg.norm(emb16, axis=1) / np.linalg.norm(emb32, axis=1)
        assert cos.min() > 0.999, cos


@pytest.mark.slow  # end to end: the full suite runs it (fast tier under 5 min)
def test_out_of_memory_names_the_settings_and_keeps_the_resume_point(project, monkeypatch, capsys):
    """A device OOM at step 7 (after the step-4 resume point): one message with the batch size,
    precision and sequence length and what to lower; the resume point still says step 4 and a
    rerun finishes with the weights of an uninterrupted run."""
    import mmcse.training.engine
    import mmcse.training.loop
    from mmcse.entry import run_entry

    cfg = _config(max_steps=8, eval_steps=4, checkpoint_steps=4)
    full = train(cfg, "data/raw", "data/teachers", project / "full", hooks=Hooks(progress=False))

    real_step = mmcse.training.loop.StudentStep.__call__
    calls = {"n": 0}

    def oom_at_7(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 7:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real_step(*args, **kwargs)

    monkeypatch.setattr(mmcse.training.loop.StudentStep, "__call__", oom_at_7)
    with pytest.raises(TrainingOutOfMemory) as err:
        train(cfg, "data/raw", "data/teachers", project / "m", hooks=Hooks(progress=False))
    message = str(err.value)
    assert "step 7" in message and f"train.batch_size={cfg.train.batch_size}" in message
    assert "train.precision=fp32" in message and "train.precision: bf16" in message
    assert f"e.g. {cfg.train.batch_size // 2}" in message and "model.max_seq_len=" in message
    assert f"try train.micro_batch: {cfg.train.batch_size // 4} with train.dropout_rng: per_row" in message
    assert "resume point (step 4) is intact" in message
    assert json.loads((project / "m/last/state.json").read_text())["step"] == 4

    calls["n"] = 6  # the next step runs out of memory
    with pytest.raises(SystemExit) as exit_info:  # the CLI turns it into one line, exit 2
        run_entry(lambda: train(cfg, "data/raw", "data/teachers", project / "cli", hooks=Hooks(progress=False)))
    assert exit_info.value.code == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]  # after the progress bars
    assert line.startswith("error: out of device memory at training step 1")
    assert "no resume point was written yet" in line

    monkeypatch.setattr(mmcse.training.loop.StudentStep, "__call__", real_step)
    resumed = train(cfg, "data/raw", "data/teachers", project / "m", hooks=Hooks(progress=False))
    assert resumed.steps == 8 and resumed.history == full.history
    a = load_file(str(project / "full/last/student.safetensors"))
    b = load_file(str(project / "m/last/student.safetensors"))
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=1e-6, msg=k)


def test_other_errors_in_a_step_are_not_called_out_of_memory(project, monkeypatch):
    import mmcse.training.engine
    import mmcse.training.loop

    def broken(*args, **kwargs):
        raise RuntimeError("shape mismatch in a loss")

    monkeypatch.setattr(mmcse.training.loop.StudentStep, "__call__", broken)
    with pytest.raises(RuntimeError, match="shape mismatch"):
        train(_config(max_steps=2), "data/raw", "data/teachers", project / "m", hooks=Hooks(progress=False))


def test_compile_compiles_the_backbone_in_place(project, monkeypatch):
    """train.compile: backbone compiles the student's backbone (dynamic shapes: dynamic padding);
    parameter names, and so checkpoints, stay those of an uncompiled run."""
    compiled = []

    def fake_compile(self, *args, **kwargs):  # torch.compile's CPU code generation takes minutes here
        compiled.append((type(self).__name__, kwargs))

    monkeypatch.setattr(torch.nn.Module, "compile", fake_compile)
    train(
        _config(compile="backbone", max_steps=2, eval_steps=2), "data/raw", "data/teachers", project / "c",
        hooks=Hooks(progress=False),
    )
    assert compiled == [("BertModel", {"dynamic": True})]
    compiled.clear()
    train(_config(max_steps=2, eval_steps=2), "data/raw", "data/teachers", project / "p", hooks=Hooks(progress=False))
    assert compiled == []
    a = load_file(str(project / "c/last/student.safetensors"))
    b = load_file(str(project / "p/last/student.safetensors"))
    assert a.keys() == b.keys()


def test_training_kernels_are_deterministic_without_filling_every_new_tensor():
    """Issue 38: the NaN fill of new tensors that deterministic mode adds (~1,100 kernels per BERT-base
    step) is off; deterministic algorithms stay on (bit-identical resumes)."""
    import torch

    from mmcse.models.precision import deterministic_kernels

    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
              torch.utils.deterministic.fill_uninitialized_memory)
    try:
        torch.utils.deterministic.fill_uninitialized_memory = True
        deterministic_kernels()
        assert torch.are_deterministic_algorithms_enabled()
        assert torch.utils.deterministic.fill_uninitialized_memory is False
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        torch.utils.deterministic.fill_uninitialized_memory = before[2]
