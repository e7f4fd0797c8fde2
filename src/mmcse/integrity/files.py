"""Checks that a stored artifact is whole before anything reads it.

A truncated ``features.npy`` otherwise surfaces as numpy's "mmap length is greater than file
size" and a truncated ``model.safetensors`` as a long traceback from deep inside a loader, and
neither names the file. Each check here compares a file against its own header (``.npy``:
shape × itemsize + header length; safetensors: the tensors' data offsets) and, where one was
recorded, against a SHA-256 digest, and raises :class:`~mmcse.errors.CorruptArtifact` with one
line: ``<path>: <what is wrong>; <what to run>``.

Hashing a GB-size feature file on every open would cost seconds per run, so a file's digest
is computed once per process and remembered against its (path, inode, size, mtime, ctime):
any write to the file or a replacement of it changes that key.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
from numpy.lib import format as npy

from mmcse.errors import CorruptArtifact
from mmcse.io import read_jsonl, write_json

T = TypeVar("T")

# --------------------------------------------------------------------------- digests (memoised)

_DIGESTS: dict[tuple[str, int, int, int, int], str] = {}


def _stat_key(path: Path) -> tuple[str, int, int, int, int]:
    st = path.stat()
    return str(path.resolve()), st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def file_sha256(path: str | Path, chunk: int = 1 << 22) -> str:
    """SHA-256 of ``path``, hashed at most once per process while the file is unchanged."""
    path = Path(path)
    key = _stat_key(path)
    digest = _DIGESTS.get(key)
    if digest is None:
        h = hashlib.sha256()
        with open(path, "rb") as handle:
            while block := handle.read(chunk):
                h.update(block)
        digest = _DIGESTS[key] = h.hexdigest()
    return digest


def remember_sha256(path: str | Path, digest: str) -> None:
    """Record the digest of a file this process has just written (hashed while writing)."""
    _DIGESTS[_stat_key(Path(path))] = digest


class HashingWriter:
    """A binary file wrapper that hashes what is written through it (``np.save`` target)."""

    def __init__(self, handle: Any) -> None:
        self._handle = handle
        self._sha = hashlib.sha256()
        self.bytes = 0

    def write(self, data: bytes | memoryview) -> int:
        self._sha.update(data)
        self.bytes += len(data)
        return self._handle.write(data)

    def hexdigest(self) -> str:
        return self._sha.hexdigest()


def _size(path: Path, fix: str) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        raise CorruptArtifact(path, "missing", fix) from None


# --------------------------------------------------------------------------- .npy


@dataclass(frozen=True)
class NpyHeader:
    shape: tuple[int, ...]
    dtype: np.dtype
    fortran_order: bool
    offset: int  # bytes before the data

    @property
    def data_bytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def npy_header(path: str | Path, fix: str) -> NpyHeader:
    """The header of a ``.npy`` file, checked against the file's size (a truncated or padded
    file is an error, before numpy would memory-map past its end)."""

    path = Path(path)
    size = _size(path, fix)
    try:
        with open(path, "rb") as handle:
            version = npy.read_magic(handle)
            if version == (1, 0):
                shape, fortran, dtype = npy.read_array_header_1_0(handle)
            elif version == (2, 0):
                shape, fortran, dtype = npy.read_array_header_2_0(handle)
            else:  # (3, 0): utf-8 field names, only through the private reader
                shape, fortran, dtype = npy._read_array_header(handle, version)
            offset = handle.tell()
    except (ValueError, OSError, SyntaxError) as err:
        raise CorruptArtifact(path, f"not a readable .npy file ({str(err).splitlines()[0]})", fix) from None
    header = NpyHeader(tuple(int(n) for n in shape), np.dtype(dtype), bool(fortran), offset)
    if header.dtype.hasobject:
        raise CorruptArtifact(path, "holds Python objects, not numbers", fix)
    expected = header.offset + header.data_bytes
    if size != expected:
        state = "truncated" if size < expected else "longer than its header says"
        problem = f"{state}: {size} bytes, its header ({header.shape} {header.dtype}) needs {expected}"
        raise CorruptArtifact(path, problem, fix)
    return header


def check_npy(
    path: str | Path, fix: str, shape: Iterable[int] | None = None, sha256: str | None = None
) -> NpyHeader:
    """Check a ``.npy`` file: header vs size always, ``shape`` when given, and the content's
    SHA-256 when one was recorded (hashed once per process per unchanged file)."""
    path = Path(path)
    header = npy_header(path, fix)
    if shape is not None and tuple(shape) != header.shape:
        raise CorruptArtifact(path, f"holds shape {header.shape}, its index records {tuple(shape)}", fix)
    if sha256 and file_sha256(path) != sha256:
        raise CorruptArtifact(path, "content does not match the SHA-256 recorded when it was written", fix)
    return header


# --------------------------------------------------------------------------- safetensors / torch

_SAFETENSORS_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "I16": 2, "F16": 2,
                      "BF16": 2, "U32": 4, "I32": 4, "F32": 4, "U64": 8, "I64": 8, "F64": 8, "C64": 8}


def check_safetensors(path: str | Path, fix: str) -> dict[str, Any]:
    """Check a safetensors file against its header: an 8-byte little-endian header length, a
    JSON header whose tensors' ``data_offsets`` lie within the data (and match each tensor's
    shape × dtype size), and a file exactly as long as header + data. Returns the header."""
    path = Path(path)
    size = _size(path, fix)
    if size < 8:
        raise CorruptArtifact(path, f"truncated: {size} bytes, shorter than the 8-byte header length", fix)
    with open(path, "rb") as handle:
        n = int.from_bytes(handle.read(8), "little")
        if 8 + n > size:
            raise CorruptArtifact(path, f"truncated: {size} bytes, its header alone claims {8 + n}", fix)
        raw = handle.read(n)
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CorruptArtifact(path, f"unreadable safetensors header ({err})", fix) from None
    if not isinstance(header, dict):
        raise CorruptArtifact(path, "unreadable safetensors header (not a JSON object)", fix)
    end = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            start, stop = (int(x) for x in info["data_offsets"])
            shape, dtype = [int(d) for d in info["shape"]], str(info["dtype"])
        except (KeyError, TypeError, ValueError):
            raise CorruptArtifact(path, f"tensor {name!r} has a malformed header entry", fix) from None
        if not 0 <= start <= stop:
            raise CorruptArtifact(path, f"tensor {name!r} has data offsets [{start}, {stop})", fix)
        if dtype in _SAFETENSORS_BYTES and stop - start != math.prod(shape) * _SAFETENSORS_BYTES[dtype]:
            raise CorruptArtifact(path, f"tensor {name!r} ({dtype} {shape}) spans {stop - start} bytes", fix)
        end = max(end, stop)
    expected = 8 + n + end
    if size != expected:
        state = "truncated" if size < expected else "longer than its header says"
        raise CorruptArtifact(path, f"{state}: {size} bytes, its header describes {expected}", fix)
    return header


def load_torch(path: str | Path, fix: str, **kwargs: Any) -> Any:
    """``torch.load(path)``; any failure (truncated zip, bad pickle) is one line naming the file."""
    import torch

    path = Path(path)
    _size(path, fix)
    try:
        return torch.load(path, **kwargs)
    except Exception as err:  # zipfile, pickle and torch errors all mean "unreadable"
        first = str(err).splitlines()[0] if str(err) else ""
        raise CorruptArtifact(path, f"unreadable ({type(err).__name__}: {first[:200]})", fix) from None


def read_json_artifact(path: str | Path, fix: str) -> Any:
    """A JSON file that must be present and parse; otherwise one line naming it."""
    path = Path(path)
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise CorruptArtifact(path, "missing", fix) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CorruptArtifact(path, f"corrupt JSON ({err})", fix) from None


# --------------------------------------------------------------------------- sealed folders

# A checkpoint folder's seal: which configuration and step wrote it, and the SHA-256 of every file in it
# (``{"config_hash", "step", "files": {relative path: sha256}}``). Header checks cannot see same-size
# damage inside a tensor's data; the seal can, and it says whose checkpoint the folder is.
SEAL = "checkpoint.json"


def seal_folder(folder: str | Path, **record: Any) -> dict[str, Any]:
    """Write ``folder/checkpoint.json`` (`SEAL`): ``record`` (e.g. ``config_hash``, ``step``) and the
    SHA-256 of every file under ``folder``; returns what was written. Call it on a finished folder
    before it is renamed into place, so the seal and the files appear together."""
    folder = Path(folder)
    files = {path.relative_to(folder).as_posix(): file_sha256(path)
             for path in sorted(folder.rglob("*")) if path.is_file() and path.name != SEAL}
    sealed = {**record, "files": files}
    write_json(folder / SEAL, sealed)
    return sealed


def read_seal(folder: str | Path, fix: str) -> dict[str, Any] | None:
    """The seal of ``folder`` (None: the folder has none, e.g. a model from a hub); a damaged one is
    a `CorruptArtifact`."""
    path = Path(folder) / SEAL
    if not path.is_file():
        return None
    sealed = read_json_artifact(path, fix)
    if not isinstance(sealed, dict) or not isinstance(sealed.get("files"), dict):
        raise CorruptArtifact(path, "not a checkpoint seal (no files listed)", fix)
    return sealed


def check_sealed(folder: str | Path, fix: str) -> dict[str, Any] | None:
    """Every file the seal of ``folder`` lists, against its recorded SHA-256 (hashed once per process
    while a file is unchanged); returns the seal, None when the folder has none."""
    folder = Path(folder)
    sealed = read_seal(folder, fix)
    if sealed is None:
        return None
    for name, digest in sorted(sealed["files"].items()):
        path = folder / name
        if not path.is_file():
            raise CorruptArtifact(path, f"missing ({SEAL} lists it)", fix)
        if file_sha256(path) != digest:
            raise CorruptArtifact(path, f"content does not match the SHA-256 {SEAL} records (damaged since it "
                                  "was written)", fix)
    return sealed


def check_model_folder(folder: str | Path, fix: str, required: Iterable[str] = ()) -> dict[str, Any] | None:
    """Check a model folder before a loader reads it: ``required`` files exist, every ``*.safetensors``
    file against its header, every top-level ``*.json`` (config, tokenizer, heads) parses, and, in a
    folder mmcse wrote, every file against the SHA-256 its seal records (`check_sealed`: same-size
    damage too). Returns the seal (None: an unsealed folder, e.g. a hub model)."""
    folder = Path(folder)
    for name in required:
        if not (folder / name).is_file():
            raise CorruptArtifact(folder / name, "missing", fix)
    for path in sorted(folder.glob("*.safetensors")):
        check_safetensors(path, fix)
    for path in sorted(folder.glob("*.json")):
        read_json_artifact(path, fix)
    return check_sealed(folder, fix)


def check_image_digests(rows: Iterable[dict[str, Any]], files: Iterable[Path],
                        fix: str = "rerun the download stage (dvc repro download)") -> None:
    """Each image file against the SHA-256 its row records (images.jsonl, written by the download
    stage), before any feature is computed from it: a changed image of any size is named and never
    encoded under its row's key (a set's key holds the tables' digests, so the recorded bytes).
    Each file is hashed at most once per process while it is unchanged (`file_sha256`)."""
    for row, file in zip(rows, files, strict=True):
        recorded = row.get("sha256")
        if not recorded:
            continue
        try:
            got = file_sha256(file)
        except FileNotFoundError:
            raise CorruptArtifact(file, "missing (images.jsonl lists it)", fix) from None
        if got != recorded:
            raise CorruptArtifact(file, f"SHA-256 {got[:16]}… differs from the {recorded[:16]}… images.jsonl "
                                  "records (changed since the download stage)", fix)


IMAGE_FIX = "rerun the download stage (dvc repro download)"


def verify_images(raw: str | Path, tables: Iterable[str] = ("images.jsonl",), fix: str = IMAGE_FIX) -> int:
    """Every image the ``tables`` of the data folder ``raw`` list, against the size and SHA-256 the
    download stage recorded, whether or not a set will be built from it: a same-size swap is named
    even when every feature set is already cached. Cheap on a rerun: a file is hashed only when its
    size, mtime, ctime or inode moved since it was last verified (remembered in
    ``<raw>/../.verified/<raw name>.json``, outside the DVC output; ctime cannot be set back by a
    copy that keeps the mtime). Returns how many files were hashed."""

    raw = Path(raw)
    memo_file = raw.parent / ".verified" / f"{raw.name}.json"
    try:
        memo = json.loads(memo_file.read_text())
        memo = memo if isinstance(memo, dict) else {}
    except (OSError, ValueError):
        memo = {}
    verified: dict[str, list[Any]] = {}
    hashed = 0
    last_save = time.monotonic()
    try:
        for table in tables:
            if not (raw / table).is_file():
                continue
            for row in read_jsonl(raw / table):
                recorded, name = row.get("sha256"), row.get("file")
                if not recorded or not name or name in verified:
                    continue
                path = raw / name
                try:
                    st = path.stat()
                except FileNotFoundError:
                    raise CorruptArtifact(path, f"missing ({table} lists it)", fix) from None
                key = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, recorded]
                if memo.get(name) != key:
                    if row.get("bytes") is not None and st.st_size != row["bytes"]:
                        raise CorruptArtifact(path, f"{st.st_size} bytes, {table} records {row['bytes']} (changed "
                                              "or damaged since the download stage)", fix)
                    got = file_sha256(path)
                    hashed += 1
                    if got != recorded:
                        raise CorruptArtifact(path, f"SHA-256 {got[:16]}… differs from the {recorded[:16]}… {table} "
                                              "records (changed since the download stage)", fix)
                verified[name] = key
                if time.monotonic() - last_save > 60:  # a long first pass keeps its progress
                    write_json(memo_file, {**memo, **verified})
                    last_save = time.monotonic()
    finally:
        if verified:
            write_json(memo_file, {**memo, **verified})
    return hashed


def find_cached_set(set_name: str, cache_dir: Path, read_only: Iterable[str | Path], open_set: Callable[[Path], T],
                    what: str = "cached set", verb: str = "computing") -> T | None:
    """A cached set ``set_name`` that opens cleanly (``open_set`` checks it): first in the
    ``read_only`` caches, then in ``cache_dir``; None when there is none. A damaged read-only set
    is left alone (not ours to delete; the caller builds into ``cache_dir``); a damaged one in
    ``cache_dir`` is reported and left for the caller to replace."""

    log = logging.getLogger(__name__)
    for shared in read_only:
        found = Path(shared) / set_name
        if (found / "index.json").is_file():
            try:
                return open_set(found)
            except CorruptArtifact as err:
                log.warning("%s: %s; %s the set into %s instead", err.path, err.problem, verb, cache_dir)
    folder = Path(cache_dir) / set_name
    if (folder / "index.json").is_file():
        try:
            return open_set(folder)
        except CorruptArtifact as err:  # truncated, bit-flipped or foreign: rebuilt by the caller
            log.warning("%s: %s; deleting the %s and %s it again", err.path, err.problem, what, verb)
    return None
