"""The one training loop (`mmcse.training.engine`) on a toy task: a linear regression whose dev score is known in
closed form, so each part of the loop (schedule, logging, best checkpoint, resume, phases, errors) is checked
without a sentence encoder, tokenizer or prepared project."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from mmcse.config import Config, parse_config
from mmcse.errors import StageError, TrainingOutOfMemory
from mmcse.models.precision import grad_scaler
from mmcse.training.checkpoints import TrainState
from mmcse.training.engine import (
    FLUSH_EVERY,
    GRAD_NORM,
    LOG_EVERY,
    DevScore,
    Hooks,
    Loop,
    TrainTask,
    Update,
    build_optimizer,
    fit,
)

WEIGHTS = "toy.safetensors"
TRUE_W = torch.tensor([[1.5, -2.0, 0.5, 3.0]])  # (1, 4): the regression the toy task learns


def toy_config(**train: object) -> Config:
    return parse_config({"train": {"method": "simcse", "learning_rate": 0.05, "warmup_ratio": 0.0,
                                   "weight_decay": 0.0, **train}}, where="test")


class ToyTask(TrainTask):
    """y = x · TRUE_Wᵀ learnt by a bias-free linear layer; dev score = -100 × dev MSE (higher is better)."""

    dev_extras = ("dev_norm",)
    best_required = (WEIGHTS,)

    def __init__(self, cfg: Config, total: int, phase_end: int | None = None) -> None:
        torch.manual_seed(cfg.base.seed)
        self.model = torch.nn.Linear(4, 1, bias=False)
        self.total, self.phase_end = total, phase_end
        optimizer, self.scheduler = build_optimizer(self.model, cfg.train, total)
        self.update = Update(cfg.train, optimizer, grad_scaler("fp32", torch.device("cpu")), torch.device("cpu"))
        g = torch.Generator().manual_seed(99)
        self.dev_x = torch.randn(32, 4, generator=g)
        self.batches: list[int] = []
        self.closed = False

    def batch(self, step: int) -> torch.Tensor:
        self.batches.append(step)
        return torch.randn(8, 4, generator=torch.Generator().manual_seed(step))  # (B, 4): a function of the step

    def step(self, batch: torch.Tensor, seed: int, ranks: tuple[int, int]) -> dict[str, torch.Tensor]:
        loss = torch.nn.functional.mse_loss(self.model(batch), batch @ TRUE_W.T)
        return {"loss": loss.detach(), GRAD_NORM: self.update.apply(self.model, loss)}

    def dev(self) -> DevScore:
        with torch.no_grad():
            mse = torch.nn.functional.mse_loss(self.model(self.dev_x), self.dev_x @ TRUE_W.T).item()
        norm = self.model.weight.norm().item()
        return DevScore(-100 * mse, {"dev_norm": norm}, {"dev_toy": -100 * mse, "dev_norm": norm})

    def save_best(self, tmp: Path, state: TrainState) -> None:
        tmp.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in self.model.state_dict().items()}, str(tmp / WEIGHTS))

    def ends_phase(self, step: int) -> bool:
        return step == self.phase_end

    def close(self) -> None:
        self.closed = True


def dev_of(weight: torch.Tensor, task: ToyTask) -> float:
    return -100 * torch.nn.functional.mse_loss(task.dev_x @ weight.T, task.dev_x @ TRUE_W.T).item()


def test_fit_evaluates_on_schedule_keeps_the_best_weights_and_logs_every_value(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = toy_config(eval_steps=4, checkpoint_steps=8)
    task = ToyTask(cfg, total=12)
    logged: list[tuple[dict[str, float], int]] = []
    evals: list[tuple[int, float]] = []
    result = fit(task, cfg, tmp_path / "m", Hooks(logged.extend, lambda s, v: evals.append((s, v)), progress=False))

    assert result.steps == 12 and task.batches == list(range(12)) and task.closed
    devs = [h for h in result.history if "dev" in h]
    assert [h["step"] for h in devs] == [0, 4, 8, 12]
    assert [s for s, _ in evals] == [4, 8, 12]  # not the initial evaluation
    assert [h["step"] for h in result.history if "loss" in h] == [5, 10]  # every LOG_EVERY-th step's loss
    best = max(devs, key=lambda h: h["dev"])
    assert (result.best_step, result.best_score) == (best["step"], best["dev"])
    weight = load_file(str(result.best_dir / WEIGHTS))["weight"]
    assert dev_of(weight, task) == pytest.approx(result.best_score, rel=1e-6)  # best/ holds the best step's weights
    assert best["dev_norm"] == pytest.approx(weight.norm().item(), rel=1e-6)
    # the toy learns: its last dev score is far better than the untrained model's
    assert devs[-1]["dev"] > devs[0]["dev"] + 10
    steps = {step for metrics, step in logged if "loss/loss" in metrics}
    assert steps == {5, 10}
    assert {step for metrics, step in logged if "dev_toy" in metrics} == {0, 4, 8, 12}
    assert all(isinstance(v, float) for metrics, _ in logged for v in metrics.values())
    assert all(m[GRAD_NORM] > 0 and m["lr"] > 0 for m, _ in logged if "loss/loss" in m)


def test_a_run_stopped_by_on_eval_resumes_to_the_same_weights(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = toy_config(eval_steps=2, checkpoint_steps=4)
    full = fit(ToyTask(cfg, total=10), cfg, tmp_path / "full", Hooks(progress=False))

    def stop_at_6(step: int, score: float) -> None:
        if step == 6:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        fit(ToyTask(cfg, total=10), cfg, tmp_path / "resumed", Hooks(on_eval=stop_at_6, progress=False))
    again = ToyTask(cfg, total=10)
    resumed = fit(again, cfg, tmp_path / "resumed", Hooks(progress=False))
    assert again.batches == list(range(4, 10))  # from the resume point at step 4
    assert (resumed.best_step, resumed.best_score) == (full.best_step, full.best_score)
    assert torch.equal(load_file(str(resumed.best_dir / WEIGHTS))["weight"],
                       load_file(str(full.best_dir / WEIGHTS))["weight"])
    # finished: a third run reads the result back and takes no step
    third = ToyTask(cfg, total=10)
    assert fit(third, cfg, tmp_path / "resumed", Hooks(progress=False)).best_step == full.best_step
    assert third.batches == []


def test_a_phase_end_evaluates_and_writes_a_resume_point(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = toy_config(eval_steps=100, checkpoint_steps=100)
    task = ToyTask(cfg, total=7, phase_end=3)
    loop = Loop(task, cfg, tmp_path / "m", Hooks(progress=False))
    result = loop.run()
    assert [h["step"] for h in result.history if "dev" in h] == [0, 3, 7]
    assert loop.resumed_from == 7


def test_flush_reads_values_back_and_keeps_log_every_losses(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = toy_config()
    logged: list[tuple[dict[str, float], int]] = []
    loop = Loop(ToyTask(cfg, total=4), cfg, tmp_path / "m", Hooks(log_metrics=logged.extend, progress=False))
    loop.pending = [({"loss/loss": torch.tensor(2.5), "lr": 0.1}, LOG_EVERY),
                    ({"loss/loss": torch.tensor(1.5)}, LOG_EVERY + 1)]
    loop.flush()
    assert loop.pending == [] and loop.shown_loss == 1.5
    assert loop.state.history == [{"step": LOG_EVERY, "loss": 2.5}]
    assert logged == [({"loss/loss": 2.5, "lr": 0.1}, LOG_EVERY), ({"loss/loss": 1.5}, LOG_EVERY + 1)]
    assert FLUSH_EVERY % LOG_EVERY == 0  # a flush step is a logged step


def test_a_failing_tracking_store_leaves_a_resume_point(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = toy_config(eval_steps=2, checkpoint_steps=100)

    def locked(entries):
        if any(step == 4 for _, step in entries):
            raise StageError("tracking store locked")

    with pytest.raises(StageError, match="locked"):
        fit(ToyTask(cfg, total=8), cfg, tmp_path / "m", Hooks(log_metrics=locked, progress=False))
    again = ToyTask(cfg, total=8)
    fit(again, cfg, tmp_path / "m", Hooks(progress=False))
    assert again.batches == list(range(4, 8))


def test_out_of_memory_in_a_step_names_the_settings_and_the_resume_point(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = toy_config(eval_steps=2, checkpoint_steps=2)
    task = ToyTask(cfg, total=6)
    real_step = task.step

    def oom_at_3(batch, seed, ranks):
        if len(task.batches) == 4:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real_step(batch, seed, ranks)

    task.step = oom_at_3
    with pytest.raises(TrainingOutOfMemory, match=r"at training step 4 .*resume point \(step 2\) is intact"):
        fit(task, cfg, tmp_path / "m", Hooks(progress=False))
    assert task.closed
