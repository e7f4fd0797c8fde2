"""STS evaluation: Spearman × 100 of cosine similarity, SentEval's "all" setting.

For STS12–16 the subsets of a year are pooled into one Spearman (SimCSE's
``all`` number); STS-B and SICK-R use their test split; ``avg`` is the mean over
the tasks present. Each distinct sentence is encoded once, in length-sorted
batches.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from scipy.stats import spearmanr
from tqdm.auto import tqdm

from mmcse.data.senteval import SentencePair
from mmcse.errors import InputError
from mmcse.evaluation.names import STS_PRIMARY
from mmcse.hub import resolve_model
from mmcse.integrity.files import check_model_folder
from mmcse.models.precision import autocast, check_precision
from mmcse.models.student import load_student, pool

log = logging.getLogger(__name__)

PRIMARY_METRIC = STS_PRIMARY
EncodeFn = Callable[[list[str]], np.ndarray]
COLLAPSED_TAG = "mmcse.evaluation_warning"  # MLflow tag of a run whose model was found collapsed


def spearman_x100(predicted: Sequence[float], gold: Sequence[float]) -> float:
    """Spearman × 100; NaN when ``predicted`` is constant (a rank correlation of a constant is
    undefined: said by `evaluate_sts` as a collapsed model, not by scipy's ConstantInputWarning)."""
    if np.ptp(np.asarray(predicted, dtype=np.float64)) == 0:
        return float("nan")
    return float(spearmanr(predicted, gold).statistic * 100.0)


def collapsed_message(tasks: Sequence[str]) -> str:
    """What a collapsed model is told: every sentence gets the same vector, so every cosine of the STS
    ``tasks`` is the same and their Spearman undefined."""
    return (f"the model returns the same vector for every sentence (every cosine of {', '.join(tasks)} is the "
            "same): its Spearman there is undefined (nan); the encoder collapsed, or its weights did not load")


def encode_unique(encode: EncodeFn, sentences: Sequence[str], batch_size: int, desc: str = "encode") -> dict:
    """Embed each distinct sentence once, in batches of similar length (less padding)."""
    unique = sorted(set(sentences), key=lambda s: (len(s), s))
    vectors: dict[str, np.ndarray] = {}
    batches = range(0, len(unique), batch_size)
    for start in tqdm(batches, desc=desc, unit="batch", leave=False, disable=len(batches) < 50):
        chunk = unique[start : start + batch_size]
        emb = np.asarray(encode(chunk), dtype=np.float64)
        vectors.update(zip(chunk, emb, strict=True))
    return vectors


def senteval_cosine(u: np.ndarray, v: np.ndarray) -> float:
    """SentEval's per-pair cosine, term for term: identical pairs tie exactly, so Spearman's
    tie handling (and hence the score) matches SentEval's to the last digit."""
    u, v = np.nan_to_num(u), np.nan_to_num(v)
    return float(np.nan_to_num(np.dot(u, v) / (np.sqrt(np.dot(u, u)) * np.sqrt(np.dot(v, v)))))


@dataclass
class STSResult:
    scores: dict[str, float]
    # every task's Spearman × 100, also the one task `scores` leaves to ``avg``
    task_scores: dict[str, float] = field(default_factory=dict)
    predictions: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)  # task -> (cos, gold)
    # sentence -> its (d,) embedding, float64; filled only with ``evaluate_sts(..., keep_vectors=True)``
    vectors: dict[str, np.ndarray] = field(default_factory=dict)
    collapsed: list[str] = field(default_factory=list)  # tasks whose cosines are all the same (`collapsed_message`)

    @property
    def primary(self) -> float:
        return self.scores[PRIMARY_METRIC]


