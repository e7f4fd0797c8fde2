"""The ``train`` stage: SimCSE / MCSE student training with resumable checkpoints.

Batches alternate as in MCSE: text-only batches from the corpus, and one
image–caption batch after every ``len(text_loader) // len(pair_loader)`` text
batches. Data order is a pure function of (seed, epoch), so a resumed run
replays exactly the batches an uninterrupted run would have seen.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm
from transformers import get_linear_schedule_with_warmup

from mmcse.config import Config, active_terms
from mmcse.data.senteval import SentencePair
from mmcse.device import resolve_device
from mmcse.errors import CorruptArtifact, TrainingOutOfMemory
from mmcse.evaluation.geometry import POSITIVE_GOLD, check_sts_geometry, sts_geometry
from mmcse.evaluation.retrieval import image_head
from mmcse.evaluation.sts import evaluate_sts, group_by_task, student_encoder
from mmcse.export import EVAL_MAX_SEQ_LEN, export_sentence_transformers
from mmcse.integrity import check_model_folder, check_safetensors, load_torch, read_json_artifact
from mmcse.io import read_json, read_jsonl, write_json
from mmcse.methods.losses import span_mean, weighted_teacher_similarity
from mmcse.methods.objectives import STAT, StepEmbeddings, needed_features, step_objective
from mmcse.models import HEADS_FILE, HEADS_META, Student, load_backbone, load_tokenizer, save_student
from mmcse.precision import autocast, check_precision, configure_kernels, fused_adamw_supported, grad_scaler
from mmcse.teachers import FeatureStore
from mmcse.tokens import TokenTable, cached_tokens, to_device

log = logging.getLogger(__name__)
TEXT, PAIR = "text", "pair"
LOG_EVERY = 5  # steps between logged loss values
# Steps between reading logged values back from the device: each read waits for the GPU to
# finish (a host sync), so values are kept on the device and read in one go this often.
FLUSH_EVERY = 50
StepLogger = Callable[[list[tuple[dict[str, float], int]]], None]  # a batch of (metrics, step)
EvalCallback = Callable[[int, float], None]
# Dev geometry (Wang & Isola; DALR Table 6) logged at every dev evaluation: metric name -> key of
# `mmcse.evaluation.geometry.sts_geometry`; the same names are the keys of a dev history entry.
DEV_GEOMETRY = {"dev_alignment": "alignment", "dev_uniformity": "uniformity"}


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


def teacher_set_folder(name: str, teachers_dir: Path, teacher_dirs: Sequence[Path] = ()) -> Path:
    """Where the cached set ``name`` a manifest names is: ``teachers_dir``, else the first of
    ``teacher_dirs`` holding it (a variant's manifest names sets of the top-level cache too)."""
    found = [d / name for d in (teachers_dir, *teacher_dirs) if (d / name / "index.json").is_file()]
    return found[0] if found else teachers_dir / name


def check_inputs(data_dir: Path, teachers_dir: Path, teacher_manifest: Path | None = None,
                 teacher_dirs: Sequence[Path] = ()) -> None:
    """Fail before any run is started when an upstream stage's output is missing, or a cached
    teacher set is damaged (one line naming the file; its digest is then remembered, so the
    training that follows does not hash it again)."""
    manifest = teacher_manifest or teachers_dir / "manifest.json"
    needed = [data_dir / "corpus.txt", data_dir / "pairs.jsonl", data_dir / "sts" / "dev.jsonl", manifest]
    missing = [str(p) for p in needed if not p.is_file()]
    if missing:
        raise FileNotFoundError(
            f"missing inputs {', '.join(missing)}: run the download, detect_objects and cache_teachers stages "
            "first (dvc repro train)"
        )
    sets = read_json(manifest).get("sets", {})
    for value in sets.values():
        for name in [value] if isinstance(value, str) else [t[k] for t in value for k in ("caption", "corpus")]:
            FeatureStore.open(teacher_set_folder(name, teachers_dir, teacher_dirs))


@dataclass
class TrainData:
    """Corpus, pairs and the memory-mapped teacher features training reads (no model runs)."""

    corpus: list[str]
    captions: list[str]
    pair_ids: list[str]
    image_ids: list[str]
    image_features: FeatureStore
    object_features: FeatureStore
    joint_text: FeatureStore
    joint_image: FeatureStore
    text_captions: list[FeatureStore]  # one per teacher in teachers.text
    text_corpus: list[FeatureStore]
    text_weights: list[float]
    objects: dict[str, list[dict[str, Any]]]  # pair_id -> its object–phrase pairs
    dev: dict[str, list[SentencePair]]

    @classmethod
    def load(cls, data_dir: Path, teachers_dir: Path, objects_dir: Path | None = None,
             manifest: Path | None = None, teacher_dirs: Sequence[Path] = ()) -> TrainData:
        """``manifest`` (default ``<teachers_dir>/manifest.json``) names the feature sets, looked
        up in ``teachers_dir`` and then ``teacher_dirs``."""
        corpus = [s for s in (data_dir / "corpus.txt").read_text().splitlines() if s.strip()]
        pairs = read_jsonl(data_dir / "pairs.jsonl")
        empty = [p["pair_id"] for p in pairs if not p["caption"].strip()]
        if empty:
            raise ValueError(f"{data_dir / 'pairs.jsonl'}: empty captions in pairs {empty[:5]}")
        manifest = manifest or teachers_dir / "manifest.json"
        sets = read_json(manifest)["sets"]
        missing = [k for k in ("image", "object", "joint_text", "joint_image", "text") if k not in sets]
        if missing:
            raise ValueError(
                f"{manifest}: no cached sets {missing} (written by an older version): "
                "rerun the cache_teachers stage"
            )

        def open_set(name: str) -> FeatureStore:
            return FeatureStore.open(teacher_set_folder(name, teachers_dir, teacher_dirs))

        objects_dir = objects_dir or data_dir.parent / "objects"
        objects: dict[str, list[dict[str, Any]]] = {}
        if (objects_dir / "objects.jsonl").is_file():
            objects = {row["pair_id"]: row["objects"] for row in read_jsonl(objects_dir / "objects.jsonl")}
        dev = group_by_task([SentencePair.from_row(r) for r in read_jsonl(data_dir / "sts" / "dev.jsonl")])
        return cls(
            corpus, [p["caption"] for p in pairs], [p["pair_id"] for p in pairs], [p["image_id"] for p in pairs],
            open_set(sets["image"]), open_set(sets["object"]), open_set(sets["joint_text"]),
            open_set(sets["joint_image"]), [open_set(t["caption"]) for t in sets["text"]],
            [open_set(t["corpus"]) for t in sets["text"]], [float(t["weight"]) for t in sets["text"]],
            objects, dev,
        )

    def check_objects(self, min_objects: int, max_seq_len: int, objects_dir: Path) -> None:
        """MCSEO's exclusions must already hold (detect_objects applies them): every kept pair
        has >= ``min_objects`` objects and every phrase span is non-empty and ends before the
        maximum length (checked here, on the host, so the training step needs no check)."""
        if not self.objects:
            raise ValueError(f"{objects_dir / 'objects.jsonl'}: no object–phrase pairs; run detect_objects")
        for pair_id, objects in self.objects.items():
            if len(objects) < min_objects:
                raise ValueError(f"{objects_dir / 'objects.jsonl'}: pair {pair_id} has {len(objects)} objects "
                                 f"(< detect.min_objects={min_objects}); rerun detect_objects")
            if any(o["token_end"] > max_seq_len - 1 for o in objects):  # the last position is [SEP]
                raise ValueError(f"{objects_dir / 'objects.jsonl'}: pair {pair_id} has a phrase past "
                                 f"model.max_seq_len={max_seq_len}; rerun detect_objects with this model")
            if any(not 0 <= o["token_start"] < o["token_end"] for o in objects):
                raise ValueError(f"{objects_dir / 'objects.jsonl'}: pair {pair_id} has an empty phrase span; "
                                 "rerun detect_objects")

    def _rows(self, group: str) -> Any:
        """Feature-store row numbers of every pair / corpus sentence for one feature group,
        looked up once per run (a batch is then one gather per store)."""
        memo = self.__dict__.setdefault("_row_memo", {})
        if group not in memo:
            if group == "image":
                memo[group] = self.image_features.row_indices(self.image_ids)
            elif group == "joint":
                memo[group] = (self.joint_text.row_indices(self.pair_ids), self.joint_image.row_indices(self.image_ids))
            elif group == "captions":
                memo[group] = [s.row_indices(self.pair_ids) for s in self.text_captions]
            elif group == "corpus":
                corpus_ids = [f"corpus-{i}" for i in range(len(self.corpus))]
                memo[group] = [s.row_indices(corpus_ids) for s in self.text_corpus]
            elif group == "objects":
                spans = [self.objects.get(p, []) for p in self.pair_ids]
                flat = [o for pair in spans for o in pair]
                memo[group] = {
                    "bounds": np.cumsum([0] + [len(pair) for pair in spans]),  # pair i: [b[i], b[i+1])
                    "crop": self.object_features.row_indices([o["crop"] for o in flat]),
                    "start": np.array([o["token_start"] for o in flat], dtype=np.int64),
                    "end": np.array([o["token_end"] for o in flat], dtype=np.int64),
                }
            else:
                raise KeyError(group)
        return memo[group]

    def pair_features(self, idx: Sequence[int], need: set[str], device: torch.device) -> BatchFeatures:
        """Cached features of pair rows ``idx`` for the groups in ``need`` (on ``device``;
        the host-side gathers overlap the device's work on the previous step)."""
        feats = BatchFeatures()
        idx = np.asarray(idx, dtype=np.int64)
        if "image" in need:
            feats.image = _tensor(self.image_features.take(self._rows("image")[idx]), device)
        if "joint" in need:
            text_rows, image_rows = self._rows("joint")
            feats.joint_text = _tensor(self.joint_text.take(text_rows[idx]), device)
            feats.joint_image = _tensor(self.joint_image.take(image_rows[idx]), device)
        if "text_teachers" in need:
            feats.text_teachers = [_tensor(s.take(r[idx]), device)
                                   for s, r in zip(self.text_captions, self._rows("captions"), strict=True)]
            feats.text_weights = self.text_weights
        if "objects" in need:
            # one row per object–phrase pair: (sentence in batch, token start, token end), its crop
            objects = self._rows("objects")
            bounds = objects["bounds"]
            counts = bounds[idx + 1] - bounds[idx]  # (B,) objects of each pair
            if counts.sum():
                flat = np.concatenate([np.arange(bounds[i], bounds[i + 1]) for i in idx])  # (T,)
                feats.object_row = _tensor(np.repeat(np.arange(len(idx)), counts), device)
                feats.object_start = _tensor(objects["start"][flat], device)
                feats.object_end = _tensor(objects["end"][flat], device)
                feats.objects = _tensor(self.object_features.take(objects["crop"][flat]), device)
        return feats

    def text_features(self, idx: Sequence[int], need: set[str], device: torch.device) -> BatchFeatures | None:
        if "text_teachers" not in need:
            return None
        idx = np.asarray(idx, dtype=np.int64)
        return BatchFeatures(text_teachers=[_tensor(s.take(r[idx]), device)
                                            for s, r in zip(self.text_corpus, self._rows("corpus"), strict=True)],
                             text_weights=self.text_weights)

    def token_tables(self, tokenizer: Any, max_len: int, cache_dir: Path) -> dict[str, TokenTable]:
        """Corpus and captions tokenized once (cached under ``cache_dir``), by batch kind."""
        return {TEXT: cached_tokens(cache_dir, "corpus", tokenizer, self.corpus, max_len),
                PAIR: cached_tokens(cache_dir, "captions", tokenizer, self.captions, max_len)}


def _tensor(rows: np.ndarray, device: torch.device) -> torch.Tensor:
    return to_device(torch.from_numpy(np.ascontiguousarray(rows)), device)


@dataclass
class BatchFeatures:
    """Cached teacher features of one batch (each ``(N, ·)`` in batch order)."""

    image: torch.Tensor | None = None  # image-encoder features of each pair's image
    joint_text: torch.Tensor | None = None  # t̂
    joint_image: torch.Tensor | None = None  # v̂
    text_teachers: list[torch.Tensor] | None = None
    text_weights: list[float] | None = None
    objects: torch.Tensor | None = None  # (T, d_img) object-crop features
    object_row: torch.Tensor | None = None  # (T,) which sentence of the batch
    object_start: torch.Tensor | None = None  # (T,) phrase token span [start, end)
    object_end: torch.Tensor | None = None

    def to(self, device: torch.device) -> BatchFeatures:
        """The same features on ``device`` (training gathers them there directly; tests and
        benchmarks build them on the CPU)."""
        moved: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor):
                moved[f.name] = to_device(value, device)
            elif f.name == "text_teachers" and value is not None:
                moved[f.name] = [to_device(t, device) for t in value]
        return dataclasses.replace(self, **moved)


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


