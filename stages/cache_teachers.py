"""DVC stage `cache_teachers`: frozen teacher/encoder features, memory-mapped, keyed by hash;
then KDMCSE's threshold statistics of the cached joint teacher (plot + metrics)."""

import sys

from mmcse.entry import run_entry
from mmcse.evaluation.teacher_statistics import save_threshold_statistics
from mmcse.experiments.params import load_config
from mmcse.io import write_json
from mmcse.pipeline.cache_teachers import run_cache_teachers
from mmcse.pipeline.paths import Paths


def main() -> None:
    cfg = load_config("params.yaml")
    paths = Paths.of(cfg)
    result = run_cache_teachers(cfg, paths)
    # which cached set each role reads (content-addressed names); whether it was found cached goes to
    # the log, not into this tracked file: it depends on what ran before
    sets = {role: name for role, name in result["sets"].items() if role != "text"}
    for i, teacher in enumerate(result["sets"]["text"]):
        sets |= {f"text_{i}_caption": teacher["caption"], f"text_{i}_corpus": teacher["corpus"]}
    write_json(paths.metrics / "teachers.json", sets)
    for role, hit in result["hits"].items():
        print(f"cache_teachers: {role}: {'cached' if hit else 'computed'}", file=sys.stderr)
    save_threshold_statistics(paths.teachers, paths.raw, paths.plots / "kdmcse_threshold.png",
                              paths.metrics / "threshold.json", threshold=cfg.loss.kdmcse.threshold_value)


if __name__ == "__main__":
    run_entry(main, stage="cache_teachers")
