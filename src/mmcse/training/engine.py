"""The one training loop every method runs (`fit`): the students (`mmcse.training.loop.StudentTask`) and the
retrieval models, DUET, VSE++ and VSRN (`mmcse.training.duet.RetrievalTask`).

What differs between methods sits behind a `TrainTask`: make a step's batch, take the step, score the model on
dev, save the best weights (and, for VSE++'s fine-tuning, where a phase ends). Everything else is written once
here: the dev evaluations and the best checkpoint, resume points (`mmcse.training.checkpoints`), logged values
read back from the device in batches, the divergence watch, Ctrl-C/SIGTERM, out-of-memory advice and the
processes of a job on several (`mmcse.training.distributed`: rank 0 alone evaluates, holds and writes).
The loop's state is one object (`Loop`), each of its parts callable alone."""

from __future__ import annotations

import logging
import math
import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import get_linear_schedule_with_warmup

from mmcse import stopping
from mmcse.config import RETRIEVAL_METHODS, Config, TrainConfig
from mmcse.errors import StageError, StoppedEarly, TrainingDiverged, TrainingOutOfMemory
from mmcse.methods.objectives import STAT
from mmcse.models.device import resolve_device
from mmcse.models.precision import (
    autocast,
    check_precision,
    configure_kernels,
    deterministic_kernels,
    fused_adamw_supported,
)
from mmcse.training.checkpoints import BEST_REQUIRED, Checkpoints, TrainState, kept_dir, run_definition_hash
from mmcse.training.distributed import any_rank, average_gradients, from_lead, wait_for_lead, world
from mmcse.training.divergence import DivergenceWatch
from mmcse.training.optimizers import make_optimizer

log = logging.getLogger(__name__)

LOG_EVERY = 5  # steps between logged loss values


# Steps between reading logged values back from the device: each read waits for the GPU to
# finish (a host sync), so values are kept on the device and read in one go this often.
FLUSH_EVERY = 50


StepLogger = Callable[[list[tuple[dict[str, float], int]]], None]  # a batch of (metrics, step)


EvalCallback = Callable[[int, float], None]


# Dev geometry (Wang & Isola; DALR Table 6) a student logs at every dev evaluation: metric name -> key of
# `mmcse.evaluation.geometry.sts_geometry`; the same names are the keys of a dev history entry.
DEV_GEOMETRY = {"dev_alignment": "alignment", "dev_uniformity": "uniformity"}

GRAD_NORM = f"{STAT}grad_norm"  # a step's gradient L2 norm before clipping: logged, and watched for divergence


@dataclass(frozen=True)
class Hooks:
    """What a caller hears of a run: ``log_metrics`` receives batches of ``(metrics, step)`` (logged values are
    read back from the device every `FLUSH_EVERY` steps and at every dev evaluation, not per step);
    ``on_eval(step, score)`` after each dev evaluation, which may raise to stop: `StoppedEarly` for a
    planned stop (Optuna pruning: the best checkpoint so far and a resume point are written first), anything
    else as a crash; ``progress``: a progress bar (rank 0 only)."""

    log_metrics: StepLogger | None = None
    on_eval: EvalCallback | None = None
    progress: bool = True


@dataclass
class TrainResult:
    best_score: float
    best_step: int
    steps: int
    best_dir: Path
    history: list[dict[str, float]]

    @property
    def best_geometry(self) -> dict[str, float]:
        """``dev_alignment`` / ``dev_uniformity`` of the best checkpoint (see `best_geometry`)."""
        return best_geometry(self.history, self.best_step)


def best_geometry(history: Sequence[dict[str, Any]], best_step: int) -> dict[str, float]:
    """The dev geometry logged at ``best_step``'s dev evaluation (``{}`` when that evaluation has
    none: a retrieval model's, or a history begun by a version that did not log it)."""
    for entry in history:
        if entry["step"] == best_step and "dev" in entry:
            return {k: entry[k] for k in DEV_GEOMETRY if k in entry}
    return {}


def read_back(pending: list[tuple[dict[str, Any], int]]) -> list[tuple[dict[str, float], int]]:
    """Logged ``(metrics, step)`` entries whose values may still be device tensors, as floats, read
    back in one host sync (a read per value would wait for the device each time); empties
    ``pending``."""
    tensors = [v for metrics, _ in pending for v in metrics.values() if isinstance(v, torch.Tensor)]
    values = iter(torch.stack([t.detach().float() for t in tensors]).tolist() if tensors else [])
    entries = [({k: next(values) if isinstance(v, torch.Tensor) else float(v) for k, v in metrics.items()}, step)
               for metrics, step in pending]
    pending.clear()
    return entries


