"""Ablations: variants × seeds, each a train + evaluate run, aggregated into one table.

A job's result is written atomically to ``<out>/<variant>/seed<k>/result.json``; a rerun
skips jobs whose result exists for the same configuration, so an interrupted ablation
resumes. Once the result is written the job's resume weights are released (its best
checkpoint and history stay), so a long ablation does not fill the disk or the DVC cache
with optimizer states. Failed jobs are kept in the table as failed, never dropped.
"""

from __future__ import annotations

import math
import re
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from scipy import stats

from mmcse.config import Config, to_dict, with_overrides
from mmcse.io import read_json, sha256_json, write_json, write_text
from mmcse.tracking import metric_name


@dataclass(frozen=True)
class Job:
    variant: str
    seed: int
    overrides: dict[str, Any]

    def folder(self, root: Path) -> Path:
        return root / slug(self.variant) / f"seed{self.seed}"


def slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.=-]+", "_", name).strip("_") or "variant"


def expand(cfg: Config) -> list[Job]:
    """Every (variant, seed) with its overrides (seed included), in params.yaml order."""
    jobs = []
    for name, overrides in cfg.ablate.variants.items():
        for seed in cfg.ablate.seeds:
            jobs.append(Job(name, seed, {**overrides, "base.seed": seed}))
    slugs = [slug(n) for n in cfg.ablate.variants]
    if len(set(slugs)) != len(slugs):
        raise ValueError(f"params.yaml: ablate.variants names collide as folder names: {slugs}")
    return jobs


def job_run_name(job: Job) -> str:
    """The MLflow run name of an ablation job: ``<variant>-seed<seed>`` (e.g. ``no-teacher-seed2``)."""
    return f"{job.variant}-seed{job.seed}"


def parent_run_name(cfg: Config) -> str:
    """The MLflow run name of an ablation's parent run: ``ablation <preset>``, else ``ablation
    <ablate.title>``, else ``ablation variants``."""
    if cfg.ablate.preset != "none":
        return f"ablation {cfg.ablate.preset}"
    return f"ablation {cfg.ablate.title.strip() or 'variants'}"


def job_config(cfg: Config, job: Job) -> Config:
    return with_overrides(cfg, job.overrides, where=f"params.yaml (ablate.variants.{job.variant})")


def job_hash(job_cfg: Config, data_seed: int | None = None) -> str:
    """What makes a job's result: the whole configuration but the ablation's bookkeeping and
    the sweep, and the keys of the upstream artifacts it trains on (``data_seed``: the
    pipeline's seed the data is made with, `mmcse.upstream`); ``ablate.transfer`` counts (a
    result without transfer scores is not finished when they are asked for)."""
    from mmcse.upstream import artifact_keys

    tree = to_dict(job_cfg)
    ablate = tree.pop("ablate")
    tree.pop("sweep")
    tree["artifacts"] = artifact_keys(job_cfg, data_seed)
    if ablate["transfer"]:
        tree["ablate.transfer"] = True
    return sha256_json(tree)


def finished_result(folder: Path, config_hash: str) -> dict[str, Any] | None:
    """The result of a job finished in ``folder`` with ``config_hash`` (None: none), its MLflow run
    from the folder's run record (`mmcse.tracking.remembered_run`; result.json holds no run id)."""
    from mmcse.tracking import remembered_run

    path = folder / "result.json"
    if not path.is_file():
        return None
    result = read_json(path)
    if result.get("status") == "ok" and result.get("config_hash") == config_hash:
        record = remembered_run(folder)
        return result | ({"run_id": record["run_id"]} if record else {})
    return None


def _write_result(folder: Path, result: dict[str, Any]) -> None:
    """result.json without the run id (random: the ablation folder is a DVC output), which goes to
    the folder's run record instead."""
    from mmcse.tracking import remember_run

    if result.get("run_id"):
        remember_run(folder, result["run_id"])
    write_json(folder / "result.json", {k: v for k, v in result.items() if k not in ("skipped", "run_id")})


