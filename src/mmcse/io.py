"""Atomic file writes, JSON Lines and content hashing shared by every stage."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import yaml
from PIL import Image, UnidentifiedImageError

from mmcse.errors import InputError, StageError


def _file_mode() -> int:
    """The mode ``open(path, "w")`` gives a new file: 0o666 less the process umask (0o644 by default)."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def _dir_mode() -> int:
    """The mode ``mkdir`` gives a new folder: 0o777 less the process umask (0o755 by default)."""
    return _file_mode() | (0o111 & ~_umask())


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def build_dir(parent: str | Path, prefix: str, suffix: str = "") -> Path:
    """A new private-named folder in ``parent`` to build an output in before it is renamed into place,
    with the mode a plain ``mkdir`` would give it (``tempfile.mkdtemp`` makes it owner-only, 0700, and
    a renamed build keeps that mode)."""
    folder = Path(tempfile.mkdtemp(prefix=prefix, suffix=suffix, dir=parent))
    os.chmod(folder, _dir_mode())
    return folder


def swap_in_dir(tmp: str | Path, final: str | Path) -> None:
    """Replace folder ``final`` by the finished build ``tmp`` so that one complete version always exists
    (a crash leaves the old one, or ``final.old`` with it, never a half-written ``final``)."""
    tmp, final = Path(tmp), Path(final)
    old = final.with_name(final.name + ".old")
    if old.exists():
        shutil.rmtree(old)
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    if old.exists():
        shutil.rmtree(old)


def follow_umask(root: str | Path) -> None:
    """Give every file under ``root`` the mode a plain write would (some writers, safetensors among
    them, create owner-only 0600 files) and every folder, ``root`` included, a plain ``mkdir``'s."""
    root = Path(root)
    file_mode, dir_mode = _file_mode(), _dir_mode()
    for path in [root, *root.rglob("*")]:
        if path.is_symlink():
            continue
        os.chmod(path, dir_mode if path.is_dir() else file_mode)


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; rename it over ``path`` only on success.

    A crash mid-write leaves the old file (or none) in place, never a partial one. The file gets
    the mode a plain write would give it (readable by others under the usual umask), not the
    owner-only mode of the temporary file.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        if tmp_path.is_file():
            os.chmod(tmp_path, _file_mode())
        os.replace(tmp_path, path)
    finally:
        if tmp_path.exists():
            tmp_path.unlink()


