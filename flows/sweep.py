"""Prefect flow `sweep`: an Optuna study over params.yaml's `sweep.space`.

Start several of these (flow runs or `mmcse sweep` processes) against one shared
`sweep.storage`; they cooperate on the same study and stop at `sweep.n_trials`. As
deployment `sweep` (pool `gpu`), submit one flow run per GPU worker: each runs in its worker's
``CUDA_VISIBLE_DEVICES`` and its MLflow runs record that device.
"""

from __future__ import annotations

import sys

from prefect import flow

from mmcse.experiments.params import load_config
from mmcse.experiments.sweep import best_line, run_sweep
from mmcse.pipeline.paths import Paths
from mmcse.tracking import prefect_tags


@flow(name="sweep", log_prints=True)
def sweep(params_path: str = "params.yaml", n_trials: int | None = None, storage: str | None = None,
          progress: bool = True) -> dict:
    """One sweep worker; ``progress``: its bar on stderr (trials finished by all workers / n_trials,
    best value so far), moved whenever any worker's trial finishes."""
    cfg = load_config(params_path)
    summary = run_sweep(cfg, Paths.of(cfg), n_trials=n_trials, storage=storage, tags=prefect_tags(),
                        progress=progress)
    print(best_line(summary))
    return summary


if __name__ == "__main__":
    sweep(sys.argv[1] if len(sys.argv) > 1 else "params.yaml")
