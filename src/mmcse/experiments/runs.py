"""`mmcse runs`: DVC's experiments as one compact table (one row per experiment, scores first).

``dvc exp show`` lists every param of every stage, every metric file and every dependency's hash
(this project: ~400 columns), and DVC has no setting for a default column set, so at 200 columns
its table is all "…". This reads the same record (``dvc exp show --json``) and prints per
experiment: its name, when it ran, the method, the params it changed against its baseline commit,
and the headline scores: the best dev score (metrics/train.json), the test STS average, each
test set's rsum and NDCG mean (metrics/eval.json, `mmcse.evaluation.names`) and the ablation's
primary metric per variant (metrics/ablate.json).

A score is an experiment's own only when the stage that writes it ran on what the experiment changed:
an experiment that ran only ``train`` still holds the commit's metrics/eval.json. Its dvc.lock says so
(`stale_stages`: a stage whose recorded deps are not its upstream's outputs, or whose params are not
the experiment's), and such a score is starred. A row whose code differs from its baseline commit (an
experiment made from a dirty tree; the workspace's uncommitted edits) names the files in a ``code``
column.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from mmcse.analysis.text import terminal_table
from mmcse.config.coercion import flatten
from mmcse.evaluation.names import display_name, is_headline
from mmcse.integrity.code import CODE_PATHS, source_state
from mmcse.io import load_yaml

TRAIN, EVAL, ABLATE = "metrics/train.json", "metrics/eval.json", "metrics/ablate.json"
WRITTEN_BY = {TRAIN: "train", EVAL: "evaluate", ABLATE: "ablate"}  # the stage each metrics file comes from
DEV_SCORES = ("best_dev_sts", "best_dev_rsum")
MAX_CHANGED = 60  # characters of the changed-params cell
INHERITED = "*"
INHERITED_NOTE = ("* not this experiment's score: the stage that writes it did not run after what it depends on "
                  "changed (the baseline's file, left in place)")


def read_experiments(repo: Path = Path(".")) -> list[dict[str, Any]]:
    """``dvc exp show --json`` of ``repo``: the workspace, the commit and their experiments."""
    out = subprocess.run(["dvc", "exp", "show", "--json"], cwd=repo, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"dvc exp show failed in {repo.resolve()}: {out.stderr.strip()[-2000:]}")
    return json.loads(out.stdout)


def _git(repo: Path, *args: str) -> str | None:
    out = subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True)
    return out.stdout if out.returncode == 0 else None


def read_provenance(exps: Sequence[dict[str, Any]], repo: Path = Path(".")) -> dict[str, dict[str, Any]]:
    """Per row of `experiment_rows`: ``lock`` (its dvc.lock: the workspace's file, a commit's or an
    experiment's from git) and ``code`` (the files under `mmcse.integrity.code.CODE_PATHS` that differ from
    its baseline commit: the workspace's uncommitted ones, an experiment's against the commit it ran on)."""
    def lock_at(rev: str) -> dict[str, Any]:
        return load_yaml(_git(repo, "show", f"{rev}:dvc.lock") or "{}") or {}

    found: dict[str, dict[str, Any]] = {}
    for base in exps:
        if base.get("rev") == "workspace":
            lock = load_yaml((repo / "dvc.lock").read_text()) if (repo / "dvc.lock").is_file() else None
            found["workspace"] = {"lock": lock or {}, "code": source_state(repo)["changed"]}
            continue
        rev = str(base.get("rev"))
        found[base.get("name") or rev[:7]] = {"lock": lock_at(rev), "code": []}
        for exp in base.get("experiments") or []:
            tip = (exp.get("revs") or [{}])[0]
            tip_rev = str(tip.get("rev", ""))
            diff = _git(repo, "diff", "--name-only", rev, tip_rev, "--", *CODE_PATHS) or ""
            found[tip.get("name") or tip_rev[:7]] = {"lock": lock_at(tip_rev),
                                                     "code": sorted(f for f in diff.splitlines() if f.strip())}
    return found


def _value_at(tree: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return None
        tree = tree[part]
    return tree


def _same(a: Any, b: Any) -> bool:
    """Equal as params: YAML 1.1 (PyYAML, reading dvc.lock here) keeps ``3e-05`` a string where DVC's YAML
    1.2 reads a float, so a number and a string that reads as that number are the same value."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, str) != isinstance(b, str) and not isinstance(a, bool) and not isinstance(b, bool):
        try:
            return float(a) == float(b)
        except (TypeError, ValueError):
            return False
    return a == b


