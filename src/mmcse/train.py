"""The ``train`` stage: SimCSE / MCSE student training with resumable checkpoints.

Batches alternate as in MCSE: text-only batches from the corpus, and one
image–caption batch after every ``len(text_loader) // len(pair_loader)`` text
batches. Data order is a pure function of (seed, epoch), so a resumed run
replays exactly the batches an uninterrupted run would have seen.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm
from transformers import get_linear_schedule_with_warmup

from mmcse.config import Config
from mmcse.data.senteval import SentencePair
from mmcse.evaluate import evaluate_sts, group_by_task, student_encoder
from mmcse.io import read_json, read_jsonl, write_json
from mmcse.losses import mcse_objective
from mmcse.models import Student, load_backbone, load_tokenizer, save_student
from mmcse.teachers import FeatureStore

TEXT, PAIR = "text", "pair"
LOG_EVERY = 5  # steps between logged loss values
StepLogger = Callable[[dict[str, float], int], None]
EvalCallback = Callable[[int, float], None]


def alternation_schedule(n_text: int, n_pair: int) -> list[str]:
    """One epoch's batch kinds: after every ``n_text // n_pair`` text batches one pair batch.

    Text batches left over once the pair batches run out come at the end; with more
    pair than text batches (ratio 0) the kinds alternate until the text runs out.
    """
    if n_pair == 0:
        return [TEXT] * n_text
    ratio = max(n_text // n_pair, 1)
    schedule: list[str] = []
    text_left, pair_left = n_text, n_pair
    while text_left or pair_left:
        take = min(ratio, text_left)
        schedule += [TEXT] * take
        text_left -= take
        if pair_left:
            schedule.append(PAIR)
            pair_left -= 1
    return schedule


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("params.yaml: base.device=cuda but no CUDA device is available (use cpu or auto)")
    return torch.device(name)


def check_inputs(data_dir: Path, teachers_dir: Path) -> None:
    """Fail before any run is started when an upstream stage's output is missing."""
    needed = [data_dir / "corpus.txt", data_dir / "pairs.jsonl", data_dir / "sts" / "dev.jsonl",
              teachers_dir / "manifest.json"]
    missing = [str(p) for p in needed if not p.is_file()]
    if missing:
        raise FileNotFoundError(
            f"missing inputs {', '.join(missing)}: run the download, detect_objects and cache_teachers stages "
            "first (dvc repro train)"
        )


@dataclass
class TrainData:
    corpus: list[str]
    captions: list[str]
    image_ids: list[str]
    image_features: FeatureStore
    dev: dict[str, list[SentencePair]]

    @classmethod
    def load(cls, data_dir: Path, teachers_dir: Path) -> TrainData:
        corpus = [s for s in (data_dir / "corpus.txt").read_text().splitlines() if s.strip()]
        pairs = read_jsonl(data_dir / "pairs.jsonl")
        empty = [p["pair_id"] for p in pairs if not p["caption"].strip()]
        if empty:
            raise ValueError(f"{data_dir / 'pairs.jsonl'}: empty captions in pairs {empty[:5]}")
        manifest = read_json(teachers_dir / "manifest.json")
        store = FeatureStore.open(teachers_dir / manifest["sets"]["image"])
        dev = group_by_task([SentencePair.from_row(r) for r in read_jsonl(data_dir / "sts" / "dev.jsonl")])
        return cls(corpus, [p["caption"] for p in pairs], [p["image_id"] for p in pairs], store, dev)


@dataclass
class TrainState:
    step: int = 0
    best_score: float = -math.inf
    best_step: int = -1
    history: list[dict[str, float]] = field(default_factory=list)


@dataclass
class TrainResult:
    best_score: float
    best_step: int
    steps: int
    best_dir: Path
    history: list[dict[str, float]]


class _Batches:
    """Deterministic per-epoch order of text and pair batches (drop_last)."""

    def __init__(self, n_text_items: int, n_pair_items: int, batch_size: int, seed: int):
        self.batch_size, self.seed = batch_size, seed
        self.n_text_items, self.n_pair_items = n_text_items, n_pair_items
        self.n_text, self.n_pair = n_text_items // batch_size, n_pair_items // batch_size
        if self.n_text + self.n_pair == 0:
            raise ValueError(
                f"train.batch_size={batch_size} exceeds both the corpus ({n_text_items}) and the pairs ({n_pair_items})"
            )
        self.schedule = alternation_schedule(self.n_text, self.n_pair)

    def __len__(self) -> int:
        return len(self.schedule)

    def epoch(self, epoch: int) -> list[tuple[str, list[int]]]:
        g = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
        text_order = torch.randperm(self.n_text_items, generator=g).tolist()
        pair_order = torch.randperm(self.n_pair_items, generator=g).tolist()
        cursors = {TEXT: 0, PAIR: 0}
        orders = {TEXT: text_order, PAIR: pair_order}
        out = []
        for kind in self.schedule:
            start = cursors[kind]
            out.append((kind, orders[kind][start : start + self.batch_size]))
            cursors[kind] = start + self.batch_size
        return out


