"""Stage ``detect_objects``: image–caption pairs → object–phrase pairs (MCSEO §3.3)."""

from __future__ import annotations

from typing import Any

from mmcse.config import Config
from mmcse.detection.objects import detect_objects
from mmcse.integrity.files import verify_images
from mmcse.integrity.keys import artifact_keys, record_key
from mmcse.io import write_json
from mmcse.models.device import with_base_threads
from mmcse.models.student import load_tokenizer
from mmcse.pipeline.paths import Paths


@with_base_threads
def run_detect(cfg: Config, paths: Paths, write_metrics: bool = True) -> dict[str, Any]:
    """Object–phrase pairs of ``paths.raw`` into ``paths.objects``; ``artifact.json`` (its key and
    counts) is written last, so an interrupted run is not taken for a finished one."""

    tokenizer = load_tokenizer(cfg.model.name_or_path)
    verify_images(paths.raw)  # the images it detects in are the ones the download stage recorded
    (paths.objects / "artifact.json").unlink(missing_ok=True)
    stats = detect_objects(paths.raw, paths.objects, cfg.detect, tokenizer, cfg.model.max_seq_len, cfg.base.device)
    if write_metrics:
        write_json(paths.metrics / "detect.json", stats)
    keys = artifact_keys(cfg)
    record_key(paths.objects / "artifact.json", keys["objects"], {"data_key": keys["data"], "counts": stats})
    return stats
