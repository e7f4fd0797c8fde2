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


FIG3_SENTENCES = 5000  # DALR §4.4: "we randomly sample 5,000 image-text pairs from the MSCOCO test set"


def first_jobs(results: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """``{variant: result}`` of each row's finished job with the lowest seed, in the rows' order."""
    out: dict[str, dict[str, Any]] = {}
    for r in sorted((r for r in results if r.get("status") == "ok" and r.get("run_id")), key=lambda r: r["seed"]):
        out.setdefault(r["variant"], r)
    return {v: out[v] for v in dict.fromkeys(r["variant"] for r in results) if v in out}


def figure_sentences(raw: Path, n: int, seed: int) -> tuple[list[str], list[str] | None]:
    """At most ``n`` distinct test sentences (a seeded sample) and the image each describes: the
    retrieval test captions (DALR Fig. 3: COCO test captions), else the STS test sentences
    (no images: a text-only data set)."""
    import numpy as np

    from mmcse.io import read_jsonl

    captions = raw / "retrieval" / "captions.jsonl"
    if captions.is_file():
        image_of = {}
        for row in read_jsonl(captions):
            image_of.setdefault(str(row["caption"]), str(row["image_id"]))
        sentences = sorted(image_of)
    else:
        sentences = sorted({s for row in read_jsonl(raw / "sts" / "test.jsonl") for s in (row["s1"], row["s2"])})
        image_of = None
    if len(sentences) > n:
        keep = np.sort(np.random.default_rng(seed).choice(len(sentences), n, replace=False))
        sentences = [sentences[i] for i in keep]
    return sentences, [image_of[s] for s in sentences] if image_of is not None else None


def _tsne_clusters(cfg: Config, jobs: dict[str, dict[str, Any]], ablations: Path) -> tuple[Any, dict[str, float]]:
    """Each row's best checkpoint encodes the same test captions; one t-SNE panel per row."""
    import numpy as np

    from mmcse.evaluation.figures import TSNE_CLUSTERS, tsne_panels
    from mmcse.evaluation.sts import TextEncoder, encode_unique
    from mmcse.experiments.ablate import Job
    from mmcse.models.device import resolve_device

    sentences, groups = figure_sentences(Paths.of(cfg).raw, FIG3_SENTENCES, cfg.base.seed)
    device = str(resolve_device(cfg.base.device))
    embeddings = {}
    for variant, job in jobs.items():
        best = Job(variant, job["seed"], {}).folder(ablations) / "best"
        if not best.is_dir():
            raise FileNotFoundError(f"{best}: the best checkpoint of row {variant!r} (seed {job['seed']}) is not here")
        encoder = TextEncoder(str(best), cfg.evaluate.pooler, device, precision=cfg.train.precision)
        vectors = encode_unique(encoder, sentences, cfg.evaluate.batch_size, desc=f"t-SNE {variant}")
        embeddings[variant] = np.stack([vectors[s] for s in sentences])
    fig, metrics = tsne_panels(embeddings, TSNE_CLUSTERS, cfg.base.seed, groups)
    flat = {f"{variant}/cluster_{k}": v for variant, m in metrics.items() for k, v in m.items()
            if k in ("silhouette", "purity")}
    return fig, flat


def log_ablation_figures(cfg: Config, results: list[dict[str, Any]], run_id: str,
                         ablations: Path | None = None) -> list[str]:
    """``ablate.figures`` into the parent run ``run_id`` (``figures/<name>.png``), each from the job
    of every row with the lowest seed:

    - ``sts_scatter``: the model's cosine against the gold score of the STS test pairs, one panel
      per row (DALR Fig. 4; `mmcse.evaluation.figures.sts_scatter_runs`);
    - ``tsne_clusters``: each row's best checkpoint (under ``ablations``, default the ablation
      folder) encodes the same test captions, t-SNE + 50 KMeans clusters per row (DALR Fig. 3; the
      clusters' silhouette and purity against the captions' images go to the parent's metrics).

    A figure that cannot be drawn does not undo the table: its error goes to the parent's tag
    ``figure.<name>.error`` and is printed. Returns the artifacts logged."""
    import math

    import mlflow

    from mmcse.evaluation.figures import load_sts_predictions, sts_scatter_runs

    client = mlflow.MlflowClient()
    jobs = first_jobs(results)
    logged = []
    for name in cfg.ablate.figures:
        if not jobs:
            break
        try:
            metrics: dict[str, float] = {}
            if name == "sts_scatter":
                fig = sts_scatter_runs({v: load_sts_predictions(j["run_id"]) for v, j in jobs.items()})
            else:  # tsne_clusters
                fig, metrics = _tsne_clusters(cfg, jobs, ablations or Paths.of(cfg).ablations)
        except Exception as err:  # noqa: BLE001 - the table is the record; the figure says why it is missing
            client.set_tag(run_id, f"figure.{name}.error", str(err)[:500])
            print(f"ablation figure {name} not drawn: {err}")
            continue
        client.log_figure(run_id, fig, f"figures/{name}.png")
        for key, value in metrics.items():
            if math.isfinite(value):
                client.log_metric(run_id, key, value)
        logged.append(f"figures/{name}.png")
    return logged
