"""DVC stage `check_params`: the whole params.yaml (every section, each ablation row with its recipe,
the sweep space's ends, no offline stand-in teacher under a paper profile) checked before any other
stage runs, and so before DVC removes any stage's outputs: a bad `dvc exp run -S key=value` fails here
in seconds and every committed result stays."""

from mmcse.entry import run_entry
from mmcse.experiments.params import check_params
from mmcse.experiments.stand_ins import check_stand_ins
from mmcse.io import write_json
from mmcse.pipeline.paths import CHECKED_PARAMS


def main() -> None:
    check_stand_ins(check_params("params.yaml"))
    # Every stage depends on this file; its bytes never change, so a valid edit re-runs only the
    # stages whose own params or deps it touches.
    write_json(CHECKED_PARAMS, {"params.yaml": "valid"})


if __name__ == "__main__":
    run_entry(main)
