"""Ablation tables: one row per variant (mean ± std over seeds, the significance test against the
reference), the columns in SentEval's order, Markdown and CSV, the MLflow metrics of a table
and the note on the environment its jobs ran in.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from mmcse.analysis.statistics import ALPHA, FEW_SEEDS, MARKER, significance
from mmcse.config import Config
from mmcse.data.prepare import retrieval_set_name
from mmcse.data.senteval import STS_TASKS, TRANSFER_TASKS
from mmcse.environment import describe
from mmcse.evaluation.names import display_name, is_headline, score_key
from mmcse.io import atomic_path, write_text
from mmcse.tracking import metric_name


def aggregate_metrics(rows: Sequence[dict[str, Any]]) -> dict[str, float]:
    """The table as MLflow metrics of the parent run: ``<variant>/<metric>_mean|_std|_p`` (variant
    names made metric-safe; ``_p``: the paired t-test against the reference) and
    ``<variant>/seeds``; NaN cells are left out."""
    out: dict[str, float] = {}
    for row in rows:
        name = re.sub(r"[^A-Za-z0-9_. -]+", "_", row["variant"]).strip() or "variant"  # MLflow's name rules
        for key, value in row.items():
            if key.endswith(("_mean", "_std", "_p")) and isinstance(value, int | float) and math.isfinite(value):
                out[metric_name(f"{name}/{key}")] = float(value)  # mcse/demo_i2t_R1_mean
        out[f"{name}/seeds"] = float(row["seeds"])
    return out


TRANSFER_AVG = "transfer_avg"


# A retrieval score named without its test set (a preset that runs on any data: duet-table2)
BARE_RETRIEVAL = re.compile(r"^(rsum|(i2t|t2i)_R\d+|((i2t|t2i)_)?NDCG\d+_\w+)$")


def table_metric(cfg: Config) -> str:
    """The table's primary column: ``ablate.metric``, where a bare retrieval score (``rsum``,
    ``i2t_R1``, ``NDCG25_rouge_l``) gets the data's test set as its prefix (``demo_rsum``,
    ``flickr30k_1k_rsum``; COCO: the 1K folds the papers' ablations report, ``coco_1k_rsum``)."""

    metric = score_key(cfg.ablate.metric)  # i2t_R@1 and i2t_R1 name the same column
    if not BARE_RETRIEVAL.match(metric):
        return metric
    return f"{'coco_1k' if cfg.data.pairs == 'coco' else retrieval_set_name(cfg.data.pairs)}_{metric}"


def headline_metrics(rows: Sequence[dict[str, Any]], primary: str, limit: int = 4) -> list[str]:
    """The table's headline scores (at most ``limit``): ``primary`` first, then the STS /
    transfer / MTEB averages, each test set's rsum and its NDCG means that the rows hold."""
    held = [k[: -len("_mean")] for k in (rows[0] if rows else {}) if k.endswith("_mean")]
    rest = [m for m in held if m != primary and is_headline(m)]
    return [primary, *sorted(rest, key=lambda m: (m not in ("avg", TRANSFER_AVG), m))][:limit]


def metric_order(metrics: Sequence[str]) -> list[str]:
    """Table columns: STS tasks (SentEval order, then others by name), their ``avg``, the
    transfer tasks (SentEval order) and ``transfer_avg``."""

    def key(m: str) -> tuple[int, int, str]:
        if m in TRANSFER_TASKS:
            return (2, TRANSFER_TASKS.index(m), m)
        group = {"avg": 1, TRANSFER_AVG: 3}.get(m, 0)
        return (group, STS_TASKS.index(m) if m in STS_TASKS else len(STS_TASKS), m)

    return sorted(metrics, key=key)


def no_transfer_note(cfg: Config) -> str:
    """Why a table asked for transfer scores (``ablate.transfer``) has none."""
    if not cfg.data.transfer_tasks:
        return ("no transfer tasks: data.transfer_tasks is empty (the demo data has none; "
                "set data.source: senteval and data.transfer_tasks)")
    return "no transfer scores: no finished job's data held data.transfer_tasks"


