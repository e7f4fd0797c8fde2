"""`mmcse.pipeline.train.run_train`: the training minutes on the run record, never in the DVC output."""

import json

import mlflow
import pytest

from mmcse import tracking
from mmcse.config import with_overrides
from mmcse.experiments.params import load_config
from mmcse.pipeline.paths import Paths
from mmcse.pipeline.train import run_train
from mmcse.training.engine import Hooks


@pytest.mark.slow  # end to end: the full suite runs it (fast tier under 5 min)
def test_training_minutes_are_on_the_run_summed_over_its_sessions_and_not_in_the_folder(project):
    cfg = with_overrides(load_config("params.yaml"), {"train.max_steps": 2, "train.eval_steps": 2})
    first = run_train(cfg, Paths.of(cfg), out_dir=project / "m", hooks=Hooks(progress=False))
    client = mlflow.MlflowClient()
    minutes = client.get_run(first["run_id"]).data.metrics[tracking.TRAIN_MINUTES]
    assert 0 < minutes < 5 and first[tracking.TRAIN_MINUTES] == pytest.approx(minutes)
    # summary.json is a DVC output: nothing in it may differ between two identical runs
    assert set(json.loads((project / "m/summary.json").read_text())) & {"run_id", tracking.TRAIN_MINUTES} == set()
    # run again on the finished folder: the same run, its minutes grow by this session's (loading)
    again = run_train(cfg, Paths.of(cfg), out_dir=project / "m", hooks=Hooks(progress=False))
    assert again["run_id"] == first["run_id"]
    history = [m.value for m in client.get_metric_history(first["run_id"], tracking.TRAIN_MINUTES)]
    assert len(history) == 2 and history[1] > history[0] == pytest.approx(minutes)