def evaluate_sts(
    encode: EncodeFn, tasks: Mapping[str, Sequence[SentencePair]], batch_size: int = 128,
    keep_vectors: bool = False,
) -> STSResult:
    """Spearman × 100 per task plus their mean ``avg``; tasks with no pairs are omitted, tasks whose
    cosines are all equal (a collapsed model) are listed in ``collapsed`` and logged once. With one
    task the mean is that task's score, so ``scores`` holds it once, as ``avg`` (one name per number,
    `mmcse.evaluation.names`); ``task_scores`` names the task. ``keep_vectors``
    keeps each distinct sentence's embedding in ``STSResult.vectors`` (training's dev geometry
    reuses them instead of encoding the dev set twice)."""
    tasks = {name: list(pairs) for name, pairs in tasks.items() if pairs}
    if not tasks:
        raise InputError("no STS pairs to evaluate")
    sentences = [s for pairs in tasks.values() for p in pairs for s in (p.s1, p.s2)]
    vectors = encode_unique(encode, sentences, batch_size)
    result = STSResult(scores={}, vectors=vectors if keep_vectors else {})
    for name, pairs in tasks.items():
        cos = np.array([senteval_cosine(vectors[p.s1], vectors[p.s2]) for p in pairs])
        gold = np.array([p.score for p in pairs])
        result.task_scores[name] = spearman_x100(cos, gold)
        result.predictions[name] = (cos, gold)
        if len(pairs) > 1 and np.ptp(cos) == 0:
            result.collapsed.append(name)
    if result.collapsed:
        log.warning("%s", collapsed_message(result.collapsed))
    if len(tasks) > 1:
        result.scores.update(result.task_scores)
    result.scores[PRIMARY_METRIC] = float(np.mean(list(result.task_scores.values())))
    return result


def group_by_task(pairs: Sequence[SentencePair]) -> dict[str, list[SentencePair]]:
    grouped: dict[str, list[SentencePair]] = {}
    for p in pairs:
        grouped.setdefault(p.task, []).append(p)
    return grouped


class TextEncoder:
    """Wraps an HF model folder / id, or an mmcse student checkpoint, as an ``EncodeFn``."""

    def __init__(
        self, model_name_or_path: str, pooler: str, device: str = "cpu", max_length: int = 512,
        precision: str = "fp32",
    ):
        from transformers import AutoModel, AutoTokenizer

        self.pooler, self.device, self.max_length = pooler, torch.device(device), max_length
        check_precision(precision, self.device)
        self.precision = precision
        location = Path(resolve_model(model_name_or_path))
        self.student = None
        if location.is_dir():  # checked before a loader reads it: a damaged file is one line naming it

            fix = ("retrain it (dvc repro train)" if (location / "heads.json").is_file()
                   else "download or save the model again")
            check_model_folder(location, fix)
        if (location / "heads.json").is_file():
            self.student, self.tokenizer = load_student(location)
            self.model = self.student.backbone
            self.student.to(self.device).eval()
        else:
            self.tokenizer = AutoTokenizer.from_pretrained(location)
            self.model = AutoModel.from_pretrained(location).to(self.device).eval()
        self.max_length = min(max_length, getattr(self.tokenizer, "model_max_length", max_length) or max_length)

    @torch.inference_mode()
    def __call__(self, sentences: list[str]) -> np.ndarray:
        batch = self.tokenizer(
            sentences, padding=True, truncation=True, max_length=self.max_length, return_tensors="pt"
        ).to(self.device)
        with autocast(self.precision, self.device):
            return self._pooled(batch).float().cpu().numpy()

    def _pooled(self, batch) -> torch.Tensor:
        out = self.model(**batch, output_hidden_states=True)
        if self.pooler == "cls" and self.student is None:
            pooled = getattr(out, "pooler_output", None)
            if pooled is None:
                raise InputError("pooler 'cls' needs a model with a pooler output; use cls_before_pooler or avg")
        else:
            pooled = pool(self.pooler, out.hidden_states, batch["attention_mask"], self.student and self.student.mlp)
        return pooled


def student_encoder(
    student, tokenizer, pooler: str, max_length: int, device: torch.device, precision: str = "fp32",
    keep_tokens: bool = False,
) -> EncodeFn:
    """An ``EncodeFn`` over a student being trained (eval mode is the caller's job), under
    inference mode and the training precision's autocast; pooled vectors come back as fp32.
    ``keep_tokens`` keeps each batch's token ids on the device for the next call with the
    same sentences: training's dev evaluations encode the same batches every time, and
    re-tokenizing them would cost the GPU an idle gap per evaluation."""

    kept: dict[tuple[str, ...], Any] = {}

    def tokenized(sentences: list[str]) -> Any:
        key = tuple(sentences)
        batch = kept.get(key)
        if batch is None:
            batch = tokenizer(sentences, padding=True, truncation=True, max_length=max_length, return_tensors="pt")
            batch = batch.to(device, non_blocking=True)
            if keep_tokens:
                kept[key] = batch
        return batch

    @torch.inference_mode()
    def encode(sentences: list[str]) -> np.ndarray:
        batch = tokenized(sentences)
        with autocast(precision, device):
            pooled = student.encode(batch["input_ids"], batch["attention_mask"], pooler)
        return pooled.float().cpu().numpy()

    return encode
