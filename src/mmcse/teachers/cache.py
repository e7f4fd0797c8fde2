"""Frozen teacher / encoder features, computed once and memory-mapped.

Each cached set lives in ``<cache_dir>/<name>-<key>/`` with ``features.npy`` (float32,
``(N, d)``) and ``index.json`` (row ids, teacher config, data fingerprint). The key
is a hash of (teacher config, data fingerprint), so a rerun, an ablation or a sweep
trial that needs the same features finds them and runs no model at all.
``index.json`` is written last: a set without it is incomplete and is recomputed. It records
the shape and SHA-256 of ``features.npy``; a set that does not match them (truncated, damaged)
is deleted and recomputed by ``cached_features``, and named in one line by ``FeatureStore.open``.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from tqdm.auto import tqdm

from mmcse.config import TeachersConfig
from mmcse.cpu_isa import kernels_in_force
from mmcse.errors import CorruptArtifact, InputError, MissingEntry
from mmcse.hub import resolve_model
from mmcse.integrity.files import HashingWriter, check_npy, find_cached_set, read_json_artifact, remember_sha256
from mmcse.io import atomic_path, open_image, sha256_json, write_json
from mmcse.models.device import blas_threads
from mmcse.models.student import pool
from mmcse.teachers import encoders as tm
from mmcse.teachers.encoders import build_resnet50, clip_text_features, resnet50_features, resolve_resnet50, revision

log = logging.getLogger(__name__)
REBUILD = "rerun the cache_teachers stage to rebuild it (dvc repro cache_teachers)"

# --------------------------------------------------------------------------- image encoder


def colour_edge_grid_features(rgba: np.ndarray, grid: int, bins: int) -> np.ndarray:
    """Handcrafted, weight-free image features of ``rgba (N, S, S, 4)`` uint8 images.

    Per cell of a ``grid × grid`` layout: a joint RGB histogram with ``bins`` levels per
    channel and an 8-bin gradient-orientation histogram (shape cue), both weighted by
    alpha (so a crop on a transparent background describes only its object). Each
    block is square-rooted (Hellinger) and the whole vector L2-normalised.
    Returns ``(N, grid² · (bins³ + 8))`` float32.
    """
    x = rgba.astype(np.float32) / 255.0
    n, size = x.shape[0], x.shape[1]
    rgb, alpha = x[..., :3], x[..., 3]  # (N, S, S, 3), (N, S, S)
    level = np.minimum((rgb * bins).astype(np.int64), bins - 1)
    colour_bin = (level[..., 0] * bins + level[..., 1]) * bins + level[..., 2]  # (N, S, S)
    grey = rgb.mean(-1) * alpha
    gy, gx = np.gradient(grey, axis=(1, 2))
    magnitude = np.hypot(gx, gy)
    orient_bin = np.minimum(((np.arctan2(gy, gx) % np.pi) / np.pi * 8).astype(np.int64), 7)
    cell = (np.arange(size) * grid // size).astype(np.int64)
    cell_id = cell[:, None] * grid + cell[None, :]  # (S, S)
    n_cells, n_colours = grid * grid, bins**3
    flat = np.broadcast_to(cell_id, (n, size, size))
    offsets = (np.arange(n) * n_cells)[:, None, None]
    colour_hist = np.zeros(n * n_cells * n_colours, np.float64)
    np.add.at(colour_hist, ((offsets + flat) * n_colours + colour_bin).ravel(), alpha.ravel())
    edge_hist = np.zeros(n * n_cells * 8, np.float64)
    np.add.at(edge_hist, ((offsets + flat) * 8 + orient_bin).ravel(), magnitude.ravel())
    colour_hist = colour_hist.reshape(n, n_cells, n_colours)
    edge_hist = edge_hist.reshape(n, n_cells, 8)
    colour_hist /= colour_hist.sum((1, 2), keepdims=True).clip(1e-9)
    edge_hist /= edge_hist.sum((1, 2), keepdims=True).clip(1e-9)
    feats = np.concatenate([np.sqrt(colour_hist), np.sqrt(edge_hist)], -1).reshape(n, -1)
    feats /= np.linalg.norm(feats, axis=1, keepdims=True).clip(1e-9)
    return feats.astype(np.float32)


def read_rgba(path: Path, size: int) -> np.ndarray:
    """An image as ``(size, size, 4)`` uint8; a clear error names a missing/corrupt file."""
    img = open_image(path).convert("RGBA")
    if img.size != (size, size):
        img = img.resize((size, size), Image.BILINEAR)
    return np.asarray(img, dtype=np.uint8)


# --------------------------------------------------------------------------- text teacher


def text_teacher_features(
    name_or_path: str,
    sentences: Sequence[str],
    poolers: Sequence[str],
    batch_size: int,
    max_len: int = 128,
    device: torch.device | None = None,
    loaded: Any = None,
) -> dict[str, np.ndarray]:
    """Frozen text-teacher embeddings ``{pooler: (N, d)}``, L2-normalised float32, from one
    forward pass per batch however many poolers are asked for. Pooler ``clip`` is a CLIP
    model's projected text feature (`mmcse.teachers.encoders.clip_text_features`), its only pooler.
    ``loaded``: ``(tokenizer, model)`` already built (CLIP: ``(model, processor)``), else loaded here."""
    from transformers import AutoModel, AutoTokenizer

    device = device or torch.device("cpu")
    if "clip" in poolers:
        if set(poolers) != {"clip"}:
            raise InputError(f"teachers.text: {name_or_path} is a CLIP model (pooler clip); it has no "
                             f"{sorted(set(poolers) - {'clip'})} pooling of hidden states")

        return {"clip": clip_text_features(name_or_path, sentences, batch_size, device, loaded)}
    if loaded is None:
        location = resolve_model(name_or_path)
        loaded = AutoTokenizer.from_pretrained(location), AutoModel.from_pretrained(location)
    tokenizer, model = loaded
    model = model.eval().to(device)
    order = np.argsort([len(s) for s in sentences], kind="stable")
    out = {p: np.zeros((len(sentences), model.config.hidden_size), np.float32) for p in poolers}
    with torch.inference_mode():
        for start in tqdm(range(0, len(order), batch_size), desc=f"teacher {name_or_path}", unit="batch"):
            idx = order[start : start + batch_size]
            batch = tokenizer(
                [sentences[i] for i in idx], padding=True, truncation=True, max_length=max_len, return_tensors="pt"
            ).to(device)
            hidden = model(**batch, output_hidden_states=True).hidden_states
            for pooler, features in out.items():
                emb = pool(pooler, hidden, batch["attention_mask"])
                features[idx] = torch.nn.functional.normalize(emb.float(), dim=-1).cpu().numpy()
    return out


# --------------------------------------------------------------------------- choosing encoders

ImageEncoder = Callable[[Sequence[Path], str], np.ndarray]


def image_encoder(cfg: TeachersConfig, device: torch.device,
                  download: bool = True) -> tuple[dict[str, Any], ImageEncoder]:
    """The configured image encoder: its cache-key description (resolved weights and
    preprocessing, no model built; ``download``: fetch ResNet-50's weights when online and not
    cached) and a function ``(files, label) -> (N, d)`` features."""
    if cfg.image_encoder == "colour-edge-grid":
        size = 64

        def colour_edge_grid(files: Sequence[Path], label: str) -> np.ndarray:
            chunks = []
            for start in tqdm(range(0, len(files), cfg.batch_size), desc=f"teacher: {label}", unit="batch"):
                batch = np.stack([read_rgba(f, size) for f in files[start : start + cfg.batch_size]])
                chunks.append(colour_edge_grid_features(batch, cfg.image_grid, cfg.colour_bins))
            return np.concatenate(chunks)

        return {"name": cfg.image_encoder, "grid": cfg.image_grid, "bins": cfg.colour_bins, "size": size}, \
            colour_edge_grid

    # fails here, before compute, when offline
    path, preprocess, described = resolve_resnet50(cfg.image_weights, download=download)
    built: list[torch.nn.Module] = []  # one model for images and object crops, built on the first miss

    def resnet50(files: Sequence[Path], label: str) -> np.ndarray:
        if not built:
            built.append(build_resnet50(path))
        return resnet50_features(files, built[0], preprocess, cfg.batch_size, cfg.num_workers, device)

    return {"name": "resnet50", **described}, resnet50


def text_teacher_key(name_or_path: str, pooler: str) -> dict[str, Any]:
    """Cache key of a text teacher: model id, the revision it resolves to, and the pooler."""

    return {"name": name_or_path, "revision": revision(resolve_model(name_or_path)), "pooler": pooler}


JointFeatures = Callable[[Sequence[str], Sequence[Path]], tuple[np.ndarray, np.ndarray]]


def pretrained_joint_teacher(cfg: TeachersConfig, device: torch.device) -> tuple[dict[str, Any], JointFeatures]:
    """A pretrained joint text–image teacher (``clip`` or ``open_clip``): its cache-key
    description and ``(captions, image files) -> (t̂, v̂)``."""

    j = cfg.joint
    if j.kind == "clip":
        described = tm.describe_clip(j.model)

        def clip(captions: Sequence[str], files: Sequence[Path]) -> tuple[np.ndarray, np.ndarray]:
            return tm.clip_features(j.model, captions, files, cfg.batch_size, cfg.num_workers, device)

        return {"kind": "clip", **described}, clip
    if j.kind == "open_clip":
        described = tm.describe_open_clip(j.model, j.pretrained)

        def open_clip(captions: Sequence[str], files: Sequence[Path]) -> tuple[np.ndarray, np.ndarray]:
            return tm.open_clip_features(j.model, j.pretrained, captions, files, cfg.batch_size, cfg.num_workers,
                                         device)

        return {"kind": "open_clip", **described}, open_clip
    raise InputError(f"teachers.joint.kind={j.kind!r} is not a pretrained teacher (cca is fitted here)")


# --------------------------------------------------------------------------- joint teacher


@dataclass(frozen=True)
class CCAProjection:
    """A fitted regularised CCA: text and image features → a shared ``dim``-d space."""

    text_mean: np.ndarray  # (d_t,)
    text_weights: np.ndarray  # (d_t, k)
    image_mean: np.ndarray  # (d_v,)
    image_weights: np.ndarray  # (d_v, k)
    correlations: np.ndarray  # (k,) canonical correlations, descending

    def text(self, x: np.ndarray) -> np.ndarray:
        with blas_threads(1):  # the fit's bits whatever the thread count (fit_cca)
            return ((x - self.text_mean) @ self.text_weights).astype(np.float32)

    def image(self, y: np.ndarray) -> np.ndarray:
        with blas_threads(1):  # the fit's bits whatever the thread count (fit_cca)
            return ((y - self.image_mean) @ self.image_weights).astype(np.float32)


def _inverse_sqrt(cov: np.ndarray) -> np.ndarray:
    values, vectors = np.linalg.eigh(cov)
    return (vectors / np.sqrt(values.clip(1e-12))) @ vectors.T


def fit_cca(text: np.ndarray, image: np.ndarray, dim: int, regularization: float) -> CCAProjection:
    """Regularised CCA of paired rows ``text (n, d_t)``, ``image (n, d_v)``.

    Each covariance gets ``regularization · mean eigenvalue`` added to its diagonal (the
    image features have more dimensions than there are pairs); directions are the top
    ``dim`` singular vectors of the whitened cross-covariance, so the projected text and
    image coordinates are uncorrelated within a modality and maximally correlated across.
    """
    n = text.shape[0]
    if text.shape[0] != image.shape[0] or n < 2:
        raise InputError(f"CCA needs the same number (>= 2) of text and image rows: {text.shape[0]}, {image.shape[0]}")
    if dim > min(text.shape[1], image.shape[1]):
        raise InputError(f"teachers.joint.dim={dim} exceeds the feature widths {text.shape[1]}, {image.shape[1]}")
    # on one BLAS thread: OpenBLAS splits a product's sums and a solver's updates by its thread count, so the same
    # CCA fitted with 1 and with 2 threads differed in its last bits (and every cached joint feature with it)
    with blas_threads(1):
        return _fit_cca(text, image, dim, regularization)


def _fit_cca(text: np.ndarray, image: np.ndarray, dim: int, regularization: float) -> CCAProjection:
    n = text.shape[0]
    x = text.astype(np.float64) - text.mean(0)
    y = image.astype(np.float64) - image.mean(0)
    cxx, cyy, cxy = x.T @ x / (n - 1), y.T @ y / (n - 1), x.T @ y / (n - 1)
    cxx += regularization * np.trace(cxx) / cxx.shape[0] * np.eye(cxx.shape[0])
    cyy += regularization * np.trace(cyy) / cyy.shape[0] * np.eye(cyy.shape[0])
    wx, wy = _inverse_sqrt(cxx), _inverse_sqrt(cyy)
    u, corr, vt = np.linalg.svd(wx @ cxy @ wy)
    return CCAProjection(
        text.mean(0), wx @ u[:, :dim], image.mean(0), wy @ vt.T[:, :dim], corr[:dim]
    )


# --------------------------------------------------------------------------- the cache


@dataclass(frozen=True)
class FeatureStore:
    """A read-only, memory-mapped feature set with id → row lookup."""

    folder: Path
    ids: tuple[str, ...]
    features: np.ndarray
    meta: dict[str, Any]

    @classmethod
    def open(cls, folder: str | Path) -> FeatureStore:
        """Open a set, checked first: ``features.npy``'s header against its size, its shape
        against ``index.json`` (``shape``, one row per id) and, when the index records one, its
        SHA-256 (hashed once per process per unchanged file). A bad set raises
        :class:`CorruptArtifact` naming the file and the stage that rebuilds it."""
        folder = Path(folder)
        index = read_json_artifact(folder / "index.json", REBUILD)
        ids = index.get("ids") if isinstance(index, dict) else None
        if not isinstance(ids, list):
            raise CorruptArtifact(folder / "index.json", "no list of row ids", REBUILD)
        file = folder / "features.npy"
        header = check_npy(file, REBUILD, shape=index.get("shape"), sha256=index.get("sha256"))
        if len(header.shape) != 2 or header.shape[0] != len(ids):
            raise CorruptArtifact(file, f"holds shape {header.shape}, index.json lists {len(ids)} ids", REBUILD)
        features = np.load(file, mmap_mode="r")
        return cls(folder, tuple(ids), features, index)

    @property
    def dim(self) -> int:
        return int(self.features.shape[1])

    def rows(self, ids: Sequence[str]) -> np.ndarray:
        return self.take(self.row_indices(ids))

    def row_indices(self, ids: Sequence[str]) -> np.ndarray:
        """Row numbers ``(n,)`` of ``ids``: looked up once per run, so a batch is one gather."""
        lookup = self._lookup
        try:
            return np.fromiter((lookup[i] for i in ids), dtype=np.int64, count=len(ids))
        except KeyError as err:
            raise MissingEntry(f"{self.folder}: no cached features for id {err.args[0]!r}") from None

    def take(self, rows: np.ndarray) -> np.ndarray:
        """Features ``(n, dim)`` of row numbers ``rows`` (a copy out of the memory map)."""
        return np.asarray(self.features[rows])

    @property
    def _lookup(self) -> dict[str, int]:
        cached = self.__dict__.get("_lookup_cache")
        if cached is None:
            cached = {k: i for i, k in enumerate(self.ids)}
            object.__setattr__(self, "_lookup_cache", cached)
        return cached


def cache_key(teacher: dict[str, Any], fingerprint: str) -> str:
    """A set's key: the teacher, the data, and the kernels in force (`mmcse.cpu_isa.kernels_in_force`: a set computed
    unpinned has other last bits than a pinned one, so neither is taken for the other)."""
    return sha256_json({"teacher": teacher, "data": fingerprint, "kernels": kernels_in_force()})[:16]


def cached_features(
    cache_dir: str | Path,
    name: str,
    teacher: dict[str, Any],
    fingerprint: str,
    ids: Sequence[str],
    compute: Callable[[], np.ndarray],
    read_only: Sequence[str | Path] = (),
) -> tuple[FeatureStore, bool]:
    """Open the cached set for (teacher, fingerprint) or compute and store it.

    ``read_only``: other caches looked in first (an ablation variant reads the DVC-tracked
    ``data/teachers`` but writes its own sets elsewhere). Returns the store and whether it was
    a cache hit (``compute`` not called).
    """
    set_name = f"{name}-{cache_key(teacher, fingerprint)}"
    found = find_cached_set(set_name, Path(cache_dir), read_only, FeatureStore.open)
    if found is not None:
        return found, True
    folder = Path(cache_dir) / set_name
    if folder.exists():
        shutil.rmtree(folder)  # an interrupted earlier write, or the damaged set above
    # No rows (data.pairs: none has no images or captions): an empty (0, 0) set, no model runs.
    features = np.ascontiguousarray(compute() if len(ids) else np.zeros((0, 0)), dtype=np.float32)
    if features.shape[0] != len(ids):
        raise ValueError(f"teacher {name}: computed {features.shape[0]} rows for {len(ids)} ids")
    folder.mkdir(parents=True)
    with atomic_path(folder / "features.npy") as tmp:
        with open(tmp, "wb") as handle:
            writer = HashingWriter(handle)  # the digest is taken while writing: no second read
            np.save(writer, features)
    remember_sha256(folder / "features.npy", writer.hexdigest())
    write_json(
        folder / "index.json",
        {"ids": list(ids), "teacher": teacher, "fingerprint": fingerprint, "shape": list(features.shape),
         "sha256": writer.hexdigest(), "bytes": writer.bytes},
    )
    return FeatureStore.open(folder), False
