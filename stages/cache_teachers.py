"""DVC stage `cache_teachers`: frozen teacher/encoder features, memory-mapped, keyed by hash;
then KDMCSE's threshold statistics of the cached joint teacher (plot + metrics)."""

from mmcse.cli import run_entry
from mmcse.config import load_config
from mmcse.evaluation.figures import save_threshold_statistics
from mmcse.io import write_json
from mmcse.pipeline import Paths, run_cache_teachers


def main() -> None:
    cfg = load_config("params.yaml")
    paths = Paths.of(cfg)
    result = run_cache_teachers(cfg, paths)
    write_json(paths.metrics / "teachers.json", {f"cache_hit_{k}": v for k, v in result["hits"].items()})
    save_threshold_statistics(paths.teachers, paths.raw, paths.plots / "kdmcse_threshold.png",
                              paths.metrics / "threshold.json", threshold=cfg.loss.kdmcse.threshold_value)


if __name__ == "__main__":
    run_entry(main)
