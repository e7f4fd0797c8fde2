"""The record of a finished ablation: its table, significance tests and figure in the MLflow
parent run, ``plots/ablation.png`` and ``metrics/ablate.json``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mmcse.config import Config
from mmcse.io import write_json
from mmcse.pipeline.paths import Paths


def log_ablation(cfg: Config, rows: list[dict[str, Any]], files: dict[str, Path], paths: Paths,
                 results: list[dict[str, Any]] | None = None, run_id: str | None = None,
                 step: int | None = None) -> None:
    """Table (``mlflow.log_table``: every column, the significance test's p-values ``<metric>_p``
    included), CSV/Markdown, figure, the aggregate metrics (mean, std and p per variant,
    `mmcse.analysis.tables.aggregate_metrics`), the list of jobs (``jobs.json``: variant, seed, status,
    MLflow run, artifact keys) and the significance tests in full (``significance.json``: t, p,
    paired seeds, mean difference, note per variant and metric) into the active (parent) MLflow
    run: bars per variant, or a line over ``ablate.plot_x`` for a parameter sweep; the figure
    also to ``plots/ablation.png`` and the per-variant primary metric (with its p-value against
    the reference) to ``metrics/ablate.json``. ``run_id``: the parent run, named (not taken from
    the thread's active run, which a job's run may be); default the active run. ``step``: of the
    aggregate metrics (the flow: jobs done, continuing the history `log_partial` logs)."""
    import math
    import time

    import mlflow
    import pandas as pd
    from mlflow.entities import Metric

    from mmcse.analysis.statistics import ALPHA, TESTS, significance
    from mmcse.analysis.tables import aggregate_metrics
    from mmcse.evaluation.plots import ablation_bars, ablation_line, save_figure

    def finite(value: Any) -> Any:  # JSON has no NaN
        return value if not isinstance(value, float) or math.isfinite(value) else None

    from mmcse.analysis.tables import table_metric

    metric = table_metric(cfg)
    if run_id is None:
        active = mlflow.active_run()
        if active is None:
            raise RuntimeError("log_ablation needs run_id or an active MLflow run (the ablation's parent)")
        run_id = active.info.run_id
    client = mlflow.MlflowClient()
    now = int(time.time() * 1000)
    values = [Metric(k, v, now, step or 0) for k, v in aggregate_metrics(rows).items()]
    for start in range(0, len(values), 1000):  # MLflow's batch limit
        client.log_batch(run_id, metrics=values[start : start + 1000])
    if results is not None:
        jobs = [{k: r.get(k) for k in ("variant", "seed", "status", "run_id", "artifacts", "error") if k in r}
                for r in results]
        client.log_dict(run_id, {"jobs": jobs}, "jobs.json")
        metrics = [k[: -len("_mean")] for k in rows[0] if k.endswith("_mean")] if rows else []
        tests = significance(results, cfg.ablate.reference, metrics, cfg.ablate.test)
        client.log_dict(run_id, {"reference": cfg.ablate.reference, "alpha": ALPHA,
                                 "test": TESTS[cfg.ablate.test],
                                 "variants": {v: {m: {k: finite(x) for k, x in cell.items()}
                                                  for m, cell in by_metric.items()}
                                              for v, by_metric in tests.items()}}, "significance.json")
    client.log_table(run_id, pd.DataFrame(rows), artifact_file="ablation_table.json")
    client.log_artifact(run_id, str(files["csv"]))
    client.log_artifact(run_id, str(files["md"]))
    means = [r.get(f"{metric}_mean", math.nan) for r in rows]
    stds = [r.get(f"{metric}_std", math.nan) for r in rows]
    if cfg.ablate.plot_x:
        xs = [cfg.ablate.variants[r["variant"]][cfg.ablate.plot_x] for r in rows]
        fig = ablation_line(xs, means, stds, metric, cfg.ablate.plot_x)
    else:
        fig = ablation_bars([r["variant"] for r in rows], means, stds, metric)
    client.log_figure(run_id, fig, "figures/ablation.png")
    save_figure(fig, paths.plots / "ablation.png")
    summary = {
        r["variant"]: {"mean": r.get(f"{metric}_mean"), "std": r.get(f"{metric}_std"), "status": r["status"],
                       "p": finite(r.get(f"{metric}_p", math.nan)), "note": r.get("note", "")}
        for r in rows
    }
    write_json(paths.metrics / "ablate.json", {"metric": metric, "preset": cfg.ablate.preset, "variants": summary})


def first_runs(results: list[dict[str, Any]]) -> dict[str, str]:
    """``{variant: run_id}`` of each row's finished job with the lowest seed, in the rows' order."""
    out: dict[str, str] = {}
    for r in sorted((r for r in results if r.get("status") == "ok" and r.get("run_id")), key=lambda r: r["seed"]):
        out.setdefault(r["variant"], r["run_id"])
    return {v: out[v] for v in dict.fromkeys(r["variant"] for r in results) if v in out}


def log_ablation_figures(cfg: Config, results: list[dict[str, Any]], run_id: str) -> list[str]:
    """``ablate.figures`` into the parent run ``run_id`` (``figures/<name>.png``), each from the job
    of every row with the lowest seed: ``sts_scatter``, the model's cosine against the gold score of
    the STS test pairs, one panel per row (DALR Fig. 4; `mmcse.evaluation.figures.sts_scatter_runs`).
    Returns the artifacts logged."""
    import mlflow

    from mmcse.evaluation.figures import load_sts_predictions, sts_scatter_runs

    logged = []
    runs = first_runs(results)
    for name in cfg.ablate.figures:
        if name == "sts_scatter" and runs:
            fig = sts_scatter_runs({variant: load_sts_predictions(job) for variant, job in runs.items()})
            mlflow.MlflowClient().log_figure(run_id, fig, f"figures/{name}.png")
            logged.append(f"figures/{name}.png")
    return logged