def write_weights_folder(model: torch.nn.Module, weights: dict[str, torch.Tensor], folder: Path,
                         save: Callable[[Path], None]) -> None:
    """Write ``model`` with ``weights`` (the best checkpoint's, held in memory) to ``folder`` through
    ``save(tmp)``, atomically (`_swap_in`); the model's current weights are restored afterwards."""
    current = {k: v.detach().clone() for k, v in model.state_dict().items()}
    model.load_state_dict(weights)
    tmp = folder.with_name(folder.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    try:
        save(tmp)
        _swap_in(tmp, folder)
    finally:
        model.load_state_dict(current)


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
    folder: Path, student: torch.nn.Module, optimizer, scheduler, scaler, state: TrainState, config_hash: str,
) -> None:
    tmp = folder.with_name(folder.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    save_file({k: v.detach().contiguous() for k, v in student.state_dict().items()}, str(tmp / "student.safetensors"))
    rng = {"rng": torch.get_rng_state()}
    if torch.cuda.is_initialized():  # dropout on the GPU draws from the CUDA generators
        rng["cuda_rng"] = torch.cuda.get_rng_state_all()
    torch.save(
        {"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(),
         **rng},
        tmp / "trainer.pt",
    )
    (tmp / "state.json").write_text(
        json.dumps({"step": state.step, "best_score": state.best_score, "best_step": state.best_step,
                    "history": state.history, "config_hash": config_hash})
    )
    _swap_in(tmp, folder)


RESUME_WEIGHTS = ("student.safetensors", "trainer.pt")


def release_resume_point(out_dir: Path) -> int:
    """Delete a finished run's resume weights (student + AdamW moments, ~3x the model),
    keeping ``last/state.json`` for its history; returns the bytes freed.

    An ablation keeps dozens of finished runs whose result is already recorded; their
    resume points would only fill the disk and the DVC cache. A later ``train`` with the
    same folder starts afresh (see ``_load_resume_point``)."""
    freed = 0
    for name in RESUME_WEIGHTS:
        path = out_dir / "last" / name
        if path.is_file():
            freed += path.stat().st_size
            path.unlink()
    return freed


def run_definition_hash(cfg: Config) -> str:
    """What defines a training run: everything but bookkeeping that cannot change the numbers
    (a resume point of another definition is not resumed)."""
    from mmcse.config import to_dict
    from mmcse.io import sha256_json

    run_def = to_dict(cfg)
    for section in ("ablate", "sweep", "evaluate"):
        run_def.pop(section)
    run_def["dev_pooler"] = cfg.evaluate.pooler  # it picks the best checkpoint
    return sha256_json(run_def)


def resume_point_run(out_dir: Path, cfg: Config) -> tuple[str | None, int]:
    """The MLflow run id and step of the resume point ``train`` would continue in ``out_dir``
    (``(None, 0)`` when it would start afresh), so the caller continues that run's record. The
    run id is the folder's remembered run (`mmcse.tracking.remembered_run`), not part of the resume
    point: a tracked output holds nothing random (a resume point written by an older version that
    still names its run is read too)."""
    from mmcse.tracking import remembered_run

    for folder in (out_dir / "last", out_dir / "last.old"):
        if (folder / "state.json").is_file():
            try:
                meta = json.loads((folder / "state.json").read_text())
            except ValueError:
                return None, 0
            if meta.get("config_hash") != run_definition_hash(cfg):
                return None, 0
            record = remembered_run(out_dir)
            return (record["run_id"] if record else meta.get("run_id")), int(meta.get("step", 0))
    return None, 0


def _recorded_definition(folder: Path) -> str | None:
    """The run-definition hash a resume point in ``folder`` (or its ``.old`` copy) records; None
    when there is none or it cannot be read (the full checks of `_load_resume_point` then apply)."""
    for candidate in (folder, folder.with_name(folder.name + ".old")):
        try:
            meta = json.loads((candidate / "state.json").read_text())
        except (OSError, ValueError):
            continue
        if isinstance(meta, dict) and isinstance(meta.get("config_hash"), str):
            return meta["config_hash"]
    return None


def _load_resume_point(
    folder: Path, student: torch.nn.Module, optimizer, scheduler, scaler, config_hash: str,
    best_required: Sequence[str] | None = None,
) -> TrainState | None:
    """Restore the resume point in ``folder`` (or the ``.old`` copy a kill between the renames
    of ``_swap_in`` left). Every file is checked before anything is restored: a damaged one is
    named in a warning and the next copy tried, else training starts afresh. A damaged best
    checkpoint beside it is deleted and training starts afresh too: the best weights can only
    be had again by replaying the run (the resume point holds the latest weights, not the best).
    ``best_required``: the files a best checkpoint must hold (default: a student's, `BEST_REQUIRED`)."""
    if _recorded_definition(folder) not in (None, config_hash):
        return None  # another configuration's run (e.g. another method): its best folder is not checked
    if _best_is_damaged(folder.parent / "best", BEST_REQUIRED if best_required is None else best_required):
        return None
    damaged = False
    for candidate in (folder, folder.with_name(folder.name + ".old")):
        if not (candidate / "state.json").is_file():
            continue
        try:
            loaded = _read_resume_point(candidate, student, config_hash)
        except CorruptArtifact as err:
            log.warning("%s", err)
            damaged = True
            continue
        if loaded is None:
            return None
        meta, weights, trainer = loaded
        student.load_state_dict(weights)
        optimizer.load_state_dict(trainer["optimizer"])
        scheduler.load_state_dict(trainer["scheduler"])
        if trainer.get("scaler"):
            scaler.load_state_dict(trainer["scaler"])
        torch.set_rng_state(trainer["rng"])
        if "cuda_rng" in trainer and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(trainer["cuda_rng"])
        return TrainState(meta["step"], meta["best_score"], meta["best_step"], meta["history"])
    if damaged:
        log.warning("%s: no whole resume point; training starts afresh from step 0", folder)
    return None


_IGNORED = "resume point ignored"


def _read_resume_point(
    folder: Path, student: Student, config_hash: str
) -> tuple[dict[str, Any], dict[str, torch.Tensor], dict[str, Any]] | None:
    """``(state, student weights, trainer state)`` of a resume point, checked against the model
    being trained; None for another configuration's point or released weights."""
    meta = read_json_artifact(folder / "state.json", _IGNORED)
    if not isinstance(meta, dict) or not {"step", "best_score", "best_step", "history", "config_hash"} <= meta.keys():
        raise CorruptArtifact(folder / "state.json", "fields missing", _IGNORED)
    if meta["config_hash"] != config_hash:
        return None  # a different configuration: start afresh rather than mix runs
    if not all((folder / name).is_file() for name in RESUME_WEIGHTS):
        return None  # weights released by release_resume_point: only the history is left
    weights_file = folder / "student.safetensors"
    check_safetensors(weights_file, _IGNORED)
    weights = load_file(str(weights_file))
    expected = student.state_dict()
    if weights.keys() != expected.keys() or any(weights[k].shape != v.shape for k, v in expected.items()):
        raise CorruptArtifact(weights_file, "its tensors do not match the model being trained", _IGNORED)
    trainer = load_torch(folder / "trainer.pt", _IGNORED, weights_only=True)
    if not isinstance(trainer, dict) or not {"optimizer", "scheduler", "rng"} <= trainer.keys():
        raise CorruptArtifact(folder / "trainer.pt", "optimizer, scheduler or RNG state missing", _IGNORED)
    return meta, weights, trainer


BEST_REQUIRED = ("config.json", "model.safetensors", HEADS_FILE, HEADS_META)


def _best_is_damaged(best_dir: Path, required: Sequence[str] = ()) -> bool:
    """Check a best checkpoint folder (HF safetensors headers, JSON files, required files);
    a damaged one is named in a warning and deleted (True)."""
    if not best_dir.is_dir():
        return False
    try:
        check_model_folder(best_dir, "retraining from step 0 to rebuild it", required=required or BEST_REQUIRED)
    except CorruptArtifact as err:
        log.warning("%s", err)
        shutil.rmtree(best_dir)
        return True
    return False


def build_optimizer(student: torch.nn.Module, cfg: Config, total_steps: int, device: torch.device | None = None):
    """AdamW (no weight decay on biases and LayerNorm) with linear warmup and decay to 0;
    fused (one kernel for all parameters) on CUDA."""
    decay, no_decay = [], []
    for name, p in student.named_parameters():
        (no_decay if p.ndim < 2 or "LayerNorm" in name else decay).append(p)
    fused = device is not None and fused_adamw_supported(device)
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.train.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.train.learning_rate, fused=fused or None,
    )
    scheduler = get_linear_schedule_with_warmup(optimizer, int(cfg.train.warmup_ratio * total_steps), total_steps)
    return optimizer, scheduler