def _swap_in(tmp: Path, final: Path) -> None:
    """Replace folder ``final`` by ``tmp`` so that one complete version always exists."""
    old = final.with_name(final.name + ".old")
    if old.exists():
        shutil.rmtree(old)
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    if old.exists():
        shutil.rmtree(old)


def _save_resume_point(
    folder: Path, student: Student, optimizer, scheduler, state: TrainState, config_hash: str
) -> None:
    tmp = folder.with_name(folder.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    save_file({k: v.detach().contiguous() for k, v in student.state_dict().items()}, str(tmp / "student.safetensors"))
    torch.save(
        {"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), "rng": torch.get_rng_state()},
        tmp / "trainer.pt",
    )
    (tmp / "state.json").write_text(
        json.dumps({"step": state.step, "best_score": state.best_score, "best_step": state.best_step,
                    "history": state.history, "config_hash": config_hash})
    )
    _swap_in(tmp, folder)


def _load_resume_point(folder: Path, student: Student, optimizer, scheduler, config_hash: str) -> TrainState | None:
    if not (folder / "state.json").is_file():
        old = folder.with_name(folder.name + ".old")
        if (old / "state.json").is_file():  # killed between the two renames of _swap_in
            folder = old
        else:
            return None
    meta = json.loads((folder / "state.json").read_text())
    if meta["config_hash"] != config_hash:
        return None  # a different configuration: start afresh rather than mix runs
    student.load_state_dict(load_file(str(folder / "student.safetensors")))
    trainer = torch.load(folder / "trainer.pt", weights_only=True)
    optimizer.load_state_dict(trainer["optimizer"])
    scheduler.load_state_dict(trainer["scheduler"])
    torch.set_rng_state(trainer["rng"])
    return TrainState(meta["step"], meta["best_score"], meta["best_step"], meta["history"])


def _tokenize(tokenizer, sentences: Sequence[str], max_len: int, device: torch.device) -> dict[str, torch.Tensor]:
    batch = tokenizer(list(sentences), padding=True, truncation=True, max_length=max_len, return_tensors="pt")
    return {"input_ids": batch["input_ids"].to(device), "attention_mask": batch["attention_mask"].to(device)}


def build_optimizer(student: torch.nn.Module, cfg: Config, total_steps: int):
    """AdamW (no weight decay on biases and LayerNorm) with linear warmup and decay to 0."""
    decay, no_decay = [], []
    for name, p in student.named_parameters():
        (no_decay if p.ndim < 2 or "LayerNorm" in name else decay).append(p)
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.train.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.train.learning_rate,
    )
    scheduler = get_linear_schedule_with_warmup(optimizer, int(cfg.train.warmup_ratio * total_steps), total_steps)
    return optimizer, scheduler


def training_step_loss(
    student: Student,
    cfg: Config,
    batch: dict[str, torch.Tensor],
    image_features: torch.Tensor | None,
) -> dict[str, torch.Tensor]:
    """Loss terms of one batch: two dropout passes (as one doubled batch), SimCSE, and the
    MCSE image term when ``image_features (B, d_img)`` are given and the method uses them."""
    ids, mask = batch["input_ids"], batch["attention_mask"]
    n = ids.shape[0]
    cls = student.cls(ids.repeat(2, 1), mask.repeat(2, 1))  # (2B, H): two dropout masks
    z = student.mlp(cls)  # (2B, H)
    use_image = image_features is not None and cfg.train.method == "mcse"
    if not use_image:
        return mcse_objective(z[:n], z[n:], cfg.loss.temperature)
    s = student.text_proj(cls)  # (2B, p): g_φ1 on [CLS] (MCSE Eq. 2)
    v = student.image_proj(image_features)  # (B, p): g_φ2 on frozen image features
    return mcse_objective(
        z[:n], z[n:], cfg.loss.temperature, s[:n], s[n:], v,
        temperature_img=cfg.loss.temperature_img, lambda_img=cfg.loss.lambda_img,
    )


def train(
    cfg: Config,
    data_dir: str | Path,
    teachers_dir: str | Path,
    out_dir: str | Path,
    log_metrics: StepLogger | None = None,
    on_eval: EvalCallback | None = None,
    progress: bool = True,
) -> TrainResult:
    """Train a student; keep the best dev checkpoint in ``out_dir/best`` (HF folder,
    safetensors) and a resume point in ``out_dir/last``. ``on_eval(step, score)`` may
    raise to stop early (Optuna pruning)."""
    from mmcse.config import to_dict
    from mmcse.io import sha256_json

    data_dir, teachers_dir, out_dir = Path(data_dir), Path(teachers_dir), Path(out_dir)
    check_inputs(data_dir, teachers_dir)
    device = resolve_device(cfg.base.device)
    data = TrainData.load(data_dir, teachers_dir)
    torch.manual_seed(cfg.base.seed)
    torch.use_deterministic_algorithms(True, warn_only=True)

    tokenizer = load_tokenizer(cfg.model.name_or_path)
    backbone = load_backbone(cfg.model, dropout=cfg.train.dropout)
    student = Student(backbone, data.image_features.dim, cfg.model.proj_dim).to(device)

    batches = _Batches(len(data.corpus), len(data.captions), cfg.train.batch_size, cfg.base.seed)
    total = len(batches) * cfg.train.epochs
    if cfg.train.max_steps:
        total = min(total, cfg.train.max_steps)
    optimizer, scheduler = build_optimizer(student, cfg, total)

    # What defines the run: everything but bookkeeping that cannot change the numbers.
    run_def = to_dict(cfg)
    for section in ("ablate", "sweep", "evaluate"):
        run_def.pop(section)
    run_def["dev_pooler"] = cfg.evaluate.pooler  # it picks the best checkpoint
    config_hash = sha256_json(run_def)
    last_dir, best_dir = out_dir / "last", out_dir / "best"
    state = _load_resume_point(last_dir, student, optimizer, scheduler, config_hash) or TrainState()
    if state.step >= total and best_dir.is_dir():
        return TrainResult(state.best_score, state.best_step, state.step, best_dir, state.history)

    def dev_score() -> float:
        """Dev STS (primary metric); every task's score is logged as ``dev_<task>``."""
        student.eval()
        encode = student_encoder(student, tokenizer, cfg.evaluate.pooler, cfg.model.max_seq_len, device)
        result = evaluate_sts(encode, data.dev, cfg.evaluate.batch_size)
        student.train()
        if log_metrics:
            log_metrics({f"dev_{task}": v for task, v in result.scores.items()}, state.step)
        return result.primary

    def checkpoint_best(score: float) -> None:
        if score > state.best_score:
            state.best_score, state.best_step = score, state.step
            tmp = best_dir.with_name(best_dir.name + ".tmp")
            if tmp.exists():
                shutil.rmtree(tmp)
            save_student(student, tokenizer, tmp)
            write_json(tmp / "train_state.json", {"step": state.step, "dev": score})
            _swap_in(tmp, best_dir)

    if state.step == 0:
        score = dev_score()
        state.history.append({"step": 0, "dev": score})
        checkpoint_best(score)
        if log_metrics:
            log_metrics({"dev_sts": score}, 0)

    student.train()
    bar = tqdm(total=total, initial=state.step, desc=f"train {cfg.train.method}", unit="step", disable=not progress)
    last_dev = state.history[-1]["dev"] if state.history else float("nan")
    order_epoch, order = -1, []
    while state.step < total:
        epoch, offset = divmod(state.step, len(batches))
        if epoch != order_epoch:
            order_epoch, order = epoch, batches.epoch(epoch)
        kind, idx = order[offset]
        if kind == TEXT:
            sentences, feats = [data.corpus[i] for i in idx], None
        else:
            sentences = [data.captions[i] for i in idx]
            rows = data.image_features.rows([data.image_ids[i] for i in idx])
            feats = torch.from_numpy(rows).to(device)
        terms = training_step_loss(student, cfg, _tokenize(tokenizer, sentences, cfg.model.max_seq_len, device), feats)
        optimizer.zero_grad(set_to_none=True)
        terms["loss"].backward()
        optimizer.step()
        scheduler.step()
        state.step += 1
        values = {f"loss/{k}": float(v.detach()) for k, v in terms.items()}
        if state.step % LOG_EVERY == 0:
            state.history.append({"step": state.step, "loss": values["loss/loss"]})
        if log_metrics and (state.step % LOG_EVERY == 0 or kind == PAIR):  # every image term is logged
            log_metrics(values | {"lr": scheduler.get_last_lr()[0]}, state.step)
        if state.step % cfg.train.eval_steps == 0 or state.step == total:
            last_dev = dev_score()
            state.history.append({"step": state.step, "dev": last_dev})
            checkpoint_best(last_dev)
            if log_metrics:
                log_metrics({"dev_sts": last_dev}, state.step)
            if on_eval:
                on_eval(state.step, last_dev)
        if state.step % cfg.train.checkpoint_steps == 0 or state.step == total:
            _save_resume_point(last_dir, student, optimizer, scheduler, state, config_hash)
        bar.set_postfix(loss=f"{values['loss/loss']:.3f}", dev=f"{last_dev:.1f}")
        bar.update(1)
    bar.close()
    return TrainResult(state.best_score, state.best_step, state.step, best_dir, state.history)


def load_history(folder: Path) -> list[dict[str, Any]]:
    return json.loads((folder / "last" / "state.json").read_text())["history"]

