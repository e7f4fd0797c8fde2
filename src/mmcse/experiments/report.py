"""`mmcse report <paper>`: each table of a paper beside its reproduction, from the MLflow record.

For every table of ``papers/<paper>.yaml`` the latest ablation (the parent run ``ablation <preset>``
in experiment ``<prefix>-ablate``) of the table's preset under each profile is read back: its table
(``ablation_table.json``: mean, std and the table's own test per row and metric), its jobs' training
minutes and devices (the runs tagged ``ablation.variant``) and its figures. `mmcse.analysis.report`
lays them beside the paper's numbers; the Markdown and the self-contained HTML page go to
``reports/<paper>.{md,html}`` and, as artifacts under ``report/``, to every ablation run they read.
"""

from __future__ import annotations

import json
import math
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any

import mlflow

from mmcse import tracking
from mmcse.analysis.papers import Paper, load_paper
from mmcse.analysis.report import Reproduction, RunCell, paper_report, to_html, to_markdown, verdict_counts
from mmcse.config import Config, ConfigError
from mmcse.config.readings import READING_TAG, points_off_printed
from mmcse.experiments.params import list_presets
from mmcse.io import write_text
from mmcse.tracking import CHANGED_TAG, COMMIT_TAG, DIRTY_TAG, STAND_IN_TAG, TRAIN_MINUTES, VARIANT_TAG

TABLE_ARTIFACT = "ablation_table.json"
FIGURES = "figures"  # the parent run's figures: ablation.png, and those of ablate.figures
REPORT_DIR = "reports"


def _float(value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def _artifact(client: Any, run_id: str, path: str) -> bytes | None:
    """The bytes of one artifact of a run (None: not logged, e.g. a running or failed ablation)."""
    with tempfile.TemporaryDirectory(prefix="mmcse-report-") as tmp:
        try:
            return Path(client.download_artifacts(run_id, path, tmp)).read_bytes()
        except Exception:
            return None


def reproduction(client: Any, run: Any, experiment_id: str) -> Reproduction:
    """What one ablation parent run recorded: its table's cells, its jobs' minutes and devices."""
    params = run.data.params
    rows: dict[str, dict[str, RunCell]] = {}
    row_status: dict[str, str] = {}
    table = _artifact(client, run.info.run_id, TABLE_ARTIFACT)
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
    jobs = client.search_runs([experiment_id], f"tags.`mlflow.parentRunId` = '{run.info.run_id}'", max_results=5000)
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
        if job.data.tags.get(DIRTY_TAG) == "true":  # trained from a checkout whose code differed from its commit
            uncommitted[variant] = (f"{job.data.tags.get(CHANGED_TAG, 'unknown files')} (commit "
                                    f"{job.data.tags.get(COMMIT_TAG, 'unknown')[:7]})")
    for variant, values in minutes.items():
        mean = sum(values) / len(values)
        std = (sum((v - mean) ** 2 for v in values) / (len(values) - 1)) ** 0.5 if len(values) > 1 else math.nan
        rows.setdefault(variant, {})[TRAIN_MINUTES] = RunCell(mean, std, len(values))
    figures = {}
    for artifact in client.list_artifacts(run.info.run_id, FIGURES):
        if artifact.path.endswith(".png") and (png := _artifact(client, run.info.run_id, artifact.path)) is not None:
            figures[artifact.path] = png
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


def find_reproductions(cfg: Config, preset: str) -> list[Reproduction]:
    """The latest ablation parent run of ``preset`` per profile and reading (``ablation.reading``: a table
    run as printed sits beside the same table as its recipes run it), newest first, read back."""

    tracking.configure(cfg)
    client = mlflow.MlflowClient()
    experiment = client.get_experiment_by_name(f"{cfg.base.experiment_prefix}-ablate")
    if experiment is None:
        return []
    runs = client.search_runs([experiment.experiment_id], f"params.`ablation.preset` = '{preset}'",
                              order_by=["attributes.start_time DESC"], max_results=5000)
    latest: dict[tuple[str, str], Any] = {}
    for run in runs:
        if "mlflow.parentRunId" in run.data.tags:  # a job, not an ablation
            continue
        latest.setdefault((profile_of(run), run.data.params.get("ablation.reading", "recipe")), run)
    return [reproduction(client, run, experiment.experiment_id) for run in latest.values()]


def table_keys(paper: Paper, table: str | None) -> list[str] | None:
    """``--table 3`` / ``table3`` / ``fig7`` -> the paper's key; None: every table."""
    if table is None:
        return None
    key = f"table{table}" if table.isdigit() else table
    if key not in paper.tables:
        raise ConfigError(f"{paper.file}: no {key!r}; tables: {', '.join(paper.tables)}")
    return [key]


def _report(cfg: Config, paper_name: str, table: str | None, root: Path | str
            ) -> tuple[str, str, list[str], dict[str, dict[str, float]]]:
    """`build_report`, and per ablation run it read ``verdict/<table>_consistent`` and ``verdict/<table>_cells``
    of its block (`mmcse.analysis.report.verdict_counts`), from the same reproductions."""
    paper = load_paper(paper_name, root)
    keys = table_keys(paper, table)
    presets = set(list_presets(Path(root) / cfg.ablate.presets_dir))
    found = {k: find_reproductions(cfg, t.preset) for k, t in paper.tables.items()
             if (keys is None or k in keys) and t.preset in presets}
    sections = paper_report(paper, found, presets, keys)
    title = f"mmcse report: {paper.name}" + (f" {keys[0]}" if keys else "")
    runs = sorted({r.run_id for rs in found.values() for r in rs})
    verdicts: dict[str, dict[str, float]] = {}
    for key, reproductions in found.items():
        t = paper.tables[key]
        for run in reproductions:
            if t.columns and run.block in t.blocks:
                consistent, cells = verdict_counts(t, t.blocks[run.block], run)
                verdicts.setdefault(run.run_id, {}).update({f"verdict/{key}_consistent": consistent,
                                                            f"verdict/{key}_cells": cells})
    return to_markdown(sections), to_html(sections, title), runs, verdicts


def build_report(cfg: Config, paper_name: str, table: str | None = None,
                 root: Path | str = ".") -> tuple[str, str, list[str]]:
    """The report's Markdown and HTML, and the ablation runs it read."""
    return _report(cfg, paper_name, table, root)[:3]


def write_report(cfg: Config, paper_name: str, table: str | None = None, out_dir: Path | str = REPORT_DIR,
                 root: Path | str = ".", log: bool = True) -> dict[str, Path]:
    """``<out_dir>/<paper>[-<table>].{md,html}`` (atomic writes); with ``log`` also under ``report/`` in
    each ablation run the report read."""

    markdown, page, runs, verdicts = _report(cfg, paper_name, table, root)
    stem = paper_name + (f"-{table_keys(load_paper(paper_name, root), table)[0]}" if table else "")
    files = {"md": Path(out_dir) / f"{stem}.md", "html": Path(out_dir) / f"{stem}.html"}
    write_text(files["md"], markdown)
    write_text(files["html"], page)
    if log and runs:
        client = mlflow.MlflowClient()
        for run_id in runs:
            for path in files.values():
                client.log_artifact(run_id, str(path), "report")
            for name, value in verdicts.get(run_id, {}).items():  # k of n cells consistent with the paper
                client.log_metric(run_id, name, value)
    return files