def training_step_loss(
    student: Student,
    cfg: Config,
    batch: dict[str, torch.Tensor],
    feats: BatchFeatures | None,
    pair_batch: bool,
    seed: int = 0,
    on: dict[str, bool] | None = None,
) -> dict[str, torch.Tensor]:
    """Loss terms of one batch: two dropout passes (as one doubled batch) through the
    student, then every active term of the method on those embeddings and the cached
    teacher features ``feats`` (no teacher runs here). ``seed`` seeds the step's random
    draws (DALR mismatched pairs, ranking ties); ``on`` is ``active_terms(cfg)``, worked
    out once per run by the training loop."""
    ids, mask = batch["input_ids"], batch["attention_mask"]
    n = ids.shape[0]
    tokens = student.token_states(ids.repeat(2, 1), mask.repeat(2, 1))  # (2B, L, H): two dropout masks
    cls = tokens[:, 0]  # (2B, H)
    z = student.mlp(cls)  # (2B, H)
    e = StepEmbeddings(z1=z[:n], z2=z[n:], pair_batch=pair_batch)
    on = on if on is not None else active_terms(cfg)
    feats = feats or BatchFeatures()
    if pair_batch and (on["image"] or on["kdmcse"] or on["info"] or on["cma"] or on["object"]):
        s = student.text_proj(cls)  # (2B, p): g_φ1 on [CLS] (MCSE Eq. 2)
        e.s1, e.s2 = s[:n], s[n:]
    if feats.image is not None:
        e.image = student.image_proj(feats.image)  # (B, p): g_φ2 on frozen image features
    if feats.joint_text is not None:
        e.joint_text, e.joint_image = feats.joint_text, feats.joint_image
        if on["kdmcse"]:  # only KDMCSE's text term uses g_φt
            e.teacher_text = student.teacher_text_proj(feats.joint_text)  # (B, p): g_φt(t̂)
        e.teacher_image = student.teacher_image_proj(feats.joint_image)  # (B, p): g_φv(v̂)
        if on["consistency"]:
            e.shared_text = student.shared_text(cls[:n])  # (B, p)
            e.shared_image = student.shared_image(feats.joint_image)  # (B, p)
    if feats.text_teachers is not None:
        with torch.no_grad():
            e.text_teacher_sim = weighted_teacher_similarity(feats.text_teachers, feats.text_weights)  # (B, B)
    if feats.objects is not None:
        phrase_states = span_mean(tokens[:n], feats.object_row, feats.object_start, feats.object_end)  # (T, H)
        e.phrases = student.text_proj(phrase_states)  # (T, p)
        e.objects = student.image_proj(feats.objects)  # (T, p)
        e.object_pair = feats.object_row
    return step_objective(cfg, e, seed, on)