def run_job(
    cfg: Config,
    job: Job,
    root: Path,
    parent_run_id: str | None = None,
    tags: dict[str, str] | None = None,
    expected_hash: str | None = None,
) -> dict[str, Any]:
    """Train + evaluate one job (skipped when already finished); returns its result.

    The job's MLflow run is tagged with the device ``base.device`` resolves to in this process
    (`mmcse.device.device_tags`: device, cuda_visible_devices, host) and ``tags`` (e.g. the
    Prefect flow run). ``expected_hash``, from the process that submitted the job, guards a
    worker whose params.yaml differs from the submitter's. The job trains and evaluates on the
    upstream artifacts of its own configuration (`mmcse.upstream.resolve`: computed here when
    no job made them yet); their keys are in its result and tagged on its MLflow run."""
    from mmcse import tracking
    from mmcse.device import device_tags
    from mmcse.environment import environment
    from mmcse.pipeline import Paths, run_evaluate, run_train
    from mmcse.train import release_resume_point

    job_cfg = job_config(cfg, job)
    folder = job.folder(root)
    config_hash = job_hash(job_cfg, cfg.base.seed)
    if expected_hash is not None and expected_hash != config_hash:
        raise ValueError(
            f"params.yaml: job {job.variant!r} seed {job.seed} resolves to config hash {config_hash[:12]} here but "
            f"{expected_hash[:12]} where it was submitted: the worker's checkout differs (sync params.yaml)"
        )
    done = finished_result(folder, config_hash)
    if done is not None:
        return done | {"skipped": True}
    paths = Paths.of(job_cfg)
    where = device_tags(job_cfg.base.device)
    with tracking.tagged({**where, **(tags or {})}):
        summary = run_train(
            job_cfg, paths, out_dir=folder, experiment_name="ablate",
            run_name=job_run_name(job), parent_run_id=parent_run_id, progress=False,
            data_seed=cfg.base.seed,
        )
    scores = run_evaluate(job_cfg, paths, folder / "best", run_id=summary["run_id"], experiment_name="ablate",
                          transfer=job_cfg.ablate.transfer, data_dir=Path(summary["data_dir"]),
                          teacher_manifest=Path(summary["teacher_manifest"]),
                          teacher_dirs=tuple(Path(d) for d in summary["teacher_dirs"]),
                          region_sets={k: Path(v) for k, v in summary.get("region_sets", {}).items()})
    result = {
        "variant": job.variant,
        "seed": job.seed,
        "status": "ok",
        "config_hash": config_hash,
        "run_id": summary["run_id"],
        "device": where["device"],
        "best_dev": summary["best_dev"],
        "dev_metric": summary["dev_metric"],
        "artifacts": summary["artifacts"],
        "environment": environment(job_cfg.base.device),
        "scores": scores,
    }
    _write_result(folder, result)
    release_resume_point(folder)  # the result is recorded: a rerun skips this job
    return result


def ablation_hash(cfg: Config, jobs: Sequence[Job]) -> str:
    """What one ablation is: its jobs (each job's hash, or its config error) and how the table is
    made. A rerun with the same hash continues the same MLflow parent run."""
    hashes = []
    for job in jobs:
        try:
            hashes.append(job_hash(job_config(cfg, job), cfg.base.seed))
        except ValueError as err:  # a bad override fails as a job; it still names the ablation
            hashes.append(f"invalid: {err}")
    a = cfg.ablate
    return sha256_json({"jobs": [[j.variant, j.seed, h] for j, h in zip(jobs, hashes, strict=True)],
                        "table": [a.reference, a.metric, a.plot_x, a.title, a.preset]})


def previous_parent(root: Path, ablation: str) -> str | None:
    """The MLflow parent run an interrupted (or finished) run of this same ablation started."""
    from mmcse.tracking import remembered_run

    record = remembered_run(root, "ablation")
    return record["run_id"] if record and record.get("ablation") == ablation else None


def remember_parent(root: Path, ablation: str, run_id: str) -> None:
    """Remember the parent run of ablation ``ablation`` (its hash) for ``root``, beside mlruns/ (not in
    ``root``, a DVC output: a run id is random)."""
    from mmcse.tracking import remember_run

    remember_run(root, run_id, "ablation", ablation=ablation)


