"""Which MLflow run holds a folder's record, kept beside the store: run ids are random, so they stay out
of every DVC-tracked output (models/student, ablation/), and a fresh clone's `dvc repro` then reproduces
dvc.lock. One small JSON file per (kind, folder) under the project's mlruns/ (git-ignored, beside the
default SQLite store), readable without MLflow: a plan's estimate reads the pace a training recorded here
(`note_run`) without loading the tracking library."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

from mmcse.io import at_home, sha256_json, write_json

RUN_RECORDS = Path("mlruns") / "records"


def folder_key(folder: str | Path) -> str:
    """A folder as its records know it: relative to the cwd when inside it (a stage's output reads the
    same in the workspace and in a DVC experiment's copy of it), else absolute."""
    resolved = Path(folder).resolve()
    try:
        return f"./{resolved.relative_to(Path.cwd().resolve())}"
    except ValueError:
        return str(resolved)


def _record_file(folder: str | Path, kind: str, key: str | None = None) -> Path:
    return at_home(RUN_RECORDS) / f"{kind}-{sha256_json(key or folder_key(folder))[:20]}.json"


def remember_run(folder: str | Path, run_id: str, kind: str = "train", config_hash: str | None = None,
                 **extra: Any) -> None:
    """Record that MLflow run ``run_id`` holds the record of ``folder`` (``kind``: train — a training
    and its evaluation —, or ablation — an ablation's parent run, with ``extra`` such as its hash).
    ``config_hash`` (a training's `run_definition_hash`): the run is also remembered as that
    configuration's, so a folder another configuration trained in meanwhile never continues it."""

    previous = remembered_run(folder, kind) or {}
    runs = dict(previous.get("runs") or {})
    if config_hash is not None:
        runs[config_hash] = run_id
    write_json(_record_file(folder, kind), {"folder": folder_key(folder), "kind": kind,
                                            "run_id": run_id, **({"runs": runs} if runs else {}), **extra})


def remembered_run(folder: str | Path, kind: str = "train", config_hash: str | None = None) -> dict[str, Any] | None:
    """What `remember_run` recorded for ``folder`` (None: nothing, or an unreadable record); with
    ``config_hash``, the run remembered for that configuration only (``{"run_id": ...}``, or None)."""

    record = None
    # (records written before they were keyed relative to the project: by the absolute path)
    for key in dict.fromkeys((folder_key(folder), str(Path(folder).resolve()))):
        with contextlib.suppress(OSError, ValueError):
            record = json.loads(_record_file(folder, kind, key).read_text())
            break
    if not isinstance(record, dict) or not isinstance(record.get("run_id"), str):
        return None
    if config_hash is None:
        return record
    run_id = (record.get("runs") or {}).get(config_hash)
    return {**record, "run_id": run_id} if isinstance(run_id, str) else None


def folder_run_id(folder: str | Path, recorded: dict[str, Any] | None = None, config_hash: str | None = None) -> str:
    """The training run of job folder ``folder`` (its remembered run; with ``config_hash``, that
    configuration's; ``recorded``: a summary or result written before run ids left the tracked
    outputs). Raises naming the folder when none."""
    record = remembered_run(folder, config_hash=config_hash)
    if record is not None:
        return record["run_id"]
    if recorded and recorded.get("run_id") and config_hash is None:
        return str(recorded["run_id"])
    raise FileNotFoundError(f"{folder}: no MLflow run recorded for it in {RUN_RECORDS} (trained in another "
                            "checkout, or mlruns/ was removed): retrain it (dvc repro train)")


def note_run(folder: str | Path, kind: str = "train", **fields: Any) -> None:
    """Add ``fields`` (a training's ``train_minutes``, its evaluation's ``eval_minutes``)
    to ``folder``'s record, when there is one."""
    record = remembered_run(folder, kind)
    if record is not None:
        write_json(_record_file(folder, kind), {**record, **fields})
