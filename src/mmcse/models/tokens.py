"""Sentences tokenized once into cached integer arrays, batched with dynamic padding.

Tokenizing per batch costs host time on every step (and Wiki1M is re-tokenized every
epoch); here each text set is tokenized once per (tokenizer, max length, texts) key and
kept beside the teacher features as ``ids.npy (N, L) int32`` (right-padded) and
``lengths.npy (N,)``, with their SHA-256 and the key in ``tokens.json``: a table whose bytes no
longer match (overwritten ids of the right shape, a truncated file) is rebuilt, never trained on.
A batch gathers its rows and cuts them to its longest sentence, which gives exactly the
``input_ids`` / ``attention_mask`` of ``tokenizer(..., padding=True, truncation=True,
max_length=L)`` for right-padding tokenizers.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from mmcse.errors import InputError, TokenCacheError
from mmcse.io import read_json, sha256_file, sha256_json, write_json

FORMAT = 2  # 2: the arrays' SHA-256 and the key in tokens.json
_CHUNK = 4096  # sentences per tokenizer call: the fast tokenizer batches internally


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A digest of everything that decides the token ids: the fast tokenizer's full
    serialization (vocabulary, normalizer, pre-tokenizer, post-processor), less its
    truncation and padding state, which every call sets anew."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        spec = json.loads(backend.to_str())
        spec.pop("truncation", None)
        spec.pop("padding", None)
        spec = json.dumps(spec, sort_keys=True)
    else:  # a slow tokenizer: its vocabulary and class
        spec = repr(sorted(tokenizer.get_vocab().items())) + type(tokenizer).__name__
    return hashlib.sha256(spec.encode()).hexdigest()


def texts_digest(texts: Sequence[str]) -> str:
    h = hashlib.sha256()
    for t in texts:
        h.update(t.encode())
        h.update(b"\n")
    return h.hexdigest()


@dataclass
class TokenTable:
    """Token ids of N sentences: ``ids (N, L)`` right-padded with ``pad_id``, ``lengths (N,)``."""

    ids: np.ndarray
    lengths: np.ndarray
    pad_id: int
    folder: Path | None = None

    def __len__(self) -> int:
        return int(self.lengths.shape[0])

    def batch(self, idx: Sequence[int] | np.ndarray, device: torch.device,
              full_width: bool = False) -> dict[str, torch.Tensor]:
        """``input_ids`` and ``attention_mask`` ``(B, l)`` of rows ``idx``, padded to their longest
        (dynamic padding) or, with ``full_width``, to the table's width (``model.max_seq_len``: the static shapes
        of a compiled step); copied from pinned memory without blocking on CUDA."""
        idx = np.asarray(idx, dtype=np.int64)
        lengths = self.lengths[idx]  # (B,)
        width = self.ids.shape[1] if full_width else int(lengths.max())
        ids = torch.from_numpy(self.ids[idx, :width].astype(np.int64))  # (B, l)
        mask = torch.from_numpy((np.arange(width)[None, :] < lengths[:, None]).astype(np.int64))  # (B, l)
        return {"input_ids": to_device(ids, device), "attention_mask": to_device(mask, device)}


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host tensor → ``device``; on CUDA through pinned memory so the copy does not block the
    host (PyTorch's pinned-memory cache keeps the buffer alive until the copy has run)."""
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def tokenize_texts(tokenizer: Any, texts: Sequence[str], max_len: int, desc: str = "tokenize") -> TokenTable:
    """Tokenize ``texts`` (truncated to ``max_len`` tokens, special tokens added) into a table."""
    pad_id = tokenizer.pad_token_id
    if pad_id is None:
        raise InputError(f"tokenizer {tokenizer.name_or_path!r} has no padding token")
    ids = np.full((len(texts), max_len), pad_id, dtype=np.int32)
    lengths = np.zeros(len(texts), dtype=np.int32)
    chunks = range(0, len(texts), _CHUNK)
    for start in tqdm(chunks, desc=desc, unit="chunk", leave=False, disable=len(chunks) < 8):
        encoded = tokenizer(list(texts[start : start + _CHUNK]), truncation=True, max_length=max_len,
                            padding=False, return_attention_mask=False)["input_ids"]
        for row, seq in enumerate(encoded, start):
            ids[row, : len(seq)] = seq
            lengths[row] = len(seq)
    if len(texts) and int(lengths.min()) == 0:
        raise ValueError(f"{desc}: an empty token sequence (row {int(np.argmin(lengths))})")
    return TokenTable(ids, lengths, int(pad_id))