def aggregate_metrics(rows: Sequence[dict[str, Any]]) -> dict[str, float]:
    """The table as MLflow metrics of the parent run: ``<variant>/<metric>_mean|_std|_p`` (variant
    names made metric-safe; ``_p``: the paired t-test against the reference) and
    ``<variant>/seeds``; NaN cells are left out."""
    out: dict[str, float] = {}
    for row in rows:
        name = re.sub(r"[^A-Za-z0-9_. -]+", "_", row["variant"]).strip() or "variant"  # MLflow's name rules
        for key, value in row.items():
            if key.endswith(("_mean", "_std", "_p")) and isinstance(value, int | float) and math.isfinite(value):
                out[metric_name(f"{name}/{key}")] = float(value)  # demo_i2t_R@1_mean -> demo_i2t_R1_mean
        out[f"{name}/seeds"] = float(row["seeds"])
    return out


def record_result(root: Path, job: Job, result: dict[str, Any]) -> None:
    """Keep a finished job's result that was computed elsewhere (another worker's checkout)
    under ``root`` too, so a rerun here skips the job and the table's folder is complete."""
    if result.get("status") != "ok":
        return
    folder = job.folder(root)
    if finished_result(folder, result["config_hash"]) is None:
        _write_result(folder, result)


def failed_result(job: Job, error: BaseException | str) -> dict[str, Any]:
    return {"variant": job.variant, "seed": job.seed, "status": "failed", "error": str(error)[:500]}


# KDMCSE Table 1: "*: difference between MCSE and KDMCSE is significant at α = 0.05" (they used an
# independent t-test; here runs are paired by seed, as every row trains on the same seeds).
ALPHA = 0.05
MARKER = "*"
FEW_SEEDS = "n<2"  # fewer than two seeds paired with the reference: no test, no marker
TRANSFER_AVG = "transfer_avg"


def paired_significance(
    results: Sequence[dict[str, Any]], reference: str, metrics: Sequence[str]
) -> dict[str, dict[str, dict[str, Any]]]:
    """Paired t-test of every variant against ``reference``, per metric.

    Runs are paired by seed: a seed counts when both the variant's and the reference's job
    finished (status ok) and both scored the metric. Returns ``{variant: {metric: {"t", "p",
    "n", "mean_diff", "note"}}}`` for every variant but the reference (``scipy.stats.ttest_rel``,
    two-sided; t = mean(d) / (sd(d)/√n), d = variant − reference, n − 1 degrees of freedom).
    With n < 2 pairs, or identical scores on every pair, t and p are NaN and ``note`` says why
    (``"n<2"``, ``"identical"``); otherwise ``note`` is ``""``.
    """
    by_seed: dict[str, dict[int, dict[str, float]]] = {}
    for r in results:
        if r.get("status") == "ok":
            by_seed.setdefault(r["variant"], {})[r["seed"]] = r["scores"]
    ref = by_seed.get(reference, {})
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for variant in dict.fromkeys(r["variant"] for r in results):
        if variant == reference:
            continue
        runs = by_seed.get(variant, {})
        out[variant] = {}
        for m in metrics:
            seeds = sorted(s for s in runs if s in ref and m in runs[s] and m in ref[s])
            a = np.array([runs[s][m] for s in seeds], dtype=float)  # (n,) the variant, by seed
            b = np.array([ref[s][m] for s in seeds], dtype=float)  # (n,) the reference, same seeds
            cell: dict[str, Any] = {"t": math.nan, "p": math.nan, "n": len(seeds),
                                    "mean_diff": float((a - b).mean()) if len(seeds) else math.nan, "note": ""}
            if len(seeds) < 2:
                cell["note"] = FEW_SEEDS
            elif np.all(a == b):
                cell["note"] = "identical"
            else:
                with np.errstate(all="ignore"), warnings.catch_warnings():
                    warnings.simplefilter("ignore", RuntimeWarning)  # constant differences: t = ±inf, p = 0
                    test = stats.ttest_rel(a, b)
                cell["t"], cell["p"] = float(test.statistic), float(test.pvalue)
            out[variant][m] = cell
    return out


# A retrieval score named without its test set (a preset that runs on any data: duet-table2)
BARE_RETRIEVAL = re.compile(r"^(rsum|(i2t|t2i)_R@\d+|((i2t|t2i)_)?NDCG@\d+_\w+)$")


def table_metric(cfg: Config) -> str:
    """The table's primary column: ``ablate.metric``, where a bare retrieval score (``rsum``,
    ``i2t_R@1``, ``NDCG@25_rouge_l``) gets the data's test set as its prefix (``demo_rsum``,
    ``flickr30k_1k_rsum``; COCO: the 1K folds the papers' ablations report, ``coco_1k_rsum``)."""
    from mmcse.data.prepare import retrieval_set_name

    metric = cfg.ablate.metric
    if not BARE_RETRIEVAL.match(metric):
        return metric
    return f"{'coco_1k' if cfg.data.pairs == 'coco' else retrieval_set_name(cfg.data.pairs)}_{metric}"


