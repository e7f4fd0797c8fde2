"""The MLflow runs table's headline view: which columns an experiment's runs table opens with.

MLflow 3.17's runs table shows no score by default; `mmcse.tracking.ui_url` opens the shared view
`mmcse.tracking.HEADLINE_VIEW` that `write_headline_views` writes into each experiment (the
experiment tag ``mlflow.sharedViewState.mmcse-headline``, the view's state as JSON) from what its
runs log: method and seed, the ablation row and seed, the best dev score and the headline test
scores (`mmcse.evaluation.names.is_headline`).
"""

from __future__ import annotations

import json
from typing import Any

import mlflow

from mmcse.config import Config
from mmcse.evaluation.names import is_headline
from mmcse.tracking import HEADLINE_VIEW, SEED_TAG, SHARED_VIEW_TAG, VARIANT_TAG, configure

# Which columns, in this order, where the experiment's runs have them: the method and seed, the
# ablation row and seed (job runs), the best dev score, then the test scores a table compares.
HEADLINE_PARAMS = ("train.method", "base.seed")
HEADLINE_DEV = ("best_dev_sts", "best_dev_rsum")


def headline_columns(params: set[str], metrics: set[str], tags: set[str]) -> list[str]:
    """The runs-table columns (the UI's ``<type>.`<key>`` names) of `HEADLINE_VIEW` for runs that
    log ``params``, ``metrics`` and ``tags``: method and seed, `VARIANT_TAG` / `SEED_TAG`, the best
    dev score, the test STS / transfer / MTEB averages, every test set's rsum and its NDCG means."""
    columns = [f"params.`{p}`" for p in HEADLINE_PARAMS if p in params]
    columns += [f"tags.`{t}`" for t in (VARIANT_TAG, SEED_TAG) if t in tags]
    columns += [f"metrics.`{m}`" for m in HEADLINE_DEV if m in metrics]
    columns += [f"metrics.`{m}`" for m in sorted(metrics, key=_test_order) if m.startswith("test_") and is_headline(m)]
    return columns


def _test_order(metric: str) -> tuple[int, str]:
    return ({"test_avg": 0, "test_transfer_avg": 1, "test_mteb_avg": 2}.get(metric, 3), metric)


def set_headline_view(experiment_id: str, max_runs: int = 1000) -> list[str]:
    """Write `HEADLINE_VIEW` into experiment ``experiment_id`` from what its (last ``max_runs``) runs
    log, sorted by the best dev score where there is one; returns its columns."""

    client = mlflow.MlflowClient()
    runs = client.search_runs([experiment_id], max_results=max_runs)
    params = {k for r in runs for k in r.data.params}
    metrics = {k for r in runs for k in r.data.metrics}
    tags = {k for r in runs for k in r.data.tags}
    columns = headline_columns(params, metrics, tags)
    dev = next((f"metrics.`{m}`" for m in HEADLINE_DEV if m in metrics), None)
    view: dict[str, Any] = {"selectedColumns": columns, "runsHiddenMode": "SHOW_ALL"}
    if dev:
        view |= {"orderByKey": dev, "orderByAsc": False}
    client.set_experiment_tag(experiment_id, SHARED_VIEW_TAG + HEADLINE_VIEW, json.dumps(view))
    return columns


def write_headline_views(cfg: Config) -> dict[str, list[str]]:
    """`set_headline_view` for every experiment ``<prefix>-*`` of the configured store:
    ``{experiment name: its columns}``."""

    configure(cfg)
    found = mlflow.search_experiments(filter_string=f"name LIKE '{cfg.base.experiment_prefix}-%'")
    return {exp.name: set_headline_view(exp.experiment_id) for exp in found}
