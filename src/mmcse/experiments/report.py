"""`mmcse report <paper>`: each table of a paper beside its reproduction, from the MLflow record.

For every table of ``papers/<paper>.yaml`` the latest ablation (the parent run ``ablation <preset>``
in experiment ``<prefix>-ablate``) of the table's preset under each profile is read back: its table
(``ablation_table.json``: mean, std and the table's own test per row and metric), its jobs' training
minutes and devices (the runs tagged ``ablation.variant``) and its figures. `mmcse.analysis.report`
lays them beside the paper's numbers; the Markdown and the self-contained HTML page go to
``reports/<paper>.{md,html}`` (`write_report`) and, with ``mmcse report --log`` and in the report stage, as
artifacts under ``report/`` to every ablation run they read (`mmcse.tracking.reading.log_report`).

The record is read through a `mmcse.runstore.RunReader`: the SQLite store directly (no MLflow import, so
the command answers in about a second), another store through MLflow's client.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mmcse.analysis.papers import Paper, list_papers, load_paper, reproduction_tolerances, with_tolerances
from mmcse.analysis.report import Reproduction, RunCell, paper_report, to_html, to_markdown, verdict_counts
from mmcse.config import Config, ConfigError
from mmcse.config.readings import READING_TAG, points_off_printed
from mmcse.errors import InputError
from mmcse.experiments.params import list_presets
from mmcse.io import write_text
from mmcse.runstore import (
    CHANGED_TAG,
    COMMIT_TAG,
    DIRTY_TAG,
    SEED_FREE_TAG,
    STAND_IN_TAG,
    TRAIN_MINUTES,
    VARIANT_TAG,
    RunReader,
    SqliteRuns,
    StoredRun,
)

TABLE_ARTIFACT = "ablation_table.json"
FIGURES = "figures"  # the parent run's figures: ablation.png, and those of ablate.figures
REPORT_DIR = "reports"


def _float(value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def reproduction(reader: RunReader, run: StoredRun, experiment_id: str) -> Reproduction:
    """What one ablation parent run recorded: its table's cells, its jobs' minutes and devices."""
    params = run.data.params
    rows: dict[str, dict[str, RunCell]] = {}
    row_status: dict[str, str] = {}
    table = reader.artifact(run, TABLE_ARTIFACT)  # None: not logged (a running or failed ablation)
    if table is not None:
        raw = json.loads(table)
        for values in raw.get("data", []):
            row = dict(zip(raw["columns"], values, strict=True))
            variant, n = str(row["variant"]), int(_float(row.get("seeds")) or 0)
            metrics = {c[: -len("_mean")] for c in row if c.endswith("_mean")}
            rows[variant] = {m: RunCell(_float(row[f"{m}_mean"]), _float(row.get(f"{m}_std")), n,
                                        _float(row.get(f"{m}_p"))) for m in metrics}
            row_status[variant] = str(row.get("status", "ok"))
    minutes: dict[str, list[float]] = defaultdict(list)
    devices: dict[str, str] = {}
    stand_ins: dict[str, str] = {}
    readings: dict[str, list[str]] = {}
    uncommitted: dict[str, str] = {}
    seed_free: set[str] = set()
    jobs = reader.runs(experiment_id, tag=("mlflow.parentRunId", run.info.run_id))
    for job in jobs:
        variant = job.data.tags.get(VARIANT_TAG)
        if variant is None:
            continue
        if TRAIN_MINUTES in job.data.metrics:
            minutes[variant].append(job.data.metrics[TRAIN_MINUTES])
        if "device" in job.data.tags:
            devices[variant] = job.data.tags["device"]
        if STAND_IN_TAG in job.data.tags:
            stand_ins[variant] = job.data.tags[STAND_IN_TAG]
        if READING_TAG in job.data.tags:
            readings[variant] = points_off_printed(job.data.tags)
        if job.data.tags.get(SEED_FREE_TAG) == "true":
            seed_free.add(variant)
        if job.data.tags.get(DIRTY_TAG) == "true":  # trained from a checkout whose code differed from its commit
            uncommitted[variant] = (f"{job.data.tags.get(CHANGED_TAG, 'unknown files')} (commit "
                                    f"{job.data.tags.get(COMMIT_TAG, 'unknown')[:7]})")
    for variant in seed_free & rows.keys():
        rows[variant] = {m: dataclasses.replace(c, deterministic=True) for m, c in rows[variant].items()}
    for variant, values in minutes.items():
        mean = sum(values) / len(values)
        std = (sum((v - mean) ** 2 for v in values) / (len(values) - 1)) ** 0.5 if len(values) > 1 else math.nan
        rows.setdefault(variant, {})[TRAIN_MINUTES] = RunCell(mean, std, len(values))
    figures = {}
    for path in reader.artifact_paths(run, FIGURES):
        if path.endswith(".png") and (png := reader.artifact(run, path)) is not None:
            figures[path] = png
    return Reproduction(
        profile=profile_of(run), run_id=run.info.run_id, status=run.info.status,
        reference=params.get("ablation.reference", ""), test=params.get("ablation.test", "paired"), rows=rows,
        row_status=row_status, devices=devices, figures=figures, stand_ins=stand_ins,
        caveats=json.loads(params.get("ablation.caveats") or "{}"),
        reading=params.get("ablation.reading", "recipe"), readings={v: p for v, p in readings.items() if p},
        skipped=json.loads(params.get("ablation.skipped") or "{}"), uncommitted=uncommitted,
    )


def profile_of(run: Any) -> str:
    """The profile an ablation ran under (its params; older runs: the config's, else the demo)."""
    params = run.data.params
    return params.get("ablation.profile") or params.get("base.profile") or "demo"


def find_reproductions(cfg: Config, preset: str, reader: RunReader) -> list[Reproduction]:
    """The latest ablation parent run of ``preset`` per profile and reading (``ablation.reading``: a table
    run as printed sits beside the same table as its recipes run it), newest first, read back."""
    experiment_id = reader.experiment_id(f"{cfg.base.experiment_prefix}-ablate")
    if experiment_id is None:
        return []
    latest: dict[tuple[str, str], Any] = {}
    for run in reader.runs(experiment_id, param=("ablation.preset", preset)):  # newest first
        if "mlflow.parentRunId" in run.data.tags:  # a job, not an ablation
            continue
        latest.setdefault((profile_of(run), run.data.params.get("ablation.reading", "recipe")), run)
    return [reproduction(reader, run, experiment_id) for run in latest.values()]


def table_keys(paper: Paper, table: str | None) -> list[str] | None:
    """``--table 3`` / ``table3`` / ``fig7`` -> the paper's key; None: every table."""
    if table is None:
        return None
    key = f"table{table}" if table.isdigit() else table
    if key not in paper.tables:
        raise ConfigError(f"{paper.file}: no {key!r}; tables: {', '.join(paper.tables)}")
    return [key]


@dataclass
class Report:
    """A paper's report: its Markdown and self-contained HTML page, the ablation runs it read and, per run, the
    verdict of its block (``verdict/<table>_reproduced``, ``_differs``, ``_inconclusive`` and ``_cells``, its
    independent cells: `mmcse.analysis.report.verdict_counts`)."""

    markdown: str
    html: str
    runs: list[str]
    verdicts: dict[str, dict[str, float]]
    files: dict[str, Path] = field(default_factory=dict)  # where `write_report` wrote it


def default_reader(cfg: Config) -> RunReader:
    """``base.mlflow_tracking_uri``'s SQLite file read directly; refused for another store, which is read through
    MLflow (`mmcse.tracking.reading.run_reader`, a layer up: its caller passes it)."""
    reader = SqliteRuns.open(cfg.base.mlflow_tracking_uri)
    if reader is None:
        raise InputError(f"base.mlflow_tracking_uri {cfg.base.mlflow_tracking_uri}: not a SQLite file; read it "
                         "with mmcse.tracking.reading.run_reader")
    return reader


def build_report(cfg: Config, paper_name: str, table: str | None = None, root: Path | str = ".",
                 reader: RunReader | None = None) -> Report:
    """The report of ``paper_name`` (one ``table``, or all) from the runs ``reader`` reads (default: the
    configured SQLite store)."""
    reader = reader or default_reader(cfg)
    # a printed number without a std carries the papers' own run-to-run noise of its metric (the verdict's tolerance)
    tolerances = reproduction_tolerances(load_paper(name, root) for name in list_papers(root))
    paper = with_tolerances(load_paper(paper_name, root), tolerances)
    keys = table_keys(paper, table)
    presets = set(list_presets(Path(root) / cfg.ablate.presets_dir))
    found = {k: find_reproductions(cfg, t.preset, reader) for k, t in paper.tables.items()
             if (keys is None or k in keys) and t.preset in presets}
    sections = paper_report(paper, found, presets, keys)
    title = f"mmcse report: {paper.name}" + (f" {keys[0]}" if keys else "")
    runs = sorted({r.run_id for rs in found.values() for r in rs})
    verdicts: dict[str, dict[str, float]] = {}
    for key, reproductions in found.items():
        t = paper.tables[key]
        for run in reproductions:
            if t.columns and run.block in t.blocks:
                counts = verdict_counts(t, t.blocks[run.block], run)
                verdicts.setdefault(run.run_id, {}).update({
                    f"verdict/{key}_reproduced": counts.reproduced, f"verdict/{key}_differs": counts.differs,
                    f"verdict/{key}_inconclusive": counts.inconclusive, f"verdict/{key}_cells": counts.cells})
    return Report(to_markdown(sections), to_html(sections, title), runs, verdicts)


def write_report(cfg: Config, paper_name: str, table: str | None = None, out_dir: Path | str = REPORT_DIR,
                 root: Path | str = ".", reader: RunReader | None = None) -> Report:
    """`build_report`, written to ``<out_dir>/<paper>[-<table>].{md,html}`` (atomic writes; ``Report.files``).
    Logging it into the runs it read is `mmcse.tracking.reading.log_report`'s (``mmcse report --log``, the
    report stage)."""
    report = build_report(cfg, paper_name, table, root, reader)
    stem = paper_name + (f"-{table_keys(load_paper(paper_name, root), table)[0]}" if table else "")
    report.files = {"md": Path(out_dir) / f"{stem}.md", "html": Path(out_dir) / f"{stem}.html"}
    write_text(report.files["md"], report.markdown)
    write_text(report.files["html"], report.html)
    return report
