"""The MLflow runs table's headline view (`mmcse.analysis.views`): the columns it opens with."""

import mlflow

from mmcse import tracking
from mmcse.analysis.views import headline_columns, write_headline_views
from mmcse.experiments.params import load_config


def test_headline_columns_pick_what_a_table_compares():
    """The runs table's headline view: method, seed, the ablation row, the best dev score and the
    test averages / rsum / NDCG means, never the per-direction R@K or the loss terms."""
    params = {"train.method", "base.seed", "loss.lambda_img"}
    metrics = {"best_dev_sts", "dev_sts", "test_avg", "test_transfer_avg", "test_demo_rsum", "test_demo_i2t_R1",
               "test_demo_NDCG25_rouge_l", "test_demo_i2t_NDCG25_rouge_l", "loss/loss", "dev_alignment"}
    assert headline_columns(params, metrics, {"ablation.variant", "ablation.seed", "env.hash"}) == [
        "params.`train.method`", "params.`base.seed`", "tags.`ablation.variant`", "tags.`ablation.seed`",
        "metrics.`best_dev_sts`", "metrics.`test_avg`", "metrics.`test_transfer_avg`",
        "metrics.`test_demo_NDCG25_rouge_l`", "metrics.`test_demo_rsum`"]
    assert headline_columns({"train.method"}, {"best_dev_rsum", "test_coco_1k_rsum"}, set()) == [
        "params.`train.method`", "metrics.`best_dev_rsum`", "metrics.`test_coco_1k_rsum`"]


def test_the_params_a_sweep_drew_are_columns_of_the_view():
    """Issue 67.4: the values a sweep's trials drew (or an ablation's rows set) differ between runs: they are
    columns after the method and seed; a param every run shares, or only one run logs, is not."""
    from mmcse.analysis.views import varying_params

    trials = [{"train.method": "mcse", "loss.lambda_img": "0.05", "loss.temperature": "0.05", "base.seed": "42"},
              {"train.method": "mcse", "loss.lambda_img": "0.2", "loss.temperature": "0.07", "base.seed": "42"},
              {"sweep.n_trials": "2"}]  # the sweep run itself
    varying = varying_params(trials)
    assert varying == ["loss.lambda_img", "loss.temperature"]
    params = {k for t in trials for k in t}
    assert headline_columns(params, {"best_dev_sts"}, set(), varying) == [
        "params.`train.method`", "params.`base.seed`", "params.`loss.lambda_img`", "params.`loss.temperature`",
        "metrics.`best_dev_sts`"]


def test_the_headline_view_is_an_experiment_tag_the_ui_reads_as_json(project):
    import json

    cfg = load_config("params.yaml")
    experiment_id = tracking.experiment(cfg, "mcse")
    with mlflow.start_run(experiment_id=experiment_id):
        mlflow.log_params({"train.method": "mcse", "base.seed": 1})
        mlflow.log_metrics({"best_dev_sts": 70.0, "test_avg": 66.0, "lr": 1e-5})
    assert write_headline_views(cfg)["mmcse-mcse"][:2] == ["params.`train.method`", "params.`base.seed`"]
    urls = tracking.experiment_urls(cfg, "http://127.0.0.1:5000")
    assert urls["mmcse-mcse"].endswith(f"/experiments/{experiment_id}/runs?workflowType=machine_learning"
                                       "&viewStateShareKey=mmcse-headline")  # the link opens that view
    view = json.loads(mlflow.MlflowClient().get_experiment(experiment_id).tags[
        "mlflow.sharedViewState.mmcse-headline"])
    assert view == {"selectedColumns": ["params.`train.method`", "params.`base.seed`", "metrics.`best_dev_sts`",
                                        "metrics.`test_avg`"],
                    "runsHiddenMode": "SHOW_ALL", "orderByKey": "metrics.`best_dev_sts`", "orderByAsc": False}