def cache_key(tokenizer: Any, texts: Sequence[str], max_len: int) -> str:
    return sha256_json({"format": FORMAT, "tokenizer": tokenizer_fingerprint(tokenizer), "max_len": max_len,
                        "texts": texts_digest(texts)})[:16]


ARRAYS = ("ids.npy", "lengths.npy")


def open_table(folder: Path, key: str | None = None) -> TokenTable:
    """Open a cached table, checking the arrays against the header written with them: their
    SHA-256, shapes and lengths, and (given ``key``) that the header is of that key."""
    header = folder / "tokens.json"
    try:
        meta = read_json(header)
        n, width = int(meta["rows"]), int(meta["max_len"])
        digests = dict(meta["sha256"])
        if key is not None and meta.get("key") != key:
            raise TokenCacheError(f"{folder}: its header is of key {meta.get('key')!r}, not {key!r}")
        changed = [name for name in ARRAYS if sha256_file(folder / name) != digests.get(name)]
        if changed:
            raise TokenCacheError(f"{folder}: {', '.join(changed)} no longer match the SHA-256 written with them")
        ids = np.load(folder / "ids.npy", mmap_mode="r")
        lengths = np.load(folder / "lengths.npy")
    except (OSError, ValueError, KeyError, TypeError) as err:  # truncated .npy: "mmap length is greater than file size"
        if isinstance(err, TokenCacheError):
            raise
        raise TokenCacheError(f"{folder}: unreadable token cache ({err})") from err
    if ids.shape != (n, width) or lengths.shape != (n,) or ids.dtype != np.int32:
        raise TokenCacheError(f"{folder}: arrays {ids.shape}/{lengths.shape} do not match the header ({n}, {width})")
    if n and (int(lengths.min()) < 1 or int(lengths.max()) > width):
        raise TokenCacheError(f"{folder}: token lengths outside [1, {width}]")
    return TokenTable(ids, lengths, int(meta["pad_id"]), folder)


def cached_tokens(cache_dir: str | Path, name: str, tokenizer: Any, texts: Sequence[str], max_len: int) -> TokenTable:
    """The token table of ``texts`` from ``cache_dir/<name>-<key>``, tokenized and written
    (atomically: a temporary folder renamed) when absent; a corrupt folder is rebuilt."""
    key = cache_key(tokenizer, texts, max_len)
    folder = Path(cache_dir) / f"{name}-{key}"
    if folder.exists():
        try:
            return open_table(folder, key)
        except TokenCacheError as err:
            print(f"{err}: rebuilding it")
            shutil.rmtree(folder)
    table = tokenize_texts(tokenizer, texts, max_len, desc=f"tokenize {name}")
    tmp = folder.with_name(f"{folder.name}.tmp-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    np.save(tmp / "ids.npy", table.ids)
    np.save(tmp / "lengths.npy", table.lengths)
    write_json(tmp / "tokens.json", {"rows": len(table), "max_len": max_len, "pad_id": table.pad_id,
                                     "tokenizer": getattr(tokenizer, "name_or_path", ""), "format": FORMAT,
                                     "key": key, "sha256": {n: sha256_file(tmp / n) for n in ARRAYS}})
    try:
        os.replace(tmp, folder)
    except OSError:  # written meanwhile by another job with the same key: keep theirs
        shutil.rmtree(tmp)
    return open_table(folder, key)
