"""Which keys an ablation variant or a sweep trial may change."""

from __future__ import annotations

import functools
from typing import Any

from mmcse.config.checks import ConfigError

# Keys an ablation variant or a sweep trial cannot set: they choose the evaluation data (so the
# rows of one table would be scored on different test sets), where artifacts and runs are
# stored, or the ablation/sweep itself. Everything else may vary per job.
FIXED_KEYS = (
    "base.data_dir", "base.models_dir", "base.metrics_dir", "base.plots_dir", "base.mlflow_tracking_uri",
    "base.experiment_prefix", "base.profile",
    "data.source", "data.senteval_dir", "data.transfer_tasks", "data.downloads_dir", "data.sources",
    "data.demo.min_objects", "data.demo.max_objects", "data.demo.sts_dev_pairs", "data.demo.sts_test_pairs",
    "data.demo.retrieval_images", "data.demo.retrieval_val_images", "data.val_images", "data.retrieval_test",
    "teachers.cache_dir", "teachers.stand_ins", "regions.cache_dir",
    "ablate", "sweep",
)


# What a job may change upstream of training (the message of a rejected key lists these).
UPSTREAM_KEYS = (
    "data.pairs", "data.splits", "data.image_limit", "data.verify_images", "data.annotations", "data.captions",
    "data.corpus", "data.corpus_limit", "data.demo.num_images", "data.demo.captions_per_image",
    "data.demo.image_size", "data.demo.corpus_sentences", "detect.*", "teachers.* (not cache_dir, stand_ins)",
    "model.name_or_path", "model.max_seq_len", "regions.* (not cache_dir)",
)


@functools.cache  # asked for every key of every row of a table (a preset walk: ~200,000 times)
def is_fixed(key: str) -> bool:
    """A fixed key, a key under one, or a whole section holding one (``data.demo``)."""
    return any(key == k or key.startswith(k + ".") or k.startswith(key + ".") for k in FIXED_KEYS)


def check_variable_keys(keys: Any, where: str) -> None:
    """Reject an override of a key that cannot vary per job, in one line listing those that can."""
    fixed = sorted(str(k) for k in keys if is_fixed(str(k)))
    if fixed:
        raise ConfigError(
            f"{where}: {', '.join(fixed)} cannot vary per job (evaluation data, storage or the ablation/sweep itself); "
            f"upstream keys that can: {', '.join(UPSTREAM_KEYS)}; and every base.seed, base.device, model.*, "
            "train.*, loss.*, evaluate.* key"
        )