def optimizer_step(
    student: Student,
    cfg: Config,
    batch: dict[str, torch.Tensor],
    feats: BatchFeatures | None,
    pair_batch: bool,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    device: torch.device,
    seed: int = 0,
    on: dict[str, bool] | None = None,
) -> dict[str, torch.Tensor]:
    """One training step: the forward pass under ``train.precision``'s autocast, backward
    (through the fp16 loss scaler when enabled) and the optimizer update. Returns the loss
    terms, still on the device (reading them is a host sync the caller defers)."""
    with autocast(cfg.train.precision, device):
        terms = training_step_loss(student, cfg, batch, feats, pair_batch, seed, on)
    optimizer.zero_grad(set_to_none=True)
    scaler.scale(terms["loss"]).backward()
    scaler.step(optimizer)
    scaler.update()
    return terms


def out_of_memory_message(cfg: Config, step: int, resume_step: int | None) -> str:
    resume = (f"the resume point (step {resume_step}) is intact: rerun to continue from it"
              if resume_step is not None else "no resume point was written yet")
    smaller = max(cfg.train.batch_size // 2, 2)
    advice = [f"a smaller train.batch_size (e.g. {smaller})"]
    if cfg.train.precision == "fp32":
        advice.append("train.precision: bf16 (or fp16 on GPUs without bf16)")
    advice.append(f"a shorter model.max_seq_len (now {cfg.model.max_seq_len})")
    return (f"out of device memory at training step {step} with train.batch_size={cfg.train.batch_size}, "
            f"train.precision={cfg.train.precision}, model.max_seq_len={cfg.model.max_seq_len}; try "
            f"{' or '.join(advice)}; {resume}")


def _is_out_of_memory(err: BaseException) -> bool:
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
    upstream artifacts are (`mmcse.upstream`). The MLflow run is the caller's (`mmcse.pipeline.run_train`
    remembers it per folder: `resume_point_run`). Every dev
    evaluation also logs the dev geometry (``dev_alignment``, ``dev_uniformity``: `DEV_GEOMETRY`)
    into the history entry and ``log_metrics``; the best checkpoint's is ``TrainResult.best_geometry``."""
    data_dir, teachers_dir, out_dir = Path(data_dir), Path(teachers_dir), Path(out_dir)
    objects_dir = Path(objects_dir) if objects_dir is not None else data_dir.parent / "objects"
    manifest = Path(teacher_manifest) if teacher_manifest is not None else None
    shared_teachers = [Path(d) for d in teacher_dirs]
    check_inputs(data_dir, teachers_dir, manifest, shared_teachers)
    device = resolve_device(cfg.base.device)
    check_precision(cfg.train.precision, device)
    data = TrainData.load(data_dir, teachers_dir, objects_dir, manifest, shared_teachers)
    # the dev geometry needs positive pairs (gold >= 4) and two sentences: refused before any compute
    check_sts_geometry(data.dev, POSITIVE_GOLD, str(data_dir / "sts" / "dev.jsonl"))
    on = active_terms(cfg)  # per run, not per step
    if on["object"]:
        data.check_objects(cfg.detect.min_objects, cfg.model.max_seq_len, objects_dir)
    need = {kind: needed_features(cfg, pair_batch=kind == PAIR) for kind in (TEXT, PAIR)}
    if device.type == "cuda":  # deterministic cuBLAS (bit-identical resume); read when cuBLAS starts
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    configure_kernels(device)
    torch.manual_seed(cfg.base.seed)
    torch.use_deterministic_algorithms(True, warn_only=True)

    tokenizer = load_tokenizer(cfg.model.name_or_path)
    tokens = data.token_tables(tokenizer, cfg.model.max_seq_len, data_dir.parent / "tokens")
    backbone = load_backbone(cfg.model, dropout=cfg.train.dropout)
    student = Student(backbone, data.image_features.dim, cfg.model.proj_dim, data.joint_image.dim).to(device)
    if cfg.train.compile:
        # in place, so parameter names (checkpoints, resume points) do not change
        student.backbone.compile(dynamic=True)

    batches = _Batches(len(data.corpus), len(data.captions), cfg.train.batch_size, cfg.base.seed)
    total = len(batches) * cfg.train.epochs
    if cfg.train.max_steps:
        total = min(total, cfg.train.max_steps)
    optimizer, scheduler = build_optimizer(student, cfg, total, device)
    scaler = grad_scaler(cfg.train.precision, device)

    config_hash = run_definition_hash(cfg)
    last_dir, best_dir = out_dir / "last", out_dir / "best"
    state = _load_resume_point(last_dir, student, optimizer, scheduler, scaler, config_hash) or TrainState()
    if state.step >= total and best_dir.is_dir():
        return TrainResult(state.best_score, state.best_step, state.step, best_dir, state.history)
    resumed_from = state.step if state.step else None

    # The best weights are held in (device) memory and written with the next resume point:
    # writing a BERT-base folder at every improvement would cost seconds per dev evaluation,
    # and on disk the best checkpoint and the resume point's best_score must agree after a kill.
    best_weights: dict[str, torch.Tensor] | None = None

    # one encoder for the run: it keeps the dev batches' token ids on the device
    dev_encode = student_encoder(student, tokenizer, cfg.evaluate.pooler, cfg.model.max_seq_len, device,
                                 cfg.train.precision, keep_tokens=True)

    def dev_score() -> tuple[float, dict[str, float]]:
        """Dev STS (primary metric; every task's score is logged as ``dev_<task>``) and the dev
        geometry (``DEV_GEOMETRY``: alignment of the pairs with gold >= 4, uniformity of every
        distinct dev sentence) from the same embeddings, so the dev set is encoded once."""
        student.eval()
        result = evaluate_sts(dev_encode, data.dev, cfg.evaluate.batch_size, keep_vectors=True)
        student.train()
        geometry = sts_geometry(result.vectors, data.dev, POSITIVE_GOLD)
        pending.append(({f"dev_{task}": v for task, v in result.scores.items()}, state.step))
        return result.primary, {name: geometry[key] for name, key in DEV_GEOMETRY.items()}

    def checkpoint_best(score: float) -> None:
        nonlocal best_weights
        if score > state.best_score:
            state.best_score, state.best_step = score, state.step
            best_weights = {k: v.detach().clone() for k, v in student.state_dict().items()}

    def write_best() -> None:
        nonlocal best_weights
        if best_weights is None:
            return

        def save(tmp: Path) -> None:
            save_student(student, tokenizer, tmp)
            # the method and its retrieval head travel with the checkpoint (`mmcse eval --retrieval`)
            write_json(tmp / "train_state.json", {"step": state.best_step, "dev": state.best_score,
                                                  **best_geometry(state.history, state.best_step),
                                                  "method": cfg.train.method, "image_head": image_head(cfg)})
            # also a sentence-transformers folder pooling as the evaluate stage does (at its length)
            export_sentence_transformers(tmp, cfg.evaluate.pooler, EVAL_MAX_SEQ_LEN)

        write_weights_folder(student, best_weights, best_dir, save)
        best_weights = None

    # Logged values stay on the device until a flush reads them all back at once.
    pending: list[tuple[dict[str, Any], int]] = []
    shown: dict[str, float] = {}

    def flush() -> None:
        entries = read_back(pending)
        for metrics, step in entries:
            if "loss/loss" in metrics and step % LOG_EVERY == 0:
                state.history.append({"step": step, "loss": metrics["loss/loss"]})
            if "loss/loss" in metrics:
                shown["loss"] = metrics["loss/loss"]
        if log_metrics and entries:
            log_metrics(entries)

    def evaluate_now() -> float:
        score, geometry = dev_score()
        flush()  # the losses logged before this evaluation go first in the history
        state.history.append({"step": state.step, "dev": score, **geometry})
        checkpoint_best(score)
        if log_metrics:
            log_metrics([({"dev_sts": score, **geometry}, state.step)])
        return score

    if state.step == 0:
        evaluate_now()
        if best_weights is not None:
            write_best()

    student.train()
    bar = tqdm(total=total, initial=state.step, desc=f"train {cfg.train.method}", unit="step", disable=not progress)
    last_dev = state.history[-1]["dev"] if state.history and "dev" in state.history[-1] else float("nan")
    order_epoch, order = -1, []
    try:
        while state.step < total:
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
                terms = optimizer_step(student, cfg, batch, feats, kind == PAIR, optimizer, scaler, device,
                                       seed=step_seed, on=on)
            except Exception as err:
                if _is_out_of_memory(err):
                    raise TrainingOutOfMemory(out_of_memory_message(cfg, state.step + 1, resumed_from)) from None
                raise
            scheduler.step()
            state.step += 1
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
                write_best()
                _save_resume_point(last_dir, student, optimizer, scheduler, scaler, state, config_hash)
                resumed_from = state.step
            if evaluating or state.step % FLUSH_EVERY == 0:
                bar.set_postfix(loss=f"{shown.get('loss', float('nan')):.3f}", dev=f"{last_dev:.1f}")
            bar.update(1)
    finally:
        bar.close()
    return TrainResult(state.best_score, state.best_step, state.step, best_dir, state.history)


def load_history(folder: Path) -> list[dict[str, Any]]:
    return json.loads((folder / "last" / "state.json").read_text())["history"]

