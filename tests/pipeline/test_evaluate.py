"""`mmcse.pipeline.evaluate.run_evaluate`: what an evaluation says about the model it scored."""

import logging
import math
import warnings

import mlflow
import numpy as np

from mmcse.config import with_overrides
from mmcse.evaluation.sts import COLLAPSED_TAG, TextEncoder
from mmcse.experiments.params import load_config
from mmcse.pipeline.evaluate import run_evaluate
from mmcse.pipeline.paths import Paths
from mmcse.pipeline.train import run_train


def test_a_collapsed_model_is_named_in_the_log_and_on_its_run_not_by_scipy(project, monkeypatch, caplog):
    """Issue 39.4: a model that gives every sentence the same vector gets the evaluation's own warning
    (log and MLflow tag), not scipy's ConstantInputWarning from inside the evaluator."""
    cfg = with_overrides(load_config("params.yaml"), {"train.max_steps": 2, "train.eval_steps": 2,
                                                      "evaluate.retrieval.enabled": False})
    paths = Paths.of(cfg)
    summary = run_train(cfg, paths, out_dir=project / "m", progress=False)
    monkeypatch.setattr(TextEncoder, "__call__", lambda self, sentences: np.ones((len(sentences), 8), np.float32))
    with warnings.catch_warnings(), caplog.at_level(logging.WARNING, logger="mmcse.evaluation.sts"):
        warnings.simplefilter("error")  # scipy's warning (or any other) would fail here
        scores = run_evaluate(cfg, paths, project / "m/best", run_id=summary["run_id"])
    assert math.isnan(scores["avg"])
    said = [r.getMessage() for r in caplog.records if "the same vector for every sentence" in r.getMessage()]
    assert len(said) == 1
    tag = mlflow.MlflowClient().get_run(summary["run_id"]).data.tags[COLLAPSED_TAG]
    assert tag == said[0] and tag.startswith("the model returns the same vector for every sentence")