def environment_notes(results: Sequence[dict[str, Any]]) -> list[str]:
    """The table's note on the environment its finished jobs computed in (`mmcse.environment`):
    one line when they share one (``env.hash``), else a warning naming each environment, the
    versions that differ and its jobs: rows made under different software or hardware may differ
    by more than their methods. Jobs recorded before environments were (no ``environment``)
    count as unknown."""

    groups: dict[str, tuple[dict[str, str], list[str]]] = {}
    for r in results:
        if r.get("status") != "ok":
            continue
        env = r.get("environment") or {}
        key = env.get("hash", "unknown")
        groups.setdefault(key, (env, []))[1].append(f"{r['variant']} seed {r['seed']}")
    if not groups:
        return []
    if len(groups) == 1:
        env, _ = next(iter(groups.values()))
        return [f"Environment: {describe(env)}." if env else "Environment: not recorded by these jobs."]
    envs = [env for env, _ in groups.values()]
    keys = sorted({k for env in envs for k in env} - {"hash", "locked", "lock_sha256"})
    differing = [k for k in keys if len({env.get(k) for env in envs}) > 1] or ["installed packages"]
    lines = [f"Warning: the jobs ran under {len(groups)} environments (differing: {', '.join(differing)}); "
             "compare their rows with care."]
    for key, (env, jobs) in groups.items():
        lines.append(f"Environment {key}: {describe(env) if env else 'not recorded'}; jobs: {', '.join(jobs)}.")
    return lines


def _fmt(mean: float, std: float, marker: str = "", spread: bool = True) -> str:
    """``mean ± std``; the mean alone where ``spread`` is False (one seed: no spread to show)."""
    if not math.isfinite(mean):
        return "—"
    return f"{mean:.2f}{marker} ± {std:.2f}" if spread else f"{mean:.2f}{marker}"


