"""Prefect flow `ablations`: one task per variant × seed, then the aggregated table.

Runs in-process without a server (`python flows/ablations.py`, or the `ablate` DVC
stage), or as deployment `ablations` on the `gpu` process work pool (prefect.yaml).
All work is done by library functions in `mmcse.ablate` and `mmcse.pipeline`.
"""

from __future__ import annotations

import sys
from pathlib import Path

from prefect import flow, task

from mmcse.ablate import Job, aggregate, expand, failed_result, run_job, write_table
from mmcse.config import load_config
from mmcse.pipeline import Paths, log_ablation


@task(name="train-variant", task_run_name="{variant} seed={seed}")
def train_variant(params_path: str, variant: str, seed: int, parent_run_id: str | None) -> dict:
    cfg = load_config(params_path)
    job = next(j for j in expand(cfg) if j.variant == variant and j.seed == seed)
    return run_job(cfg, job, Paths.of(cfg).ablations, parent_run_id=parent_run_id)


@flow(name="ablations", log_prints=True)
def ablations(params_path: str = "params.yaml") -> list[dict]:
    """Train + evaluate every variant × seed (finished ones are skipped), retry failures
    `ablate.retries` times, and write/log the table; returns its rows."""
    from mmcse import tracking

    cfg = load_config(params_path)
    paths = Paths.of(cfg)
    jobs: list[Job] = expand(cfg)
    retrying = train_variant.with_options(retries=cfg.ablate.retries, retry_delay_seconds=0)
    with tracking.run(cfg, "ablate", run_name=f"ablation {Path(params_path).resolve().parent.name}") as parent:
        results = []
        for job in jobs:
            try:
                results.append(retrying(params_path, job.variant, job.seed, parent.info.run_id))
            except Exception as err:  # recorded as failed in the table, never dropped
                print(f"variant {job.variant!r} seed {job.seed} failed after retries: {err}")
                results.append(failed_result(job, err))
        rows = aggregate(cfg, results)
        files = write_table(rows, paths.ablations, cfg.ablate.metric, cfg.ablate.reference, cfg.ablate.title)
        log_ablation(cfg, rows, files, paths)
    print(files["md"].read_text())
    return rows


if __name__ == "__main__":
    ablations(sys.argv[1] if len(sys.argv) > 1 else "params.yaml")
