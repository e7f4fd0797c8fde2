"""DVC stage `report`: every paper's tables beside their reproduction, reports/<paper>.{md,html}."""

from mmcse.analysis.papers import PAPERS
from mmcse.entry import run_entry
from mmcse.experiments.params import load_config
from mmcse.experiments.report import write_report


def main() -> None:
    cfg = load_config("params.yaml")
    for paper in PAPERS:
        write_report(cfg, paper)


if __name__ == "__main__":
    run_entry(main, stage="report")
