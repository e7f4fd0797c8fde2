"""Fetching datasets: plain HTTP with resume, the Hugging Face hub, safe archive extraction.

Every download is verified by SHA-256 when the digest is known, written to ``<file>.part``
first and renamed only when complete and verified; an interrupted transfer resumes from the
``.part`` file with an HTTP Range request. Archives are extracted into a temporary folder
beside the destination, every member checked first (no absolute paths, no ``..``, no links
leaving the folder, no device files), and renamed into place only when all went well: a
failure leaves no partial output.
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import tarfile
import urllib.error
import urllib.request
import zipfile
from pathlib import Path, PurePosixPath

from tqdm.auto import tqdm

from mmcse.errors import DownloadError
from mmcse.hub import hf_download_command, hub_unreachable, offline, unreachable
from mmcse.io import build_dir, sha256_file, write_json


def file_digest(path: str | Path) -> str:
    """SHA-256 of ``path``, remembered in ``<path>.sha256.json`` (keyed by size and mtime) so a
    13 GB archive is hashed once, not on every rerun. Hub cache files are read-only
    symlinks: their digest is not remembered there."""
    path = Path(path)
    stat = path.stat()
    key = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    memo = path.with_name(path.name + ".sha256.json")
    if memo.is_file():
        try:
            saved = json.loads(memo.read_text())
            if {k: saved.get(k) for k in key} == key:
                return saved["sha256"]
        except (json.JSONDecodeError, KeyError):
            pass
    digest = sha256_file(path)
    if not path.is_symlink() and os.access(path.parent, os.W_OK):
        write_json(memo, {**key, "sha256": digest})
    return digest


def http_download(url: str, dest: str | Path, sha256: str | None = None, timeout: float = 30.0,
                  progress: bool = True) -> Path:
    """Download ``url`` to ``dest`` (resuming a ``.part`` file), verify ``sha256``, return ``dest``.

    An existing ``dest`` with the right digest is kept without any request. A transfer that
    stops early keeps its ``.part`` for the next call to resume; a digest mismatch deletes it.
    """
    dest = Path(dest)
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme not in ("http", "https"):  # urllib would also read file://, ftp:// and data: URLs
        raise DownloadError(f"{url}: only http(s) URLs are fetched (a local file is a source's `path:`)")
    if dest.is_file() and (sha256 is None or file_digest(dest) == sha256):
        return dest
    why = "offline: MMCSE_OFFLINE or HF_HUB_OFFLINE is set" if offline() else unreachable(url)
    if why is not None:
        raise DownloadError(f"{url}: not downloaded yet ({dest}) and it cannot be fetched here — {why}; fetch it on "
                            f"a machine with internet and copy it to {dest}")
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(dest.name + ".part")
    start = part.stat().st_size if part.is_file() else 0
    request = urllib.request.Request(url, headers={"Range": f"bytes={start}-"} if start else {})
    try:
        response = urllib.request.urlopen(request, timeout=timeout)
    except urllib.error.HTTPError as err:
        if err.code == 416 and start:  # the .part already holds the whole file
            response = None
        else:
            raise DownloadError(f"{url}: HTTP {err.code} {err.reason}") from None
    except (urllib.error.URLError, OSError) as err:
        raise DownloadError(f"{url}: cannot connect ({getattr(err, 'reason', err)})") from None
    if response is not None:
        with response:
            resumed = response.status == 206
            if start and not resumed:
                start = 0  # the server ignored the Range header: start over
            length = response.headers.get("Content-Length")
            expected = start + int(length) if length is not None else None
            received = start
            with open(part, "ab" if resumed else "wb") as out, tqdm(
                total=expected, initial=start, unit="B", unit_scale=True, desc=dest.name, disable=not progress
            ) as bar:
                try:
                    while block := response.read(1 << 20):
                        out.write(block)
                        received += len(block)
                        bar.update(len(block))
                except (OSError, urllib.error.URLError, http.client.HTTPException) as err:
                    raise DownloadError(f"{url}: transfer interrupted after {received} bytes ({err}); "
                                        f"rerun to resume from {part}") from None
            if expected is not None and received < expected:
                raise DownloadError(f"{url}: transfer stopped after {received} of {expected} bytes; "
                                    f"rerun to resume from {part}")
    if sha256 is not None:
        got = sha256_file(part)
        if got != sha256:
            part.unlink()
            raise DownloadError(f"{url}: SHA-256 mismatch (expected {sha256}, got {got}); the download was "
                                "deleted — a changed or corrupt file on the server")
    os.replace(part, dest)
    return dest


def _check_member(name: str, dest: Path, archive: Path) -> None:
    pure = PurePosixPath(name.replace("\\", "/"))
    if pure.is_absolute() or ".." in pure.parts or (pure.parts and pure.parts[0].endswith(":")):
        raise DownloadError(f"{archive}: member {name!r} would be written outside {dest}; refusing to extract")


def safe_extract(archive: str | Path, dest: str | Path) -> Path:
    """Extract a zip or tar(.gz/.bz2/.xz) archive into the folder ``dest`` (replaced only on
    success). Every member is checked before anything is written."""
    archive, dest = Path(archive), Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = build_dir(dest.parent, prefix=f".{dest.name}.")
    try:
        if zipfile.is_zipfile(archive):
            with zipfile.ZipFile(archive) as z:
                for info in z.infolist():
                    _check_member(info.filename, dest, archive)
                    if (info.external_attr >> 16) & 0o170000 == 0o120000:
                        raise DownloadError(f"{archive}: member {info.filename!r} is a symbolic link; refusing")
                bad = z.testzip()
                if bad is not None:
                    raise DownloadError(f"{archive}: member {bad!r} is corrupt (CRC mismatch)")
                z.extractall(tmp)
        else:
            try:
                with tarfile.open(archive) as t:
                    members = t.getmembers()
                    for m in members:
                        _check_member(m.name, dest, archive)
                        if m.issym() or m.islnk():
                            _check_member(str(PurePosixPath(m.name).parent / m.linkname), dest, archive)
                        if m.isdev() or m.isfifo():
                            raise DownloadError(f"{archive}: member {m.name!r} is a device file; refusing")
                    t.extractall(tmp, members=members, filter="data")
            except (tarfile.TarError, EOFError, OSError, zipfile.BadZipFile) as err:
                raise DownloadError(f"{archive}: not a complete zip or tar archive ({type(err).__name__}: {err})") \
                    from None
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(tmp, dest)
        return dest
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def hub_file(repo_id: str, filename: str, repo_type: str = "dataset", revision: str | None = None) -> Path:
    """A file of a Hugging Face hub repository: from the local hub cache first (works offline),
    downloaded (with the hub client's resume) only when online."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(hf_hub_download(repo_id, filename, repo_type=repo_type, revision=revision,
                                    local_files_only=True))
    except (LocalEntryNotFoundError, FileNotFoundError):
        pass
    where = os.environ.get("HF_HUB_CACHE") or os.environ.get("HF_HOME") or "~/.cache/huggingface"
    why = hub_unreachable()
    if why is not None:
        raise DownloadError(
            f"{repo_type} {repo_id}: {filename} is not in the local Hugging Face cache ({where}) and the hub cannot "
            f"be used here ({why}): run `{hf_download_command(repo_id, filename, repo_type)}` on a machine "
            "with internet and copy the cache here"
        )
    try:
        return Path(hf_hub_download(repo_id, filename, repo_type=repo_type, revision=revision, etag_timeout=10))
    except Exception as err:
        raise DownloadError(f"{repo_type} {repo_id}: {filename} could not be downloaded "
                            f"({type(err).__name__}: {str(err).splitlines()[0][:200]})") from None
