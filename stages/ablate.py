"""DVC stage `ablate`: variants x seeds through the Prefect flow `ablations` (no server needed)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root, for flows/

from flows.ablations import main as ablations_checked  # noqa: E402
from mmcse.entry import run_entry  # noqa: E402


def main() -> None:
    ablations_checked("params.yaml")  # every row and the sweep space checked before a Prefect server starts


if __name__ == "__main__":
    run_entry(main, stage="ablate")
