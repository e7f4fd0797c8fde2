"""`mmcse.pipeline.evaluate.run_evaluate`: what an evaluation says about the model it scored."""

import importlib
import logging
import math
import warnings
from pathlib import Path

import mlflow
import mteb
import numpy as np
import pytest

from mmcse.config import with_overrides
from mmcse.evaluation.sts import COLLAPSED_TAG, TextEncoder
from mmcse.experiments.params import load_config
from mmcse.io import read_json
from mmcse.pipeline.evaluate import EvalOutputs, run_evaluate
from mmcse.pipeline.paths import Paths
from mmcse.pipeline.train import run_train
from mmcse.training.engine import Hooks
from tests.evaluation.test_mteb import TinySTS


def test_a_collapsed_model_is_named_in_the_log_and_on_its_run_not_by_scipy(project, monkeypatch, caplog):
    """Issue 39.4: a model that gives every sentence the same vector gets the evaluation's own warning
    (log and MLflow tag), not scipy's ConstantInputWarning from inside the evaluator."""
    cfg = with_overrides(load_config("params.yaml"), {"train.max_steps": 2, "train.eval_steps": 2,
                                                      "evaluate.retrieval.enabled": False})
    paths = Paths.of(cfg)
    summary = run_train(cfg, paths, out_dir=project / "m", hooks=Hooks(progress=False))
    monkeypatch.setattr(TextEncoder, "__call__", lambda self, sentences: np.ones((len(sentences), 8), np.float32))
    with warnings.catch_warnings(), caplog.at_level(logging.WARNING, logger="mmcse.evaluation.sts"):
        warnings.simplefilter("error")  # scipy's warning (or any other) would fail here
        scores = run_evaluate(cfg, paths, project / "m/best", EvalOutputs(summary["run_id"]))
    assert math.isnan(scores["avg"])
    said = [r.getMessage() for r in caplog.records if "the same vector for every sentence" in r.getMessage()]
    assert len(said) == 1
    tag = mlflow.MlflowClient().get_run(summary["run_id"]).data.tags[COLLAPSED_TAG]
    assert tag == said[0] and tag.startswith("the model returns the same vector for every sentence")


@pytest.mark.slow  # end to end: the full suite runs it (fast tier under 5 min)
def test_mteb_results_land_in_mtebs_layout_and_load_with_its_own_loader(project, monkeypatch):
    """Issue 39.2: the evaluate stage's MTEB results are mteb's layout (results/<model>/<revision>/<Task>.json,
    model_meta.json) that ``mteb.ResultCache`` loads as they are; the folder is replaced whole, so a run
    without MTEB tasks leaves no stale result, only its README saying why."""
    registry = importlib.import_module("mteb.get_tasks")._TASKS_REGISTRY  # `mteb.get_tasks` is the function
    monkeypatch.setitem(registry, "TinySTS", TinySTS)
    cfg = with_overrides(load_config("params.yaml"), {"train.max_steps": 2, "train.eval_steps": 2,
                                                      "evaluate.retrieval.enabled": False,
                                                      "evaluate.mteb": ["TinySTS"]})
    paths = Paths.of(cfg)
    summary = run_train(cfg, paths, out_dir=project / "m", hooks=Hooks(progress=False))
    folder = project / "metrics" / "mteb"
    scores = run_evaluate(cfg, paths, project / "m/best", EvalOutputs(summary["run_id"], mteb_dir=folder))

    name = f"mmcse/{cfg.train.method}"
    revision = read_json(project / "m/best/checkpoint.json")["config_hash"][:12]
    loaded = mteb.ResultCache(cache_path=folder).load_results(models=[name], tasks=[TinySTS()], include_remote=False)
    (model,) = loaded.model_results
    assert (model.model_name, model.model_revision) == (name, revision)
    (task,) = model.task_results
    assert task.task_name == "TinySTS"  # its main score as mteb stores it (6 digits)
    assert task.get_score() * 100 == pytest.approx(scores["mteb_TinySTS"], abs=1e-4)
    run_folder = folder / "results" / f"mmcse__{cfg.train.method}" / revision
    assert sorted(p.name for p in run_folder.iterdir()) == ["TinySTS.json", "model_meta.json", "run_settings.jsonl"]
    meta = read_json(run_folder / "model_meta.json")
    student = TextEncoder(str(project / "m/best"), cfg.evaluate.pooler, "cpu")
    assert meta["embed_dim"] == student(["a"]).shape[1] and meta["max_tokens"] == student.max_length
    assert meta["n_parameters"] == sum(p.numel() for p in student.model.parameters())
    assert meta["adapted_from"] == cfg.model.name_or_path and meta["languages"] == ["eng-Latn"]
    assert meta["similarity_fn_name"] == "cosine"
    readme = (folder / "README.md").read_text()
    assert 'ResultCache(cache_path="metrics/mteb")' in readme and f'models=["{name}"]' in readme
    logged = mlflow.MlflowClient().list_artifacts(summary["run_id"], f"mteb/results/mmcse__{cfg.train.method}/"
                                                  f"{revision}")
    assert "mteb/results/" in logged[0].path and {Path(a.path).name for a in logged} >= {"TinySTS.json"}

    run_evaluate(with_overrides(cfg, {"evaluate.mteb": []}), paths, project / "m/best", EvalOutputs(mteb_dir=folder))
    assert [p.name for p in folder.iterdir()] == ["README.md"]
    assert "No MTEB task ran for this model: `evaluate.mteb` is empty" in (folder / "README.md").read_text()


@pytest.mark.slow
@pytest.mark.parametrize("evaluators", [["geometry"], ["retrieval"]])
def test_any_subset_of_evaluators_finishes_with_its_own_scores(project, evaluators):
    """Issues 75.5 and 76: the stage's result does not hang on the STS evaluator. Without it there are no STS scores,
    no STS predictions and the scatter says why (it is a DVC output); the model card is written all the same."""
    cfg = with_overrides(load_config("params.yaml"), {"train.max_steps": 2, "train.eval_steps": 2,
                                                      "evaluate.evaluators": evaluators})
    paths = Paths.of(cfg)
    summary = run_train(cfg, paths, out_dir=project / "m", hooks=Hooks(progress=False))
    plots = project / "plots"
    scores = run_evaluate(cfg, paths, project / "m/best", EvalOutputs(summary["run_id"], plots_dir=plots))
    assert "avg" not in scores and scores
    if evaluators == ["geometry"]:
        assert {"dev_alignment", "dev_uniformity"} <= set(scores) and all(math.isfinite(v) for v in scores.values())
    else:
        assert any(k.endswith("_rsum") for k in scores)
    assert (plots / "sts_scatter.png").is_file()
    artifacts = {a.path for a in mlflow.MlflowClient().list_artifacts(summary["run_id"], "evaluation")}
    assert "evaluation/sts_predictions.json" not in artifacts
    assert (project / "m/best/README.md").is_file()


def test_an_empty_list_of_evaluators_is_refused_with_the_valid_names(tmp_path):
    from mmcse.config import ConfigError
    from mmcse.experiments.params import check_params
    from tests.conftest import params_copy

    params = params_copy(tmp_path) / "params.yaml"
    text = params.read_text()
    assert "  evaluators: all " in text
    params.write_text(text.replace("  evaluators: all ", "  evaluators: [] "))
    with pytest.raises(ConfigError, match=r"evaluate.evaluators.*names no evaluator.*the evaluators: .*geometry"):
        check_params(params)
