"""The students' training loop (SimCSE, MCSE, KDMCSE, DALR, MCSEO): one batch's loss terms
(`training_step_loss`), the update (`optimizer_step`) and `train`, which evaluates on dev, keeps the
best weights and writes resume points (`mmcse.training.checkpoints`) on the batches of
`mmcse.training.batches`."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import get_linear_schedule_with_warmup

from mmcse import stopping
from mmcse.config import RETRIEVAL_METHODS, Config, TrainConfig
from mmcse.errors import StageError, TrainingDiverged, TrainingOutOfMemory
from mmcse.evaluation.geometry import POSITIVE_GOLD, check_sts_geometry, sts_geometry
from mmcse.evaluation.sts import PRIMARY_METRIC, evaluate_sts, student_encoder
from mmcse.io import write_json
from mmcse.methods.losses import (
    IGNORED,
    aggregated_teacher_embedding,
    mlm_masking,
    span_mean,
    text_teacher_similarity,
)
from mmcse.methods.objectives import (
    STAT,
    Objective,
    StepEmbeddings,
    active_terms,
    image_head,
    needed_features,
    needed_inputs,
    step_objective,
)
from mmcse.methods.terms.simcse import MLM
from mmcse.models.device import resolve_device
from mmcse.models.dropout import install_keyed_dropout
from mmcse.models.export import EVAL_MAX_SEQ_LEN, export_sentence_transformers
from mmcse.models.precision import (
    autocast,
    check_precision,
    configure_kernels,
    deterministic_kernels,
    fused_adamw_supported,
    grad_scaler,
)
from mmcse.models.student import Student, load_backbone, load_mlm_head, load_tokenizer, save_student
from mmcse.training.batches import Batches, BatchFeatures, TrainData, check_inputs
from mmcse.training.checkpoints import Checkpoints, TrainState, kept_dir, run_definition_hash
from mmcse.training.distributed import ShardedTokens, any_rank, average_gradients, from_lead, wait_for_lead, world
from mmcse.training.divergence import DivergenceWatch
from mmcse.training.gradcache import CachedTokens, TokenEncoder, direct_tokens, passes_note
from mmcse.training.schedule import PAIR, TEXT

log = logging.getLogger(__name__)


LOG_EVERY = 5  # steps between logged loss values


# Steps between reading logged values back from the device: each read waits for the GPU to
# finish (a host sync), so values are kept on the device and read in one go this often.
FLUSH_EVERY = 50


StepLogger = Callable[[list[tuple[dict[str, float], int]]], None]  # a batch of (metrics, step)


EvalCallback = Callable[[int, float], None]


# Dev geometry (Wang & Isola; DALR Table 6) logged at every dev evaluation: metric name -> key of
# `mmcse.evaluation.geometry.sts_geometry`; the same names are the keys of a dev history entry.
DEV_GEOMETRY = {"dev_alignment": "alignment", "dev_uniformity": "uniformity"}


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
    none: a history begun by a version that did not log it)."""
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
    """AdamW (no weight decay on biases and LayerNorm), fused (one kernel for all parameters) on
    CUDA, with linear warmup and decay to 0, or with ``train.lr_decay_epochs`` = N the rate ÷10
    every N epochs of ``steps_per_epoch`` steps (VSE++'s schedule)."""
    decay, no_decay = [], []
    for name, p in student.named_parameters():
        (no_decay if p.ndim < 2 or "LayerNorm" in name else decay).append(p)
    fused = device is not None and fused_adamw_supported(device)
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": train.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=train.learning_rate, fused=fused or None,
    )
    if train.lr_decay_epochs:
        if steps_per_epoch < 1:
            raise ValueError("train.lr_decay_epochs needs the number of steps an epoch has")
        every = train.lr_decay_epochs * steps_per_epoch
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.1 ** (step // every))
    else:
        scheduler = get_linear_schedule_with_warmup(optimizer, int(train.warmup_ratio * total_steps), total_steps)
    return optimizer, scheduler


GRAD_NORM = f"{STAT}grad_norm"  # a step's gradient L2 norm before clipping: logged, and watched for divergence


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


def training_step_loss(
    student: Student,
    o: Objective,
    batch: dict[str, torch.Tensor],
    feats: BatchFeatures | None,
    pair_batch: bool,
    seed: int = 0,
    on: dict[str, bool] | None = None,
    encode: TokenEncoder | None = None,
) -> dict[str, torch.Tensor]:
    """Loss terms of one batch: two dropout passes (as one doubled batch) through the
    student, then every active term of the method on those embeddings and the cached
    teacher features ``feats`` (no teacher runs here). ``seed`` seeds the step's random
    draws (DALR mismatched pairs, ranking ties, keyed dropout); ``on`` is ``active_terms(o)``, worked
    out once per run by the training loop; ``encode`` runs the encoder (default: one pass with its
    graph; `mmcse.training.gradcache.CachedTokens`: micro-batches, cached)."""
    ids, mask = batch["input_ids"], batch["attention_mask"]
    n = ids.shape[0]
    encode = encode or direct_tokens(student, seed)
    rows = torch.arange(2 * n, device=ids.device)  # (2B,): each row's dropout key (two views, two keys)
    tokens = encode(ids.repeat(2, 1), mask.repeat(2, 1), rows)  # (2B, L, H): two dropout masks
    cls = tokens[:, 0]  # (2B, H)
    z = student.mlp(cls)  # (2B, H)
    e = StepEmbeddings(z1=z[:n], z2=z[n:], pair_batch=pair_batch)
    on = on if on is not None else active_terms(o)
    wanted = needed_inputs(o, pair_batch, on)  # what this batch's active terms read
    feats = feats or BatchFeatures()
    if "mlm" in wanted:
        if student.mlm_head is None:
            raise ValueError("loss.simcse.mlm is on, but the student was built without its LM head (load_mlm_head)")
        head = student.mlm_head
        # SimCSE masks each of its two copies of a sentence on its own (train.py mask_tokens)
        masked, labels = mlm_masking(ids.repeat(2, 1), head.special_ids, head.mask_id, head.vocab,
                                     o.loss.simcse.mlm_probability, MLM.generator(seed))  # (2B, L) each
        chosen = labels != IGNORED  # (2B, L)
        masked_states = encode(masked, mask.repeat(2, 1), rows + 2 * n)  # (2B, L, H): its own dropout
        e.mlm_logits = head(masked_states[chosen])  # (M, V): only the chosen tokens reach the vocabulary
        e.mlm_labels = labels[chosen]  # (M,)
    if pair_batch and "s" in wanted:
        s = student.text_proj(cls)  # (2B, p): g_φ1 on [CLS] (MCSE Eq. 2)
        e.s1, e.s2 = s[:n], s[n:]
    if feats.image is not None:
        e.image = student.image_proj(feats.image)  # (B, p): g_φ2 on frozen image features
    if feats.joint_text is not None:
        e.joint_text, e.joint_image = feats.joint_text, feats.joint_image
        if "teacher_text" in wanted:
            e.teacher_text = student.teacher_text_proj(feats.joint_text)  # (B, p): g_φt(t̂)
        if "teacher_image" in wanted:
            e.teacher_image = student.teacher_image_proj(feats.joint_image)  # (B, p): g_φv(v̂)
        if "shared_text" in wanted or "shared_image" in wanted:
            e.shared_text = student.shared_text(cls[:n])  # (B, p)
            e.shared_image = student.shared_image(feats.joint_image)  # (B, p)
    if feats.text_teachers is not None:
        if "text_teacher_sim" in wanted:
            with torch.no_grad():
                e.text_teacher_sim = text_teacher_similarity(feats.text_teachers, feats.text_weights,
                                                             o.loss.dalr.teacher_weighting)  # (B, B)
        if "text_teacher" in wanted:
            # DALR h^t = g_φt(f_t(t)) (Eq. 3): one projected text teacher for L_CMA's and L_IMA's Q^{t2t}
            e.text_teacher = student.text_teacher_proj(
                aggregated_teacher_embedding(feats.text_teachers, feats.text_weights))  # (B, p)
    if feats.objects is not None:
        phrase_states = span_mean(tokens[:n], feats.object_row, feats.object_start, feats.object_end)  # (T, H)
        e.phrases = student.text_proj(phrase_states)  # (T, p)
        e.objects = student.image_proj(feats.objects)  # (T, p)
        e.object_pair = feats.object_row
    return step_objective(o, e, seed, on)


def optimizer_step(
    student: Student,
    o: Objective,
    train: TrainConfig,
    batch: dict[str, torch.Tensor],
    feats: BatchFeatures | None,
    pair_batch: bool,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    device: torch.device,
    seed: int = 0,
    on: dict[str, bool] | None = None,
    ranks: tuple[int, int] = (0, 1),
) -> dict[str, torch.Tensor]:
    """One training step: the forward pass under ``train.precision``'s autocast, backward
    (through the fp16 loss scaler when enabled) and the optimizer update. Returns the loss
    terms and the gradient norm (`GRAD_NORM`), still on the device (reading them is a host sync the
    caller defers). With ``train.micro_batch`` the encoder runs that many sentences per pass
    (`mmcse.training.gradcache`): the same update as the whole batch's. ``ranks`` = (this rank, world
    size) of a job over several processes, each given the step's whole ``batch`` and ``feats``: the rank
    encodes its share of the rows (`mmcse.training.distributed`), the same update as one process's."""
    rank, size = ranks
    if size > 1 and train.dropout_rng != "per_row":
        raise ValueError("a step over several processes needs train.dropout_rng: per_row (a row's dropout masks "
                         "must not depend on which rank encodes it)")
    cached = (CachedTokens(student, seed, 2 * train.micro_batch, lambda: autocast(train.precision, device))
              if train.micro_batch else None)
    encode = cached if size == 1 else ShardedTokens(cached or direct_tokens(student, seed), rank, size)
    with autocast(train.precision, device):
        terms = training_step_loss(student, o, batch, feats, pair_batch, seed, on, encode=encode)
    optimizer.zero_grad(set_to_none=True)
    scaler.scale(terms["loss"]).backward()
    if cached is not None:
        cached.backward()  # the encoder's share, micro-batch by micro-batch
    average_gradients(student.parameters(), size)  # over ranks: the one-process gradient
    return terms | {GRAD_NORM: clipped_update(student, train, optimizer, scaler)}


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


def train(
    cfg: Config,
    data_dir: str | Path,
    teachers_dir: str | Path,
    out_dir: str | Path,
    log_metrics: StepLogger | None = None,
    on_eval: EvalCallback | None = None,
    progress: bool = True,
    objects_dir: str | Path | None = None,
    teacher_manifest: str | Path | None = None,
    teacher_dirs: Sequence[str | Path] = (),
) -> TrainResult:
    """Train a student; keep the best dev checkpoint in ``out_dir/best`` (HF folder,
    safetensors) and a resume point in ``out_dir/last``. ``on_eval(step, score)`` may
    raise to stop early (Optuna pruning). ``log_metrics`` receives batches of
    ``(metrics, step)``: logged values are read back from the device every
    ``FLUSH_EVERY`` steps and at every dev evaluation, not per step. ``objects_dir`` (default
    ``<data_dir>/../objects``), ``teacher_manifest`` and ``teacher_dirs``: where the job's
    upstream artifacts are (`mmcse.integrity.keys`). The MLflow run is the caller's
    (`mmcse.pipeline.train.run_train` remembers it per folder: `resume_point_run`). Every dev
    evaluation also logs the dev geometry (``dev_alignment``, ``dev_uniformity``: `DEV_GEOMETRY`)
    into the history entry and ``log_metrics``; the best checkpoint's is ``TrainResult.best_geometry``."""
    data_dir, teachers_dir, out_dir = Path(data_dir), Path(teachers_dir), Path(out_dir)
    objects_dir = Path(objects_dir) if objects_dir is not None else data_dir.parent / "objects"
    manifest = Path(teacher_manifest) if teacher_manifest is not None else None
    shared_teachers = [Path(d) for d in teacher_dirs]
    check_inputs(data_dir, teachers_dir, manifest, shared_teachers)
    device = resolve_device(cfg.base.device)
    check_precision(cfg.train.precision, device)
    if (note := passes_note(cfg.train.batch_size, cfg.train.micro_batch, world()[1])) and world()[0] == 0:
        log.warning("%s", note)
    data = TrainData.load(data_dir, teachers_dir, objects_dir, manifest, shared_teachers)
    # the dev geometry needs positive pairs (gold >= 4) and two sentences: refused before any compute
    check_sts_geometry(data.dev, POSITIVE_GOLD, str(data_dir / "sts" / "dev.jsonl"))
    objective = Objective.of(cfg)
    on = active_terms(objective)  # per run, not per step
    need = {kind: needed_features(objective, kind == PAIR, on) for kind in (TEXT, PAIR)}
    widths = sorted({store.dim for store in data.text_captions})
    aggregates = cfg.loss.dalr.teacher_weighting == "embeddings" and "text_teachers" in need[TEXT] | need[PAIR]
    if aggregates and len(widths) > 1:
        raise ValueError(f"teachers.text: embeddings of widths {widths} cannot be aggregated with "
                         "loss.dalr.teacher_weighting: embeddings (DALR App. B); use teachers of one width, or "
                         "loss.dalr.teacher_weighting: similarities with loss.dalr.teacher_space: raw")
    if "objects" in need[PAIR]:
        data.check_objects(cfg.detect.min_objects, cfg.model.max_seq_len, objects_dir)
    if device.type == "cuda":  # deterministic cuBLAS (bit-identical resume); read when cuBLAS starts
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    configure_kernels(device)
    torch.manual_seed(cfg.base.seed)
    deterministic_kernels()

    tokenizer = load_tokenizer(cfg.model.name_or_path)
    tokens = data.token_tables(tokenizer, cfg.model.max_seq_len, data_dir.parent / "tokens")
    backbone = load_backbone(cfg.model, dropout=cfg.train.dropout)
    if cfg.train.dropout_rng == "per_row":  # each row's masks from (step, row, layer) alone: micro-batches replay them
        install_keyed_dropout(backbone)
    student = Student(backbone, data.image_features.dim, cfg.model.proj_dim, data.joint_image.dim,
                      text_teacher_dim=widths[0], head=cfg.model.projection_head,
                      joint_text_dim=data.joint_text.dim).to(device)
    if on.get("mlm"):  # after the heads above: their initial weights do not move with the switch
        student.mlm_head = load_mlm_head(cfg.model, tokenizer, cfg.loss.simcse.mlm_head).to(device)
    if cfg.train.compile:
        # in place, so parameter names (checkpoints, resume points) do not change
        student.backbone.compile(dynamic=True)

    batches = Batches(len(data.corpus), len(data.captions), cfg.train.batch_size, cfg.base.seed)
    total = len(batches) * cfg.train.epochs
    if cfg.train.max_steps:
        total = min(total, cfg.train.max_steps)
    optimizer, scheduler = build_optimizer(student, cfg.train, total, device, steps_per_epoch=len(batches))
    scaler = grad_scaler(cfg.train.precision, device)

    # one encoder for the run: it keeps the dev batches' token ids on the device
    dev_encode = student_encoder(student, tokenizer, cfg.evaluate.pooler, cfg.model.max_seq_len, device,
                                 cfg.train.precision, keep_tokens=True)

    def save_best(tmp: Path, state: TrainState) -> None:
        save_student(student, tokenizer, tmp)
        # the method and its retrieval head travel with the checkpoint (`mmcse eval --retrieval`)
        write_json(tmp / "train_state.json", {"step": state.best_step, "dev": state.best_score,
                                              **best_geometry(state.history, state.best_step),
                                              "method": cfg.train.method, "image_head": image_head(objective)})
        # also a sentence-transformers folder pooling as the evaluate stage does (at its length)
        export_sentence_transformers(tmp, cfg.evaluate.pooler, EVAL_MAX_SEQ_LEN)

    # The best weights are held in (device) memory and written with the next resume point: writing a
    # BERT-base folder at every improvement would cost seconds per dev evaluation, and on disk the best
    # checkpoint and the resume point's best_score must agree after a kill (`Checkpoints`).
    # several processes (train.devices): each encodes its share of every batch; rank 0 alone evaluates on dev,
    # holds the best weights and writes, and the others take its dev score (`mmcse.training.distributed`)
    rank, size = world()
    lead = rank == 0
    config_hash = run_definition_hash(cfg)
    checkpoints = Checkpoints(out_dir, config_hash, save_best, writes=lead,
                              kept=kept_dir(cfg, out_dir, config_hash))
    state = checkpoints.start(student, optimizer, scheduler, scaler)
    if checkpoints.restored and state.step >= total:  # finished before: its checked best/ is the result
        return checkpoints.finish(finished(state, checkpoints.best, lead))
    resumed_from = state.step if state.step else None
    watch = DivergenceWatch(device)

    def dev_score() -> tuple[float, dict[str, float]]:
        """Dev STS (primary metric, logged as ``dev_sts``; with several dev tasks each one's score is
        also logged, as ``dev_<task>``) and the dev
        geometry (``DEV_GEOMETRY``: alignment of the pairs with gold >= 4, uniformity of every
        distinct dev sentence) from the same embeddings, so the dev set is encoded once."""
        if lead:
            student.eval()
            result = evaluate_sts(dev_encode, data.dev, cfg.evaluate.batch_size, keep_vectors=True)
            student.train()
            geometry = sts_geometry(result.vectors, data.dev, POSITIVE_GOLD)
            pending.append(({f"dev_{task}": v for task, v in result.scores.items() if task != PRIMARY_METRIC},
                            state.step))
            values = [result.primary, *(geometry[key] for key in DEV_GEOMETRY.values())]
        else:
            values = [0.0] * (1 + len(DEV_GEOMETRY))
        score, *shape = from_lead(values)  # the same weights on every rank: rank 0's score is every rank's
        return score, dict(zip(DEV_GEOMETRY, shape, strict=True))

    # Logged values stay on the device until a flush reads them all back at once.
    pending: list[tuple[dict[str, Any], int]] = []
    shown: dict[str, float] = {}

    def record(entries: list[tuple[dict[str, Any], int]]) -> None:
        """Hand logged values to ``log_metrics``; when the tracking store fails for good (locked past its
        retries), a last resume point first: nothing trained is lost to a logging failure."""
        if not log_metrics or not entries:
            return
        try:
            log_metrics(entries)
        except StageError:
            checkpoints.save(student, optimizer, scheduler, scaler, state)
            raise

    def flush() -> None:
        watch.check(cfg)  # a diverged run stops here, before anything reads or saves its weights
        entries = read_back(pending)
        for metrics, step in entries:
            if "loss/loss" in metrics and step % LOG_EVERY == 0:
                state.history.append({"step": step, "loss": metrics["loss/loss"]})
            if "loss/loss" in metrics:
                shown["loss"] = metrics["loss/loss"]
        record(entries)

    def evaluate_now() -> float:
        watch.check(cfg)
        score, geometry = dev_score()
        flush()  # the losses logged before this evaluation go first in the history
        state.history.append({"step": state.step, "dev": score, **geometry})
        checkpoints.consider(score, state, student)
        record([({"dev_sts": score, **geometry}, state.step)])
        return score

    if state.step == 0:
        evaluate_now()
        if total == 0:  # train.epochs: 0, the initial encoder evaluated (MCSEO Table 1's untrained rows)
            flush()
            checkpoints.save(student, optimizer, scheduler, scaler, state)

    student.train()
    bar = tqdm(total=total, initial=state.step, desc=f"train {cfg.train.method}", unit="step",
               disable=not (progress and lead))
    last_dev = state.history[-1]["dev"] if state.history and "dev" in state.history[-1] else float("nan")
    order_epoch, order = -1, []
    try:
        with stopping.graceful():  # SIGTERM / Ctrl-C: a last resume point at the next step, then KILLED
            while state.step < total:
                if any_rank(stopping.requested()):  # every rank stops at the same step
                    flush()
                    checkpoints.save(student, optimizer, scheduler, scaler, state)
                    wait_for_lead()  # the others stop once rank 0's resume point is written
                    raise stopping.stop_exception(f"resume point written at step {state.step} of {total} "
                                                  f"({out_dir / 'last'}); rerun to continue from it")
                epoch, offset = divmod(state.step, len(batches))
                if epoch != order_epoch:
                    order_epoch, order = epoch, batches.epoch(epoch)
                kind, idx = order[offset]
                if kind == TEXT:
                    feats = data.text_features(idx, need[TEXT], device)
                else:
                    feats = data.pair_features(idx, need[PAIR], device)
                batch = tokens[kind].batch(idx, device)
                step_seed = cfg.base.seed * 1_000_003 + state.step  # the step's own random draws: resumable
                try:
                    terms = optimizer_step(student, objective, cfg.train, batch, feats, kind == PAIR, optimizer,
                                           scaler, device, seed=step_seed, on=on, ranks=(rank, size))
                except Exception as err:
                    if is_out_of_memory(err):
                        raise TrainingOutOfMemory(out_of_memory_message(cfg, state.step + 1, resumed_from)) from None
                    raise
                scheduler.step()
                state.step += 1
                watch.observe(state.step, terms["loss"], watched_norm(terms, scaler))
                if state.step % LOG_EVERY == 0 or kind == PAIR:  # every image term is logged
                    metrics: dict[str, Any] = {k if k.startswith(STAT) else f"loss/{k}": v.detach()
                                               for k, v in terms.items()}
                    pending.append((metrics | {"lr": scheduler.get_last_lr()[0]}, state.step))
                evaluating = state.step % cfg.train.eval_steps == 0 or state.step == total
                checkpointing = state.step % cfg.train.checkpoint_steps == 0 or state.step == total
                if evaluating:
                    last_dev = evaluate_now()
                    if on_eval:
                        on_eval(state.step, last_dev)
                if state.step % FLUSH_EVERY == 0 or checkpointing:
                    flush()
                if checkpointing:
                    checkpoints.save(student, optimizer, scheduler, scaler, state)
                    resumed_from = state.step
                if evaluating or state.step % FLUSH_EVERY == 0:
                    bar.set_postfix(loss=f"{shown.get('loss', float('nan')):.3f}", dev=f"{last_dev:.1f}")
                bar.update(1)
    finally:
        bar.close()
    wait_for_lead()  # rank 0's last save is on disk before any rank reports the run finished
    return checkpoints.finish(finished(state, checkpoints.best, lead))


def finished(state: TrainState, best_dir: Path, lead: bool = True) -> TrainResult:
    """The result of a finished run; one without a best checkpoint (no dev evaluation gave a finite
    score) is an error, not a result without a model. A rank other than 0 (``lead`` false) does not look:
    rank 0 wrote ``best_dir``, maybe on another machine's disk."""
    if lead and (state.best_step < 0 or not best_dir.is_dir()):
        raise TrainingDiverged(f"{best_dir}: no dev evaluation of this run gave a finite score (the model returns "
                               "the same or non-finite vectors), so there is no best checkpoint")
    return TrainResult(state.best_score, state.best_step, state.step, best_dir, state.history)
