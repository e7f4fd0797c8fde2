"""DVC stage `detect_objects`: image–caption pairs -> object–phrase table + crops."""

from mmcse.cli import run_entry
from mmcse.config import load_config
from mmcse.pipeline import Paths, run_detect


def main() -> None:
    cfg = load_config("params.yaml")
    run_detect(cfg, Paths.of(cfg))


if __name__ == "__main__":
    run_entry(main)
