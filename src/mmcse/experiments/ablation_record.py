"""The record of a finished ablation: its table, significance tests and figure in the MLflow
parent run, ``plots/ablation.png`` and ``metrics/ablate.json``.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import mlflow
import numpy as np
import pandas as pd
from mlflow.entities import Metric

from mmcse.analysis.statistics import ALPHA, TESTS, significance
from mmcse.analysis.tables import aggregate_metrics, column_label, headline_metrics, table_markdown, table_metric
from mmcse.config import Config
from mmcse.errors import InputError
from mmcse.evaluation.figures import (
    DROPOUT_MASKS,
    NEIGHBOURS,
    TSNE_CLUSTERS,
    dropout_tsne_panels,
    dropout_views,
    nearest_sentences,
    neighbours_figure,
    sts_scatter_runs,
    tsne_panels,
)
from mmcse.evaluation.plots import ablation_bars, ablation_line, plt, save_figure
from mmcse.evaluation.sts import TextEncoder, encode_unique
from mmcse.evaluation.teacher_statistics import (
    DEFAULT_THRESHOLDS,
    cached_joint_teacher,
    teacher_rank_figure,
    teacher_similarity_figure,
    threshold_metrics,
    threshold_summary,
)
from mmcse.experiments.jobs import Job, job_config
from mmcse.experiments.upstream import resolve
from mmcse.io import read_json, read_jsonl, write_metrics
from mmcse.models.device import resolve_device
from mmcse.pipeline.paths import Paths
from mmcse.tracking import DESCRIPTION_TAG, metric_name, run_description
from mmcse.tracking.reading import load_sts_predictions


def log_ablation(cfg: Config, rows: list[dict[str, Any]], files: dict[str, Path], paths: Paths,
                 results: list[dict[str, Any]] | None = None, run_id: str | None = None) -> None:
    """Table (``mlflow.log_table``: every column, the significance test's p-values ``<metric>_p``
    included), CSV/Markdown, figure, the aggregate metrics (mean, std and p per variant,
    `mmcse.analysis.tables.aggregate_metrics`), the list of jobs (``jobs.json``: variant, seed, status,
    MLflow run, artifact keys) and the significance tests in full (``significance.json``: t, p,
    paired seeds, mean difference, note per variant and metric) into the active (parent) MLflow
    run: the variants compared (`comparison_figure`); the figure also to ``plots/ablation.png`` and
    the per-variant primary metric (with its p-value against the reference) to
    ``metrics/ablate.json``. The aggregates are logged once, at step 0: one value per variant and
    score, not a curve. ``run_id``: the parent run, named (not taken from the thread's active run,
    which a job's run may be); default the active run."""

    def finite(value: Any) -> Any:  # JSON has no NaN
        return value if not isinstance(value, float) or math.isfinite(value) else None

    metric = table_metric(cfg)
    if run_id is None:
        active = mlflow.active_run()
        if active is None:
            raise RuntimeError("log_ablation needs run_id or an active MLflow run (the ablation's parent)")
        run_id = active.info.run_id
    client = mlflow.MlflowClient()
    now = int(time.time() * 1000)
    values = [Metric(k, v, now, 0) for k, v in aggregate_metrics(rows).items()]
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
    # the run page's description (its Overview, rendered Markdown): the headline table, read without a click
    client.set_tag(run_id, DESCRIPTION_TAG, run_description(table_markdown(
        rows, metric, cfg.ablate.reference, metrics=headline_metrics(rows, metric),
        notes=["Headline scores; every column is in ablation.md (artifacts), the bars in figures/ablation.png."]),
        "the whole table is the run's artifact ablation.md"))
    fig = comparison_figure(cfg, rows)
    client.log_figure(run_id, fig, "figures/ablation.png")
    save_figure(fig, paths.plots / "ablation.png")
    summary = {
        r["variant"]: {"mean": r.get(f"{metric}_mean"), "std": r.get(f"{metric}_std"), "status": r["status"],
                       "p": finite(r.get(f"{metric}_p", math.nan)), "note": r.get("note", "")}
        for r in rows
    }
    write_metrics(paths.metrics / "ablate.json", {"metric": metric, "preset": cfg.ablate.preset, "variants": summary})


def comparison_figure(cfg: Config, rows: list[dict[str, Any]]) -> Any:
    """The variants compared: a panel of bars per headline score (mean ± std over seeds,
    `mmcse.analysis.tables.headline_metrics`, the primary metric first), or for a parameter sweep
    (``ablate.plot_x``) the primary metric along the parameter."""

    metric = table_metric(cfg)

    def column(m: str, kind: str) -> list[float]:
        return [r.get(f"{m}_{kind}", math.nan) for r in rows]

    if cfg.ablate.plot_x:
        xs = [cfg.ablate.variants[r["variant"]][cfg.ablate.plot_x] for r in rows]
        return ablation_line(xs, column(metric, "mean"), column(metric, "std"), column_label(metric), cfg.ablate.plot_x)
    panels = [(column_label(m), column(m, "mean"), column(m, "std")) for m in headline_metrics(rows, metric)]
    return ablation_bars([r["variant"] for r in rows], panels, cfg.ablate.title or "")


FIG3_SENTENCES = 5000  # DALR §4.4: "we randomly sample 5,000 image-text pairs from the MSCOCO test set"


def first_jobs(results: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """``{variant: result}`` of each row's finished job with the lowest seed, in the rows' order."""
    out: dict[str, dict[str, Any]] = {}
    for r in sorted((r for r in results if r.get("status") == "ok" and r.get("run_id")), key=lambda r: r["seed"]):
        out.setdefault(r["variant"], r)
    return {v: out[v] for v in dict.fromkeys(r["variant"] for r in results) if v in out}


CAPTION_SET_NAMES = {"flickr30k": "Flickr30k test captions", "coco": "COCO test captions"}


def figure_sentences(raw: Path, n: int, seed: int, caption_set: str = "retrieval_test"
                     ) -> tuple[list[str], list[str] | None, str]:
    """At most ``n`` distinct test sentences (a seeded sample), the image each describes, and what
    they are, for the figure's title. ``caption_set`` (``ablate.figure_captions``): the retrieval
    test captions, else the STS test sentences (no images: a text-only data set); ``flickr30k`` /
    ``coco``: Karpathy's test split of that data set (``test_captions/<set>.jsonl``, DALR Fig. 3:
    COCO's), which the demo world replaces by its own test scenes' captions."""

    named = raw / "test_captions" / f"{caption_set}.jsonl"
    captions = raw / "retrieval" / "captions.jsonl"
    manifest = read_json(raw / "manifest.json") if (raw / "manifest.json").is_file() else {}
    if caption_set != "retrieval_test" and manifest.get("pairs") != "demo":
        if not named.is_file():
            raise FileNotFoundError(f"{named}: ablate.figure_captions {caption_set} reads Karpathy's test captions, "
                                    "which the download stage writes when it reads real pairs; "
                                    "rerun it (dvc repro download)")
        captions, label = named, CAPTION_SET_NAMES[caption_set]
    elif caption_set != "retrieval_test":
        label = f"demo test captions (the demo world has no {CAPTION_SET_NAMES[caption_set]})"
    else:
        label = f"{manifest.get('retrieval_set') or 'retrieval'} test captions"
    if captions.is_file() and (rows := read_jsonl(captions)):
        image_of = {}
        for row in rows:
            image_of.setdefault(str(row["caption"]), str(row["image_id"]))
        sentences = sorted(image_of)
    else:
        sentences = sorted({s for row in read_jsonl(raw / "sts" / "test.jsonl") for s in (row["s1"], row["s2"])})
        image_of, label = None, "STS test sentences"
    if len(sentences) > n:
        keep = np.sort(np.random.default_rng(seed).choice(len(sentences), n, replace=False))
        sentences = [sentences[i] for i in keep]
    groups = [image_of[s] for s in sentences] if image_of is not None else None
    return sentences, groups, f"{len(sentences):,} {label}"


def _best_checkpoints(jobs: dict[str, dict[str, Any]], ablations: Path) -> dict[str, Path]:
    out = {}
    for variant, job in jobs.items():
        best = Job(variant, job["seed"], {}).folder(ablations) / "best"
        if not best.is_dir():
            raise FileNotFoundError(f"{best}: the best checkpoint of row {variant!r} (seed {job['seed']}) is not here")
        out[variant] = best
    return out


def _encoder(cfg: Config, best: Path) -> Any:
    return TextEncoder(str(best), cfg.evaluate.pooler, str(resolve_device(cfg.base.device)),
                       precision=cfg.train.precision)


def _tsne_clusters(cfg: Config, jobs: dict[str, dict[str, Any]], ablations: Path) -> tuple[Any, dict[str, float]]:
    """Each row's best checkpoint encodes the same test captions; one t-SNE panel per row."""

    sentences, groups, what = figure_sentences(Paths.of(cfg).raw, FIG3_SENTENCES, cfg.base.seed,
                                               cfg.ablate.figure_captions)
    embeddings = {}
    for variant, best in _best_checkpoints(jobs, ablations).items():
        vectors = encode_unique(_encoder(cfg, best), sentences, cfg.evaluate.batch_size, desc=f"t-SNE {variant}")
        embeddings[variant] = np.stack([vectors[s] for s in sentences])
    fig, metrics = tsne_panels(embeddings, TSNE_CLUSTERS, cfg.base.seed, groups)
    fig.suptitle(f"t-SNE of {what}")
    flat = {f"{variant}/cluster_{k}": v for variant, m in metrics.items() for k, v in m.items()
            if k in ("silhouette", "purity")}
    return fig, flat


def _dropout_tsne(cfg: Config, jobs: dict[str, dict[str, Any]], ablations: Path) -> tuple[Any, dict[str, float]]:
    """KDMCSE Figs. 8-12: ``ablate.sentences`` each encoded under repeated dropout masks by every
    row's best checkpoint, one t-SNE panel per row."""

    sentences = list(cfg.ablate.sentences)
    if len(sentences) < 2:
        raise InputError("dropout_tsne needs ablate.sentences (the figure's sentences, at least 2)")
    views = {}
    for variant, best in _best_checkpoints(jobs, ablations).items():
        encoder = _encoder(cfg, best)
        views[variant] = dropout_views(encoder, encoder.model, sentences, DROPOUT_MASKS,
                                       cfg.evaluate.batch_size, cfg.base.seed)
    fig, metrics = dropout_tsne_panels(views, sentences, cfg.base.seed)
    return fig, {f"{variant}/dropout_{k}": v for variant, m in metrics.items() for k, v in m.items()}


def neighbour_pool(raw: Path) -> list[str]:
    """DALR Table 10's retrieval data: one caption per image of the training pairs (Flickr30k:
    ~30k images, the paper's "30k captions"), the first listed, in the images' order."""

    first: dict[str, str] = {}
    for row in read_jsonl(raw / "pairs.jsonl"):
        first.setdefault(str(row["image_id"]), str(row["caption"]))
    return list(dict.fromkeys(first.values()))


NEIGHBOUR_QUERIES = 4  # DALR Table 10 shows four queries


def _neighbours(cfg: Config, jobs: dict[str, dict[str, Any]], ablations: Path,
                raw: Path) -> tuple[Any, dict[str, float], dict[str, Any]]:
    """DALR Table 10: the top-3 neighbours of each query among the pool, every row side by side.
    Queries: ``ablate.sentences``, else a seeded sample of the pool (the paper picks at random)."""

    pool = neighbour_pool(raw)
    if len(pool) <= NEIGHBOURS:
        raise InputError(f"{raw / 'pairs.jsonl'}: {len(pool)} captions, too few to retrieve {NEIGHBOURS} neighbours")
    queries = list(cfg.ablate.sentences)
    if not queries:
        pick = np.random.default_rng(cfg.base.seed).choice(len(pool), min(NEIGHBOUR_QUERIES, len(pool)), replace=False)
        queries = [pool[i] for i in sorted(pick)]
    found, metrics = {}, {}
    for variant, best in _best_checkpoints(jobs, ablations).items():
        vectors = encode_unique(_encoder(cfg, best), [*pool, *queries], cfg.evaluate.batch_size,
                                desc=f"neighbours {variant}")
        found[variant] = nearest_sentences(np.stack([vectors[s] for s in queries]),
                                           np.stack([vectors[s] for s in pool]), pool, queries)
        metrics[f"{variant}/neighbour_cosine"] = float(np.mean([c for hits in found[variant] for _, c in hits]))
    table = {"pool": len(pool), "queries": [
        {"query": q, **{v: [{"sentence": s, "cosine": c} for s, c in found[v][i]] for v in found}}
        for i, q in enumerate(queries)]}
    return neighbours_figure(queries, found), metrics, table


def _teacher_statistics(cfg: Config, jobs: dict[str, dict[str, Any]], figure: str) -> tuple[Any, dict[str, float]]:
    """KDMCSE Figs. 5 and 6 from the joint teacher the first row trained with (its own cached
    sets, `mmcse.experiments.upstream`), its threshold marked."""

    variant, job = next(iter(jobs.items()))
    job_cfg = job_config(cfg, Job(variant, job["seed"], {**cfg.ablate.variants[variant], "base.seed": job["seed"]}))
    up = resolve(job_cfg, Paths.of(job_cfg), cfg.base.seed)
    t, v, owners = cached_joint_teacher(up.teachers, up.raw, up.teacher_manifest, up.teacher_dirs)
    threshold = job_cfg.loss.kdmcse.threshold_value
    candidates = tuple(DEFAULT_THRESHOLDS) + (() if threshold is None or threshold in DEFAULT_THRESHOLDS
                                              else (threshold,))
    s = threshold_summary(t, v, owners, candidates, seed=cfg.base.seed)
    fig = teacher_rank_figure(s) if figure == "teacher_ranks" else teacher_similarity_figure(s, threshold)
    return fig, {f"teacher/{k}": val for k, val in threshold_metrics(s).items()}


def log_ablation_figures(cfg: Config, results: list[dict[str, Any]], run_id: str,
                         ablations: Path | None = None) -> list[str]:
    """``ablate.figures`` into the parent run ``run_id`` (``figures/<name>.png``), each from the job
    of every row with the lowest seed (its best checkpoint under ``ablations``, default the
    ablation folder):

    - ``sts_scatter``: the model's cosine against the gold score of the STS test pairs, one panel
      per row (DALR Fig. 4; `mmcse.evaluation.figures.sts_scatter_runs`);
    - ``tsne_clusters``: every row encodes the same test captions, t-SNE + 50 KMeans clusters per
      row (DALR Fig. 3; the clusters' silhouette and purity against the captions' images go to
      the parent's metrics);
    - ``dropout_tsne``: ``ablate.sentences`` under repeated dropout masks, a t-SNE panel per row
      (KDMCSE Figs. 8-12; each sentence's spread and the sentences' separation as metrics);
    - ``neighbours``: the top-3 neighbours of the queries (``ablate.sentences``, else sampled)
      among one caption per training image, the rows side by side (DALR Table 10; also
      ``figures/neighbours.json``);
    - ``teacher_ranks`` / ``teacher_similarities``: the joint teacher's statistics on the first
      row's data (KDMCSE Figs. 5 / 6; the numbers of `threshold_metrics` under ``teacher/``).

    A figure that cannot be drawn does not undo the table: its error goes to the parent's tag
    ``figure.<name>.error`` and is printed. Returns the artifacts logged."""

    client = mlflow.MlflowClient()
    jobs = first_jobs(results)
    folder = ablations or Paths.of(cfg).ablations
    logged = []
    for name in cfg.ablate.figures:
        if not jobs:
            break
        table = None
        try:
            metrics: dict[str, float] = {}
            if name == "sts_scatter":
                fig = sts_scatter_runs({v: load_sts_predictions(j["run_id"]) for v, j in jobs.items()})
            elif name == "tsne_clusters":
                fig, metrics = _tsne_clusters(cfg, jobs, folder)
            elif name == "dropout_tsne":
                fig, metrics = _dropout_tsne(cfg, jobs, folder)
            elif name == "neighbours":
                fig, metrics, table = _neighbours(cfg, jobs, folder, Paths.of(cfg).raw)
            else:  # teacher_ranks, teacher_similarities
                fig, metrics = _teacher_statistics(cfg, jobs, name)
        except Exception as err:  # noqa: BLE001 - the table is the record; the figure says why it is missing
            client.set_tag(run_id, f"figure.{name}.error", str(err)[:500])
            print(f"ablation figure {name} not drawn: {err}")
            continue
        try:
            client.log_figure(run_id, fig, f"figures/{name}.png")
        finally:  # pyplot keeps every figure until closed: a flow that writes many tables would hold them all
            plt.close(fig)
        if table is not None:
            client.log_dict(run_id, table, f"figures/{name}.json")
        for key, value in metrics.items():
            if math.isfinite(value):
                client.log_metric(run_id, metric_name(key), value)
        logged.append(f"figures/{name}.png")
    return logged
