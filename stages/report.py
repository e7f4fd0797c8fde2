"""DVC stage `report`: every paper's tables beside their reproduction, reports/<paper>.{md,html}."""

from mmcse import tracking
from mmcse.analysis.papers import PAPERS
from mmcse.entry import run_entry
from mmcse.experiments.params import load_config
from mmcse.experiments.report import write_report
from mmcse.tracking.reading import log_report, run_reader


def main() -> None:
    cfg = load_config("params.yaml")
    tracking.configure(cfg)
    reader = run_reader(cfg.base.mlflow_tracking_uri)
    for paper in PAPERS:
        report = write_report(cfg, paper, reader=reader)
        log_report(report.files, report.runs, report.verdicts)  # under report/ in every ablation run it read


if __name__ == "__main__":
    run_entry(main, stage="report")