def build_optimizer(student: torch.nn.Module, train: TrainConfig, total_steps: int, device: torch.device | None = None,
                    steps_per_epoch: int = 0):
    """AdamW (no weight decay on biases and LayerNorm): ``train.optimizer``'s (`mmcse.training.optimizers`;
    PyTorch's fused, one kernel for all parameters, on CUDA), with linear warmup and decay to 0, or with
    ``train.lr_decay_epochs`` = N the rate ÷10 every N epochs of ``steps_per_epoch`` steps (VSE++'s schedule)."""
    decay, no_decay = [], []
    for name, p in student.named_parameters():
        (no_decay if p.ndim < 2 or "LayerNorm" in name else decay).append(p)
    fused = device is not None and fused_adamw_supported(device)
    optimizer = make_optimizer(
        train.optimizer,
        [{"params": decay, "weight_decay": train.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        train.learning_rate, fused,
    )
    if train.lr_decay_epochs:
        if steps_per_epoch < 1:
            raise ValueError("train.lr_decay_epochs needs the number of steps an epoch has")
        every = train.lr_decay_epochs * steps_per_epoch
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.1 ** (step // every))
    else:
        scheduler = get_linear_schedule_with_warmup(optimizer, int(train.warmup_ratio * total_steps), total_steps)
    return optimizer, scheduler


def clipped_update(model: torch.nn.Module, train: TrainConfig, optimizer: torch.optim.Optimizer,
                   scaler: torch.amp.GradScaler) -> torch.Tensor:
    """The optimizer update after backward, the gradient's global L2 norm first clipped to
    ``train.max_grad_norm`` when it is set (on the unscaled gradient under fp16). Returns that norm
    before clipping, a 0-d tensor on the device (under fp16 without clipping: of the scaled gradient)."""
    if train.max_grad_norm > 0:
        scaler.unscale_(optimizer)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), train.max_grad_norm)
    else:
        norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])
    scaler.step(optimizer)
    scaler.update()
    return norm


@dataclass
class Update:
    """What one optimizer update needs besides the model and its loss: ``train``'s settings (precision,
    clipping, micro-batches), the optimizer, fp16's loss scaler (disabled otherwise) and the device."""

    train: TrainConfig
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    device: torch.device

    def autocast(self):
        """The forward pass's autocast under ``train.precision``."""
        return autocast(self.train.precision, self.device)

    def clipped(self, model: torch.nn.Module) -> torch.Tensor:
        """`clipped_update` of ``model`` with these settings (a compiled step compiles this very function)."""
        return clipped_update(model, self.train, self.optimizer, self.scaler)

    def apply(self, model: torch.nn.Module, loss: torch.Tensor, size: int = 1,
              after_backward: Callable[[], None] | None = None,
              clipped: Callable[[], torch.Tensor] | None = None) -> torch.Tensor:
        """Backward of ``loss`` (through the fp16 scaler when enabled), ``after_backward`` (a gradient cache's
        encoder share), the gradients averaged over the job's ``size`` processes (the one-process gradient)
        and the clipped update (`clipped`, or ``clipped``: its compiled graph). Returns the gradient norm
        (`GRAD_NORM`), on the device."""
        self.optimizer.zero_grad(set_to_none=True)
        self.scaler.scale(loss).backward()
        if after_backward is not None:
            after_backward()
        average_gradients(model.parameters(), size)
        return clipped() if clipped is not None else self.clipped(model)


def watched_norm(terms: dict[str, torch.Tensor], scaler: torch.amp.GradScaler) -> torch.Tensor | None:
    """The gradient norm a divergence watch checks: none under fp16's loss scaler, whose overflowing
    steps are skipped by design (the loss is still checked)."""
    return None if scaler.is_enabled() else terms.get(GRAD_NORM)


