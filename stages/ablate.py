"""DVC stage `ablate`: variants x seeds through the Prefect flow `ablations` (no server needed)."""

import sys
from pathlib import Path

from mmcse.entry import run_entry
from mmcse.experiments.params import check_params

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root, for flows/


def main() -> None:
    # every row and the sweep space checked before the flow's imports (Prefect, the training stack:
    # seconds) and before a Prefect server starts, so a bad row is named at once
    check_params("params.yaml")
    from flows.ablations import main as ablations_checked

    ablations_checked("params.yaml")


if __name__ == "__main__":
    run_entry(main, stage="ablate")
