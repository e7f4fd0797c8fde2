"""DVC stage `download`: generate (or read) the data under data/raw; counts to metrics."""

from mmcse.entry import run_entry
from mmcse.experiments.params import load_config
from mmcse.io import write_json
from mmcse.pipeline.download import run_download
from mmcse.pipeline.paths import Paths


def main() -> None:
    cfg = load_config("params.yaml")
    paths = Paths.of(cfg)
    manifest = run_download(cfg, paths)
    write_json(paths.metrics / "download.json", manifest["counts"])


if __name__ == "__main__":
    run_entry(main, stage="download")
