"""The students' training (SimCSE, MCSE, KDMCSE, DALR, MCSEO): one batch's loss terms
(`training_step_loss`), the update (`optimizer_step`) and `StudentTask`, what the one training loop
(`mmcse.training.engine.fit`) runs for a student: the batches of `mmcse.training.batches`, dev STS with the dev
geometry, and the best checkpoint as an HF folder with a sentence-transformers export."""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Any

import torch

from mmcse.config import Config, ConfigError
from mmcse.errors import InputError
from mmcse.evaluation.geometry import POSITIVE_GOLD, check_sts_geometry, sts_geometry
from mmcse.evaluation.sts import PRIMARY_METRIC, evaluate_sts, student_encoder
from mmcse.integrity.keys import Upstream
from mmcse.io import write_json
from mmcse.methods.losses import mlm_draws
from mmcse.methods.objectives import (
    Objective,
    StepEmbeddings,
    active_terms,
    image_head,
    needed_features,
    needed_inputs,
)
from mmcse.methods.step import step_objective, term_draws, term_generator
from mmcse.methods.terms.dalr import cma_width_problem
from mmcse.methods.terms.simcse import MLM
from mmcse.models.dropout import install_keyed_dropout
from mmcse.models.export import EVAL_MAX_SEQ_LEN, export_sentence_transformers
from mmcse.models.precision import grad_scaler
from mmcse.models.student import Student, load_backbone, load_mlm_head, load_tokenizer, save_student
from mmcse.training.batches import Batches, BatchFeatures, TrainData, check_inputs
from mmcse.training.checkpoints import TrainState
from mmcse.training.compiled import BACKBONE, STEP, compile_graph, fresh_graphs, loud, on_device, seed_tensor
from mmcse.training.distributed import ShardedTokens, world
from mmcse.training.engine import (
    DEV_GEOMETRY,
    DevScore,
    Hooks,
    TrainResult,
    TrainTask,
    Update,
    best_geometry,
    build_optimizer,
    fit,
    seed_kernels,
    training_device,
)
from mmcse.training.gradcache import CachedTokens, TokenEncoder, direct_tokens, keyed_states, passes_note
from mmcse.training.inputs import StepPass, produce
from mmcse.training.schedule import PAIR, TEXT
from mmcse.training.step import Forward, TrainStep

log = logging.getLogger(__name__)


def step_draws(student: Student, o: Objective, shape: tuple[int, int], pair_batch: bool, seed: int,
               on: dict[str, bool] | None = None) -> dict[str, Any]:
    """A step's random draws on the host, for a batch of ``shape`` = (B, L) token ids: the terms' (`term_draws`) and,
    when SimCSE's MLM runs, its masks' numbers for the doubled batch (`mlm_draws`, under ``"mlm"``)."""
    n, length = shape
    on = on if on is not None else active_terms(o)
    draws: dict[str, Any] = term_draws(o, n, pair_batch, seed, on)
    if "mlm" in needed_inputs(o, pair_batch, on) and student.mlm_head is not None:
        draws["mlm"] = mlm_draws((2 * n, length), student.mlm_head.vocab, term_generator(MLM, seed))
    return draws


def training_step_loss(
    student: Student,
    o: Objective,
    batch: dict[str, torch.Tensor],
    feats: BatchFeatures | None,
    pair_batch: bool,
    seed: int | torch.Tensor = 0,
    on: dict[str, bool] | None = None,
    encode: TokenEncoder | None = None,
    draws: dict[str, Any] | None = None,
) -> dict[str, torch.Tensor]:
    """Loss terms of one batch: two dropout passes (as one doubled batch) through the student, the inputs the
    batch's running terms read (each made by its producer, `mmcse.training.inputs.PRODUCERS`, from that pass and the
    cached teacher features ``feats``: no teacher runs here), then every running term. ``seed`` seeds the step's
    keyed dropout and, when ``draws`` is not given, its random draws (`step_draws`: DALR's mismatched pairs, ranking
    ties, MLM masks); a compiled step passes ``seed`` as a 0-d tensor and the draws made ahead. ``on`` is
    ``active_terms(o)``, worked out once per run; ``encode`` runs the encoder (default: one pass with its graph;
    `mmcse.training.gradcache.CachedTokens`: micro-batches, cached)."""
    ids, mask = batch["input_ids"], batch["attention_mask"]
    n = ids.shape[0]
    on = on if on is not None else active_terms(o)
    if draws is None:
        if not isinstance(seed, int):
            raise TypeError("training_step_loss: a tensor seed needs the step's draws (step_draws) made ahead")
        draws = step_draws(student, o, (n, ids.shape[1]), pair_batch, seed, on)
    encode = encode or direct_tokens(student, seed)
    rows = torch.arange(2 * n, device=ids.device)  # (2B,): each row's dropout key (two views, two keys)
    tokens = encode(ids.repeat(2, 1), mask.repeat(2, 1), rows)  # (2B, L, H): two dropout masks
    z = student.mlp(tokens[:, 0])  # (2B, H)
    e = StepEmbeddings(z1=z[:n], z2=z[n:], pair_batch=pair_batch)
    step_pass = StepPass(student, o, ids, mask, rows, tokens, feats or BatchFeatures(), encode, draws)
    produce(step_pass, e, needed_inputs(o, pair_batch, on))
    return step_objective(o, e, on=on, draws=draws)