def write_text(path: str | Path, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def write_bytes(path: str | Path, data: bytes) -> None:
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def write_json(path: str | Path, obj: Any) -> None:
    write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


TRACKED_DECIMALS = 4  # what DVC tracks (metrics/*.json, plots/*.csv); MLflow keeps every digit


def tracked(value: Any) -> Any:
    """``value`` at the precision DVC tracks: every float to 4 decimals (4 significant digits below 0.01,
    so a rate of 1e-5 keeps its size), recursively through dicts and lists; ints, strings and non-finite
    floats unchanged. The digits dropped are those a different x86-64 CPU changes (teacher statistics,
    dev geometry: the 6th-8th digit), so `git status` after `dvc repro` is clean on any of them."""
    if isinstance(value, dict):
        return {k: tracked(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [tracked(v) for v in value]
    if isinstance(value, float) and value != 0.0 and abs(value) != float("inf") and value == value:
        if abs(value) >= 10 ** -(TRACKED_DECIMALS - 2):
            return round(value, TRACKED_DECIMALS)
        return float(f"{value:.{TRACKED_DECIMALS}g}")
    return value


def write_metrics(path: str | Path, metrics: Any) -> None:
    """A metrics file DVC tracks: `write_json` of `tracked` ``metrics``."""
    write_json(path, tracked(metrics))


def read_json(path: str | Path) -> Any:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: not found (run the stage that writes it first)")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise InputError(f"{path}: corrupt JSON: {err}") from None


def write_jsonl(path: str | Path, rows: Iterable[dict[str, Any]]) -> None:
    write_text(path, "".join(json.dumps(r, sort_keys=True) + "\n" for r in rows))


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: not found (run the stage that writes it first)")
    rows = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as err:
            raise InputError(f"{path}:{lineno}: corrupt JSON line: {err}") from None
    return rows


# PyYAML's safe loader in C (libyaml) where PyYAML was built with it: the same values, parsed ~10x faster than the
# pure-Python one (params.yaml: 19 -> 2 ms; every configuration read, plan and profile walk parses it again)
_YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def load_yaml(text: str) -> Any:
    """``text`` parsed as YAML by the safe loader (``yaml.safe_load``'s values; raises ``yaml.YAMLError``)."""
    return yaml.load(text, Loader=_YAML_LOADER)


def sha256_file(path: str | Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def sha256_json(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def project_home() -> Path:
    """The project's own workspace, where what must outlive one run is kept (the MLflow store, finished
    ablation jobs, resume points). ``dvc exp run --temp`` and queued experiments (`dvc queue start`) run
    in a copy under ``.dvc/tmp/exps/`` that DVC deletes afterwards; DVC gives every stage ``DVC_ROOT``,
    the repository the experiment was started from, so a run made in a copy lands in the project."""
    root = os.environ.get("DVC_ROOT")
    if root and Path(root).is_dir():
        return Path(root).resolve()
    return Path.cwd()


def at_home(path: str | Path) -> Path:
    """``path`` when absolute, else under `project_home`."""
    path = Path(path)
    return path if path.is_absolute() else project_home() / path


def ensure_sqlite_parent(url: str) -> str:
    """Create the folder of a relative ``sqlite:///path/db`` URL (SQLite will not) and return
    it made absolute against the project (`project_home`: the cwd, or the workspace a DVC experiment
    copy was made from): MLflow and SQLAlchemy cache stores by URL, so a relative URL reused from
    another working directory would write into the first one's database."""
    if url.startswith("sqlite:///") and not url.startswith("sqlite:////"):
        path = at_home(url[len("sqlite:///") :]).resolve()
        path.parent.mkdir(parents=True, exist_ok=True)
        return f"sqlite:///{path}"
    return url


def open_image(path: str | Path, hint: str = ""):
    """A fully loaded PIL image; a missing or corrupt file is a clear error naming it
    (``hint`` says how to repair it, e.g. which stage to rerun)."""

    path = Path(path)
    suffix = f" ({hint})" if hint else ""
    try:
        with Image.open(path) as img:
            img.load()
            return img.copy()
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: image not found{suffix}") from None
    except (UnidentifiedImageError, OSError) as err:
        raise InputError(f"{path}: corrupt or unreadable image ({err}){suffix}") from None


def _lock_file(output: Path) -> Path:
    """Where the lock of ``output`` lives: beside DVC's own lock in ``.dvc/tmp`` when the cwd is a DVC
    project (git-ignored there), else beside the output."""
    name = hashlib.sha256(str(output.resolve()).encode()).hexdigest()[:16]
    dvc_tmp = Path(".dvc") / "tmp"
    if dvc_tmp.parent.is_dir():
        return dvc_tmp / "mmcse-locks" / f"{output.name}-{name}.lock"
    return output.parent / f".{output.name}.lock"


@contextlib.contextmanager
def hold_outputs(outputs: Iterable[str | Path], holder: str) -> Iterator[None]:
    """Hold ``outputs`` exclusively while the block runs: a second process that asks for one of them
    fails at once with one line naming the holder (its pid, start and command), instead of writing into
    the same folder (an orphaned stage beside the next ``dvc repro``). The lock is the kernel's
    (``flock``): it goes with the process, so a killed holder leaves none behind."""

    handles = []
    try:
        for output in outputs:
            output = Path(output)
            file = _lock_file(output)
            file.parent.mkdir(parents=True, exist_ok=True)
            handle = open(file, "a+")  # noqa: SIM115  held until the block ends
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                handle.seek(0)
                try:
                    held = json.loads(handle.read() or "{}")
                except ValueError:
                    held = {}
                handle.close()
                raise StageError(
                    f"{output}: in use by {held.get('holder', 'another stage')} (pid {held.get('pid', '?')}, started "
                    f"{held.get('started', '?')}: {held.get('command', '?')}); wait for it, or stop it "
                    f"(kill {held.get('pid', '<pid>')}) and rerun") from None
            handle.seek(0)
            handle.truncate()
            handle.write(json.dumps({"holder": holder, "pid": os.getpid(), "command": " ".join(sys.argv)[:300],
                                     "started": time.strftime("%Y-%m-%d %H:%M:%S")}))
            handle.flush()
            handles.append(handle)
        yield
    finally:
        for handle in handles:
            handle.close()  # releases the lock


class BackgroundWriter:
    """One write at a time on a thread beside training: `submit` waits for the previous write (whose error, a full
    disk say, is raised there), then starts the next; `wait` waits for the last. Resume points are written this
    way (`mmcse.training.checkpoints.Checkpoints.save`): the step goes on while the files are written and hashed."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def submit(self, write: Callable[[], None]) -> None:
        self.wait()

        def run() -> None:
            try:
                write()
            except BaseException as err:  # noqa: BLE001 (raised again in the training thread, by wait)
                self._error = err

        self._thread = threading.Thread(target=run, name="mmcse-resume-point", daemon=False)
        self._thread.start()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            raise err