def aggregate(cfg: Config, results: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per variant (params.yaml order): mean ± std per metric over seeds, the p-value of
    ``ablate.test`` (`mmcse.analysis.statistics.significance`: paired by seed, or independent) of each
    metric against the reference variant (``<metric>_p``; ``p_value`` is the primary metric's), the
    test (``test``), the runs it compared (``paired_seeds``: seeds both rows finished; independent:
    ``tested_seeds``, the variant's runs), a ``note`` (``reference``, or ``n<2`` where no test could
    be made) and the status. With ``ablate.transfer`` but no transfer score in any result the
    ``transfer_avg`` column is still there, empty, and ``transfer_note`` says why."""
    by_variant: dict[str, list[dict[str, Any]]] = {name: [] for name in cfg.ablate.variants}
    for r in results:
        by_variant[r["variant"]].append(r)
    ok = {n: [r for r in rs if r["status"] == "ok"] for n, rs in by_variant.items()}
    metrics: list[str] = []
    for rs in ok.values():
        for r in rs:
            metrics += [m for m in r["scores"] if m not in metrics]
    transfer_note = ""
    if cfg.ablate.transfer and TRANSFER_AVG not in metrics:
        transfer_note = no_transfer_note(cfg)
        metrics.append(TRANSFER_AVG)
    metrics = metric_order(metrics)
    primary, reference = table_metric(cfg), cfg.ablate.reference
    test = cfg.ablate.test
    tests = significance([r for rs in by_variant.values() for r in rs], reference, metrics, test)
    seeds_key = "paired_seeds" if test == "paired" else "tested_seeds"
    rows = []
    for name, rs in by_variant.items():
        good = ok[name]
        failed = [r for r in rs if r["status"] != "ok"]
        row: dict[str, Any] = {
            "variant": name,
            "status": "ok" if not failed else ("failed" if not good else f"partial ({len(failed)} failed)"),
            "seeds": len(good),
            "test": test,
        }
        for m in metrics:
            vals = np.array([r["scores"][m] for r in good if m in r["scores"]], dtype=float)
            mean = float(vals.mean()) if len(vals) else math.nan
            std = float(vals.std(ddof=1)) if len(vals) > 1 else 0.0 if len(vals) else math.nan
            row[f"{m}_mean"], row[f"{m}_std"] = mean, std
        for m in metrics:
            row[f"{m}_p"] = tests[name][m]["p"] if name in tests else math.nan  # the reference: no test
        row["p_value"] = row.get(f"{primary}_p", math.nan)
        if name == reference:
            row[seeds_key], row["note"] = len(good), "reference"
        else:
            cells = tests.get(name, {})
            cell = cells.get(primary) or next(iter(cells.values()), {"n": 0, "note": FEW_SEEDS})
            row[seeds_key] = cell["n"]
            if cell["note"] == FEW_SEEDS:
                row["note"] = (f"{FEW_SEEDS}: {cell['n']} seed(s) paired with {reference}, no test" if test == "paired"
                               else f"{FEW_SEEDS}: {cell['n']} run(s) against {cell.get('n_reference', 0)} of "
                                    f"{reference}, no test")
            else:
                row["note"] = cell["note"]
        if transfer_note:
            row["transfer_note"] = transfer_note
        if failed:
            row["error"] = failed[0].get("error", "")
        rows.append(row)
    return rows


LABELS = {"avg": "STS avg", TRANSFER_AVG: "TR avg"}  # DALR's STS (Avg.) / TR (Avg.)


def column_label(metric: str) -> str:
    """A column's heading: `LABELS`, else the key as people write it (``demo_i2t_R@1``)."""
    return LABELS.get(metric, display_name(metric))


def table_markdown(rows: Sequence[dict[str, Any]], primary: str, reference: str, title: str = "",
                   notes: Sequence[str] = (), metrics: Sequence[str] | None = None) -> str:
    """Every metric's mean ± std over seeds, marked ``*`` where the paired t-test against
    ``reference`` gives p < 0.05 (KDMCSE Table 1's marker); the primary metric's p-value (or
    ``n<2``) in its own column; a footnote says what the marker means and why an empty
    transfer column is empty; ``notes`` (the environment, `environment_notes`) follow it.
    ``metrics``: only these columns, in this order (default: every metric of the rows)."""
    if metrics is None:
        metrics = metric_order([k[: -len("_mean")] for k in rows[0] if k.endswith("_mean")]) if rows else []
    header = ["variant", *[column_label(m) for m in metrics], f"p vs {reference} ({column_label(primary)})",
              "seeds", "status"]
    lines = [f"### {title}", ""] if title else []
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    transfer_notes: list[str] = []
    for r in rows:
        cells = [r["variant"]]
        for m in metrics:
            p = r.get(f"{m}_p", math.nan)
            marker = MARKER if math.isfinite(p) and p < ALPHA else ""
            if m == TRANSFER_AVG and r.get("transfer_note"):
                cells.append("n/a (no transfer tasks)" if "no transfer tasks" in r["transfer_note"] else "n/a")
                transfer_notes += [r["transfer_note"]] if r["transfer_note"] not in transfer_notes else []
            else:
                cells.append(_fmt(r[f"{m}_mean"], r[f"{m}_std"], marker, spread=r["seeds"] > 1))
        p = r.get("p_value", math.nan)
        note = r.get("note", "")
        if note == "reference":
            significance = "reference"
        elif note.startswith(FEW_SEEDS):
            significance = FEW_SEEDS
        else:
            significance = f"{p:.3f}" if math.isfinite(p) else (note or "—")
        cells += [significance, str(r["seeds"]), r["status"]]
        lines.append("| " + " | ".join(cells) + " |")
    test = rows[0].get("test", "paired") if rows else "paired"
    compared = "over the seeds both rows finished" if test == "paired" else "over every finished run of each row"
    label = {"paired": "paired t-test", "independent": "independent two-sample t-test (Student's)"}[test]
    lines += ["", f"{MARKER}: {label} against {reference} {compared}, p < {ALPHA} (KDMCSE Table 1's α; "
                  f"{FEW_SEEDS}: fewer than 2 runs to compare, no test). Mean ± std over seeds; a row of one seed: "
                  "its value."]
    lines += [f"TR avg: {n}." for n in transfer_notes]
    lines += list(notes)
    return "\n".join(lines) + "\n"


def write_table(
    rows: Sequence[dict[str, Any]], out_dir: Path, primary: str, reference: str, title: str = "",
    notes: Sequence[str] = (),
) -> dict[str, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    csv_path, md_path = out_dir / "ablation.csv", out_dir / "ablation.md"
    with atomic_path(csv_path) as tmp:
        pd.DataFrame(rows).to_csv(tmp, index=False)
    write_text(md_path, table_markdown(rows, primary, reference, title, notes))
    return {"csv": csv_path, "md": md_path}