class StudentStep:
    """A student's training step, built once per run (the train stage, ablation jobs, preflight, the benchmarks):
    `training_step_loss` of each batch kind as the forward of one `mmcse.training.step.TrainStep`, eager or compiled
    (``train.compile: step``). ``step(batch, feats, pair_batch, seed, ranks)`` makes the step's random draws on the
    host, then the forward under ``train.precision``'s autocast, backward (through the fp16 loss scaler when
    enabled) and the update; returns the loss terms and the gradient norm (`GRAD_NORM`), still on the device.

    With ``train.micro_batch`` the encoder runs that many sentences per pass (`mmcse.training.gradcache`): the same
    update as the whole batch's; compiled, those passes are the graphs (the loss on their cached states runs
    eager). ``ranks`` = (this rank, world size) of a job over several processes, each given the step's whole batch
    and features: the rank encodes its share of the rows (`mmcse.training.distributed`), the same update as one
    process's."""

    def __init__(self, student: Student, o: Objective, update: Update, on: dict[str, bool] | None = None,
                 compiled: bool = False, backend: str | None = None) -> None:
        self.student, self.o, self.update = student, o, update
        self.on = on if on is not None else active_terms(o)
        micro = update.train.micro_batch
        self.step = TrainStep(student, update, self._forward, compiled=compiled and not micro, backend=backend)
        self.passes: Callable[..., torch.Tensor] | None = None
        if compiled and micro:  # the loss on the cached states runs eager; its encoder passes are the graphs
            fresh_graphs()
            autocast = update.autocast

            def encoder_pass(ids: torch.Tensor, mask: torch.Tensor, rows: torch.Tensor,
                             seed: torch.Tensor) -> torch.Tensor:
                with autocast():
                    return keyed_states(student, ids, mask, rows, seed)

            self.passes = compile_graph(encoder_pass, update.device, backend)

    def _forward(self, pair_batch: Hashable) -> Forward:
        student, o, on = self.student, self.o, self.on

        def forward(ids: torch.Tensor, mask: torch.Tensor, feats: BatchFeatures, seed: int | torch.Tensor,
                    draws: dict[str, Any], encode: TokenEncoder | None) -> dict[str, torch.Tensor]:
            return training_step_loss(student, o, {"input_ids": ids, "attention_mask": mask}, feats,
                                      bool(pair_batch), seed, on, encode=encode, draws=draws)

        return forward

    def _encoder(self, seed: int) -> TokenEncoder | None:
        """The compiled encoder pass of step ``seed`` (gradient-cached and compiled), else None (eager passes)."""
        if self.passes is None:
            return None
        passes, seed_t = self.passes, seed_tensor(seed, self.update.device)

        def encode(ids: torch.Tensor, mask: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
            with loud():
                return passes(ids, mask, rows, seed_t)

        return encode

    def __call__(self, batch: dict[str, torch.Tensor], feats: BatchFeatures | None, pair_batch: bool, seed: int = 0,
                 ranks: tuple[int, int] = (0, 1)) -> dict[str, torch.Tensor]:
        rank, size = ranks
        train, ids = self.update.train, batch["input_ids"]
        if size > 1 and train.dropout_rng != "per_row":
            raise ConfigError("a step over several processes needs train.dropout_rng: per_row (a row's dropout "
                              "masks must not depend on which rank encodes it)")
        draws = on_device(step_draws(self.student, self.o, tuple(ids.shape), pair_batch, seed, self.on),
                          self.update.device)
        cached = CachedTokens(self.student, seed, 2 * train.micro_batch, self.update.autocast,
                              encoder=self._encoder(seed)) if train.micro_batch else None
        encode = cached if size == 1 else ShardedTokens(cached or direct_tokens(self.student, seed), rank, size)
        # a gradient cache backpropagates the encoder's share after the loss's, micro-batch by micro-batch
        return self.step(pair_batch, ids, batch["attention_mask"], feats or BatchFeatures(), self.step.seed(seed),
                         draws, encode, size=size, after_backward=cached.backward if cached else None)


def optimizer_step(student: Student, o: Objective, batch: dict[str, torch.Tensor], feats: BatchFeatures | None,
                   pair_batch: bool, update: Update, seed: int = 0, on: dict[str, bool] | None = None,
                   ranks: tuple[int, int] = (0, 1)) -> dict[str, torch.Tensor]:
    """One eager step of a `StudentStep` made for it (a test's or a one-off's; a run builds its step once)."""
    return StudentStep(student, o, update, on)(batch, feats, pair_batch, seed, ranks)


def dev_length(cfg: Config, backbone: torch.nn.Module) -> int:
    """The tokens of a dev STS sentence the best checkpoint is picked on (``train.dev_truncation``): training's
    ``model.max_seq_len``, or (``none``) the whole sentence up to the encoder's own limit (its position embeddings,
    at most `EVAL_MAX_SEQ_LEN`), as the authors' ``evaluate()``, which pads without truncating."""
    if cfg.train.dev_truncation == "max_seq_len":
        return cfg.model.max_seq_len
    return min(EVAL_MAX_SEQ_LEN, int(getattr(backbone.config, "max_position_embeddings", EVAL_MAX_SEQ_LEN)))


class StudentTask(TrainTask):
    """A student's part of the training loop: its data and batches (`TrainData`, `Batches`), the objective's
    active terms, dev STS (primary metric, logged as ``dev_sts``; with several dev tasks each one's score as
    ``dev_<task>``) with the dev geometry (`DEV_GEOMETRY`) from the same embeddings, and the best checkpoint
    (HF folder, ``train_state.json``, a sentence-transformers export pooling as the evaluate stage does)."""

    dev_extras = tuple(DEV_GEOMETRY)

    def __init__(self, cfg: Config, data_dir: Path, teachers_dir: Path, upstream: Upstream | None = None) -> None:
        objects_dir = upstream.objects if upstream is not None else data_dir.parent / "objects"
        manifest = upstream.teacher_manifest if upstream is not None else None
        shared_teachers = list(upstream.teacher_dirs) if upstream is not None else []
        check_inputs(data_dir, teachers_dir, manifest, shared_teachers)
        self.cfg = cfg
        device = training_device(cfg)
        if (note := passes_note(cfg.train.batch_size, cfg.train.micro_batch, world()[1])) and world()[0] == 0:
            log.warning("%s", note)
        self.data = data = TrainData.load(data_dir, teachers_dir, objects_dir, manifest, shared_teachers)
        # the dev geometry needs positive pairs (gold >= 4) and two sentences: refused before any compute
        check_sts_geometry(data.dev, POSITIVE_GOLD, str(data_dir / "sts" / "dev.jsonl"))
        self.objective = Objective.of(cfg)
        self.on = on = active_terms(self.objective)  # per run, not per step
        self.need = {kind: needed_features(self.objective, kind == PAIR, on) for kind in (TEXT, PAIR)}
        widths = sorted({store.dim for store in data.text_captions})
        aggregates = (cfg.loss.dalr.teacher_weighting == "embeddings"
                      and "text_teachers" in self.need[TEXT] | self.need[PAIR])
        if aggregates and len(widths) > 1:
            raise InputError(f"teachers.text: embeddings of widths {widths} cannot be aggregated with "
                             "loss.dalr.teacher_weighting: embeddings (DALR App. B); use teachers of one width, or "
                             "loss.dalr.teacher_weighting: similarities with loss.dalr.teacher_space: raw")
        if "objects" in self.need[PAIR]:
            data.check_objects(cfg.detect.min_objects, cfg.model.max_seq_len, objects_dir)
        seed_kernels(cfg, device)

        self.tokenizer = tokenizer = load_tokenizer(cfg.model.name_or_path)
        self.tokens = data.token_tables(tokenizer, cfg.model.max_seq_len, data_dir.parent / "tokens")
        backbone = load_backbone(cfg.model, dropout=cfg.train.dropout)
        if problem := cma_width_problem(self.objective, on, backbone.config.hidden_size, data.joint_image.dim):
            raise ConfigError(problem)
        if cfg.train.dropout_rng == "per_row":  # each row's masks from (step, row, layer) alone: micro-batches replay
            install_keyed_dropout(backbone)
        self.model = student = Student(backbone, data.image_features.dim, cfg.model.proj_dim, data.joint_image.dim,
                                       text_teacher_dim=widths[0], head=cfg.model.projection_head,
                                       joint_text_dim=data.joint_text.dim).to(device)
        if on.get("mlm"):  # after the heads above: their initial weights do not move with the switch
            student.mlm_head = load_mlm_head(cfg.model, tokenizer, cfg.loss.simcse.mlm_head).to(device)
        if cfg.train.compile == BACKBONE:
            # in place, so parameter names (checkpoints, resume points) do not change
            student.backbone.compile(dynamic=True)

        try:
            self.batches = Batches(len(data.corpus), len(data.captions), cfg.train.batch_size, cfg.base.seed,
                                   cfg.train.batch_order)
        except ValueError as err:  # released order with more pair than text batches
            raise ConfigError(str(err)) from None
        total = len(self.batches) * cfg.train.epochs
        self.total = min(total, cfg.train.max_steps) if cfg.train.max_steps else total
        optimizer, self.scheduler = build_optimizer(student, cfg.train, self.total, device,
                                                    steps_per_epoch=len(self.batches))
        self.update = Update(cfg.train, optimizer, grad_scaler(cfg.train.precision, device), device)
        # train.compile: step: static shapes (full-width token batches); the step one graph per batch kind, or
        # with train.micro_batch its encoder passes (cached forward and replay) compiled
        self.full_width = cfg.train.compile == STEP
        self.train_step = StudentStep(student, self.objective, self.update, on, compiled=self.full_width)
        # one encoder for the run: it keeps the dev batches' token ids on the device
        self.dev_encode = student_encoder(student, tokenizer, cfg.evaluate.pooler, dev_length(cfg, backbone), device,
                                          cfg.train.precision, keep_tokens=True)
        self._order: tuple[int, list[tuple[str, Any]]] = (-1, [])  # (epoch, its batches)

    def batch(self, step: int) -> tuple[str, dict[str, torch.Tensor], BatchFeatures]:
        epoch, offset = divmod(step, len(self.batches))
        if epoch != self._order[0]:
            self._order = (epoch, self.batches.epoch(epoch))
        kind, idx = self._order[1][offset]
        device = self.update.device
        if kind == TEXT:
            feats = self.data.text_features(idx, self.need[TEXT], device)
        else:
            feats = self.data.pair_features(idx, self.need[PAIR], device)
        return kind, self.tokens[kind].batch(idx, device, full_width=self.full_width), feats

    def step(self, batch: tuple[str, dict[str, torch.Tensor], BatchFeatures], seed: int,
             ranks: tuple[int, int]) -> dict[str, torch.Tensor]:
        kind, tokens, feats = batch
        return self.train_step(tokens, feats, kind == PAIR, seed, ranks)

    def logs_every_step(self, batch: tuple[str, Any, Any]) -> bool:
        return batch[0] == PAIR  # every image term is logged

    def dev(self) -> DevScore:
        self.model.eval()
        result = evaluate_sts(self.dev_encode, self.data.dev, self.cfg.evaluate.batch_size, keep_vectors=True)
        self.model.train()
        geometry = sts_geometry(result.vectors, self.data.dev, POSITIVE_GOLD)
        extras = {name: geometry[key] for name, key in DEV_GEOMETRY.items()}
        per_task = {f"dev_{task}": v for task, v in result.scores.items() if task != PRIMARY_METRIC}
        return DevScore(result.primary, extras, per_task | {"dev_sts": result.primary, **extras})

    def save_best(self, tmp: Path, state: TrainState) -> None:
        cfg = self.cfg
        save_student(self.model, self.tokenizer, tmp)
        # the method and its retrieval head travel with the checkpoint (`mmcse eval --retrieval`)
        write_json(tmp / "train_state.json", {"step": state.best_step, "dev": state.best_score,
                                              **best_geometry(state.history, state.best_step),
                                              "method": cfg.train.method, "image_head": image_head(self.objective)})
        # also a sentence-transformers folder pooling as the evaluate stage does (at its length)
        export_sentence_transformers(tmp, cfg.evaluate.pooler, EVAL_MAX_SEQ_LEN)


def train(cfg: Config, data_dir: str | Path, teachers_dir: str | Path, out_dir: str | Path,
          hooks: Hooks | None = None, upstream: Upstream | None = None) -> TrainResult:
    """Train a student (`StudentTask` in `mmcse.training.engine.fit`); keep the best dev checkpoint in
    ``out_dir/best`` (HF folder, safetensors) and a resume point in ``out_dir/last``. ``upstream``: where the
    job's objects and teacher sets are (`mmcse.integrity.keys`; default ``<data_dir>/../objects`` and the
    teachers in ``teachers_dir``). Every dev evaluation also logs the dev geometry (``dev_alignment``,
    ``dev_uniformity``) into the history entry and ``log_metrics``; the best checkpoint's is
    ``TrainResult.best_geometry``."""
    task = StudentTask(cfg, Path(data_dir), Path(teachers_dir), upstream)
    return fit(task, cfg, out_dir, hooks)