def out_of_memory_message(cfg: Config, step: int, resume_step: int | None) -> str:
    resume = (f"the resume point (step {resume_step}) is intact: rerun to continue from it"
              if resume_step is not None else "no resume point was written yet")
    smaller = max(cfg.train.batch_size // 2, 2)
    micro = max((cfg.train.micro_batch or cfg.train.batch_size) // 4, 1)
    # the same batch in smaller encoder passes keeps the paper's in-batch negatives; a smaller batch does not
    advice = [] if cfg.train.method in RETRIEVAL_METHODS else [
        f"train.micro_batch: {micro} with train.dropout_rng: per_row (the same batch, encoded {micro} sentences "
        "at a time: the same update)"]
    advice.append(f"a smaller train.batch_size (e.g. {smaller})")
    if cfg.train.precision == "fp32":
        advice.append("train.precision: bf16 (or fp16 on GPUs without bf16)")
    advice.append(f"a shorter model.max_seq_len (now {cfg.model.max_seq_len})")
    return (f"out of device memory at training step {step} with train.batch_size={cfg.train.batch_size}, "
            f"train.precision={cfg.train.precision}, model.max_seq_len={cfg.model.max_seq_len}; try "
            f"{' or '.join(advice)}; {resume}")


def is_out_of_memory(err: BaseException) -> bool:
    oom = getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError
    return isinstance(err, oom) or (isinstance(err, RuntimeError) and "out of memory" in str(err).lower())


def training_device(cfg: Config) -> torch.device:
    """``base.device`` resolved, its ``train.precision`` checked: refused before any data or model loads."""
    device = resolve_device(cfg.base.device)
    check_precision(cfg.train.precision, device)
    return device


def seed_kernels(cfg: Config, device: torch.device) -> None:
    """Deterministic kernels and ``base.seed`` for the model's initial weights: a resumed run is bit-identical."""
    if device.type == "cuda":  # deterministic cuBLAS; read when cuBLAS starts
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    configure_kernels(device)
    torch.manual_seed(cfg.base.seed)
    deterministic_kernels()


def finished(state: TrainState, best_dir: Path, lead: bool = True) -> TrainResult:
    """The result of a finished run; one without a best checkpoint (no dev evaluation gave a finite
    score) is an error, not a result without a model. A rank other than 0 (``lead`` false) does not look:
    rank 0 wrote ``best_dir``, maybe on another machine's disk."""
    if lead and (state.best_step < 0 or not best_dir.is_dir()):
        raise TrainingDiverged(f"{best_dir}: no dev evaluation of this run gave a finite score (the model returns "
                               "the same or non-finite vectors), so there is no best checkpoint")
    return TrainResult(state.best_score, state.best_step, state.step, best_dir, state.history)


@dataclass
class DevScore:
    """One dev evaluation (rank 0's): ``score`` decides the best checkpoint; ``extras`` go into the history
    entry (keys: the task's ``dev_extras``); ``logged``: every value handed to ``log_metrics``."""

    score: float
    extras: dict[str, float] = field(default_factory=dict)
    logged: dict[str, float] = field(default_factory=dict)


class TrainTask(ABC):
    """The part of a training run that is the method's own. A task builds its model, optimizer, scheduler and
    scaler (``update``) and knows its ``total`` steps; `fit` runs the rest. ``dev_label`` names the dev score on
    the progress bar; ``dev_extras`` the values a dev history entry carries beside it; ``best_required`` the
    files of a best checkpoint (a student's by default)."""

    model: torch.nn.Module
    update: Update
    scheduler: torch.optim.lr_scheduler.LRScheduler
    total: int
    dev_label: str = "dev"
    dev_extras: tuple[str, ...] = ()
    best_required: tuple[str, ...] = BEST_REQUIRED

    @abstractmethod
    def batch(self, step: int) -> Any:
        """Step ``step``'s batch on the device: a pure function of (seed, step), so a resumed run replays it."""

    @abstractmethod
    def step(self, batch: Any, seed: int, ranks: tuple[int, int]) -> dict[str, torch.Tensor]:
        """One update on ``batch``; the loss terms and `GRAD_NORM`, still on the device."""

    def logs_every_step(self, batch: Any) -> bool:
        """Whether this batch's terms are logged although the step is not a `LOG_EVERY` one."""
        return False

    @abstractmethod
    def dev(self) -> DevScore:
        """Rank 0's dev evaluation, the model left in training mode."""

    @abstractmethod
    def save_best(self, tmp: Path, state: TrainState) -> None:
        """The model (its best weights loaded) and whatever travels with it, into the folder ``tmp``."""

    def restored(self, state: TrainState) -> None:  # noqa: B027 (a hook most tasks leave empty)
        """Called once the run's state is known (a resume point's, or step 0)."""

    def before_step(self, state: TrainState, checkpoints: Checkpoints) -> None:  # noqa: B027 (a hook most tasks leave empty)
        """Called before each step (VSE++ starts its fine-tuning here)."""

    def ends_phase(self, step: int) -> bool:
        """A step after which the run evaluates and writes a resume point besides its schedule's."""
        return False

    def close(self) -> None:  # noqa: B027 (a hook most tasks leave empty)
        """Release what the task holds open (readers a step ahead)."""


class Loop:
    """One run's state, explicit: the task, its checkpoints and `TrainState`, the divergence watch, the logged
    values not yet read back (``pending``), the last loss and dev score shown, the step of the resume point a
    rerun would continue (``resumed_from``)."""

    def __init__(self, task: TrainTask, cfg: Config, out_dir: Path, hooks: Hooks) -> None:
        self.task, self.cfg, self.out_dir, self.hooks = task, cfg, Path(out_dir), hooks
        self.rank, self.size = world()
        self.lead = self.rank == 0
        config_hash = run_definition_hash(cfg)
        # the best weights are held in (device) memory and written with the next resume point (`Checkpoints`);
        # on several processes rank 0 alone evaluates, holds and writes them, the others take its dev score
        self.checkpoints = Checkpoints(self.out_dir, config_hash, task.save_best, task.best_required,
                                       writes=self.lead, kept=kept_dir(cfg, self.out_dir, config_hash))
        self.state = TrainState()
        self.watch = DivergenceWatch(task.update.device)
        self.pending: list[tuple[dict[str, Any], int]] = []
        self.shown_loss = math.nan
        self.last_dev = math.nan
        self.resumed_from: int | None = None

    # ---------------------------------------------------------------- parts

    def save(self) -> None:
        t = self.task
        self.checkpoints.save(t.model, t.update.optimizer, t.scheduler, t.update.scaler, self.state)

    def record(self, entries: list[tuple[dict[str, Any], int]]) -> None:
        """Hand logged values to ``log_metrics``; when the tracking store fails for good (locked past its
        retries), a last resume point first: nothing trained is lost to a logging failure."""
        if not self.hooks.log_metrics or not entries:
            return
        try:
            self.hooks.log_metrics(entries)
        except StageError:
            self.save()
            self.checkpoints.wait()
            raise

    def flush(self) -> None:
        """Read the pending values back (one host sync), keep every `LOG_EVERY`-th loss in the history, log them."""
        self.watch.check(self.cfg)  # a diverged run stops here, before anything reads or saves its weights
        entries = read_back(self.pending)
        for metrics, step in entries:
            if "loss/loss" in metrics:
                self.shown_loss = metrics["loss/loss"]
                if step % LOG_EVERY == 0:
                    self.state.history.append({"step": step, "loss": metrics["loss/loss"]})
        self.record(entries)

    def evaluate(self) -> float:
        """A dev evaluation on rank 0, its score every rank's; the best checkpoint considered; logged."""
        self.watch.check(self.cfg)
        keys = self.task.dev_extras
        dev = self.task.dev() if self.lead else DevScore(0.0, dict.fromkeys(keys, 0.0))
        score, *extra = from_lead([dev.score, *(dev.extras[k] for k in keys)])  # the same weights on every rank
        extras = dict(zip(keys, extra, strict=True))
        self.flush()  # the losses logged before this evaluation go first in the history
        self.state.history.append({"step": self.state.step, "dev": score, **extras})
        self.checkpoints.consider(score, self.state, self.task.model)
        self.record([(dev.logged, self.state.step)])
        self.last_dev = score
        return score

    def stop(self) -> None:
        """Ctrl-C / SIGTERM: a last resume point, then every rank stops at this step."""
        self.flush()
        self.save()
        self.checkpoints.wait()
        wait_for_lead()  # the others stop once rank 0's resume point is written
        raise stopping.stop_exception(f"resume point written at step {self.state.step} of {self.task.total} "
                                      f"({self.out_dir / 'last'}); rerun to continue from it")

    def step(self) -> bool:
        """One training step with what follows it on schedule: logging, a dev evaluation (``on_eval`` told), a
        resume point. Returns whether it evaluated."""
        task, state = self.task, self.state
        task.before_step(state, self.checkpoints)
        batch = task.batch(state.step)
        step_seed = self.cfg.base.seed * 1_000_003 + state.step  # the step's own random draws: resumable
        try:
            terms = task.step(batch, step_seed, (self.rank, self.size))
        except Exception as err:
            if is_out_of_memory(err):
                raise TrainingOutOfMemory(out_of_memory_message(self.cfg, state.step + 1, self.resumed_from)) from None
            raise
        task.scheduler.step()
        state.step += 1
        self.watch.observe(state.step, terms["loss"], watched_norm(terms, task.update.scaler))
        if state.step % LOG_EVERY == 0 or task.logs_every_step(batch):
            metrics: dict[str, Any] = {k if k.startswith(STAT) else f"loss/{k}": v.detach() for k, v in terms.items()}
            # the rate as a float: a compiled step's schedule holds it in a CPU tensor, not on the device
            self.pending.append((metrics | {"lr": float(task.scheduler.get_last_lr()[0])}, state.step))
        # a phase's end (the run's, VSE++'s frozen phase) comes with a dev score and a resume point
        ends = state.step == task.total or task.ends_phase(state.step)
        evaluating = state.step % self.cfg.train.eval_steps == 0 or ends
        checkpointing = state.step % self.cfg.train.checkpoint_steps == 0 or ends
        if evaluating:
            self.evaluate()
            if self.hooks.on_eval:
                try:
                    self.hooks.on_eval(state.step, self.last_dev)
                except StoppedEarly as stop:  # a planned stop leaves its best checkpoint and a resume point
                    self.flush()
                    self.save()
                    self.checkpoints.wait()
                    stop.best_score, stop.best_step = state.best_score, state.best_step
                    raise
        if state.step % FLUSH_EVERY == 0 or checkpointing:
            self.flush()
        if checkpointing:
            self.save()
            self.resumed_from = state.step
        return evaluating

    # ---------------------------------------------------------------- the run

    def run(self) -> TrainResult:
        """The run from its start or resume point to its last step; a resume point being written when it ends (an
        error, a stop) is on disk before it returns or raises."""
        try:
            return self._run()
        except BaseException:
            try:
                self.checkpoints.wait()
            except Exception as err:  # the run's own error is the one to raise; this one is said
                log.warning("the last resume point could not be written: %s", err)
            raise

    def _run(self) -> TrainResult:
        task = self.task
        self.state = self.checkpoints.start(task.model, task.update.optimizer, task.scheduler, task.update.scaler)
        if self.checkpoints.restored and self.state.step >= task.total:  # finished before: its checked best/
            return self.checkpoints.finish(finished(self.state, self.checkpoints.best, self.lead))
        self.resumed_from = self.state.step or None
        task.restored(self.state)
        if self.state.step == 0:
            self.evaluate()
            if task.total == 0:  # train.epochs: 0, the initial model evaluated (MCSEO Table 1's untrained rows)
                self.flush()
                self.save()
        history = self.state.history
        self.last_dev = history[-1]["dev"] if history and "dev" in history[-1] else math.nan
        task.model.train()
        bar = tqdm(total=task.total, initial=self.state.step, desc=f"train {self.cfg.train.method}", unit="step",
                   disable=not (self.hooks.progress and self.lead))
        try:
            with stopping.graceful():  # SIGTERM / Ctrl-C: a last resume point at the next step, then KILLED
                while self.state.step < task.total:
                    if any_rank(stopping.requested()):  # every rank stops at the same step
                        self.stop()
                    if self.step() or self.state.step % FLUSH_EVERY == 0:
                        bar.set_postfix({"loss": f"{self.shown_loss:.3f}", task.dev_label: f"{self.last_dev:.1f}"})
                    bar.update(1)
        finally:
            bar.close()
            task.close()
        self.flush()
        self.checkpoints.wait()
        wait_for_lead()  # rank 0's last save is on disk before any rank reports the run finished
        return self.checkpoints.finish(finished(self.state, self.checkpoints.best, self.lead))


def fit(task: TrainTask, cfg: Config, out_dir: str | Path, hooks: Hooks | None = None) -> TrainResult:
    """Train ``task`` as ``cfg`` says; keep the best dev checkpoint in ``out_dir/best`` and a resume point in
    ``out_dir/last`` (a run of the same configuration continues it). The MLflow run is the caller's."""
    return Loop(task, cfg, Path(out_dir), hooks or Hooks()).run()
