"""DVC stage `cache_regions`: DUET's region features and boxes (§4.1.1) of the training, val and test
images, one content-addressed set each under data/regions (reused by train, evaluate and ablation jobs)."""

import sys

from mmcse.entry import run_entry
from mmcse.experiments.params import load_config
from mmcse.io import write_json
from mmcse.pipeline.cache_regions import run_cache_regions
from mmcse.pipeline.paths import Paths


def main() -> None:
    cfg = load_config("params.yaml")
    paths = Paths.of(cfg)
    result = run_cache_regions(cfg, paths)
    for split, hit in result["hits"].items():
        print(f"cache_regions: {split}: {'cached' if hit else 'computed'}", file=sys.stderr)
    # what the sets hold, not whether they were cache hits: a tracked metric must not depend on history
    write_json(paths.metrics / "regions.json", {**{f"images_{k}": n for k, n in result["images"].items()},
                                                "dim": result.get("dim", 0)})


if __name__ == "__main__":
    run_entry(main, stage="cache_regions")
