"""Stage ``download``: the data of ``data`` (the demo world, or the papers' datasets), verified."""

from __future__ import annotations

from typing import Any

from mmcse.config import Config
from mmcse.data.prepare import prepare_data
from mmcse.integrity.keys import artifact_keys
from mmcse.io import write_json
from mmcse.pipeline.paths import Paths


def run_download(cfg: Config, paths: Paths) -> dict[str, Any]:
    """Write ``paths.raw`` for ``cfg.data`` and ``base.seed``; its manifest records the artifact key
    (`mmcse.experiments.upstream`), so training can tell which configuration made it."""

    manifest = prepare_data(cfg.data, cfg.base.seed, paths.raw, paths.downloads)
    manifest["artifact_key"] = artifact_keys(cfg)["data"]
    write_json(paths.raw / "manifest.json", manifest)
    return manifest
