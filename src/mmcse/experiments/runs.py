"""`mmcse runs`: DVC's experiments as one compact table (one row per experiment, scores first).

``dvc exp show`` lists every param of every stage, every metric file and every dependency's hash
(this project: ~400 columns), and DVC has no setting for a default column set, so at 200 columns
its table is all "…". This reads the same record (``dvc exp show --json``) and prints per
experiment: its name, when it ran, the method, the params it changed against its baseline commit,
and the headline scores: the best dev score (metrics/train.json), the test STS average, each
test set's rsum and NDCG mean (metrics/eval.json, `mmcse.evaluation.names`) and the ablation's
primary metric per variant (metrics/ablate.json).
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from mmcse.analysis.tables import terminal_table
from mmcse.evaluation.names import display_name, is_headline
from mmcse.tracking import flatten

TRAIN, EVAL, ABLATE = "metrics/train.json", "metrics/eval.json", "metrics/ablate.json"
DEV_SCORES = ("best_dev_sts", "best_dev_rsum")
MAX_CHANGED = 60  # characters of the changed-params cell


def read_experiments(repo: Path = Path(".")) -> list[dict[str, Any]]:
    """``dvc exp show --json`` of ``repo``: the workspace, the commit and their experiments."""
    out = subprocess.run(["dvc", "exp", "show", "--json"], cwd=repo, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"dvc exp show failed in {repo.resolve()}: {out.stderr.strip()[-2000:]}")
    return json.loads(out.stdout)


def _entries(exps: Sequence[dict[str, Any]]) -> Iterator[tuple[str, dict[str, Any], dict[str, Any] | None]]:
    """(name, data, baseline data) per row: each baseline (the workspace, against the commit after
    it; a commit), then its experiments."""
    for n, base in enumerate(exps):
        data = base.get("data") or {}
        workspace = base.get("rev") == "workspace"
        name = "workspace" if workspace else (base.get("name") or str(base.get("rev"))[:7])
        yield name, data, (exps[n + 1].get("data") or {}) if workspace and n + 1 < len(exps) else None
        for exp in base.get("experiments") or []:
            tip = (exp.get("revs") or [{}])[0]
            yield tip.get("name") or str(tip.get("rev", ""))[:7], tip.get("data") or {}, data


def _params(data: dict[str, Any]) -> dict[str, Any]:
    return flatten(((data.get("params") or {}).get("params.yaml") or {}).get("data") or {})


def _metrics(data: dict[str, Any], path: str) -> dict[str, Any]:
    return ((data.get("metrics") or {}).get(path) or {}).get("data") or {}


def _fmt(value: Any) -> str:
    return f"{value:.2f}" if isinstance(value, int | float) and not isinstance(value, bool) else "—"


def experiment_rows(exps: Sequence[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    """The table's header and rows (`read_experiments`): experiment, created, method, changed
    params (``key=value``, against the experiment's baseline commit), then one column per headline
    score that any row holds."""
    entries = list(_entries(exps))
    scores: list[str] = []
    for _, data, _ in entries:
        train, test = _metrics(data, TRAIN), _metrics(data, EVAL)
        scores += [k for k in DEV_SCORES if k in train and k not in scores]
        scores += [k for k in sorted(test, key=lambda k: (k != "test_avg", k))
                   if k.startswith("test_") and is_headline(k) and k not in scores]
    variants: list[str] = []
    for _, data, _ in entries:
        variants += [v for v in _metrics(data, ABLATE).get("variants", {}) if v not in variants]
    ablate_metric = next((_metrics(d, ABLATE).get("metric") for _, d, _ in entries if _metrics(d, ABLATE)), None)
    header = ["experiment", "created", "method", "changed params", *[display_name(s) for s in scores],
              *[f"{v} ({display_name(ablate_metric or 'ablation')})" for v in variants]]
    rows = []
    for name, data, baseline in entries:
        params = _params(data)
        changed = ""
        if baseline is not None:
            before = _params(baseline)
            changed = ", ".join(f"{k}={params[k]}" for k in params if params[k] != before.get(k))
            changed = changed if len(changed) <= MAX_CHANGED else changed[: MAX_CHANGED - 1] + "…"
        train, test, ablate = _metrics(data, TRAIN), _metrics(data, EVAL), _metrics(data, ABLATE)
        created = str(data.get("timestamp") or "")[:16].replace("T", " ")
        row = [name, created, str(params.get("train.method", "—")), changed or "—"]
        row += [_fmt(train.get(s, test.get(s))) for s in scores]
        row += [_fmt((ablate.get("variants", {}).get(v) or {}).get("mean")) for v in variants]
        rows.append(row)
    return header, rows


def experiments_table(exps: Sequence[dict[str, Any]], width: int = 200) -> str:
    """`experiment_rows` as aligned text no wider than ``width`` (wide column sets wrap into
    blocks that each start with the experiment's name)."""
    header, rows = experiment_rows(exps)
    markdown = "\n".join(["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
                          *("| " + " | ".join(c.replace("|", "/") for c in row) + " |" for row in rows)])
    return terminal_table(markdown + "\n", width)
