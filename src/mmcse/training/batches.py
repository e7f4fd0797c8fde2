"""What training reads per batch: the corpus, the pairs and the cached teacher features
(`TrainData`), one batch's features on the device (`BatchFeatures`), and the batch order.

Batches alternate as in MCSE: text-only batches from the corpus and image–caption batches, in one of the
orders of `mmcse.training.schedule` (``train.batch_order``). Data order is a pure function of (seed, step), so a
resumed run replays exactly the batches an uninterrupted run would have seen.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mmcse.data.senteval import SentencePair
from mmcse.errors import InputError
from mmcse.evaluation.sts import group_by_task
from mmcse.io import read_json, read_jsonl
from mmcse.models.tokens import TokenTable, cached_tokens, to_device
from mmcse.teachers.cache import FeatureStore
from mmcse.training.schedule import ALTERNATE, PAIR, RELEASED, TEXT, epoch_schedule, full_batches


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
            raise InputError(f"{data_dir / 'pairs.jsonl'}: empty captions in pairs {empty[:5]}")
        manifest = manifest or teachers_dir / "manifest.json"
        sets = read_json(manifest)["sets"]
        missing = [k for k in ("image", "object", "joint_text", "joint_image", "text") if k not in sets]
        if missing:
            raise InputError(
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
            raise InputError(f"{objects_dir / 'objects.jsonl'}: no object–phrase pairs; run detect_objects")
        for pair_id, objects in self.objects.items():
            if len(objects) < min_objects:
                raise InputError(f"{objects_dir / 'objects.jsonl'}: pair {pair_id} has {len(objects)} objects "
                                 f"(< detect.min_objects={min_objects}); rerun detect_objects")
            if any(o["token_end"] > max_seq_len - 1 for o in objects):  # the last position is [SEP]
                raise InputError(f"{objects_dir / 'objects.jsonl'}: pair {pair_id} has a phrase past "
                                 f"model.max_seq_len={max_seq_len}; rerun detect_objects with this model")
            if any(not 0 <= o["token_start"] < o["token_end"] for o in objects):
                raise InputError(f"{objects_dir / 'objects.jsonl'}: pair {pair_id} has an empty phrase span; "
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


class Batches:
    """Deterministic order of text and pair batches (full batches only: drop_last), a pure function of (seed,
    step) so a resumed run replays it. ``order`` (``train.batch_order``, `mmcse.training.schedule`): ``alternate``
    walks each kind's items once an epoch in a fresh permutation of (seed, epoch); ``released`` draws each kind
    from its endless stream of passes (a fresh permutation of (seed, kind, pass) each), which goes on from one epoch
    into the next as the authors' ``inf_train_gen`` loaders do."""

    def __init__(self, n_text_items: int, n_pair_items: int, batch_size: int, seed: int,
                 order: str = ALTERNATE) -> None:
        self.batch_size, self.seed, self.order = batch_size, seed, order
        self.n_text_items, self.n_pair_items = n_text_items, n_pair_items
        self.n_text, self.n_pair = full_batches(n_text_items, n_pair_items, batch_size)
        self.schedule = epoch_schedule(order, self.n_text, self.n_pair)

    def __len__(self) -> int:
        return len(self.schedule)

    def epoch(self, epoch: int) -> list[tuple[str, list[int]]]:
        if self.order == RELEASED:
            return self._released_epoch(epoch)
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

    def _released_epoch(self, epoch: int) -> list[tuple[str, list[int]]]:
        items = {TEXT: self.n_text_items, PAIR: self.n_pair_items}
        per_pass = {TEXT: self.n_text, PAIR: self.n_pair}  # full batches in one pass of a kind's stream
        taken = {kind: epoch * self.schedule.count(kind) for kind in (TEXT, PAIR)}  # batches of earlier epochs
        passes: dict[tuple[str, int], list[int]] = {}
        out = []
        for kind in self.schedule:
            pass_no, offset = divmod(taken[kind], per_pass[kind])
            if (kind, pass_no) not in passes:
                g = torch.Generator().manual_seed((self.seed * 100_003 + pass_no) * 2 + (kind == PAIR))
                passes[kind, pass_no] = torch.randperm(items[kind], generator=g).tolist()
            start = offset * self.batch_size
            out.append((kind, passes[kind, pass_no][start : start + self.batch_size]))
            taken[kind] += 1
        return out