def metric_order(metrics: Sequence[str]) -> list[str]:
    """Table columns: STS tasks (SentEval order, then others by name), their ``avg``, the
    transfer tasks (SentEval order) and ``transfer_avg``."""
    from mmcse.data.senteval import STS_TASKS, TRANSFER_TASKS

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
    from mmcse.environment import describe

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


def _fmt(mean: float, std: float, marker: str = "") -> str:
    return "—" if not math.isfinite(mean) else f"{mean:.2f}{marker} ± {std:.2f}"


def aggregate(cfg: Config, results: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per variant (params.yaml order): mean ± std per metric over seeds, the paired
    t-test p-value of each metric against the reference variant (``<metric>_p``, seeds paired:
    `paired_significance`; ``p_value`` is the primary metric's), the number of seeds paired with
    the reference (``paired_seeds``), a ``note`` (``reference``, or ``n<2`` where no test could
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
    tests = paired_significance([r for rs in by_variant.values() for r in rs], reference, metrics)
    rows = []
    for name, rs in by_variant.items():
        good = ok[name]
        failed = [r for r in rs if r["status"] != "ok"]
        row: dict[str, Any] = {
            "variant": name,
            "status": "ok" if not failed else ("failed" if not good else f"partial ({len(failed)} failed)"),
            "seeds": len(good),
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
            row["paired_seeds"], row["note"] = len(good), "reference"
        else:
            cells = tests.get(name, {})
            cell = cells.get(primary) or next(iter(cells.values()), {"n": 0, "note": FEW_SEEDS})
            row["paired_seeds"] = cell["n"]
            row["note"] = f"{FEW_SEEDS}: {cell['n']} seed(s) paired with {reference}, no test" \
                if cell["n"] < 2 else cell["note"]
        if transfer_note:
            row["transfer_note"] = transfer_note
        if failed:
            row["error"] = failed[0].get("error", "")
        rows.append(row)
    return rows


LABELS = {"avg": "STS avg", TRANSFER_AVG: "TR avg"}  # DALR's STS (Avg.) / TR (Avg.)


def table_markdown(rows: Sequence[dict[str, Any]], primary: str, reference: str, title: str = "",
                   notes: Sequence[str] = ()) -> str:
    """Every metric's mean ± std over seeds, marked ``*`` where the paired t-test against
    ``reference`` gives p < 0.05 (KDMCSE Table 1's marker); the primary metric's p-value (or
    ``n<2``) in its own column; a footnote says what the marker means and why an empty
    transfer column is empty; ``notes`` (the environment, `environment_notes`) follow it."""
    metrics = metric_order([k[: -len("_mean")] for k in rows[0] if k.endswith("_mean")]) if rows else []
    header = ["variant", *[LABELS.get(m, m) for m in metrics], f"p vs {reference} ({LABELS.get(primary, primary)})",
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
                cells.append(_fmt(r[f"{m}_mean"], r[f"{m}_std"], marker))
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
    lines += ["", f"{MARKER}: paired t-test against {reference} over the seeds both rows finished, p < {ALPHA} "
                  f"(KDMCSE Table 1's α; {FEW_SEEDS}: fewer than 2 paired seeds, no test). Mean ± std over seeds."]
    lines += [f"TR avg: {n}." for n in transfer_notes]
    lines += list(notes)
    return "\n".join(lines) + "\n"


def write_table(
    rows: Sequence[dict[str, Any]], out_dir: Path, primary: str, reference: str, title: str = "",
    notes: Sequence[str] = (),
) -> dict[str, Path]:
    import pandas as pd

    from mmcse.io import atomic_path

    out_dir.mkdir(parents=True, exist_ok=True)
    csv_path, md_path = out_dir / "ablation.csv", out_dir / "ablation.md"
    with atomic_path(csv_path) as tmp:
        pd.DataFrame(rows).to_csv(tmp, index=False)
    write_text(md_path, table_markdown(rows, primary, reference, title, notes))
    return {"csv": csv_path, "md": md_path}
