"""DVC stage `detect_objects`: image–caption pairs -> object–phrase table + crops."""

from mmcse.entry import run_entry
from mmcse.experiments.params import load_config
from mmcse.pipeline.detect import run_detect
from mmcse.pipeline.paths import Paths


def main() -> None:
    cfg = load_config("params.yaml")
    run_detect(cfg, Paths.of(cfg))


if __name__ == "__main__":
    run_entry(main, stage="detect_objects")
