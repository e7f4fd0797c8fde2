"""DVC stage `download`: generate (or read) the data under data/raw; counts to metrics."""

from mmcse.cli import run_entry
from mmcse.config import load_config
from mmcse.io import write_json
from mmcse.pipeline import Paths, run_download


def main() -> None:
    cfg = load_config("params.yaml")
    paths = Paths.of(cfg)
    manifest = run_download(cfg, paths)
    write_json(paths.metrics / "download.json", manifest["counts"])


if __name__ == "__main__":
    run_entry(main)
