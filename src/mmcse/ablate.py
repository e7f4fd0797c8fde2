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
    path = folder / "result.json"
    if not path.is_file():
        return None
    result = read_json(path)
    if result.get("status") == "ok" and result.get("config_hash") == config_hash:
        return result
    return None


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
            run_name=f"{job.variant} seed={job.seed}", parent_run_id=parent_run_id, progress=False,
            data_seed=cfg.base.seed,
        )
    scores = run_evaluate(job_cfg, paths, folder / "best", run_id=summary["run_id"], experiment_name="ablate",
                          transfer=job_cfg.ablate.transfer, data_dir=Path(summary["data_dir"]),
                          teacher_manifest=Path(summary["teacher_manifest"]),
                          teacher_dirs=tuple(Path(d) for d in summary["teacher_dirs"]))
    result = {
        "variant": job.variant,
        "seed": job.seed,
        "status": "ok",
        "config_hash": config_hash,
        "run_id": summary["run_id"],
        "device": where["device"],
        "best_dev_sts": summary["best_dev_sts"],
        "artifacts": summary["artifacts"],
        "scores": scores,
    }
    write_json(folder / "result.json", result)
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
    path = root / "parent.json"
    if not path.is_file():
        return None
    try:
        record = read_json(path)
    except ValueError:
        return None
    return record.get("run_id") if record.get("ablation") == ablation else None


def remember_parent(root: Path, ablation: str, run_id: str) -> None:
    write_json(root / "parent.json", {"ablation": ablation, "run_id": run_id})


def aggregate_metrics(rows: Sequence[dict[str, Any]]) -> dict[str, float]:
    """The table as MLflow metrics of the parent run: ``<variant>/<metric>_mean|_std`` (variant
    names made metric-safe) and ``<variant>/seeds``; NaN cells are left out."""
    out: dict[str, float] = {}
    for row in rows:
        name = re.sub(r"[^A-Za-z0-9_. -]+", "_", row["variant"]).strip() or "variant"  # MLflow's name rules
        for key, value in row.items():
            if (key.endswith("_mean") or key.endswith("_std")) and math.isfinite(value):
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
        write_json(folder / "result.json", {k: v for k, v in result.items() if k != "skipped"})


def failed_result(job: Job, error: BaseException | str) -> dict[str, Any]:
    return {"variant": job.variant, "seed": job.seed, "status": "failed", "error": str(error)[:500]}


def _fmt(mean: float, std: float) -> str:
    return "—" if not math.isfinite(mean) else f"{mean:.2f} ± {std:.2f}"


def aggregate(cfg: Config, results: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per variant (params.yaml order): mean ± std per metric over seeds, the
    Welch t-test p-value of the primary metric against the reference variant, status."""
    by_variant: dict[str, list[dict[str, Any]]] = {name: [] for name in cfg.ablate.variants}
    for r in results:
        by_variant[r["variant"]].append(r)
    ok = {n: [r for r in rs if r["status"] == "ok"] for n, rs in by_variant.items()}
    metrics: list[str] = []
    for rs in ok.values():
        for r in rs:
            metrics += [m for m in r["scores"] if m not in metrics]
    primary = cfg.ablate.metric
    ref = [r["scores"].get(primary, math.nan) for r in ok[cfg.ablate.reference]]
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
        values = [r["scores"].get(primary, math.nan) for r in good]
        if name == cfg.ablate.reference or len(values) < 2 or len(ref) < 2:
            row["p_value"] = math.nan
        else:
            row["p_value"] = float(stats.ttest_ind(values, ref, equal_var=False).pvalue)
        if failed:
            row["error"] = failed[0].get("error", "")
        rows.append(row)
    return rows


def table_markdown(rows: Sequence[dict[str, Any]], primary: str, reference: str, title: str = "") -> str:
    metrics = [k[: -len("_mean")] for k in rows[0] if k.endswith("_mean")] if rows else []
    metrics = sorted(metrics, key=lambda m: (m == primary, m))  # tasks first, the average last
    header = ["variant", *metrics, f"p vs {reference}", "seeds", "status"]
    lines = [f"### {title}", ""] if title else []
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        cells = [r["variant"], *[_fmt(r[f"{m}_mean"], r[f"{m}_std"]) for m in metrics]]
        p = r["p_value"]
        cells += ["—" if not math.isfinite(p) else f"{p:.3f}", str(r["seeds"]), r["status"]]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_table(
    rows: Sequence[dict[str, Any]], out_dir: Path, primary: str, reference: str, title: str = ""
) -> dict[str, Path]:
    import pandas as pd

    from mmcse.io import atomic_path

    out_dir.mkdir(parents=True, exist_ok=True)
    csv_path, md_path = out_dir / "ablation.csv", out_dir / "ablation.md"
    with atomic_path(csv_path) as tmp:
        pd.DataFrame(rows).to_csv(tmp, index=False)
    write_text(md_path, table_markdown(rows, primary, reference, title))
    return {"csv": csv_path, "md": md_path}
