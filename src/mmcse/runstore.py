"""MLflow's SQLite tracking store read directly, read-only: the runs, params, tags, latest metrics and local
artifacts a report or a table reads back, without importing MLflow (which takes seconds a command that only
reads should not pay). Another store (PostgreSQL, a server) is read through MLflow's client
(`mmcse.tracking.reading.MlflowRuns`), which answers the same calls (`RunReader`).

Only MLflow's stable schema is read (``experiments``, ``runs``, ``params``, ``tags``, ``latest_metrics``) and
only active runs, as MLflow's own search returns them by default.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol
from urllib.parse import unquote, urlparse

from mmcse.io import at_home

SQLITE_PREFIX = "sqlite:///"

# an ablation job's row and seed (`mmcse.experiments.ablate.run_job`), read back by `mmcse report`
VARIANT_TAG, SEED_TAG = "ablation.variant", "ablation.seed"
# a job trained with offline stand-in teachers under a paper profile (teachers.stand_ins: allow): what stood in
STAND_IN_TAG = "mmcse.stand_in_teachers"
# a job no seed can change (`mmcse.experiments.jobs.seed_free`): it ran once, and `mmcse report` compares it with the
# printed interval, not with a spread
SEED_FREE_TAG = "mmcse.seed_free"
# a training run's wall-clock minutes, summed over its resumed sessions (DALR Table 7): MLflow only,
# like the run id, since a DVC output must not change between two identical runs
TRAIN_MINUTES = "train_minutes"
# which code a run trained with (`mmcse.integrity.code.source_state`)
COMMIT_TAG, DIRTY_TAG, CHANGED_TAG, CODE_TAG = "mmcse.commit", "mmcse.dirty", "mmcse.changed", "mmcse.code_digest"


@dataclass(frozen=True)
class RunInfo:
    run_id: str
    status: str
    start_time: int
    experiment_id: str
    artifact_uri: str


@dataclass(frozen=True)
class RunData:
    params: dict[str, str] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class StoredRun:
    """One run as MLflow's client returns it, in the fields a reader uses (``run.info``, ``run.data``)."""

    info: RunInfo
    data: RunData


class RunReader(Protocol):
    """What reading a tracking store back takes: experiments by name, runs by one param or tag, artifacts."""

    def experiment_id(self, name: str) -> str | None: ...

    def runs(self, experiment_id: str, param: tuple[str, str] | None = None,
             tag: tuple[str, str] | None = None) -> list[StoredRun]: ...

    def artifact(self, run: StoredRun, path: str) -> bytes | None: ...

    def artifact_paths(self, run: StoredRun, folder: str) -> list[str]: ...


def local_artifact_root(artifact_uri: str) -> Path | None:
    """The folder of a run's artifacts when they are on this machine's disk (``file://`` or a plain path)."""
    parsed = urlparse(artifact_uri)
    if parsed.scheme == "file":
        return Path(unquote(parsed.path))
    if parsed.scheme == "":
        return Path(artifact_uri)
    return None


class SqliteRuns:
    """A `RunReader` on MLflow's SQLite file ``db`` (opened read-only: reading never locks out a writer for
    long, nor creates a store). A store whose artifacts are not on this disk reads as no artifacts."""

    def __init__(self, db: Path) -> None:
        self.db = db

    @classmethod
    def open(cls, tracking_uri: str) -> SqliteRuns | None:
        """The reader of ``tracking_uri`` when it is a SQLite file, else None; a relative path is the project's
        (`mmcse.io.at_home`, as `mmcse.tracking.configure` reads it)."""
        if not tracking_uri.startswith(SQLITE_PREFIX):
            return None
        path = Path(tracking_uri[len(SQLITE_PREFIX):])
        return cls(path if path.is_absolute() else at_home(path))

    def _query(self, sql: str, args: Sequence[object] = ()) -> list[tuple]:
        if not self.db.is_file():
            return []  # no run was ever logged here
        uri = f"file:{self.db.resolve()}?mode=ro"
        with closing(sqlite3.connect(uri, uri=True, timeout=30)) as db:
            return db.execute(sql, tuple(args)).fetchall()

    def experiment_id(self, name: str) -> str | None:
        rows = self._query("SELECT experiment_id FROM experiments WHERE name = ? AND lifecycle_stage = 'active'",
                           [name])
        return str(rows[0][0]) if rows else None

    def runs(self, experiment_id: str, param: tuple[str, str] | None = None,
             tag: tuple[str, str] | None = None) -> list[StoredRun]:
        """The experiment's active runs with ``param`` / ``tag`` = (key, value), newest first."""
        sql = ("SELECT run_uuid, status, start_time, experiment_id, artifact_uri FROM runs "
               "WHERE experiment_id = ? AND lifecycle_stage = 'active'")
        args: list[object] = [int(experiment_id)]
        for table, match in (("params", param), ("tags", tag)):
            if match is not None:
                sql += f" AND run_uuid IN (SELECT run_uuid FROM {table} WHERE key = ? AND value = ?)"
                args += list(match)
        infos = [RunInfo(r[0], r[1], int(r[2] or 0), str(r[3]), r[4] or "")
                 for r in self._query(sql + " ORDER BY start_time DESC", args)]
        if not infos:
            return []
        ids = [i.run_id for i in infos]
        marks = ",".join("?" * len(ids))
        params: dict[str, dict[str, str]] = {i: {} for i in ids}
        tags: dict[str, dict[str, str]] = {i: {} for i in ids}
        metrics: dict[str, dict[str, float]] = {i: {} for i in ids}
        for run, key, value in self._query(f"SELECT run_uuid, key, value FROM params WHERE run_uuid IN ({marks})", ids):
            params[run][key] = value
        for run, key, value in self._query(f"SELECT run_uuid, key, value FROM tags WHERE run_uuid IN ({marks})", ids):
            tags[run][key] = value
        for run, key, value, is_nan in self._query(
                f"SELECT run_uuid, key, value, is_nan FROM latest_metrics WHERE run_uuid IN ({marks})", ids):
            metrics[run][key] = float("nan") if is_nan else float(value)
        return [StoredRun(i, RunData(params[i.run_id], tags[i.run_id], metrics[i.run_id])) for i in infos]

    def artifact(self, run: StoredRun, path: str) -> bytes | None:
        root = local_artifact_root(run.info.artifact_uri)
        file = root / path if root is not None else None
        return file.read_bytes() if file is not None and file.is_file() else None

    def artifact_paths(self, run: StoredRun, folder: str) -> list[str]:
        root = local_artifact_root(run.info.artifact_uri)
        if root is None or not (root / folder).is_dir():
            return []
        return sorted(str(p.relative_to(root)) for p in (root / folder).iterdir() if p.is_file())