def stale_stages(lock: dict[str, Any], params: dict[str, Any]) -> set[str]:
    """The stages of ``lock`` (a dvc.lock) whose outputs were not made from what the same lock and
    ``params`` (params.yaml's tree) say they depend on: a dep another stage writes recorded with another hash
    than that stage's output, a param recorded with another value, or an upstream stage that is stale."""
    stages = lock.get("stages") or {}
    made_by = {out.get("path"): (name, out.get("md5")) for name, stage in stages.items()
               for out in stage.get("outs") or []}
    stale: set[str] = set()
    changed = True
    while changed:  # until no upstream's staleness reaches another stage
        changed = False
        for name, stage in stages.items():
            if name in stale:
                continue
            deps = [made_by.get(dep.get("path")) + (dep.get("md5"),) for dep in stage.get("deps") or []
                    if dep.get("path") in made_by]
            recorded = ((stage.get("params") or {}).get("params.yaml") or {}).items()
            if (any(upstream in stale or made != used for upstream, made, used in deps)
                    or any(not _same(_value_at(params, key), value) for key, value in recorded)):
                stale.add(name)
                changed = True
    return stale


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


def experiment_rows(exps: Sequence[dict[str, Any]],
                    provenance: dict[str, dict[str, Any]] | None = None) -> tuple[list[str], list[list[str]]]:
    """The table's header and rows (`read_experiments`): experiment, created, method, changed
    params (``key=value``, against the experiment's baseline commit), the code files that differ from it
    (a ``code`` column, when any row's do: `read_provenance`), then one column per headline score that any
    row holds, `INHERITED`-starred where the row's lock says the stage writing it did not run on its state."""
    provenance = provenance or {}
    entries = list(_entries(exps))
    with_code = any(p.get("code") for p in provenance.values())
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
    header = ["experiment", "created", "method", "changed params", *(["code"] if with_code else []),
              *[display_name(s) for s in scores],
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
        own = provenance.get(name) or {}
        if with_code:
            code = ", ".join(Path(f).name for f in own.get("code") or [])
            code = code if len(code) <= MAX_CHANGED else code[: MAX_CHANGED - 1] + "…"
            row.append(("uncommitted: " if name == "workspace" else "changed: ") + code if code else "—")
        stale = stale_stages(own.get("lock") or {}, ((data.get("params") or {}).get("params.yaml") or {}).get("data")
                             or {}) if own.get("lock") else set()

        def cell(value: Any, path: str, stale: set[str] = stale) -> str:
            shown = _fmt(value)
            return shown + INHERITED if WRITTEN_BY[path] in stale and shown != "—" else shown

        row += [cell(train[s], TRAIN) if s in train else cell(test.get(s), EVAL) for s in scores]
        row += [cell((ablate.get("variants", {}).get(v) or {}).get("mean"), ABLATE) for v in variants]
        rows.append(row)
    return header, rows


def experiments_table(exps: Sequence[dict[str, Any]], width: int = 200,
                      provenance: dict[str, dict[str, Any]] | None = None) -> str:
    """`experiment_rows` as aligned text no wider than ``width`` (wide column sets wrap into
    blocks that each start with the experiment's name), with `INHERITED_NOTE` under it when a score is starred."""
    header, rows = experiment_rows(exps, provenance)
    markdown = "\n".join(["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
                          *("| " + " | ".join(c.replace("|", "/") for c in row) + " |" for row in rows)])
    starred = any(c.endswith(INHERITED) for row in rows for c in row[4:])
    return terminal_table(markdown + "\n", width) + (INHERITED_NOTE + "\n" if starred else "")
